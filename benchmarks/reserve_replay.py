"""The reserve model against the H200 measurements: the traced plan's reserved peak (the traced
allocations replayed through the CUDA caching allocator's rules, plan/reserve/allocator.py, plus
the varied-shapes term, plan/reserve/core.py) and the analytic plan's (the measured fixed-shape
slack) for the three specs tunepilot measured on a lent H200 (benchmarks/data/h200_gpu_check.yaml:
torch.cuda.max_memory_reserved of step 2), with the signed error of each.

The trace runs on fake tensors on this machine's CPU, as `tunepilot plan --trace` does, planned
for a CUDA card: no GPU is needed. Printed, not asserted; resources/runtime.yaml quotes the
errors it prints.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/reserve_replay.py [--json] [--short]
  --short replays the smallest spec only (CI runs it so).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "data" / "h200_gpu_check.yaml"
GIB = 2**30


def replay(row: dict) -> dict:
    from tunepilot.model.arch import Arch, resolve_model_config
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.plan.trace.core import trace_in_child, traced_plan_from
    from tunepilot.spec import spec_from_dict

    spec = spec_from_dict(row["spec"], source=row["id"])
    cfg = resolve_model_config(spec)
    arch = Arch.from_config(cfg)
    analytic = analytic_plan(spec, arch, "cuda")
    traced = traced_plan_from(spec, trace_in_child(spec, cfg, "cuda"), analytic, "cuda", arch)
    measured = row["max_memory_reserved_gib"] * GIB
    out = {"id": row["id"], "what": row["what"], "measured_reserved_bytes": measured,
           "measured_allocated_bytes": row["max_memory_allocated_gib"] * GIB}
    for name, plan in (("traced", traced), ("analytic", analytic)):
        got = plan.per_device.reserved_peak_bytes
        out[f"{name}_reserved_bytes"] = got
        out[f"{name}_allocated_bytes"] = plan.per_device.allocated_peak_bytes
        out[f"{name}_error"] = got / measured - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--short", action="store_true", help="the smallest spec only")
    a = ap.parse_args()
    data = yaml.safe_load(DATA.read_text(encoding="utf-8"))
    rows = data["reserve"][:1] if a.short else data["reserve"]
    out = [replay(r) for r in rows]
    if a.json:
        print(json.dumps({"source": data["source"], "rows": out}, indent=1))
        return 0
    print(f"reserved peak, planned vs measured max_memory_reserved (GiB = 2^30 B; measured on "
          f"{data['measured_on']}, {data['as_of']}; planned = projected)")
    for r in out:
        print(f"  {r['id']:<27} measured {r['measured_reserved_bytes'] / GIB:7.2f} GiB | traced "
              f"{r['traced_reserved_bytes'] / GIB:7.2f} GiB {r['traced_error']:+6.1%} | analytic "
              f"{r['analytic_reserved_bytes'] / GIB:7.2f} GiB {r['analytic_error']:+6.1%}")
    print("  (" + ", ".join(f"{r['traced_error']:+.1%}" for r in out) + " traced)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
