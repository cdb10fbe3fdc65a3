"""How long the traced plan takes, and how much memory its child process needs, on this machine.

Targets (issue 8, 2 CPU cores): llama-3-8b full fine-tune bf16-true, seq 2048, micro-batch 1:
<= 30 s and <= 4 GB peak RSS of the trace's child process; llama-3.1-70b LoRA: <= 3 min.
Printed, not asserted (timings depend on the machine and its load).

Run:  .venv/bin/python benchmarks/trace_speed.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tunepilot.model.arch import resolve_model_config
from tunepilot.plan.trace.core import trace_in_child
from tunepilot.spec import spec_from_dict

CASES = [
    ("llama-3-8b full bf16-true s2048 mb1", 30.0, {
        "model": {"preset": "llama-3-8b"}, "method": {"kind": "full"}, "precision": "bf16-true",
        "sequence_length": 2048, "micro_batch_size": 1}),
    ("llama-3.1-70b LoRA r16 q,v bf16-mixed s2048 mb1", 180.0, {
        "model": {"preset": "llama-3.1-70b"}, "method": {"kind": "lora", "lora_rank": 16},
        "precision": "bf16-mixed", "sequence_length": 2048, "micro_batch_size": 1}),
    ("llama-3.1-70b LoRA r16 all-linear, checkpointed, s2048 mb1 accum 16", 180.0, {
        "model": {"preset": "llama-3.1-70b"},
        "method": {"kind": "lora", "lora_rank": 16, "lora_targets": "all-linear"},
        "precision": "bf16-mixed", "activation_checkpointing": "full",
        "sequence_length": 2048, "micro_batch_size": 1, "gradient_accumulation_steps": 16}),
]
RSS_TARGET_BYTES = 4 * 10**9  # 4 GB


def run_case(fields: dict) -> dict:
    spec = spec_from_dict(fields)
    t0 = time.perf_counter()
    raw = trace_in_child(spec, resolve_model_config(spec), "cuda")
    return {"wall_s": time.perf_counter() - t0, "child_wall_s": raw.child_wall_s,
            "child_peak_rss_bytes": raw.child_peak_rss_bytes, "num_ops": raw.num_ops,
            "peak_bytes": raw.peak_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, target_s, fields in CASES:
        r = run_case(fields)
        r.update(case=name, target_s=target_s)
        rows.append(r)
        if not args.json:
            ok_t = "ok" if r["wall_s"] <= target_s else "OVER"
            ok_m = "ok" if r["child_peak_rss_bytes"] <= RSS_TARGET_BYTES else "OVER"
            print(f"{name}: {r['wall_s']:.1f} s end to end (child {r['child_wall_s']:.1f} s, "
                  f"target <= {target_s:.0f} s: {ok_t}); child peak RSS "
                  f"{r['child_peak_rss_bytes'] / 1e9:.2f} GB (target <= 4 GB: {ok_m}); "
                  f"{r['num_ops']:,} ops traced; traced peak {r['peak_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    if args.json:
        print(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=2))
    else:
        print(f"(measured on this machine: {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
