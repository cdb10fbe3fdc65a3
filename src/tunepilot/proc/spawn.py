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
and the sentinel ends the child's whole process group, and every process that left it: it
records the child's descendants as they appear (every SENTINEL_POLL_S) and, at the end, also
finds every process still carrying the child's TOKEN_ENV in its environment (a `setsid`
grandchild whose parent already exited: no process group or parent links it to the child any
more). A command that tunepilot watches for its whole life (`watch`) also makes tunepilot a
child subreaper (Linux PR_SET_CHILD_SUBREAPER): while tunepilot lives an orphaned descendant is
re-parented to it, not to init, so it stays in the tree that is sampled and torn down.

What cannot be covered (Linux, without cgroups): a descendant that both clears its environment
and leaves the process tree - started, setsid'd and orphaned - within one SENTINEL_POLL_S of
tunepilot's SIGKILL; work handed to another service (systemd-run, a container runtime, ssh,
at/cron), which is not a descendant at all; a process that changed its user (setuid), which we
may not signal. A cgroup (systemd-run --user --scope tunepilot ...) holds all of these.
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
SENTINEL_POLL_S = 0.5  # the sentinel's look at the tree: one pass over the process table
TOKEN_ENV = "TUNEPILOT_SPAWN_TOKEN"  # marks every process a reaped child starts (inherited)
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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


def become_subreaper(on: bool = True) -> bool:
    """Linux: orphaned descendants of this process are re-parented to it instead of init, so
    a command's tree stays this process's tree (`watch`; ``on=False`` ends it); False where
    that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def run_tool(cmd: Sequence[str], *, timeout_s: float | None, **kw
             ) -> subprocess.CompletedProcess:
    """subprocess.run for a short-lived tool (git, nvidia-smi, sbatch): it dies with tunepilot
    too (PR_SET_PDEATHSIG), as every child tunepilot starts."""
    parent = os.getpid()
    return subprocess.run(list(cmd), timeout=timeout_s,
                          preexec_fn=lambda: die_with_parent(parent_pid=parent), **kw)


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
                 preexec: Callable[[], None] | None = None, cleanup: Path | None = None,
                 subreaper: bool = False):
        self.cmd = [str(c) for c in cmd]
        self.grace_s = grace_s
        parent = os.getpid()
        self.token = None
        if reaper:  # every process the child starts inherits it (unless it clears its env)
            import secrets

            self.token = f"{parent}-{secrets.token_hex(8)}"
            env = {**(os.environ if env is None else env), TOKEN_ENV: self.token}

        def before_exec() -> None:
            die_with_parent(parent_pid=parent)
            if preexec is not None:
                preexec()

        # a subreaper (before the child starts: an orphan made at once must find it): every
        # child of ours but this one and the sentinel is an adopted orphan of this child's tree
        self._subreaper = subreaper and become_subreaper()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd,
                                     start_new_session=True, preexec_fn=before_exec)
        self.pid = self.proc.pid
        self._known: dict[int, object] = {}
        self._reaper = _start_reaper(self.pid, grace_s, cleanup, self.token,
                                     os.getpid() if self._subreaper else None) \
            if reaper else None
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
        self._adopted()

    def _adopted(self) -> None:
        """Our own children other than the child and the sentinel: descendants orphaned and
        re-parented to us (a subreaper). Remember the living (and theirs), reap the dead."""
        import psutil

        mine = {self.pid, self._reaper[0].pid if self._reaper else -1}
        try:
            kids = psutil.Process().children()
        except psutil.Error:
            return
        for c in kids:
            if c.pid in mine or not (self._subreaper or c.pid in self._known or
                                     self._carries_token(c)):
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
                if c.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(c.pid, os.WNOHANG)  # a zombie only we can reap
                    continue
                self._known.setdefault(c.pid, c)
                for g in c.children(recursive=True):
                    self._known.setdefault(g.pid, g)

    def tree(self) -> list:
        """The child and every descendant known and running now (orphans re-parented to us
        included): what `watch` samples."""
        import psutil

        self.refresh()
        out = []
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(self.pid))
        for p in list(self._known.values()):
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def _carries_token(self, p) -> bool:
        return self.token is not None and _has_token(p, self.token)

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
                if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if os.getpgid(p.pid) == self.pid or (p.pid not in out and
                                                     self._carries_token(p)):
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
        if self._subreaper:
            self._adopted()  # reap what was re-parented to us and has ended
            become_subreaper(False)
            self._subreaper = False
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


def _start_reaper(pgid: int, grace_s: float, cleanup: Path | None, token: str | None,
                  adopter: int | None) -> tuple[subprocess.Popen, int]:
    """The sentinel: watches a pipe whose only write end is ours, recording the child's
    descendants meanwhile; at EOF without DONE (we died) it ends process group ``pgid``, every
    descendant it recorded and every process carrying ``token``, and removes ``cleanup`` (the
    child's job directory)."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: the child never holds the write end
    args = [sys.executable, "-m", "tunepilot.proc.spawn", str(pgid), str(grace_s),
            str(cleanup) if cleanup else "-", token or "-", str(adopter or "-")]
    proc = subprocess.Popen(args, stdin=read_fd, start_new_session=True, close_fds=True)
    os.close(read_fd)
    return proc, write_fd


def _has_token(p, token: str) -> bool:
    """Whether process ``p`` carries TOKEN_ENV=token in its environment (readable for our own
    user's processes only; a zombie or another user's process has none we can see)."""
    import psutil

    try:
        return p.environ().get(TOKEN_ENV) == token
    except (psutil.Error, OSError):
        return False


def run_to_end(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
               stdout=None, stderr=None, reaper: bool = False, cleanup: Path | None = None
               ) -> tuple[int | None, bool]:
    """(return code, timed out) of a child run to its end under the rules above."""
    with Spawned(cmd, env=env, stdout=stdout, stderr=stderr, reaper=reaper,
                 cleanup=cleanup) as p:
        finished = p.wait(timeout_s)
    return p.proc.returncode, not finished


def _reaper_main(argv: list[str]) -> int:
    """The sentinel (see _start_reaper): argv = PGID GRACE_S CLEANUP|- TOKEN|- ADOPTER|-."""
    pgid, grace = int(argv[0]), float(argv[1])
    cleanup = argv[2] if len(argv) > 2 and argv[2] != "-" else None
    token = argv[3] if len(argv) > 3 and argv[3] != "-" else None
    adopter = int(argv[4]) if len(argv) > 4 and argv[4] != "-" else None
    seen: dict[int, float] = {}  # pid -> create time (a pid reused later is not ours)
    got = _watch_pipe(lambda: _record(seen, pgid, adopter))
    if got.endswith(DONE):
        return 0  # tunepilot tore the tree down itself
    _end_tree(pgid, seen, token, grace)
    if cleanup:
        import shutil

        shutil.rmtree(cleanup, ignore_errors=True)
    return 0


def _watch_pipe(record: Callable[[], None]) -> bytes:
    """Read stdin to EOF, calling ``record`` every SENTINEL_POLL_S while nothing arrives."""
    import select

    got = b""
    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([0], [], [], SENTINEL_POLL_S)
            if not ready:
                record()
                continue
        try:
            chunk = os.read(0, 4096)
        except OSError:
            return got
        if not chunk:
            return got
        got += chunk


def _record(seen: dict[int, float], root: int, adopter: int | None = None) -> None:
    """Every process now descending from the child, from a process recorded before (an
    orphan re-parented elsewhere keeps being followed) or - ``adopter``: tunepilot as a
    subreaper - from an orphan re-parented to tunepilot: one pass over the process table."""
    import psutil

    kids: dict[int, list] = {}
    created: dict[int, float] = {}
    for p in psutil.process_iter(["ppid", "create_time"]):
        kids.setdefault(p.info["ppid"], []).append(p.pid)
        created[p.pid] = p.info["create_time"] or 0.0
    # a recorded pid is followed only while it is the same process (pids are reused)
    frontier = [root] + [pid for pid, t in seen.items()
                         if pid in created and abs(created[pid] - t) < 0.01]
    if adopter is not None:
        frontier += [c for c in kids.get(adopter, ()) if c != os.getpid()]
    while frontier:
        pid = frontier.pop()
        if pid in created:
            seen.setdefault(pid, created[pid])
        frontier += [c for c in kids.get(pid, ()) if c not in seen and c != os.getpid()]


def _end_tree(pgid: int, seen: dict[int, float], token: str | None, grace: float) -> None:
    """SIGTERM, a grace period, SIGKILL: to the child's group, every recorded descendant still
    running (the same process: its create time matches) and theirs, and every process that
    carries ``token``."""
    import psutil

    _record(seen, pgid)  # the last look: what appeared since, under what was recorded (the
    # adopter is gone: what it had adopted is init's now, followed as recorded)
    targets: dict[int, object] = {}
    for p in psutil.process_iter(["create_time"]):
        if p.pid == os.getpid():
            continue
        mine = p.pid in seen and abs((p.info["create_time"] or 0) - seen[p.pid]) < 0.01
        with contextlib.suppress(psutil.Error, OSError):
            mine = mine or os.getpgid(p.pid) == pgid
        if mine or (token is not None and _has_token(p, token)):
            targets[p.pid] = p
    for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for p in targets.values():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        if pause:
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline and any(_running(p) for p in targets.values()):
                time.sleep(POLL_S)


def _running(p) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False


if __name__ == "__main__":
    sys.exit(_reaper_main(sys.argv[1:]))

