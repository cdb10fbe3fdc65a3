"""Export: every file arrives with the right SHA-256, a second run skips what is there intact,
a damaged destination file is copied again, and a damaged local checkpoint never leaves."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import fsspec
import pytest
import torch

import tunepilot.checkpoint.export as E
from tunepilot.checkpoint import save_checkpoint
from tunepilot.checkpoint.export import ExportError, export_run
from tunepilot.dataset import DataStream, build_dataset, make_loader
from tunepilot.errors import UserError
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult, Throughput
from tunepilot.spec import load_spec
from tunepilot.store import RunDir
from tunepilot.training.step import TrainState

ROOT = Path(__file__).resolve().parents[1]
TINY = load_spec(ROOT / "examples" / "tiny.yaml")


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory as the stages leave it: manifest, a stage result, a log, a checkpoint,
    and the temporary directory of a save that was killed (which must not be exported)."""
    run = RunDir(tmp_path / "run")
    run.write(PilotResult(throughput=Throughput(
        useful_tokens_per_s=Figure.measured(1.0, "tokens/s"))), TINY.spec_hash())
    (run.logs_dir() / "pilot.log").write_text("step 1\n" * 1000)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    ds, info = build_dataset(TINY, 512)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), step=1)
    save_checkpoint(run.path / "checkpoints" / "step-1", state,
                    DataStream(make_loader(TINY, ds, info)), TINY)
    stale = run.path / "checkpoints" / ".step-2.tmp-99999-dead"
    stale.mkdir()
    (stale / "half-written.distcp").write_bytes(b"\0" * 100)
    return run.path


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _local_files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _sha(p) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_export_verifies_every_file_and_resumes(run_dir, tmp_path):
    dest = tmp_path / "dest"
    first = export_run(run_dir, str(dest))
    assert first.count("copied") == len(first.files) and first.count("skipped") == 0
    assert not any(".tmp-" in f.path for f in first.files)
    there = _local_files(dest)
    assert not any(".tmp-" in k for k in there)
    for f in first.files:  # byte-identical, and export.json lists the right hashes
        assert there[f.path] == f.sha256 == _sha(run_dir / f.path)
    assert there["manifest.json"] == _sha(run_dir / "manifest.json")
    assert there["export.json"] == _sha(run_dir / "export.json")

    record = json.loads((run_dir / "export.json").read_text())
    for key, unit in (("bytes", "bytes"), ("seconds", "s"), ("bytes_per_s", "B/s")):
        assert record[key]["basis"] == "measured" and record[key]["unit"] == unit
        assert record[key]["value"] > 0
    assert record["bytes"]["value"] == sum(f.bytes for f in first.files)
    assert "export" in RunDir(run_dir).manifest().stages

    second = export_run(run_dir, str(dest))  # resume: everything is already there
    assert second.count("skipped") == len(second.files) and second.bytes_copied.value == 0
    rate = second.to_dict()["bytes_per_s"]
    assert rate["from_previous_export"] is True
    assert rate["value"] == record["bytes_per_s"]["value"]

    flipped = next(f.path for f in first.files if f.path.endswith(".distcp"))
    data = bytearray((dest / flipped).read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other bytes: only a hash sees it
    (dest / flipped).write_bytes(bytes(data))
    (dest / "logs" / "pilot.log").write_text("step 1\n")  # a partial upload
    third = export_run(run_dir, str(dest))
    assert {f.path for f in third.files if f.action == "recopied"} == {flipped, "logs/pilot.log"}
    assert third.count("skipped") == len(third.files) - 2
    assert _sha(dest / flipped) == _sha(run_dir / flipped)


@pytest.mark.slow
def test_export_to_an_fsspec_url(run_dir):
    url = "memory://tunepilot-test/run"
    result = export_run(run_dir, url)
    fs = fsspec.filesystem("memory")
    for f in result.files:
        with fs.open(f"/tunepilot-test/run/{f.path}", "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == f.sha256
    assert json.loads(fs.cat("/tunepilot-test/run/export.json"))["dest"] == url
    assert export_run(run_dir, url).count("skipped") == len(result.files)
    fs.rm("/tunepilot-test", recursive=True)


def test_a_damaged_local_checkpoint_is_not_exported(run_dir, tmp_path):
    target = next((run_dir / "checkpoints" / "step-1" / "optimizer").glob("*.distcp"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"optimizer/__0_.\.distcp \(optimizer\)"):
        export_run(run_dir, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_a_file_that_does_not_read_back_intact_is_named(run_dir, tmp_path, monkeypatch):
    real = E._sha256_remote

    def corrupt(fs, path):
        return "0" * 64 if path.endswith("pilot.log") else real(fs, path)

    monkeypatch.setattr(E, "_sha256_remote", corrupt)
    with pytest.raises(ExportError, match="logs/pilot.log: sha256 at the destination"):
        export_run(run_dir, str(tmp_path / "dest"))


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_a_missing_filesystem_package_says_what_to_install(run_dir):
    with pytest.raises(UserError, match="pip install s3fs"):
        export_run(run_dir, "s3://some-bucket/runs/tiny")


def test_cli_export_json(run_dir, tmp_path):
    from typer.testing import CliRunner

    from tunepilot.cli import app

    res = CliRunner().invoke(app, ["export", str(run_dir), str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verified"] is True and data["files_copied"] == len(data["files"])
    res = CliRunner().invoke(app, ["export", str(run_dir), str(tmp_path / "out")])
    assert res.exit_code == 0 and "skipped" in res.stdout


def test_export_result_reads_back_equal(run_dir, tmp_path):
    from tunepilot.results.export import ExportResult

    result = export_run(run_dir, str(tmp_path / "dest"))
    back = RunDir(run_dir).read(ExportResult)
    assert back == ExportResult.from_dict(result.to_dict())
    assert back.to_dict() == json.loads((run_dir / "export.json").read_text())


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_full_destination_stops_with_a_message_and_the_run_is_untouched(run_dir, tmp_path):
    import sys

    from tests.support.full_disk import available, run_on_full_disk

    if not available():
        pytest.skip("mounting a small tmpfs needs root / CAP_SYS_ADMIN")
    before = _tree(run_dir)
    exe = str(Path(sys.executable).with_name("tunepilot"))
    # 40 KiB: the stage result and the log fit, the checkpoint's shards do not
    proc = run_on_full_disk(tmp_path / "dest", 40, [exe, "export", str(run_dir),
                                                     str(tmp_path / "dest" / "x")])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the destination is full" in proc.stderr and "Traceback" not in proc.stderr
    assert "run the export again" in proc.stderr
    assert _tree(run_dir) == before  # no export.json, nothing rewritten
