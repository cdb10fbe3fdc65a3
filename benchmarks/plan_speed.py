"""Time the analytic plan of llama-3.1-70b against every catalog card, in-process.

Target: <= 0.5 s for the plan and the full fit table (devices needed, largest micro-batch and
sequence length per card). Also prints the cold import + first-call time of a fresh process,
which is what a user waits for at `tunepilot plan`.
Run:  .venv/bin/python benchmarks/plan_speed.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from tunepilot.catalog import load_catalog
from tunepilot.memory.plan import make_plan
from tunepilot.spec import spec_from_dict

SPEC = {"model": {"preset": "llama-3.1-70b"}, "method": {"kind": "full"},
        "precision": "bf16-mixed", "sequence_length": 4096, "micro_batch_size": 1,
        "activation_checkpointing": "full", "parallel": {"strategy": "fsdp", "devices": 8}}


def main() -> None:
    spec = spec_from_dict(SPEC)
    catalog = load_catalog()
    make_plan(spec, catalog=catalog)  # warm caches (preset and runtime files)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        plan = make_plan(spec, catalog=catalog)
        times.append(time.perf_counter() - t)
    cold = subprocess.run([sys.executable, "-c", (
        "import time; t=time.perf_counter(); from tunepilot.catalog import load_catalog; "
        "from tunepilot.memory.plan import make_plan; from tunepilot.spec import spec_from_dict; "
        f"make_plan(spec_from_dict({SPEC!r})); print(time.perf_counter()-t)")],
        capture_output=True, text=True, check=True)
    print(f"analytic plan, llama-3.1-70b full FSDPx8, {len(plan.cards)} cards with fit table: "
          f"median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms "
          f"over {len(times)} runs (measured; target <= 500 ms)")
    print(f"fresh process, imports + first plan: {float(cold.stdout) * 1000:.0f} ms (measured)")


if __name__ == "__main__":
    main()
