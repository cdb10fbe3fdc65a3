"""The restore proof passes on a good checkpoint - full, LoRA with dropout, text data across an
epoch end under fp16 - and fails, naming the component, when any one component is broken."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tunepilot.errors import UserError
from tunepilot.restore import proof as R
from tunepilot.restore.worker import load_hook
from tunepilot.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = load_spec(ROOT / "examples" / "tiny.yaml")
# LoRA with dropout (the RNG streams decide the losses) under fp16-mixed (a GradScaler to restore)
LORA = TINY.with_changes(name="tiny-lora-fp16", method={"kind": "lora", "lora_rank": 4,
                                                        "lora_dropout": 0.1},
                         precision="fp16-mixed")
# 256 texts / 64 per batch = 4 batches per epoch: K = 4 saves exactly at the end of epoch 0
TEXT = TINY.with_changes(name="tiny-text", data={"source": "tiny-text"}, micro_batch_size=64,
                         sequence_length=16)
ALL = ["checksums", "model", "optimizer", "scheduler", "rng", "data_position", "progress",
       "batches", "lr", "loss"]

RUNS = {"tiny": (TINY, 3, 3), "lora": (LORA, 3, 3), "text": (TEXT, 4, 3)}  # (spec, K, M)
CLEAN = ("lora", "text")  # runs whose unbroken proof must pass
# fault -> (run, the component that must be named first, others that must fail too)
HOOKS = "support.restore_faults:"  # tests/support: each hook breaks one component on purpose
FAULTS: dict[str, tuple[str, str, set[str]]] = {
    HOOKS + "DROP_RNG": ("lora", "rng", {"loss"}),  # dropout: a wrong RNG changes the losses too
    HOOKS + "DROP_DATA_POSITION": ("tiny", "data_position", {"batches", "loss"}),
    HOOKS + "RESET_SCHEDULER": ("tiny", "scheduler", {"lr", "loss"}),
    HOOKS + "PERTURB_OPTIMIZER": ("tiny", "optimizer", set()),  # one ULP of one element
    HOOKS + "TRUNCATE_MODEL": ("tiny", "checksums", {"model"}),
    HOOKS + "FLIP_OPTIMIZER": ("tiny", "checksums", {"optimizer"}),
}


def _names(result, passed: bool) -> list[str]:
    return [c.name for c in result.components if c.passed is passed]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """One original run per spec in this process, then one fresh process per fault and per
    clean run, three at a time: {fault or run name: RestoreResult}."""
    originals = {}
    for name, (spec, k, m) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(spec.label)
        originals[name] = (run_dir, R.run_original(spec, k, m, run_dir, None, "cpu"))

    def one(case: tuple[str | None, str]):
        fault, run = case
        run_dir, original = originals[run]
        mine = tmp_path_factory.mktemp("fresh")
        shutil.copytree(run_dir, mine, dirs_exist_ok=True)  # each fault damages its own copy
        original = original.model_copy(update={"checkpoint": original.checkpoint.replace(
            str(run_dir), str(mine))})
        hook = load_hook(fault)
        if hasattr(hook, "after_save"):
            hook.after_save(Path(original.checkpoint))
        return R.verdict(original, R.run_fresh(original, mine, fault), fault)

    cases = [(fault, run) for fault, (run, _, _) in FAULTS.items()] + [(None, r) for r in CLEAN]
    with ThreadPoolExecutor(3) as pool:
        return {fault or run: result
                for (fault, run), result in zip(cases, pool.map(one, cases), strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_broken_component_fails_the_proof_and_is_named(broken, fault):
    result = broken[fault]
    _, first, also = FAULTS[fault]
    failed = _names(result, False)
    assert not result.passed
    assert failed[0] == first, [(c.name, c.detail) for c in result.components]
    assert also <= set(failed)
    assert first in result.failure_message()
    data = result.to_dict()
    assert data["passed"] is False and data["failed_components"] == failed
    assert data["hook"] == fault


@pytest.mark.slow
def test_a_damaged_file_is_named_with_its_component(broken):
    for fault, component in ((HOOKS + "TRUNCATE_MODEL", "model"),
                             (HOOKS + "FLIP_OPTIMIZER", "optimizer")):
        checks = {c.name: c for c in broken[fault].components}
        assert f"{component}/__0_" in checks["checksums"].detail
        assert f"({component})" in checks["checksums"].detail
        assert checks[component].detail.startswith("did not load")
        assert broken[fault].load_s.value is None
        assert broken[fault].to_dict()["load_s"]["value"] is None


@pytest.mark.slow
def test_divergence_names_the_first_step_and_what_diverged(broken):
    d = broken[HOOKS + "DROP_DATA_POSITION"].first_divergence
    assert d["step"] == 3 and d["index"] == 0 and "batches" in d["diverged"]
    assert d["original"]["fingerprints"] != d["restored"]["fingerprints"]
    d = broken[HOOKS + "RESET_SCHEDULER"].first_divergence
    assert d["step"] == 3 and d["diverged"] == ["lr"]  # the first step's loss is still the same


@pytest.mark.slow
def test_cli_restore_passes_and_writes_restore_json(tmp_path):
    from typer.testing import CliRunner

    from tunepilot.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["restore", str(ROOT / "examples" / "tiny.yaml"),
                                   "--steps-before", "3", "--steps-after", "3", "--out", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    printed = json.loads(res.stdout)
    assert printed["passed"] is True
    assert [c["name"] for c in printed["components"]] == ALL
    assert all(c["passed"] and c["detail"] for c in printed["components"])
    saved = json.loads((out / "restore.json").read_text())
    for key, unit in (("save_s", "s"), ("load_s", "s"), ("checkpoint_bytes", "bytes")):
        assert saved[key]["basis"] == "measured" and saved[key]["unit"] == unit
        assert saved[key]["value"] > 0
    assert saved["stage"] == "restore" and saved["spec_hash"] == TINY.spec_hash()
    assert saved["loss_max_abs_diff"]["value"] == 0.0 and saved["deterministic"]["held"]
    orig, rest = saved["steps"]["original"], saved["steps"]["restored"]
    assert [s["loss_bits"] for s in orig] == [s["loss_bits"] for s in rest]
    assert [s["step"] for s in rest] == [3, 4, 5]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "restore" in manifest["stages"] and manifest["device"]["kind"] == "cpu"
    assert (out / "checkpoints" / "restore-step-000003" / "manifest.json").exists()


@pytest.mark.slow
def test_cli_exits_1_naming_the_failed_component(broken, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import tunepilot.restore as restore_pkg
    from tunepilot.cli import app

    monkeypatch.setattr(restore_pkg, "verify_restore",
                        lambda *a, **k: broken[HOOKS + "DROP_DATA_POSITION"])
    res = CliRunner().invoke(app, ["restore", str(ROOT / "examples" / "tiny.yaml"), "--out",
                                   str(tmp_path), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["failed_components"][0] == "data_position"
    assert "restore proof failed: data_position" in res.stderr


@pytest.mark.slow
def test_lora_with_dropout_and_grad_scaler_restores_exactly(broken):
    result = broken["lora"]
    assert result.passed, [(c.name, c.detail) for c in result.components if not c.passed]
    assert result.checkpoint.kind == "lora"
    assert {c.name: c.passed for c in result.components}["grad_scaler"]
    assert [s.loss_bits for s in result.steps.restored] == \
        [s.loss_bits for s in result.steps.original]


@pytest.mark.slow
def test_text_data_restores_across_the_end_of_an_epoch(broken):
    result = broken["text"]
    assert result.passed, [(c.name, c.detail) for c in result.components if not c.passed]
    checks = {c.name: c for c in result.components}
    assert "epoch 0, 256 samples in (4 batches)" in checks["data_position"].detail
    assert [s.step for s in result.steps.restored] == [4, 5, 6]  # all in epoch 1
    padded = [s.useful_tokens for s in result.steps.restored]
    assert all(0 < n < 64 * 15 for n in padded)  # real texts: padding is not counted


def test_steps_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="at least 1 step"):
        R.verify_restore(TINY, 0, 3, tmp_path)


@pytest.mark.gpu
def test_restore_on_the_gpu_reports_determinism_and_loss_difference(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm device")
    spec = TINY.with_changes(precision="bf16-mixed")
    result = R.verify_restore(spec, 3, 3, tmp_path)
    data = result.to_dict()
    assert data["device"]["kind"] in ("cuda", "rocm")
    assert data["loss_max_abs_diff"]["value"] is not None
    assert isinstance(data["deterministic"]["held"], bool)
    failed = {c.name for c in result.components if not c.passed}
    assert not failed - {"loss"}, failed  # the state itself must restore exactly on a GPU too


@pytest.mark.slow
def test_sigkill_of_restore_leaves_no_worker_and_no_job_directory(tmp_path):
    """The fresh-process worker dies with tunepilot and its job directory goes with it (issue
    26: a SIGKILL left the worker running and a tunepilot-child-* directory behind)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    exe = Path(sys.executable).with_name("tunepilot")
    proc = subprocess.Popen([str(exe), "restore", "examples/tiny.yaml", "--out",
                             str(tmp_path / "r")], env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not workers:
        workers = [p for p in psutil.process_iter(["cmdline"])
                   if "tunepilot.restore.worker" in " ".join(p.info["cmdline"] or [])
                   and str(tmp) in " ".join(p.info["cmdline"] or [])]
        time.sleep(0.1)
    assert workers, "the worker never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "the worker outlived a SIGKILLed tunepilot restore"
    end = time.monotonic() + 30
    while time.monotonic() < end and list(tmp.glob("tunepilot-child-*")):
        time.sleep(0.2)
    assert list(tmp.glob("tunepilot-child-*")) == []
