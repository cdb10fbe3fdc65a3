"""Plan each published, measured fine-tuning peak in shared/reference and print the signed error.

Like is compared with like: a row measured with max_memory_allocated (or active_bytes, about the
same) against the plan's allocated peak; reserved against reserved; device-level (NVML) against
the device peak. Units follow the row's mem_kind bracket ([GB] = 1e9 B, [GiB] = 2^30 B).

Run:  .venv/bin/python benchmarks/plan_accuracy.py [--trace] [--json] [--kernels-only]
The DPO / GRPO rows (published_objectives, with their sources) are in objectives_reference.py
and printed after the SFT and the kernels' rows.
  --trace adds the traced plan's column (slower: one real traced step per row).
  The kernels' and adapter variants' published rows (Liger, PEFT's DoRA/rsLoRA, Unsloth's context
  table: benchmarks/kernel_rows.py) follow as their own table; --kernels-only prints just it.
torch.compile, optimizer_in_backward and activation_offloading are modelled on top of the step
(the trace runs the plain eager step), and said so in each plan. A row using a setting a spec
cannot express would be planned without it, marked, and left out of the like-for-like median;
the median over all rows and the share of rows within +-10% are printed too.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from tunepilot.memory.analytic import analytic_plan
from tunepilot.model.arch import Arch
from tunepilot.spec import spec_from_dict

HERE = Path(__file__).resolve().parent
REFERENCE = next(p for p in (HERE.parent / "shared" / "reference",
                             HERE.parent.parent / "shared" / "reference",
                             HERE.parents[2] / "shared" / "reference") if p.exists())

# Architectures of the two reference models that are not presets, from model_arch.csv and the
# models' Hugging Face configs (microsoft/phi-1_5, stabilityai/stablelm-base-alpha-3b).
CONFIGS = {
    "phi-1.5": {"model_type": "phi", "hidden_size": 2048, "num_hidden_layers": 24,
                "num_attention_heads": 32, "intermediate_size": 8192, "vocab_size": 51200,
                "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                "max_position_embeddings": 2048, "hidden_act": "gelu_new"},
    "stablelm-alpha-3b": {"model_type": "gpt_neox", "hidden_size": 4096, "num_hidden_layers": 16,
                          "num_attention_heads": 32, "intermediate_size": 16384,
                          "vocab_size": 50688, "rotary_pct": 0.25, "use_parallel_residual": True,
                          "tie_word_embeddings": False, "max_position_embeddings": 4096,
                          "hidden_act": "gelu"},
}
LITGPT_QV = {"kind": "lora", "lora_rank": 8, "lora_alpha": 16}
LITGPT = {"precision": "bf16-true", "model_implementation": "litgpt"}  # its chunked loss
TT = {"sequence_length": 4096, "micro_batch_size": 2, "precision": "bf16-true",
      "optimizer": {"name": "adamw", "impl": "fused"}}  # torchtune configs set fused: True

# row id -> (model, spec fields, settings the spec cannot express)
ROWS: dict[str, tuple[str, dict, list[str]]] = {
    "7": ("phi-1.5", {"method": dict(LITGPT_QV, lora_targets=["q_proj", "v_proj"]),
                      **LITGPT, "sequence_length": 1044}, []),
    "8": ("phi-1.5", {"method": dict(LITGPT_QV, lora_targets=["q_proj", "v_proj"]),
                      **LITGPT, "sequence_length": 1044, "micro_batch_size": 4},
          []),
    "9": ("stablelm-alpha-3b", {"method": dict(LITGPT_QV, lora_targets=["query_key_value"]),
                                **LITGPT, "sequence_length": 1034}, []),
    "10": ("llama-2-7b", {"method": dict(LITGPT_QV, lora_targets=["q_proj", "v_proj"]),
                          **LITGPT, "sequence_length": 1304}, []),
    "11": ("llama-2-7b", {"method": dict(LITGPT_QV, kind="qlora", lora_targets=["q_proj", "v_proj"],
                                         quantize_lm_head=True, quantize_on_load=False),
                          "optimizer": {"name": "paged_adamw"},
                          **LITGPT, "sequence_length": 1304}, []),
    "12": ("llama-2-13b", {"method": dict(LITGPT_QV, lora_targets=["q_proj", "v_proj"]),
                           **LITGPT, "sequence_length": 1304}, []),
    "13": ("stablelm-alpha-3b", {"method": dict(LITGPT_QV, lora_targets=["query_key_value"],
                                                base_dtype="fp32"),
                                 "precision": "bf16-mixed", "model_implementation": "litgpt",
                                 "sequence_length": 1034}, []),
    "20": ("llama-3.2-3b", dict(TT, method={"kind": "full"}), []),
    "21": ("llama-3.2-3b", dict(TT, method={"kind": "full"}, chunked_loss=True,
                                torch_compile=True), []),
    "22": ("llama-3.2-3b", dict(TT, method={"kind": "full"}, chunked_loss=True,
                                activation_checkpointing="full", torch_compile=True), []),
    "23": ("llama-3.2-3b", dict(TT, method={"kind": "full"}, chunked_loss=True,
                                activation_checkpointing="full",
                                optimizer={"name": "paged_adamw_8bit"}, torch_compile=True,
                                optimizer_in_backward=True, activation_offloading=True), []),
    "24": ("llama-3.2-3b", dict(TT, method={"kind": "lora", "lora_rank": 64, "lora_alpha": 128,
                                            "lora_targets": "all-linear"},
                                chunked_loss=True, activation_checkpointing="full",
                                torch_compile=True, activation_offloading=True), []),
    "25": ("llama-3.2-3b", dict(TT, method={"kind": "qlora", "lora_rank": 64, "lora_alpha": 128,
                                            "lora_targets": "all-linear"},
                                optimizer={"name": "adamw"}, torch_compile=True,
                                chunked_loss=True, activation_checkpointing="full",
                                activation_offloading=True), []),
}
KIND_KEY = {"max_memory_allocated": "allocated_peak_bytes", "active_bytes": "allocated_peak_bytes",
            "max_memory_reserved": "reserved_peak_bytes", "nvidia-smi": "device_peak_bytes",
            "nvml": "device_peak_bytes"}


def row_spec(model: str, fields: dict) -> tuple[dict, dict]:
    model_spec = {"preset": model} if model not in CONFIGS else {"config": f"<{model}>"}
    fields = dict(fields)
    impl = fields.pop("model_implementation", None)
    if impl:
        model_spec["implementation"] = impl
    d = {"model": model_spec, "micro_batch_size": 1, "activation_checkpointing": "none"}
    d.update(fields)
    return d, CONFIGS.get(model) or {}


def measured_bytes(row: dict) -> tuple[int, str]:
    kind = row["mem_kind"]
    unit = 2**30 if "[GiB]" in kind else 10**9
    key = next(v for k, v in KIND_KEY.items() if k in kind.lower())
    return int(float(row["peak_mem_gb"]) * unit), key


def plan_row(model: str, fields: dict):
    d, cfg = row_spec(model, fields)
    if cfg:  # placeholder source; the arch comes from cfg below
        d["model"] = {"preset": "tiny", **{k: v for k, v in d["model"].items()
                                            if k == "implementation"}}
    spec = spec_from_dict(d)
    if cfg:
        arch = Arch.from_config(cfg)
    else:
        from tunepilot.model.arch import resolve_arch

        arch = resolve_arch(spec)
    return spec, arch, cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="add the traced plan's column")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the kernels' and adapter variants' rows (kernel_rows.py)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from kernel_rows import plan_kernel_rows, print_kernel_rows

    kernel_rows = plan_kernel_rows()
    if args.kernels_only:
        if args.json:
            print(json.dumps({"kernel_rows": kernel_rows}, indent=2))
        else:
            print_kernel_rows(kernel_rows)
        return 0
    traced_peak = None
    if args.trace:
        from tunepilot.memory.trace import traced_peak_for_benchmark as traced_peak
    with open(REFERENCE / "published_memory.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        if row["id"] not in ROWS:
            continue
        model, fields, unmodelled = ROWS[row["id"]]
        spec, arch, cfg = plan_row(model, fields)
        got, key = measured_bytes(row)
        plan = analytic_plan(spec, arch)
        rec = {"id": row["id"], "model": row["model"], "method": row["method"],
               "seq": int(row["seq_len"]), "mb": int(row["micro_batch"]), "compare": key,
               "measured_bytes": got, "analytic_bytes": getattr(plan.per_device, key),
               "analytic_error": getattr(plan.per_device, key) / got - 1, "peak_phase": plan.peak_phase,
               "unmodelled": unmodelled}
        if traced_peak is not None:
            t = traced_peak(spec, arch, cfg)
            rec["traced_bytes"] = t.get(key) if t else None
            rec["traced_error"] = (t[key] / got - 1) if t and t.get(key) else None
            rec["traced_note"] = (t or {}).get("note")
        out.append(rec)
    like = [r for r in out if not r["unmodelled"]]
    summary = {
        "rows": len(out), "like_for_like_rows": len(like),
        "analytic_median_abs_error_like_for_like": statistics.median(
            abs(r["analytic_error"]) for r in like),
        "analytic_median_abs_error_all": statistics.median(abs(r["analytic_error"]) for r in out),
        "analytic_within_10pct": sum(abs(r["analytic_error"]) <= 0.10 for r in out),
    }
    if traced_peak is not None:
        te = [abs(r["traced_error"]) for r in like if r.get("traced_error") is not None]
        ta = [abs(r["traced_error"]) for r in out if r.get("traced_error") is not None]
        summary["traced_median_abs_error_like_for_like"] = statistics.median(te) if te else None
        summary["traced_median_abs_error_all"] = statistics.median(ta) if ta else None
        summary["traced_within_10pct"] = sum(x <= 0.10 for x in ta)
        summary["traced_fallbacks"] = sum(r.get("traced_error") is None for r in out)
    from objectives_reference import fit_rows, memory_rows, print_memory

    objectives = memory_rows()
    if args.json:
        print(json.dumps({"rows": out, "summary": summary, "kernel_rows": kernel_rows,
                          "objectives": objectives, "objectives_fit": fit_rows()}, indent=2))
        return 0
    hdr = f"{'id':>3} {'model':<24} {'method':<12} {'seq':>5} {'mb':>2} {'compare':<21} " \
          f"{'measured':>10} {'analytic':>10} {'err':>7}"
    if traced_peak is not None:
        hdr += f" {'traced':>10} {'err':>7}"
    print("plan accuracy against published measured peaks (GiB = 2^30 B; measured = published, "
          "analytic/traced = projected)")
    print(hdr)
    for r in out:
        line = (f"{r['id']:>3} {r['model']:<24} {r['method'][:12]:<12} {r['seq']:>5} {r['mb']:>2} "
                f"{r['compare'].removesuffix('_bytes'):<21} {r['measured_bytes'] / 2**30:>6.2f} GiB "
                f"{r['analytic_bytes'] / 2**30:>6.2f} GiB {r['analytic_error']:>+7.1%}")
        if traced_peak is not None:
            tb = r.get("traced_bytes")
            line += (f" {tb / 2**30:>6.2f} GiB {r['traced_error']:>+7.1%}" if tb else
                     f" {'fallback':>10} {'':>7}")
        if r["unmodelled"]:
            line += "   (not modelled: " + ", ".join(r["unmodelled"]) + ")"
        print(line)
    print(f"median |error| analytic: {summary['analytic_median_abs_error_like_for_like']:.1%} "
          f"over the {len(like)} like-for-like rows (target <= 15%); "
          f"{summary['analytic_median_abs_error_all']:.1%} over all {len(out)} rows; "
          f"{summary['analytic_within_10pct']} of {len(out)} within +-10%")
    if traced_peak is not None and summary.get("traced_median_abs_error_like_for_like") is not None:
        print(f"median |error| traced:   {summary['traced_median_abs_error_like_for_like']:.1%} "
              f"like-for-like (target <= 10%); {summary['traced_median_abs_error_all']:.1%} all; "
              f"{summary['traced_within_10pct']} of {len(out)} within +-10%; "
              f"{summary['traced_fallbacks']} fallbacks")
    print_kernel_rows(kernel_rows)
    print_memory(objectives)  # DPO / GRPO rows: benchmarks/objectives_reference.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
