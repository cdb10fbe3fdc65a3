"""Nothing tunepilot starts outlives a SIGKILL of tunepilot (issue 40 item 12, N26-N27): a
`setsid` grandchild of `watch` (also one that cleared its environment and lost its parent), and
the fresh-load child of `verify`. Linux only (prctl); the processes here are real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tunepilot.proc.spawn import pid_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG / PR_SET_CHILD_SUBREAPER are Linux's")
EXE = [sys.executable, "-m", "tunepilot"]


def _gone(pid: int, within_s: float = 20.0) -> bool:
    """Ended (a zombie waiting for init counts as ended) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def _wait_for(path: Path, within_s: float = 60.0) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.1)
    raise AssertionError(f"{path} was not written")


@pytest.mark.parametrize("script", [
    "setsid sleep 300 & echo $! > {pid}; sleep 300",  # N26: left the group, parent alive
    "(env -i setsid sleep 300 & echo $! > {pid}); sleep 300",  # orphaned, no token in its env
])
def test_a_setsid_grandchild_of_watch_dies_with_a_sigkilled_tunepilot(tmp_path, script):
    pid_file = tmp_path / "grandchild.pid"
    cmd = script.format(pid=pid_file)
    watcher = subprocess.Popen([*EXE, "watch", "--out", str(tmp_path / "w"), "--", "bash", "-c",
                                cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    grandchild = None
    try:
        grandchild = _wait_for(pid_file)
        time.sleep(1.5)  # the sentinel has looked at the tree since
        assert pid_alive(grandchild)
        watcher.send_signal(signal.SIGKILL)
        watcher.wait(timeout=30)
        assert _gone(grandchild), f"sleep {grandchild} outlived `watch` (SIGKILL)"
    finally:
        if grandchild is not None and pid_alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        if watcher.poll() is None:
            watcher.kill()


@pytest.mark.slow
def test_an_orphan_the_command_left_is_ended_when_watch_ends(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    proc = subprocess.run([*EXE, "watch", "--out", str(tmp_path / "w"), "--", "bash", "-c",
                           f"(env -i setsid sleep 300 & echo $! > {pid_file}); sleep 1"],
                          capture_output=True, text=True, timeout=120)
    orphan = int(pid_file.read_text().split()[0])
    try:
        assert proc.returncode == 0, proc.stderr
        assert _gone(orphan, 5.0) and "left running were terminated" in proc.stdout
    finally:
        if pid_alive(orphan):
            os.kill(orphan, signal.SIGKILL)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    import torch

    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.spec import load_spec
    from tunepilot.training.step import TrainState

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny.yaml")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    ds, info = build_dataset(spec, 256)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), step=1)
    save_checkpoint(tmp_path / "ckpt", state, DataStream(make_loader(spec, ds, info)), spec)
    return tmp_path / "ckpt"


def test_the_fresh_load_child_of_verify_dies_with_a_sigkilled_verify(tmp_path, checkpoint):
    """N27. The child is held in its start-up (a sitecustomize of this test's own that sleeps
    in that process only), as a large checkpoint holds it in its load for up to an hour."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time\n"
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    if b'tunepilot.checkpoint.inspect' in f.read():\n"
        "        time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slow), os.environ.get(
        "PYTHONPATH", "")])}
    verify = subprocess.Popen([*EXE, "verify", str(checkpoint)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline:
            out = subprocess.run(["pgrep", "-P", str(verify.pid), "-f", "checkpoint.inspect"],
                                 capture_output=True, text=True).stdout.split()
            child = int(out[0]) if out else None
            time.sleep(0.1)
        assert child is not None, "verify did not start its fresh-load child"
        verify.send_signal(signal.SIGKILL)
        verify.wait(timeout=30)
        assert _gone(child), "the fresh-load child outlived `verify` (SIGKILL)"
    finally:
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)
        if verify.poll() is None:
            verify.kill()
