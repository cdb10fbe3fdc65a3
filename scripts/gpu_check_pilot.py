"""The pilot on a CUDA GPU: a 1B full fine-tune and an 8B LoRA, random weights (see the .sh)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# 1B full: bf16-mixed (fp32 master weights + AdamW fp32 states: 16 B/param), 2 x 2048 tokens.
FULL_1B = {"name": "gpu-check-llama3.2-1b-full", "model": {"preset": "llama-3.2-1b"},
           "method": {"kind": "full"}, "optimizer": {"name": "adamw", "lr": 1.0e-5},
           "precision": "bf16-mixed", "sequence_length": 2048, "micro_batch_size": 2,
           "gradient_accumulation_steps": 1, "data": {"source": "synthetic"},
           "validation": {"num_batches": 5}}
# 8B LoRA r16 on q/v, bf16 frozen base, 2 x 4096 tokens, 2 micro-batches per step.
LORA_8B = {"name": "gpu-check-llama3-8b-lora", "model": {"preset": "llama-3-8b"},
           "method": {"kind": "lora", "lora_rank": 16, "lora_alpha": 32,
                      "lora_targets": ["q_proj", "v_proj"]},
           "optimizer": {"name": "adamw", "lr": 2.0e-4}, "precision": "bf16-mixed",
           "sequence_length": 4096, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
           "data": {"source": "synthetic"}, "validation": {"num_batches": 5}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"))
    ap.add_argument("--only", choices=["1b", "8b"], default=None)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check_pilot: torch is not installed: skipping")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check_pilot: no CUDA GPU on this machine: skipping (nothing was run)")
        return 0
    from tunepilot.pilot.runner import PilotOptions, run_pilot
    from tunepilot.spec import spec_from_dict
    from tunepilot.views.common import console
    from tunepilot.views.pilot import render_pilot

    specs = {"1b": FULL_1B, "8b": LORA_8B}
    rc = 0
    summary = {}
    for key, raw in specs.items():
        if args.only and key != args.only:
            continue
        spec = spec_from_dict(raw)
        out = Path(args.out) / spec.label
        console.rule(f"pilot: {spec.label}")
        res = run_pilot(spec, out, PilotOptions(max_steps=args.max_steps))
        d = res.to_dict()
        render_pilot(res, str(out / "pilot.json"))
        comps = d["plan_vs_measured"]["components"]
        residuals = {k: {"planned_gib": v["planned"]["value"] / 2**30,
                         "measured_gib": (v["measured"]["value"] or 0) / 2**30,
                         "ratio": (v.get("ratio") or {}).get("value")} for k, v in comps.items()}
        summary[spec.label] = {
            "verdict": d["verdict"], "device": d["device"],
            "step_time_p50_s": d["step_time"]["p50_s"]["value"],
            "useful_tokens_per_s": d["throughput"]["useful_tokens_per_s"]["value"],
            "mfu": d["mfu"]["value"], "residuals": residuals,
            "alloc_retries": d["memory"]["allocator"]["num_alloc_retries"]["value"]}
        rc = rc or (0 if res.fits else 1)
        del res
        torch.cuda.empty_cache()
    print(json.dumps(summary, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
