"""pyproject's floors are versions the code runs on. Under `make floor` (TUNEPILOT_FLOORS set)
this runs on exactly those versions; everywhere it checks the floors against what the code
needs and that launch installs no older torch."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from floors import floors  # noqa: E402

# what the code calls, and the first release that has it
NEEDS = {"transformers": ("4.56.0", "from_config/from_pretrained(dtype=...): model/build.py"),
         "peft": ("0.17.0", "LoraConfig(target_parameters=...): model/build.py")}


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:3] if x.isdigit())


def test_the_floors_are_at_least_what_the_code_calls():
    """pyproject allowed transformers 4.45 (no dtype=: every model build failed) and peft 0.12
    (no target_parameters)."""
    f = floors()
    for pkg, (need, why) in NEEDS.items():
        assert _v(f[pkg]) >= _v(need), f"{pkg} {f[pkg]} < {need}: {why}"


def test_launch_installs_the_same_torch_floor():
    from tunepilot.launch import TORCH_FLOOR

    assert _v(TORCH_FLOOR) == _v(floors()["torch"])


def test_torch_is_no_requirement_and_an_older_one_is_said_not_refused():
    """A torch requirement, even a floor, would have pip replace a GPU user's own build."""
    import tomllib

    from tunepilot.device import torch_floor_note

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = doc["dependencies"] + [r for extra in doc["optional-dependencies"].values()
                                  for r in extra]
    assert not [r for r in reqs if r.split(">")[0].split("=")[0].strip().lower() == "torch"]
    assert torch_floor_note("2.12.1+cu128") and "older than" in torch_floor_note("2.12.1+cu128")
    assert torch_floor_note(floors()["torch"] + ".0") is None
    assert torch_floor_note("2.14.0+rocm7.0") is None


def test_the_floor_job_runs_on_the_floors():
    pins = os.environ.get("TUNEPILOT_FLOORS")
    if not pins:
        pytest.skip("not the floor job (make floor sets TUNEPILOT_FLOORS)")
    import peft
    import torch
    import transformers

    got = {"torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__}
    for line in Path(pins).read_text().split():
        pkg, version = line.split("==")
        assert _v(got[pkg])[:len(_v(version))] == _v(version), (pkg, got[pkg], version)


def test_a_lora_model_builds_and_trains_at_these_versions():
    """dtype= through from_config, LoRA through get_peft_model with target_parameters, one
    step: what the floors must run."""
    from tunepilot.spec import spec_from_dict
    from tunepilot.training.build import build_run
    from tunepilot.training.step import train_step

    s = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "lora"},
                        "precision": "fp32", "sequence_length": 32, "micro_batch_size": 2,
                        "data": {"source": "synthetic"}})
    run = build_run(s, "cpu", total_steps=2)
    st = train_step(run.state, run.stream.next, s)
    assert math.isfinite(st.loss) and st.grad_norm > 0


def test_the_floors_script_prints_pins():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "floors.py")],
                         capture_output=True, text=True, check=True).stdout.split()
    assert {p.split("==")[0] for p in out} == {"torch", "transformers", "peft"}
