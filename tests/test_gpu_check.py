"""scripts/gpu_check.sh's tiny-model path on the CPU (SMOKE=1): the same sections as on the
GPU - tunepilot run end to end, the Liger, FP8 and DPO pilots - each ran and wrote its figures
into the one JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_checks_tiny_path_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "PY": sys.executable,
           "BUDGET_S": "900"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(got) == ["env", "run-8b", "liger", "fp8", "dpo"]
    for name in ("run-8b", "liger", "fp8", "dpo"):
        assert got[name]["status"] == "ok", (name, got[name].get("tail"))
    decision = got["run-8b"]["figures"]["decision"]
    assert decision is not None and {g["stage"] for g in decision["gates"]} >= {
        "plan", "pilot", "restore", "quote"}
    for name in ("liger", "fp8", "dpo"):
        assert got[name]["figures"]["fits"] is True, name
