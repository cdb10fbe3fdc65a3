"""Published DPO / GRPO figures (collected in /work/research/objectives/published_objectives.csv,
NOTES.md; each row's source below) and the plan's and the time model's error on each.
Imported by plan_accuracy.py (memory rows) and throughput_accuracy.py (step-time rows); run on
its own it prints both:  .venv/bin/python benchmarks/objectives_reference.py [--json]

What a row can and cannot say is in its note; rows whose settings were inferred, or that measure
another implementation, are marked and left out of the like-for-like median.
"""

from __future__ import annotations

import argparse
import json
import statistics

MIB, GIB = 2**20, 2**30

# Architectures that are not presets, from the models' Hugging Face config.json
ARCH = {
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
                   "max_position_embeddings": 40960, "hidden_act": "silu"},
    "qwen3-1.7b": {"model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True,
                   "max_position_embeddings": 40960, "hidden_act": "silu"},
    "qwen2.5-3b": {"model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2,
                   "intermediate_size": 11008, "vocab_size": 151936, "tie_word_embeddings": True,
                   "max_position_embeddings": 32768, "hidden_act": "silu"},
}
ISSUE_3456 = ("https://github.com/huggingface/trl/issues/3456 (comment by wa008, 2025-05-23, "
              "TRL ~0.17/0.18)")
LIGER = ("github.com/linkedin/Liger-Kernel benchmark/data/all_benchmark_data.csv @ead96b6 "
         "(benchmark_orpo_loss.py, benchmark_grpo_loss.py; torch.cuda.max_memory_allocated)")


def _grpo_issue(model: str) -> dict:
    return {"method": {"kind": "full"}, "precision": "fp32", "sequence_length": 3072,
            "micro_batch_size": 4,
            "objective": {"kind": "grpo", "beta": 0.04, "loss_type": "bnpo",
                          "num_generations": 4, "max_prompt_length": 2048,
                          "max_completion_length": 1024, "generation": {"backend": "transformers"}}}


MEMORY_ROWS = [
    {"id": "trl_issue3456_grpo_qwen3_0p6b", "source": ISSUE_3456, "arch": "qwen3-0.6b",
     "spec": _grpo_issue("qwen3-0.6b"), "measured_bytes": 49273 * MIB, "compare": "device",
     "measured_kind": "nvidia-smi [MiB]", "inferred": True,
     "note": "user report; fp32, no checkpointing, HF generate, 4 completions per step inferred "
             "from the defaults of the time (8 generations would not divide 4)"},
    {"id": "trl_issue3456_grpo_qwen3_1p7b", "source": ISSUE_3456, "arch": "qwen3-1.7b",
     "spec": _grpo_issue("qwen3-1.7b"), "measured_bytes": 78147 * MIB, "compare": "device",
     "measured_kind": "nvidia-smi [MiB]", "inferred": True, "note": "as the 0.6B row"},
    {"id": "liger_grpo_losshead_torch_b16_t1024", "source": LIGER, "component": "grpo",
     "rows": 16, "tokens": 1024, "measured_bytes": int(37474.5 * MIB), "compare": "allocated",
     "measured_kind": "max_memory_allocated [MiB]", "inferred": True,
     "note": "component: lm_head (4096 x 128256) + the GRPO loss, fwd + bwd, bf16, in Liger's "
             "plain-PyTorch reference (the whole logits upcast to fp32), not the row-by-row "
             "log-softmax the plan assumes: shows what that path saves"},
    {"id": "liger_orpo_losshead_hf_b16_t1024", "source": LIGER, "component": "orpo",
     "rows": 16, "tokens": 1024, "measured_bytes": int(33418.4 * MIB), "compare": "allocated",
     "measured_kind": "max_memory_allocated [MiB]", "inferred": True,
     "note": "component: lm_head + the ORPO loss of 8 pairs (16 sequences), HF's reference "
             "implementation; as the GRPO row"},
]
FIT_ROWS = [
    {"id": "verl_fits_qwen25_7b_grpo_lora_1xh100",
     "source": "github.com/volcengine/verl docs/perf/device_tuning.rst @b178a3cd; "
               "examples/tuning/7b/qwen2-7b_grpo-lora_1_h100_fsdp_vllm.sh",
     "card": "h100-sxm-80gb", "published": "ran (MIN resources: 1 x H100, 16 prompts x 5)",
     "spec": {"model": {"preset": "qwen2.5-7b"},
              "method": {"kind": "lora", "lora_rank": 32, "lora_alpha": 32,
                         "lora_targets": "all-linear"},
              "precision": "bf16-mixed", "sequence_length": 1536, "micro_batch_size": 16,
              "gradient_accumulation_steps": 5, "activation_checkpointing": "full",
              "objective": {"kind": "grpo", "beta": 0.001, "num_generations": 5,
                            "max_prompt_length": 512, "max_completion_length": 1024,
                            "generation": {"backend": "vllm-colocate",
                                           "gpu_memory_utilization": 0.2}}},
     "note": "verl's micro-batch of 16 responses, 80 per optimizer step; verl also offloads "
             "the (LoRA) optimizer state and FSDP parameters, which the plan does not"},
]
STEP_ROWS = [
    {"id": "minir1_grpo_qwen25_3b_4xh100_step",
     "source": "github.com/philschmid/deep-learning-pytorch-huggingface "
               "training/mini-deepseek-r1-aha-grpo.ipynb @59b3797 (TRL 0.14, vLLM 0.7)",
     "arch": "qwen2.5-3b", "card": "h100-sxm-80gb", "published_s": 52.5,
     "spec": {"method": {"kind": "full"}, "precision": "bf16-mixed", "sequence_length": 1280,
              "micro_batch_size": 8, "gradient_accumulation_steps": 8,
              "activation_checkpointing": "full",
              "parallel": {"strategy": "fsdp", "devices": 3},
              "objective": {"kind": "grpo", "beta": 0.001, "num_generations": 8,
                            "max_prompt_length": 256, "max_completion_length": 1024,
                            "generation": {"backend": "vllm-server", "server_devices": 1}}},
     "note": "'around 45-60s' per step; ZeRO-3 on 3 GPUs, vLLM on the 4th; 24 prompts x 8 "
             "completions per step; completions may stop before 1024 tokens"},
    {"id": "nemo_grpo_llama31_8b_16xh100_onpolicy_step",
     "source": "github.com/NVIDIA-NeMo/RL docs/about/performance-summary.md @e7c0123d7 (v0.5, "
               "H100 BF16); recipe grpo-llama3.1-8b-instruct-2n8g.yaml @v0.5.0",
     "arch": None, "preset": "llama-3.1-8b", "card": "h100-sxm-80gb", "published_s": 92.8,
     "spec": {"model": {"preset": "llama-3.1-8b", "implementation": "megatron"},
              "method": {"kind": "full"}, "precision": "bf16-mixed", "sequence_length": 1146,
              "micro_batch_size": 1, "gradient_accumulation_steps": 32,
              "activation_checkpointing": "full",
              "parallel": {"strategy": "fsdp", "devices": 8, "nodes": 2},
              "objective": {"kind": "grpo", "beta": 0.01, "num_generations": 32,
                            "steps_per_generation": 128, "max_prompt_length": 127,
                            "max_completion_length": 1019,
                            "generation": {"backend": "vllm-colocate",
                                           "gpu_memory_utilization": 0.6}}},
     "per_generation": True,
     "note": "one GRPO step = 2048 completions generated, 4 optimizer steps of 512; the "
             "completion is the measured mean 1,019 tokens (the decode runs to the longest), the "
             "prompt 127 tokens as the published 1,581 tokens/s/GPU implies; Megatron TP1 PP2 "
             "planned as FSDP"},
]


def _spec(row: dict):
    from tunepilot.model.arch import Arch, resolve_arch
    from tunepilot.spec import spec_from_dict

    d = dict(row["spec"])
    if row.get("arch"):
        d.setdefault("model", {"preset": "tiny"})  # placeholder; the arch comes from ARCH
    spec = spec_from_dict(d)
    arch = Arch.from_config(ARCH[row["arch"]]) if row.get("arch") else resolve_arch(spec)
    return spec, arch


def _component(row: dict) -> int:
    """The loss head alone as the plan counts it: lm_head (4096 x 128256, bf16) and its
    gradient, the hidden states and theirs, the log-prob terms at bf16 (activations.py)."""
    from tunepilot.model.arch import Arch, load_preset
    from tunepilot.plan.analytic.activations import logprob_bytes
    from tunepilot.spec import spec_from_dict

    arch = Arch.from_config(load_preset("llama-3-8b"))
    t = row["tokens"]
    if row["component"] == "grpo":
        obj = {"kind": "grpo", "num_generations": 2, "max_prompt_length": 1,
               "max_completion_length": t - 1}
        mb = row["rows"]
    else:
        obj, mb = {"kind": "orpo"}, row["rows"] // 2
    spec = spec_from_dict({"model": {"preset": "llama-3-8b"}, "precision": "bf16-true",
                           "method": {"kind": "full"}, "sequence_length": t,
                           "micro_batch_size": mb, "objective": obj})
    lp = logprob_bytes(arch, spec, 2, row["rows"])
    head = 2 * 2 * arch.hidden_size * arch.vocab_size
    hidden = 2 * 2 * row["rows"] * t * arch.hidden_size
    return head + hidden + lp["kept"] + max(lp["forward"], lp["backward"])


def memory_rows() -> list[dict]:
    from tunepilot.plan.analytic.core import analytic_plan

    out = []
    for row in MEMORY_ROWS:
        if row.get("component"):
            planned = _component(row)
        else:
            spec, arch = _spec(row)
            plan = analytic_plan(spec, arch, "cuda")
            planned = getattr(plan.per_device, f"{row['compare']}_peak_bytes")
        out.append({"id": row["id"], "compare": row["compare"], "measured_kind":
                    row["measured_kind"], "measured_bytes": row["measured_bytes"],
                    "analytic_bytes": planned, "error": planned / row["measured_bytes"] - 1,
                    "inferred": row.get("inferred", False), "note": row["note"],
                    "source": row["source"]})
    return out


def fit_rows() -> list[dict]:
    from tunepilot.catalog import load_catalog
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.plan.fit import fit_card

    out = []
    for row in FIT_ROWS:
        spec, arch = _spec(row)
        card = load_catalog().get(row["card"])
        fit = fit_card(spec, arch, card, analytic_plan)
        out.append({"id": row["id"], "card": card.id, "published": row["published"],
                    "plan_fits": fit.fits, "device_peak_gib": fit.device_peak_bytes / GIB,
                    "max_micro_batch": fit.max_micro_batch, "note": row["note"],
                    "source": row["source"]})
    return out


def step_rows() -> list[dict]:
    """Projected step time: the step's token positions over every rank / (ranks x efficiency
    x one card's positions per second at the throughput model's MFU, the decode added at the
    card's HBM bandwidth) - the quote's rule (cost/throughput.per_card) without a pilot."""
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.assumptions import efficiency_parts
    from tunepilot.cost.mfu import estimate
    from tunepilot.model.flops import decode_seconds_per_position, flops_per_token, peak_precision
    from tunepilot.spec.objective import global_generation_batch, lengths

    out = []
    for row in STEP_ROWS:
        spec, arch = _spec(row)
        card = load_catalog().get(row["card"])
        e = estimate(spec.model.implementation, card.id, spec.method.kind,
                     spec.activation_checkpointing, spec.torch_compile, spec.precision)
        per_s = e.mfu * card.peak_flops(peak_precision(spec)) / flops_per_token(arch, spec).train
        decode = decode_seconds_per_position(arch, spec, card.hbm_bandwidth_bytes_per_s)
        per_s = 1 / (1 / per_s + decode)
        n = spec.parallel.world_size
        positions = global_generation_batch(spec) * lengths(spec).sequence
        projected = positions / (n * efficiency_parts(spec.parallel.strategy, n)[0] * per_s)
        gen_share = decode / (1 / per_s)
        out.append({"id": row["id"], "card": card.id, "ranks": n, "mfu": e.mfu,
                    "published_s": row["published_s"], "projected_s": projected,
                    "error": projected / row["published_s"] - 1,
                    "decode_share": gen_share, "note": row["note"], "source": row["source"]})
    return out


def print_memory(rows: list[dict]) -> None:
    print("objectives: plan vs published peaks (GiB = 2^30 B; measured = published)")
    for r in rows:
        print(f"  {r['id']:<40} {r['compare']:<9} {r['measured_bytes'] / GIB:>7.2f} GiB "
              f"{r['analytic_bytes'] / GIB:>7.2f} GiB {r['error']:>+7.1%}"
              + ("   (inferred / another implementation)" if r["inferred"] else ""))
    like = [abs(r["error"]) for r in rows if not r["inferred"]]
    print("  median |error| like-for-like: " + (f"{statistics.median(like):.1%}" if like else
          "none: every published DPO/GRPO peak found has inferred settings or measures a "
          "component of another implementation (see each note)"))
    for r in fit_rows():
        print(f"  {r['id']:<40} {r['card']}: published {r['published']}; the plan "
              f"{'fits' if r['plan_fits'] else 'does NOT fit'} at {r['device_peak_gib']:.1f} GiB"
              f" (max micro-batch {r['max_micro_batch']})")


def print_steps(rows: list[dict]) -> None:
    print("objectives: projected vs published GRPO step time (s; published = measured)")
    for r in rows:
        print(f"  {r['id']:<44} {r['ranks']:>3} x {r['card']:<14} MFU {r['mfu']:.2f} "
              f"{r['published_s']:>7.1f} s {r['projected_s']:>7.1f} s {r['error']:>+7.1%} "
              f"(decode {r['decode_share']:.0%} of the time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    mem, steps = memory_rows(), step_rows()
    if a.json:
        print(json.dumps({"memory": mem, "fit": fit_rows(), "steps": steps}, indent=1))
        return
    print_memory(mem)
    print_steps(steps)


if __name__ == "__main__":
    main()
