"""kill -9 of one rank during a sharded save: 2 FSDP ranks under real torchrun save the same
checkpoint path again and again; one rank is SIGKILLed while a save's temporary directory holds
its shard files; the checkpoint at the path must still verify (every SHA-256) and load in a
fresh process.

    trial(workdir) -> dict   one trial (used by tests/test_restore_sharded.py)
    python -m tests.support.sharded_kill --worker DIR   the rank loop torchrun runs
The 10-trial figure: benchmarks/sharded_save_kill.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "tiny-fsdp.yaml"
# wider than the tiny preset, so a save takes long enough to be caught in the middle
CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 8192, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def _spec(work: Path):
    from tunepilot.spec import load_spec

    cfg = work / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    return load_spec(SPEC).with_changes(model={"config": str(cfg)}, sequence_length=32)


def worker(work: Path) -> None:
    import torch.distributed as dist

    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.restore.worker import train
    from tunepilot.scaling.worker import init_group, placement
    from tunepilot.training.build import build_run

    rank, _, device = init_group("cpu", 1)
    (work / f"pid.rank{rank}").write_text(str(os.getpid()))
    spec = _spec(work) if rank == 0 else None
    box = [spec]
    dist.broadcast_object_list(box, src=0)
    spec = box[0]
    run = build_run(spec, device, total_steps=1000, rank=rank,
                    world_size=dist.get_world_size(),
                    **placement("fsdp", spec, device))
    for i in range(1, 200):
        train(run.state, run.stream, spec, 1)
        save_checkpoint(work / "ckpt" / "latest", run.state, run.stream, spec)
        if rank == 0:
            with open(work / "saves", "a") as f:
                f.write(f"{i}\n")


def _saves(work: Path) -> int:
    p = work / "saves"
    return len(p.read_text().split()) if p.exists() else 0


def _in_temporary(work: Path, rank: int) -> bool:
    """A save is under way and this rank has started writing its shard into the temporary."""
    return any(any(tmp.glob(f"*/__{rank}_*")) for tmp in (work / "ckpt").glob(".latest.tmp-*"))


def trial(work: Path, *, seed: int = 0, victim: int = 1, timeout_s: float = 120) -> dict:
    """One trial; the returned dict says where the kill landed and what survived."""
    from tunepilot.checkpoint import read_manifest, verify_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "--max-restarts", "0", "-m", "tests.support.sharded_kill",
           "--worker", str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    result = {"seed": seed, "victim_rank": victim, "killed_mid_save": False}
    try:
        wanted = 1 + rng.randrange(3)  # complete saves before the one that is interrupted
        while _saves(work) < wanted:
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the saver ended or stalled before {wanted} saves")
            time.sleep(0.005)
        time.sleep(rng.random() * 0.05)
        pid = int((work / f"pid.rank{victim}").read_text())
        while time.monotonic() - t0 < timeout_s:
            if _in_temporary(work, victim):
                os.kill(pid, signal.SIGKILL)
                result["killed_mid_save"] = True
                break
            time.sleep(0.0005)
        result["complete_saves_before"] = _saves(work)
        proc.wait(timeout=90)  # torchrun sees the dead rank and stops the other
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = work / "ckpt" / "latest"
    problems = verify_checkpoint(latest)
    result["problems"] = [str(p) for p in problems]
    result["step"] = read_manifest(latest).step if not problems else None
    result["leftover_temporaries"] = len(list((work / "ckpt").glob(".latest.tmp-*")))
    fresh = subprocess.run([str(Path(sys.executable).with_name("tunepilot")), "verify",
                            str(latest), "--json"], capture_output=True, text=True, timeout=300)
    report = json.loads(fresh.stdout) if fresh.stdout.strip().startswith("{") else {}
    result["loaded_in_fresh_process"] = fresh.returncode == 0 and bool(
        report.get("loaded_in_fresh_process"))
    # the checkpoint on disk is the last save that completed: nothing older, nothing half-written
    result["is_last_complete_save"] = result["step"] == result["complete_saves_before"]
    result["ok"] = (not problems and result["loaded_in_fresh_process"]
                    and result["is_last_complete_save"])
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
    else:
        print(__doc__)
