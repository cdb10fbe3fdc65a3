"""Checkpoints an adversary edited (issue 40 item 12, N19, N21-N25, N28): every count read from
a manifest is bounded, a manifest that is a FIFO or /dev/zero is a problem and not a hang, a
scheduler state that is not one is not called resumable, `export` refuses whatever `verify`
rejects, and a destination inside the run is refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.cli import run_cli
from tunepilot.checkpoint import save_checkpoint
from tunepilot.checkpoint.export import ExportError, export_run
from tunepilot.checkpoint.inspect import inspect_checkpoint
from tunepilot.checkpoint.manifest import digest
from tunepilot.dataset import DataStream, build_dataset, make_loader
from tunepilot.errors import UserError
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult, Throughput
from tunepilot.spec import load_spec
from tunepilot.store import RunDir
from tunepilot.training.step import TrainState

ROOT = Path(__file__).resolve().parents[1]
TINY = load_spec(ROOT / "examples" / "tiny.yaml")
DATA = Path(__file__).resolve().parent / "data" / "trust4"
CKPT = "checkpoints/step-1"


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = RunDir(tmp_path / "run")
    run.write(PilotResult(throughput=Throughput(
        useful_tokens_per_s=Figure.measured(1.0, "tokens/s"))), TINY.spec_hash())
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    ds, info = build_dataset(TINY, 256)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), step=1)
    save_checkpoint(run.path / CKPT, state, DataStream(make_loader(TINY, ds, info)), TINY)
    return run.path


def reseal(ckpt: Path, **manifest_changes) -> None:
    """What a forger does (no key is involved): recompute every listed file's SHA-256 and size
    and the manifest's own digest after editing."""
    m = json.loads((ckpt / "manifest.json").read_text())
    for rel, e in m["files"].items():
        p = ckpt / rel
        if p.is_file():
            e["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
            e["bytes"] = p.stat().st_size
    m.update(manifest_changes)
    m["manifest_sha256"] = digest(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def verify_in_a_process(ckpt: Path) -> dict:
    """`tunepilot verify --json` as a user runs it; a hang fails the test at the timeout."""
    proc = subprocess.run([sys.executable, "-m", "tunepilot", "verify", str(ckpt), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stderr
    return json.loads(proc.stdout)


def test_a_manifest_claiming_a_billion_ranks_is_refused_at_once(run_dir):
    ckpt = run_dir / CKPT
    reseal(ckpt, world_size=10**9)
    report = verify_in_a_process(ckpt)
    assert not report["ok"] and "world_size" in report["problems"][0]["problem"]
    with pytest.raises(ExportError, match="world_size"):
        export_run(run_dir, str(run_dir.parent / "dest"))


def test_many_missing_ranks_are_counted_not_listed(run_dir):
    ckpt = run_dir / CKPT
    reseal(ckpt, world_size=100_000)
    problems = inspect_checkpoint(ckpt, load=False).problems
    assert len(problems) < 40
    assert any("more ranks' files" in p.problem for p in problems)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_manifest_that_is_not_a_regular_file_is_named_not_read(run_dir, kind):
    ckpt = run_dir / CKPT
    (ckpt / "manifest.json").unlink()
    if kind == "fifo":
        os.mkfifo(ckpt / "manifest.json")
    else:
        (ckpt / "manifest.json").symlink_to("/dev/zero")
    report = verify_in_a_process(ckpt)
    assert "not a regular file" in report["problems"][0]["problem"]
    with pytest.raises(ExportError, match="not a regular file"):
        export_run(run_dir, str(run_dir.parent / "dest"))


def test_a_scheduler_state_that_is_not_one_is_not_resumable(run_dir):
    ckpt = run_dir / CKPT
    (ckpt / "scheduler.json").write_text("[1, 2]")
    reseal(ckpt)
    report = inspect_checkpoint(ckpt, load=False)
    assert not report.resumable
    assert [p.component for p in report.problems] == ["scheduler"]
    code, out, _ = run_cli("verify", ckpt, "--json")
    assert code == 1 and json.loads(out)["resumable"] is False


@pytest.mark.slow
def test_a_scheduler_state_of_the_right_shape_is_loaded_into_a_scheduler(run_dir):
    """Shape passes the no-torch check; the fresh process loads it into a real LambdaLR."""
    ckpt = run_dir / CKPT
    saved = json.loads((ckpt / "scheduler.json").read_text())
    saved["lr_lambdas"] = [5]  # LambdaLR keeps a dict (or None) per lambda, not a number
    (ckpt / "scheduler.json").write_text(json.dumps(saved))
    reseal(ckpt)
    assert inspect_checkpoint(ckpt, load=False).ok
    report = verify_in_a_process(ckpt)
    assert report["loaded_in_fresh_process"]
    assert [p["component"] for p in report["problems"]] == ["scheduler"]
    assert "does not load into an LR scheduler" in report["problems"][0]["problem"]


def _add_shard(ckpt: Path) -> None:
    src = next((ckpt / "model").glob("*.distcp"))
    (ckpt / "model" / "__0_9.distcp").write_bytes(src.read_bytes())


def _bad_progress(ckpt: Path) -> None:
    (ckpt / "progress.json").write_text('{"step": 7, "useful_tokens_seen": 1}')
    reseal(ckpt)


def _bad_scheduler(ckpt: Path) -> None:
    (ckpt / "scheduler.json").write_text('{"base_lrs": "x"}')
    reseal(ckpt)


def _flip(ckpt: Path) -> None:
    p = ckpt / "rng.rank0.json"
    data = bytearray(p.read_bytes())
    data[10] ^= 1
    p.write_bytes(bytes(data))


def _resealed_shard(ckpt: Path) -> None:
    """the fuzzer's seed 20261206, checkpoint case 917: a shard cut short, the manifest
    resealed over it"""
    p = next((ckpt / "model").glob("*.distcp"))
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    reseal(ckpt)


@pytest.mark.parametrize("tamper", [_add_shard, _bad_progress, _bad_scheduler, _flip,
                                    _resealed_shard])
def test_export_refuses_whatever_verify_rejects(run_dir, tamper):
    ckpt = run_dir / CKPT
    tamper(ckpt)
    if tamper is not _resealed_shard:  # resealed: only loading it finds the damage
        assert not inspect_checkpoint(ckpt, load=False).ok
    with pytest.raises(ExportError, match="damaged") as err:
        export_run(run_dir, str(run_dir.parent / "dest"))
    assert "Traceback" not in str(err.value)  # DCP's exception quotes its ranks' tracebacks
    assert not (run_dir.parent / "dest").exists()


def test_a_failed_dcp_load_is_named_by_the_ranks_own_error_in_one_line():
    from torch.distributed.checkpoint.api import CheckpointException

    from tunepilot.checkpoint.inspect import load_error

    exc = CheckpointException("load", {0: (ValueError("bad header\nat byte 8"), None)})
    assert "Traceback" in str(exc)
    assert load_error(exc) == "rank 0: ValueError: bad header at byte 8"


def test_an_export_into_the_run_directory_is_refused(run_dir):
    with pytest.raises(UserError, match="inside the run directory"):
        export_run(run_dir, str(run_dir / "sub"))
    with pytest.raises(UserError, match="inside the run directory"):
        export_run(run_dir, str(run_dir))
    export_run(run_dir, str(run_dir.parent / "dest"))  # outside: fine, and again
    export_run(run_dir, str(run_dir.parent / "dest"))


@pytest.mark.slow
def test_verify_says_the_digests_are_not_a_signature(run_dir):
    code, out, _ = run_cli("verify", run_dir / CKPT, "--json")
    assert code == 0
    assert any("not a signature" in n for n in json.loads(out)["notes"])


def test_a_run_manifest_of_the_wrong_shape_is_one_paragraph():
    code, _, err = run_cli("quote", ROOT / "examples" / "tiny.yaml", "--from",
                           DATA / "rundir_manifest_null", "--card", "h100", "--hours", "2")
    assert code == 2 and "schema_version" in err and "Traceback" not in err
