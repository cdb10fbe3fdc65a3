"""The one way tunepilot starts another process - a fresh-process child (proc/child.py), torchrun
(scaling/launch.py), a watched command (integrations/watch.py), the user's script under the
restore proof - and makes sure nothing it started outlives it.

    with Spawned(cmd, env=..., stdout=...) as p:     # its own session (process group)
        while p.running():                           # descendants tracked as they appear
            ...
    # leaving the block tears the whole tree down: SIGTERM to every group, a grace period,
    # SIGKILL to whatever is left - also on an exception or a timeout

Dying with tunepilot: the child gets SIGKILL when tunepilot's process dies (Linux
PR_SET_PDEATHSIG, with a check for a parent that died before the request was made). Its own
children do not inherit that, so with ``reaper=True`` a small sentinel process holds the read
end of a pipe only tunepilot writes to: when tunepilot dies - even by SIGKILL - the pipe closes
and the sentinel ends the child's whole process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

GRACE_S = 5.0
POLL_S = 0.2


LAUNCHERS = ("torch.distributed.run", "torchrun")  # what a rank's parent process runs


def die_with_parent(sig: int = signal.SIGKILL, *, parent_pid: int | None = None,
                    parent_runs: tuple[str, ...] | None = None) -> None:
    """Linux: this process gets ``sig`` when its parent dies (prctl PR_SET_PDEATHSIG), so a
    SIGKILL of tunepilot ends torchrun and, through torchrun, every rank; no-op elsewhere.
    A parent that died before the request was made (a rank still importing torch when
    tunepilot was killed) is caught too: given ``parent_pid`` or the words ``parent_runs`` its
    command line holds, a process whose parent is no longer that one ends itself at once.
    Usable as a Popen preexec_fn (with functools.partial for the keywords)."""
    if not sys.platform.startswith("linux"):
        return
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    ppid = os.getppid()
    orphaned = (parent_pid is not None and ppid != parent_pid) or (
        parent_runs is not None and not any(w in _cmdline(ppid) for w in parent_runs))
    if orphaned:
        os.kill(os.getpid(), sig)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Spawned:
    """A child process in a session of its own, its descendants tracked, torn down whole."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, stdout=None,
                 stderr=None, cwd=None, reaper: bool = False, grace_s: float = GRACE_S,
                 preexec: Callable[[], None] | None = None, cleanup: Path | None = None):
        self.cmd = [str(c) for c in cmd]
        self.grace_s = grace_s
        parent = os.getpid()

        def before_exec() -> None:
            die_with_parent(parent_pid=parent)
            if preexec is not None:
                preexec()

        self.proc = subprocess.Popen(self.cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd,
                                     start_new_session=True, preexec_fn=before_exec)
        self.pid = self.proc.pid
        self._known: dict[int, object] = {}
        self._reaper = _start_reaper(self.pid, grace_s, cleanup) if reaper else None
        self.refresh()

    # --- while it runs -----------------------------------------------------------------------
    def running(self) -> bool:
        self.refresh()
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def refresh(self) -> None:
        """Remember every descendant seen (ranks and workers may live in sessions of their own,
        so killing the child's group alone would orphan them)."""
        import psutil

        try:
            for c in psutil.Process(self.pid).children(recursive=True):
                self._known.setdefault(c.pid, c)
        except psutil.Error:
            pass

    def signal_group(self, sig: int) -> None:
        """``sig`` to the child's process group (a forwarded SIGINT/SIGTERM)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait(self, timeout_s: float) -> bool:
        """Wait for the child to end; False when ``timeout_s`` passed first (still running)."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    # --- the end -----------------------------------------------------------------------------
    def alive(self) -> list:
        """Descendants still running (zombies excluded), and anything left in the child's group."""
        import psutil

        out = {}
        for p in self._known.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out[p.pid] = p
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid != os.getpid() and os.getpgid(p.pid) == self.pid and \
                        p.status() != psutil.STATUS_ZOMBIE:
                    out.setdefault(p.pid, p)
        return list(out.values())

    def _signal_all(self, sig: int, procs: list) -> None:
        import psutil

        own = os.getpgrp()
        groups = {self.pid}
        for p in procs:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(p.pid))
        for g in groups - {own}:
            with contextlib.suppress(OSError):
                os.killpg(g, sig)
        for p in procs:  # a process that left its group
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def teardown(self) -> int:
        """End the child and everything it started: SIGTERM, a grace period, SIGKILL. How many
        processes were still running when it began (the child itself not counted)."""
        import psutil

        self.refresh()
        left = [p for p in self.alive() if p.pid != self.pid]
        if self.proc.poll() is None or left:
            self._signal_all(signal.SIGTERM, left)
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and (self.proc.poll() is None or self.alive()):
                time.sleep(POLL_S)
            still = self.alive()
            if self.proc.poll() is None or still:
                self._signal_all(signal.SIGKILL, still)
        try:
            self.proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        psutil.wait_procs(self.alive(), timeout=self.grace_s)
        self._stop_reaper()
        return len(left)

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            proc, fd = self._reaper
            with contextlib.suppress(OSError):
                os.write(fd, DONE)  # torn down by us: the sentinel leaves everything as it is
                os.close(fd)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.grace_s)
            self._reaper = None

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


DONE = b"done\n"


def _start_reaper(pgid: int, grace_s: float, cleanup: Path | None
                  ) -> tuple[subprocess.Popen, int]:
    """The sentinel: blocks on a pipe whose only write end is ours; at EOF without DONE (we
    died) it ends process group ``pgid`` and removes ``cleanup`` (the child's job directory)."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: the child never holds the write end
    args = [sys.executable, "-m", "tunepilot.proc.spawn", str(pgid), str(grace_s)]
    proc = subprocess.Popen(args + ([str(cleanup)] if cleanup else []), stdin=read_fd,
                            start_new_session=True, close_fds=True)
    os.close(read_fd)
    return proc, write_fd


def run_to_end(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
               stdout=None, stderr=None, reaper: bool = False, cleanup: Path | None = None
               ) -> tuple[int | None, bool]:
    """(return code, timed out) of a child run to its end under the rules above."""
    with Spawned(cmd, env=env, stdout=stdout, stderr=stderr, reaper=reaper,
                 cleanup=cleanup) as p:
        finished = p.wait(timeout_s)
    return p.proc.returncode, not finished


def _reaper_main(argv: list[str]) -> int:
    pgid, grace = int(argv[0]), float(argv[1])
    got = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(0, 4096):
            got += chunk
    if got.endswith(DONE):
        return 0  # tunepilot tore the tree down itself
    for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(pause)
    if len(argv) > 2:
        import shutil

        shutil.rmtree(argv[2], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_reaper_main(sys.argv[1:]))

