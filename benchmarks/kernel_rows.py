"""Published memory of runs with fused kernels and adapter variants, and their stock twins: the
kernels' own tables (Liger's end-to-end and Hugging Face example charts, PEFT's MetaMathQA
method comparison, Unsloth's context-length table), planned here with the plan's error on each.
Collected in research/kernels/published_kernels.csv (the row ids are its ids); each row below
carries its source (repository @ commit : path).

Two kinds of row:
  peak  a measured peak (allocated or reserved, as published) against the plan's same peak
  fit   the longest context that fit on the card, against the plan's longest context on it
        (fit table, no headroom): the published single-card runs must fit where they ran

Run:  PYTHONPATH=src .venv/bin/python benchmarks/plan_accuracy.py --kernels-only [--json]
"""

from __future__ import annotations

LIG = "linkedin/Liger-Kernel@ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c"
PEFT = ("huggingface/peft@5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40:"
        "method_comparison/MetaMathQA/results/")
UNS = "unslothai/unsloth@0acd1c7eec2a6c6adb43367a333dd0e30332b1b0:README.md"
LIGER = ["rope", "rms_norm", "swiglu", "fused_linear_cross_entropy"]

# Liger README e2e chart: LLaMA 3-8B, batch 8, bf16, AdamW, gradient checkpointing, FSDP1 on
# 8 A100s; peak reserved memory (MB = 2^20 B, Liger's EfficiencyCallback M_BIN_UNIT).
# Both Liger setups load the model in bf16 under HF Trainer bf16=True with FSDP1: accelerate's
# prepare_model (its FSDP1 section) upcasts trainable low-precision parameters to fp32 when
# mixed precision is on ("FSDP upcast of low precision parameters may affect the precision of
# model checkpoints"), so they are planned bf16-mixed on FSDP1 - as plan_accuracy.py's lg1/lg2 rows plan
# the same chart (planned bf16-true on FSDP2 they missed by -32% to -46%)
# (transformers 4.44, the newest release when the charts were added in 2024-08: the forward's
# fp32 logits; Liger's fused loss computes none)
_V444 = {"transformers_version": "4.44"}
# Liger's scripts (examples/huggingface run_*.sh) leave eval_strategy at "no" (no validation
# pass) and set save_strategy "no" (no checkpoint while training)
_NO_EVAL = {"validation": {"enabled": False}, "checkpoint": {"state_dict": "none"}}
_E2E = {"model": {"preset": "llama-3-8b", **_V444}, **_NO_EVAL,
        "method": {"kind": "full"}, "precision": "bf16-mixed",
        "micro_batch_size": 8, "activation_checkpointing": "full",
        "parallel": {"strategy": "fsdp", "devices": 8, "fsdp_version": 1}}
# Liger examples/huggingface: Alpaca, max_seq_length 512, bf16 weights, gradient checkpointing,
# FSDP1 on 4 A100s, batch 32; per-step max_memory_allocated (MB = 2^20 B)
_HF = {**_NO_EVAL, "method": {"kind": "full"}, "precision": "bf16-mixed", "sequence_length": 512,
       "micro_batch_size": 32, "activation_checkpointing": "full",
       "parallel": {"strategy": "fsdp", "devices": 4, "fsdp_version": 1}}
# PEFT MetaMathQA: Llama-3.2-3B, bf16 weights without autocast (fp32 adapters), batch 4,
# <= 768 tokens, no checkpointing, SDPA; 99th percentile of memory_reserved in training (MiB)
_PEFT = {"model": {"preset": "llama-3.2-3b"}, "precision": "bf16-true", "sequence_length": 768,
         "micro_batch_size": 4, "optimizer": {"name": "adamw", "weight_decay": 0.1}}
_QV32 = {"kind": "lora", "lora_rank": 32, "lora_alpha": 64, "lora_targets": ["q_proj", "v_proj"]}
_QV64 = {"kind": "lora", "lora_rank": 64, "lora_alpha": 128, "lora_targets": ["q_proj", "v_proj"]}
# Unsloth README context table: Llama 3.1 8B, 4-bit QLoRA r=32 on q,k,v,o,gate,up,down,
# batch 1, sequences padded to the length; adamw_8bit as Unsloth's notebooks
_UNS = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "qlora", "lora_rank": 32,
                                                         "lora_alpha": 32,
                                                         "lora_targets": "all-linear"},
        "optimizer": {"name": "adamw_8bit"}, "activation_checkpointing": "full"}

MIB = 2**20

# id: (kind, spec fields, published figure, unit bytes or "tokens", compare, card, source)
ROWS: dict[str, tuple] = {
    "LIG-E2E-M1a": ("peak", dict(_E2E, sequence_length=1024), 36800, MIB, "reserved", None,
                    f"{LIG}:README.md + docs/images/e2e-memory.png (chart, +-3%)"),
    "LIG-E2E-M1b": ("peak", dict(_E2E, sequence_length=1024, kernels={"liger": LIGER}), 19800,
                    MIB, "reserved", None, f"{LIG}:docs/images/e2e-memory.png"),
    "LIG-E2E-M2a": ("peak", dict(_E2E, sequence_length=2048), 61000, MIB, "reserved", None,
                    f"{LIG}:docs/images/e2e-memory.png"),
    "LIG-E2E-M2b": ("peak", dict(_E2E, sequence_length=2048, kernels={"liger": LIGER}), 23500,
                    MIB, "reserved", None, f"{LIG}:docs/images/e2e-memory.png"),
    "LIG-E2E-M3b": ("peak", dict(_E2E, sequence_length=4096, kernels={"liger": LIGER}), 30700,
                    MIB, "reserved", None, f"{LIG}:docs/images/e2e-memory.png (HF: OOM)"),
    "LIG-E2E-M4b": ("peak", dict(_E2E, sequence_length=8192, kernels={"liger": LIGER}), 48000,
                    MIB, "reserved", None, f"{LIG}:docs/images/e2e-memory.png (HF: OOM)"),
    "LIG-E2E-M5b": ("peak", dict(_E2E, sequence_length=16384, kernels={"liger": LIGER}), 77000,
                    MIB, "reserved", None, f"{LIG}:docs/images/e2e-memory.png (HF: OOM)"),
    "LIG-HF-llama-M32a": ("peak", dict(_HF, model={"preset": "llama-3-8b", **_V444}), 54000, MIB,
                          "allocated", None,
                          f"{LIG}:examples/huggingface/img/llama_mem_alloc.png (chart, +-3%)"),
    "LIG-HF-llama-M32b": ("peak", dict(_HF, model={"preset": "llama-3-8b", **_V444},
                                       kernels={"liger": LIGER}), 38200, MIB, "allocated", None,
                          f"{LIG}:examples/huggingface/img/llama_mem_alloc.png"),
    "LIG-HF-qwen-M32a": ("peak", dict(_HF, model={"preset": "qwen2.5-7b", **_V444}), 51154, MIB,
                         "allocated", None, f"{LIG}:examples/huggingface/img/qwen_mem_alloc.png "
                         "(Qwen2-7B: the Qwen2.5-7B architecture)"),
    "LIG-HF-qwen-M32b": ("peak", dict(_HF, model={"preset": "qwen2.5-7b", **_V444},
                                      kernels={"liger": LIGER}), 39300, MIB, "allocated", None,
                         f"{LIG}:examples/huggingface/img/qwen_mem_alloc.png"),
    "PEFT-LORA32": ("peak", dict(_PEFT, method=_QV32), 19188, MIB, "reserved", None,
                    f"{PEFT}lora--llama-3.2-3B-rank32.json"),
    "PEFT-DORA32": ("peak", dict(_PEFT, method=dict(_QV32, dora=True)), 21152, MIB, "reserved",
                    None, f"{PEFT}lora--llama-3.2-3B-rank32-dora.json"),
    "PEFT-LORA64": ("peak", dict(_PEFT, method=_QV64), 19426, MIB, "reserved", None,
                    f"{PEFT}lora--llama-3.2-3B-rank64.json"),
    "PEFT-RSLORA64": ("peak", dict(_PEFT, method=dict(_QV64, lora_alpha=64, rslora=True)),
                      19424, MIB, "reserved", None,
                      f"{PEFT}lora--llama-3.2-3B-rank64-rslora.json"),
    "PEFT-FULL": ("peak", dict(_PEFT, method={"kind": "full"}), 35615, MIB, "reserved", None,
                  f"{PEFT}full-finetuning--llama-3.2-3B-lr_0.00001.json"),
    "UNS-L8-80a": ("fit", dict(_UNS, kernels={"attention": "flash-attention-2"}), 28454,
                   "tokens", "max_sequence_length", "a100-sxm-80gb",
                   f"{UNS} (context table, 80 GB, Hugging Face + FA2)"),
    "UNS-L8-80b": ("fit", dict(_UNS, kernels={"unsloth": True,
                                              "unsloth_gradient_checkpointing": True}),
                   342733, "tokens", "max_sequence_length", "a100-sxm-80gb",
                   f"{UNS} (context table, 80 GB, Unsloth)"),
    "UNS-L70-80b": ("fit", dict(_UNS, model={"preset": "llama-3.1-70b"},
                                kernels={"unsloth": True, "unsloth_gradient_checkpointing": True}),
                    89389, "tokens", "max_sequence_length", "a100-sxm-80gb",
                    f"{UNS} (Llama 3.3 70B on an 80GB A100, Unsloth with Cut Cross-Entropy; "
                    "the Llama 3.1 70B architecture)"),
}


def plan_kernel_rows() -> list[dict]:
    """Every row planned (analytic), with the plan's figure and its error against the
    published one (positive: the plan needs more than was measured / fits less)."""
    from tunepilot.catalog import load_catalog
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.plan.fit import fit_card
    from tunepilot.spec import spec_from_dict

    catalog = load_catalog()
    out = []
    for rid, (kind, fields, value, unit, compare, card_id, source) in ROWS.items():
        spec = spec_from_dict(dict(fields, sequence_length=fields.get("sequence_length", value)))
        arch = resolve_arch(spec)
        plan = analytic_plan(spec, arch, "cuda")
        rec = {"id": rid, "kind": kind, "compare": compare, "source": source,
               "kernels": [n for n in plan.assumptions if any(
                   w in n for w in ("Liger", "Unsloth", "DoRA", "rsLoRA", "Cut Cross"))][:2]}
        if kind == "peak":
            got = getattr(plan.per_device, f"{compare}_peak_bytes")
            rec.update(measured_bytes=value * unit, plan_bytes=got, error=got / (value * unit) - 1)
        else:
            card = catalog.select([card_id])[0]
            fit = fit_card(spec, arch, card, analytic_plan, 0.0, plan)
            rec.update(card=card_id, measured_tokens=value, fits_where_it_ran=fit.fits,
                       plan_device_peak_bytes=plan.per_device.device_peak_bytes,
                       plan_tokens=fit.max_sequence_length,
                       error=value / fit.max_sequence_length - 1)
        out.append(rec)
    return out


def print_kernel_rows(rows: list[dict]) -> None:
    print("kernels and adapter variants: published figures vs the analytic plan (GiB = 2^30 B; "
          "published = measured, plan = projected; fit error = published / plan's longest - 1)")
    for r in rows:
        if r["kind"] == "peak":
            print(f"  {r['id']:<19} {r['compare']:<10} published {r['measured_bytes'] / 2**30:6.2f}"
                  f" GiB  plan {r['plan_bytes'] / 2**30:6.2f} GiB  {r['error']:+7.1%}")
        else:
            print(f"  {r['id']:<19} fit {r['card']:<13} published {r['measured_tokens']:>8,} tok "
                  f"(plan there: {r['plan_device_peak_bytes'] / 2**30:.1f} GiB, "
                  f"{'fits' if r['fits_where_it_ran'] else 'DOES NOT FIT'})  plan's longest "
                  f"{r['plan_tokens']:>8,}  {r['error']:+7.1%}")
    twins = [("LIG-E2E-M1a", "LIG-E2E-M1b"), ("LIG-E2E-M2a", "LIG-E2E-M2b"),
             ("LIG-HF-llama-M32a", "LIG-HF-llama-M32b"), ("LIG-HF-qwen-M32a", "LIG-HF-qwen-M32b"),
             ("PEFT-LORA32", "PEFT-DORA32"), ("PEFT-LORA64", "PEFT-RSLORA64"),
             ("UNS-L8-80a", "UNS-L8-80b")]
    by = {r["id"]: r for r in rows}
    for a, b in twins:
        ra, rb = by[a], by[b]
        if ra["kind"] == "peak":
            pub = rb["measured_bytes"] - ra["measured_bytes"]
            plan = rb["plan_bytes"] - ra["plan_bytes"]
            print(f"  twin {b} - {a}: published {pub / 2**30:+6.2f} GiB, plan {plan / 2**30:+6.2f}"
                  " GiB")
        else:
            pub = rb["measured_tokens"] / ra["measured_tokens"]
            print(f"  twin {b} / {a}: published x{pub:.2f} longer context, plan "
                  f"x{rb['plan_tokens'] / ra['plan_tokens']:.2f}")
