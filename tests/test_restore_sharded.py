"""The sharded restore proof: 2 FSDP ranks under real torchrun save one sharded checkpoint, a
fresh process group loads it (on 2 ranks: bit-exact per rank; on 1 rank: resharded, within
tolerance), and tampering with one rank's files is named by file, component and rank."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny-fsdp.yaml"
EXE = Path(sys.executable).with_name("tunepilot")

pytestmark = pytest.mark.slow


def _cli(*args, timeout=600):
    return subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "run"
    proc = _cli("restore", SPEC, "--nproc", "2", "--steps-before", "3", "--steps-after", "3",
                "--out", out, "--json")
    return out, proc


def test_two_fsdp_ranks_resume_bit_exactly_per_rank(proof):
    out, proc = proof
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["passed"] and r["nproc"] == 2 and r["checkpoint"]["world_size"] == 2
    by_rank = {(c["name"], c["rank"]) for c in r["components"]}
    for name in ("model", "optimizer", "scheduler", "rng", "data_position", "progress", "loss"):
        assert (name, 0) in by_rank and (name, 1) in by_rank, name
    assert r["loss_max_abs_diff"]["value"] == 0.0
    assert "bit-exact" in r["tolerance"]


def test_a_checkpoint_of_two_ranks_loads_resharded_on_one(tmp_path):
    proc = _cli("restore", SPEC, "--nproc", "2", "--resume-nproc", "1", "--steps-before", "2",
                "--steps-after", "3", "--out", tmp_path / "run", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["passed"] and r["resume_nproc"] == 1
    assert "resharded 2 -> 1" in r["tolerance"] and "not bit-exact" in r["tolerance"]
    assert r["loss_max_abs_diff"]["value"] < 1e-3


def test_a_resume_rank_count_that_breaks_the_global_batch_is_refused(tmp_path):
    proc = _cli("restore", SPEC, "--nproc", "2", "--resume-nproc", "3", "--out", tmp_path)
    assert proc.returncode == 2 and "--resume-nproc" in proc.stderr
    assert "Traceback" not in proc.stderr


def _checkpoint(proof, tmp_path) -> Path:
    out, _ = proof
    src = next((out / "checkpoints").glob("restore-sharded-step-*"))
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def _problems(path: Path) -> list[dict]:
    proc = _cli("verify", path, "--json")
    assert proc.returncode == 1, proc.stdout
    return json.loads(proc.stdout)["problems"]


def test_verify_names_a_dropped_rank_rng_file(proof, tmp_path):
    ck = _checkpoint(proof, tmp_path)
    assert _cli("verify", ck).returncode == 0
    (ck / "rng.rank1.json").unlink()
    bad = _problems(ck)
    assert any(p["component"] == "rng" and p["rank"] == 1 and p["file"] == "rng.rank1.json"
               for p in bad), bad


def test_verify_names_a_flipped_byte_in_one_shard(proof, tmp_path):
    ck = _checkpoint(proof, tmp_path)
    shard = ck / "optimizer" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    shard.write_bytes(bytes(raw))
    bad = _problems(ck)
    assert bad == [p for p in bad if p["file"] == "optimizer/__1_0.distcp"]
    assert bad[0]["rank"] == 1 and bad[0]["component"] == "optimizer"


def test_verify_names_a_truncated_manifest_and_a_same_size_shard_from_another_run(proof,
                                                                                   tmp_path):
    ck = _checkpoint(proof, tmp_path)
    m = ck / "manifest.json"
    m.write_bytes(m.read_bytes()[:200])
    assert _problems(ck)[0]["file"] == "manifest.json"
    ck2 = _checkpoint(proof, tmp_path / "b")
    a, b = ck2 / "model" / "__0_0.distcp", ck2 / "model" / "__1_0.distcp"
    if a.stat().st_size == b.stat().st_size:  # a shard of the same size, other bytes
        shutil.copy(b, a)
        bad = _problems(ck2)
        assert any(p["file"] == "model/__0_0.distcp" and p["rank"] == 0 for p in bad)


def test_kill_9_of_one_rank_mid_sharded_save_leaves_the_previous_checkpoint(tmp_path):
    """One trial here; benchmarks/sharded_save_kill.py runs 10 (rank 1 and rank 0 alternately)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.sharded_kill import trial

    from tunepilot.checkpoint.files import remove_stale_temporaries

    r = trial(tmp_path, seed=3, victim=1)
    assert r["killed_mid_save"], r
    assert r["problems"] == [] and r["loaded_in_fresh_process"] and r["is_last_complete_save"]
    assert r["leftover_temporaries"] >= 1  # the dead save's, until the next save removes it
    remove_stale_temporaries(tmp_path / "ckpt" / "latest")
    assert not list((tmp_path / "ckpt").glob(".latest.tmp-*"))
