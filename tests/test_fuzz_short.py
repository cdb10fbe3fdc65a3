"""The input fuzzer's short mode (benchmarks/fuzz_inputs.py --short: a few dozen cases of every
input kind of issue 40 item 12), as CI runs it: no traceback, no hang, no broken invariant. A
fixed seed, so a failure here replays with the command it prints; the full run (1,000 cases per
kind, a fresh seed each time) is the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED = 40  # issue 40


@pytest.mark.slow
def test_the_fuzzer_finds_nothing_in_its_short_mode():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz_inputs.py"),
                           "--short", "--seed", str(SEED), "--json"],
                          capture_output=True, text=True, timeout=3000, cwd=ROOT)
    report = json.loads(proc.stdout)
    assert report["seed"] == SEED and report["cases_per_kind"] >= 20
    kinds = {k: v for k, v in report.items() if isinstance(v, dict) and "cases" in v}
    assert len(kinds) == 12, sorted(kinds)
    for kind, res in kinds.items():
        found = res["tracebacks"] + res["hangs"] + res["invariant_violations"]
        assert found == 0, (f"replay: benchmarks/fuzz_inputs.py --seed {SEED} --short --only "
                            f"{kind}", res["examples"])
    assert proc.returncode == 0, proc.stderr[-2000:]
