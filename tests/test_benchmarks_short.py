"""Every accuracy benchmark runs from a plain clone, in its short mode (what CI runs): the
benchmarks and the package are copied into a temporary directory with nothing around it (no
../shared, no research folder), so a benchmark that reads a file outside the repository fails
here. Each prints its medians; the reserve replay prints the error resources/runtime.yaml quotes.

The benchmarks import tunepilot's functions inside their bodies, so a rename in src/ that breaks
one is caught here too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# script -> (its short-mode arguments, a line its output must hold); the analytic ones run whole
# in seconds, the reserve replay traces one spec of its three (below)
SHORT = {
    "throughput_accuracy.py": ([], "median |error|"),
    "time_to_train.py": ([], "median |error|"),
    "objectives_reference.py": ([], "plan vs published peaks"),
    "rl_steps.py": ([], "median |error| held_out"),
    "plan_accuracy.py": ([], "median"),
}


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """src/ and benchmarks/ (with benchmarks/data/) as a clone has them, and nothing else."""
    where = tmp_path_factory.mktemp("plain-clone")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("src", "benchmarks"):
        shutil.copytree(ROOT / part, where / part, ignore=ignore)
    return where


def _run(clone: Path, script: str, args: list[str]) -> str:
    out = subprocess.run([sys.executable, str(clone / "benchmarks" / script), *args],
                         capture_output=True, text=True, timeout=600, cwd=clone,
                         env={**os.environ, "PYTHONPATH": str(clone / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SHORT))
def test_each_accuracy_benchmark_runs_from_a_plain_clone_in_its_short_mode(clone, script):
    args, expect = SHORT[script]
    assert expect in _run(clone, script, args)


@pytest.mark.slow
def test_runtime_yaml_quotes_the_error_the_reserve_replay_prints(clone):
    """The reserve replay's short mode (the 1B spec, the first of the three) runs from the clone,
    and resources/runtime.yaml's allocator source states the error it prints."""
    printed = _run(clone, "reserve_replay.py", ["--short"])
    first = re.search(r"traced\s+[\d.]+ GiB\s+([+-][\d.]+%)", printed).group(1)
    text = (ROOT / "src" / "tunepilot" / "resources" / "runtime.yaml").read_text()
    stated = re.search(r"\(([+-][\d.]+%), [+-][\d.]+%, [+-][\d.]+%:\s+benchmarks/reserve_replay",
                       text)
    assert stated and stated.group(1) == first, (first, stated and stated.group(0))


def test_an_open_sample_length_explains_only_a_plan_above_the_figure():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plan_accuracy as pa
    finally:
        sys.path.pop(0)
    for bound in pa.LENGTH_BOUNDS:  # max_length, or the longest sample of the datasets
        row = {"unmodelled": [bound]}
        assert pa.open_setting_explains(dict(row, e=+0.13), "e")  # shorter samples: lower
        assert not pa.open_setting_explains(dict(row, e=-0.12), "e")  # the longest is low
    assert pa.open_setting_explains({"unmodelled": ["the vision tower"], "e": -0.2}, "e")
    assert not pa.open_setting_explains({"unmodelled": [], "e": +0.2}, "e")


def test_a_reserve_on_a_full_card_is_capped_at_what_the_allocator_can_get():
    """A card's reserve stops at the card less what lives outside the caching allocator (the
    context and the collectives' buffers: device peak - reserved), not at the card less the
    context alone; a step whose allocated peak does not fit is left as planned."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plan_accuracy as pa
    finally:
        sys.path.pop(0)
    gib = 2**30
    card = pa.CARD_BYTES["aa6"]
    figures = {"allocated_peak_bytes": 18 * gib, "reserved_peak_bytes": 30 * gib,
               "device_peak_bytes": 30 * gib + 5 * gib // 4}
    assert pa.on_card("aa6", "reserved_peak_bytes", figures) == card - 5 * gib // 4
    assert pa.on_card("aa6", "allocated_peak_bytes", figures) == 18 * gib
    assert pa.on_card("aa1", "reserved_peak_bytes", figures) == 30 * gib  # no card named
    big = dict(figures, allocated_peak_bytes=card)
    assert pa.on_card("aa6", "reserved_peak_bytes", big) == 30 * gib
