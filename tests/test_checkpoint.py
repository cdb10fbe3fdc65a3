"""Checkpoints: the full training state round-trips exactly, damage is named by file and component
before anything loads, and a save killed at any point leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tunepilot import checkpoint as ck
from tunepilot.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from tunepilot.restore.worker import build as _build
from tunepilot.restore.worker import train as _train
from tunepilot.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = load_spec(ROOT / "examples" / "tiny.yaml")
LORA = TINY.with_changes(name="tiny-lora", method={"kind": "lora", "lora_rank": 4,
                                                   "lora_dropout": 0.1})


def _trained(spec, steps=3, total=8):
    state, stream = _build(spec, total, None, "cpu")
    _train(state, stream, spec, steps)
    return state, stream


def _bits(records):
    return [(r.loss_bits, r.lr_bits, r.fingerprints) for r in records]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full tiny run saved after 3 steps, and the 3 steps that follow it."""
    path = tmp_path_factory.mktemp("ck") / "step-3"
    state, stream = _trained(TINY)
    info = save_checkpoint(path, state, stream, TINY, extra={"note": "test"})
    return path, info, _train(state, stream, TINY, 3)


def _copy(saved, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved[0], dst)
    return dst


@pytest.mark.slow
def test_round_trip_resumes_bit_identically(saved):
    path, info, after = saved
    assert info.bytes == sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert info.seconds > 0 and info.step == 3 and info.kind == "full"
    assert "manifest.json" in info.files and "scheduler.json" in info.files
    assert set(info.components) == {"model", "optimizer", "scheduler", "rng", "data_position",
                                    "progress"}
    state, stream = _build(TINY, 8, None, "cpu")
    loaded = load_checkpoint(path, state, stream, TINY)
    assert (state.step, loaded.step, loaded.bytes) == (3, 3, info.bytes)
    assert state.useful_tokens_seen == 3 * TINY.micro_batch_size * (TINY.sequence_length - 1)
    assert _bits(_train(state, stream, TINY, 3)) == _bits(after)


def test_manifest_holds_sha256_per_file_and_verifies_clean(saved):
    manifest = read_manifest(saved[0])
    assert manifest.step == 3 and manifest.spec_hash == TINY.spec_hash()
    assert manifest.extra == {"note": "test"}
    for rel, entry in manifest.files.items():
        assert len(entry.sha256) == 64 and entry.bytes == (saved[0] / rel).stat().st_size
    assert {e.component for e in manifest.files.values()} >= {"model", "optimizer", "rng"}
    assert verify_checkpoint(saved[0]) == []


def _largest(path: Path, component: str) -> Path:
    m = read_manifest(path)
    return path / max(m.components[component], key=lambda r: m.files[r].bytes)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("component, damage, words", [
    ("model", _truncate, "truncated"),
    ("optimizer", _flip, "altered"),
    ("rng", _flip, "altered"),
    ("data_position", Path.unlink, "missing"),
    ("scheduler", _truncate, "truncated"),
])
def test_damage_is_named_by_file_and_component_and_nothing_loads(saved, tmp_path, component,
                                                                  damage, words):
    path = _copy(saved, tmp_path)
    target = _largest(path, component)
    damage(target)
    problems = verify_checkpoint(path)
    assert [(p.component, p.file) for p in problems] == [(component,
                                                          str(target.relative_to(path)))]
    assert words in problems[0].problem
    state, stream = _build(TINY, 8, None, "cpu")
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path, state, stream, TINY)
    assert exc.value.component == component and exc.value.file == str(target.relative_to(path))
    assert str(target.relative_to(path)) in str(exc.value)
    assert state.step == 0 and all(torch.equal(before[k], v)
                                   for k, v in state.model.state_dict().items())


@pytest.mark.slow
def test_large_shards_are_hashed_first_then_read_into_the_live_tensors(saved, tmp_path,
                                                                     monkeypatch):
    """Shards above STAGE_MAX_FILE_BYTES are not staged: hashed, then read in place. Damage is
    still refused before the state is touched, and a shard rewritten between the hash and the
    read is refused too."""
    from tunepilot.checkpoint import state as st

    monkeypatch.setattr(st, "STAGE_MAX_FILE_BYTES", 0)
    state, stream = _build(TINY, 8, None, "cpu")
    load_checkpoint(saved[0], state, stream, TINY)
    assert _bits(_train(state, stream, TINY, 3)) == _bits(saved[2])

    path = _copy(saved, tmp_path)
    target = _largest(path, "optimizer")
    _flip(target)
    state, stream = _build(TINY, 8, None, "cpu")
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path, state, stream, TINY)
    assert exc.value.file == str(target.relative_to(path)) and "altered" in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())

    path = _copy(saved, tmp_path / "again")
    target = _largest(path, "model")
    real_check = st.check_files

    def check_then_rewrite(*args, **kwargs):
        found = real_check(*args, **kwargs)
        time.sleep(0.01)  # a later mtime
        target.write_bytes(target.read_bytes())  # same bytes, but written after the hash
        return found

    monkeypatch.setattr(st, "check_files", check_then_rewrite)
    state, stream = _build(TINY, 8, None, "cpu")
    with pytest.raises(CheckpointError, match="changed on disk while it was being loaded"):
        load_checkpoint(path, state, stream, TINY)


@pytest.mark.slow
def test_an_async_save_holds_the_step_it_was_taken_at(tmp_path):
    from tunepilot.checkpoint.async_save import save_checkpoint_async

    state, stream = _trained(TINY)
    pending = save_checkpoint_async(tmp_path / "a", state, stream, TINY)
    after = _train(state, stream, TINY, 3)  # training goes on while it writes
    info = pending.result(timeout=60)
    assert info.step == 3 and pending.unblocked_s > 0 and verify_checkpoint(tmp_path / "a") == []
    fresh, fresh_stream = _build(TINY, 8, None, "cpu")
    load_checkpoint(tmp_path / "a", fresh, fresh_stream, TINY)
    assert _bits(_train(fresh, fresh_stream, TINY, 3)) == _bits(after)
    again = save_checkpoint_async(tmp_path / "b", state, stream, TINY)  # buffers reused
    assert again.result(timeout=60).step == 6


@pytest.mark.slow
def test_a_failed_async_save_raises_on_result_and_keeps_the_previous(tmp_path, monkeypatch):
    from tunepilot.checkpoint import state as st
    from tunepilot.checkpoint.async_save import save_checkpoint_async

    state, stream = _trained(TINY)
    save_checkpoint(tmp_path / "a", state, stream, TINY)
    before = read_manifest(tmp_path / "a").step

    def full(*_a, **_k):
        raise CheckpointError("the disk is full (no space left on device)", component="model")

    monkeypatch.setattr(st, "_write_components", full)
    _train(state, stream, TINY, 1)
    pending = save_checkpoint_async(tmp_path / "a", state, stream, TINY)
    with pytest.raises(CheckpointError, match="disk is full"):
        pending.result(timeout=60)
    assert verify_checkpoint(tmp_path / "a") == [] and read_manifest(tmp_path / "a").step == before
    assert not list(tmp_path.glob(".a.tmp-*"))  # the failed save's temporary is gone


def test_a_damaged_manifest_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    m["step"] = 4  # valid JSON, but no longer what was written
    (path / "manifest.json").write_text(json.dumps(m))
    assert [p.component for p in verify_checkpoint(path)] == ["manifest"]
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_checkpoint(path, *_build(TINY, 8, None, "cpu"), TINY)


@pytest.mark.slow
def test_lora_saves_the_adapter_only_with_a_base_reference(tmp_path):
    state, stream = _trained(LORA)
    info = save_checkpoint(tmp_path / "lora", state, stream, LORA)
    manifest = read_manifest(tmp_path / "lora")
    assert info.kind == "lora" and manifest.model["adapter"]["rank"] == 4
    base = manifest.model["base"]
    assert base["preset"] == "tiny" and base["seed"] == LORA.seed
    assert len(base["config_sha256"]) == 64
    trainable = sum(p.numel() * 4 for p in state.model.parameters() if p.requires_grad)
    model_bytes = sum(manifest.files[r].bytes for r in manifest.components["model"])
    frozen = sum(p.numel() * p.element_size() for p in state.model.parameters()
                 if not p.requires_grad)
    assert trainable <= model_bytes < trainable + frozen // 4  # no base weights inside

    after = _train(state, stream, LORA, 2)  # dropout: the RNG streams decide these losses
    fresh, fresh_stream = _build(LORA, 8, None, "cpu")
    load_checkpoint(tmp_path / "lora", fresh, fresh_stream, LORA)
    assert _bits(_train(fresh, fresh_stream, LORA, 2)) == _bits(after)

    other_base = LORA.with_changes(seed=LORA.seed + 1)  # another random base: refuse the adapter
    with pytest.raises(CheckpointError, match="base seed") as exc:
        load_checkpoint(tmp_path / "lora", *_build(other_base, 8, None, "cpu"), other_base)
    assert exc.value.component == "model"


@pytest.mark.slow
def test_fp16_grad_scaler_state_round_trips(tmp_path):
    spec = TINY.with_changes(precision="fp16-mixed")
    state, stream = _trained(spec, steps=2)
    state.scaler.update(1024.0)  # a scale that is not the default, to see it come back
    info = save_checkpoint(tmp_path / "fp16", state, stream, spec)
    assert "grad_scaler" in info.components
    fresh, fresh_stream = _build(spec, 8, None, "cpu")
    load_checkpoint(tmp_path / "fp16", fresh, fresh_stream, spec)
    assert fresh.scaler.state_dict() == state.scaler.state_dict()
    with pytest.raises(CheckpointError) as exc:  # an fp32 run has no scaler to restore into
        load_checkpoint(tmp_path / "fp16", *_build(TINY, 8, None, "cpu"), TINY)
    assert exc.value.component == "grad_scaler"


def test_every_rng_stream_round_trips():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = ck.rng_state()
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ck.set_rng_state(json.loads(json.dumps(saved)))  # through JSON, as on disk
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


@pytest.mark.slow
def test_a_save_right_after_a_restore_keeps_the_data_position(saved, tmp_path):
    """torchdata's sampler reports position 0 until a batch is drawn after a load; a checkpoint
    written then must still resume where the run was (regression)."""
    path, _, after = saved
    state, stream = _build(TINY, 8, None, "cpu")
    load_checkpoint(path, state, stream, TINY)
    save_checkpoint(tmp_path / "again", state, stream, TINY)  # before any step
    third, third_stream = _build(TINY, 8, None, "cpu")
    load_checkpoint(tmp_path / "again", third, third_stream, TINY)
    assert _bits(_train(third, third_stream, TINY, 3)) == _bits(after)


@pytest.mark.slow
def test_overwriting_replaces_atomically_and_a_failed_save_keeps_the_old(saved, tmp_path,
                                                                         monkeypatch):
    path = _copy(saved, tmp_path)
    state, stream = _trained(TINY, steps=4)
    save_checkpoint(path, state, stream, TINY)
    assert read_manifest(path).step == 4 and verify_checkpoint(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no temporaries left

    def boom(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    import tunepilot.checkpoint.state as ck_state

    monkeypatch.setattr(ck_state, "hash_files", boom)
    _train(state, stream, TINY, 1)
    with pytest.raises(CheckpointError, match="disk is full"):
        save_checkpoint(path, state, stream, TINY)
    assert read_manifest(path).step == 4 and verify_checkpoint(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_interrupted_swap_without_exchange_is_recovered(saved, tmp_path):
    """Where renameat2 is refused the old checkpoint is moved aside first; a crash between the
    two renames leaves it at .NAME.old-*, and the next load puts it back."""
    path = _copy(saved, tmp_path)
    aside = tmp_path / f".{path.name}.old-12345-abcd"
    os.rename(path, aside)
    assert verify_checkpoint(path) == [] and path.is_dir() and not aside.exists()


CHILD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.spec import load_spec
    from tunepilot.training.step import TrainState

    spec = load_spec(sys.argv[1])
    # ~50 MB of state (4M weights + 2 AdamW moments), so a save takes long enough to be hit
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ds, info = build_dataset(spec, 512)
    stream = DataStream(make_loader(spec, ds, info))
    state = TrainState(model, opt, sched)
    path = Path(sys.argv[2])
    while True:
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step += 1
        save_checkpoint(path, state, stream, spec)
        print(state.step, flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(CHILD)
    path = tmp_path / "ckpt" / "latest"
    proc = subprocess.Popen([sys.executable, str(script), str(ROOT / "examples" / "tiny.yaml"),
                             str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one complete checkpoint exists
        deadline = time.monotonic() + 60
        temporaries: list[Path] = []
        while time.monotonic() < deadline:  # wait until the next save has written files
            temporaries = [p for p in path.parent.glob(".latest.tmp-*")
                           if any(f.stat().st_size > 1 << 20 for f in p.rglob("*.distcp"))]
            if temporaries:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        proc.kill()
        proc.wait()
    assert temporaries, "never caught the saver mid-write"
    assert any(t.exists() for t in temporaries)  # killed while the temporary was being written
    assert verify_checkpoint(path) == []
    step = read_manifest(path).step
    assert step >= 1

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.training.step import TrainState

    ds, info = build_dataset(TINY, 512)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    load_checkpoint(path, state, DataStream(make_loader(TINY, ds, info)), TINY)
    assert state.step == step

    save_checkpoint(path, state, DataStream(make_loader(TINY, ds, info)), TINY)
    assert not list(path.parent.glob(".latest.tmp-*"))  # the dead save's leftovers are gone
