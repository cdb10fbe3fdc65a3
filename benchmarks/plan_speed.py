"""Time the analytic plan: in-process (llama-3.1-70b against every catalog card), and what a user
waits for at `tunepilot plan examples/tiny.yaml` - a fresh process, start-up and imports
included - as CPU seconds (user + system, so another job on the machine does not inflate it).

Target: <= 0.5 s for the in-process plan and the full fit table. The command is measured twice:
warm (Python's bytecode of tunepilot and its dependencies already compiled - any run after the
first, or an install that compiled it) and cold (no bytecode: the first run after
`pip install -e .` or a fresh clone, where Python compiles every module it imports). Both use a
private bytecode cache (PYTHONPYCACHEPREFIX), so nothing is written into the source tree and an
environment with PYTHONDONTWRITEBYTECODE=1 is measured as a user's would be. The README quotes
these figures.
Run:  .venv/bin/python benchmarks/plan_speed.py [--json]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"model": {"preset": "llama-3.1-70b"}, "method": {"kind": "full"},
        "precision": "bf16-mixed", "sequence_length": 4096, "micro_batch_size": 1,
        "activation_checkpointing": "full", "parallel": {"strategy": "fsdp", "devices": 8}}


def cli_cpu_seconds(runs: int = 3, *, cold: bool = False,
                    args: tuple[str, ...] = ("plan", "examples/tiny.yaml", "--json")
                    ) -> list[float]:
    """CPU seconds (user + system) of ``tunepilot ARGS`` in fresh processes. Warm: one untimed
    run first fills a private bytecode cache; cold: every run starts with an empty one."""
    exe = str(Path(sys.executable).with_name("tunepilot"))
    out = []
    with tempfile.TemporaryDirectory(prefix="tunepilot-pyc-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        if not cold:
            subprocess.run([exe, *args], env=env, cwd=ROOT, capture_output=True, check=True)
        for i in range(runs):
            if cold:
                env["PYTHONPYCACHEPREFIX"] = os.path.join(cache, str(i))
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([exe, *args], env=env, cwd=ROOT, capture_output=True, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            out.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return out


def in_process_ms(repeats: int = 7) -> tuple[list[float], int]:
    from tunepilot.catalog import load_catalog
    from tunepilot.plan.api import make_plan
    from tunepilot.spec import spec_from_dict

    spec = spec_from_dict(SPEC)
    catalog = load_catalog()
    make_plan(spec, catalog=catalog)  # warm caches (preset and runtime files)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        plan = make_plan(spec, catalog=catalog)
        times.append((time.perf_counter() - t) * 1000)
    return times, len(plan.cards)


def main() -> None:
    times, cards = in_process_ms()
    warm, cold = cli_cpu_seconds(5), cli_cpu_seconds(3, cold=True)
    figures = {
        "in_process_plan_ms": {"median": statistics.median(times), "max": max(times),
                               "unit": "ms", "basis": "measured",
                               "what": f"analytic plan, llama-3.1-70b full FSDPx8, {cards} cards "
                                       "with fit table (target <= 500 ms)"},
        "cli_plan_cpu_s_warm": {"min": min(warm), "median": statistics.median(warm),
                                "unit": "s", "basis": "measured",
                                "what": "tunepilot plan examples/tiny.yaml, fresh process, "
                                        "bytecode compiled"},
        "cli_plan_cpu_s_cold": {"min": min(cold), "median": statistics.median(cold),
                                "unit": "s", "basis": "measured",
                                "what": "the same with no bytecode (first run after install)"},
    }
    if "--json" in sys.argv:
        print(json.dumps(figures, indent=1))
        return
    for f in figures.values():
        mid = f.get("median")
        low = f.get("min", f.get("max"))
        print(f"{f['what']}: median {mid:.3f} {f['unit']} ({'min' if 'min' in f else 'max'} "
              f"{low:.3f}) (measured)")


if __name__ == "__main__":
    main()
