"""Launch a per-rank entry point with torchrun (`python -m torch.distributed.run`) as a
subprocess, and make sure that when it ends - finished, crashed or timed out - nothing it
started is left running.

Process layout: tunepilot -> torchrun (start_new_session: its own process group) -> N ranks.
torchrun and every rank die with their parent (PR_SET_PDEATHSIG on Linux), so even a SIGKILL of
tunepilot ends them; SIGTERM/SIGINT of tunepilot (the CLI raises them as exceptions) reach the
teardown below.
torchrun starts each rank in a session of its own too (torch.distributed.elastic's
SubprocessHandler uses start_new_session), so killing torchrun's group alone would orphan them.
spawn.Spawned (the one way tunepilot starts a process) therefore keeps a list of torchrun's
descendants while it runs (psutil), and tears down by SIGTERM to torchrun's group and to each
rank's group, a grace period, then SIGKILL to whatever is left. torchrun itself already stops every rank when one of them exits with an error; our
timeout covers the case it cannot see: a rank that hangs.

Each rank's stdout and stderr go to files (torchrun --log-dir/--redirects 3/--tee 3):
    LOG_DIR/<run id>_<random>/attempt_0/<local rank>/{stdout,stderr}.log
and torchrun's own output (with the tee'd rank lines) to LOG_DIR/torchrun.log.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tunepilot.errors import TunepilotError
from tunepilot.proc.child import src_pythonpath
from tunepilot.proc.spawn import Spawned

TEARDOWN_GRACE_S = 5.0  # SIGTERM -> SIGKILL; torchrun's own default is 30 s
POLL_INTERVAL_S = 0.2
LOG_TAIL_LINES = 25

# The progress protocol: a rank writes "[tunepilot rank R] PHASE [detail]" lines to stderr.
# After a timeout the rank that got least far along this order is the one named.
PROGRESS_RE = re.compile(r"\[tunepilot rank (\d+)\] (\w[\w-]*)(?: (.*))?$")
PHASES = ("start", "init", "data", "model", "wrap", "train", "report", "done")


class LaunchError(TunepilotError):
    """A torchrun launch that failed: which rank, why, and the tail of that rank's log."""

    def __init__(self, message: str, *, name: str, rank: int | None = None,
                 timed_out: bool = False, log_path: Path | None = None, log_tail: str = ""):
        self.name, self.rank, self.timed_out = name, rank, timed_out
        self.log_path, self.log_tail = log_path, log_tail
        super().__init__(message)

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "launch": self.name, "rank": self.rank,
                "timed_out": self.timed_out, "log": str(self.log_path) if self.log_path else None,
                "log_tail": self.log_tail, "message": str(self)}


@dataclass
class Rendezvous:
    """torchrun's rendezvous options, passed through unchanged (multi-node runs)."""

    nnodes: int = 1
    node_rank: int | None = None
    endpoint: str | None = None
    """host:port of the rendezvous (the first node), e.g. 'node001:29400'."""
    backend: str = "c10d"
    id: str | None = None

    @property
    def standalone(self) -> bool:
        """One node and no endpoint: torchrun --standalone picks a free local port."""
        return self.nnodes == 1 and self.endpoint is None

    def for_launch(self, suffix: str) -> Rendezvous:
        """The same rendezvous with an id unique to one launch (each launch is a new job)."""
        base = self.id or "tunepilot"
        return Rendezvous(self.nnodes, self.node_rank, self.endpoint, self.backend,
                          f"{base}-{suffix}")


@dataclass
class RankLog:
    local_rank: int
    stdout: Path | None
    stderr: Path | None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the rank's stderr (or stdout when stderr is empty)."""
        for p in (self.stderr, self.stdout):
            if p is not None and p.exists() and p.stat().st_size:
                return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def progress(self) -> tuple[int | None, str, int]:
        """(global rank, last phase, its index in PHASES) from the rank's progress lines."""
        rank, phase = None, ""
        for p in (self.stderr, self.stdout):
            if p is None or not p.exists():
                continue
            for line in p.read_text(errors="replace").splitlines():
                m = PROGRESS_RE.search(line)
                if m:
                    rank, phase = int(m.group(1)), m.group(2)
        order = PHASES.index(phase) if phase in PHASES else -1
        return rank, phase, order


@dataclass
class LaunchResult:
    name: str
    command: list[str]
    returncode: int
    wall_s: float
    log_dir: Path
    launcher_log: Path
    rank_logs: list[RankLog] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "command": self.command, "returncode": self.returncode,
                "wall_s": self.wall_s, "log_dir": str(self.log_dir),
                "launcher_log": str(self.launcher_log),
                "rank_logs": {str(r.local_rank): str(r.stderr) for r in self.rank_logs}}


@lru_cache(maxsize=1)
def torchrun_options() -> frozenset[str]:
    """The option strings this torch's torchrun accepts (torch is not pinned for users)."""
    from torch.distributed.run import get_args_parser

    return frozenset(s for a in get_args_parser()._actions for s in a.option_strings)


def torchrun_command(module: str, module_args: list[str], *, nproc: int, rdzv: Rendezvous,
                     log_dir: Path, options: frozenset[str] | None = None) -> list[str]:
    """The torchrun command line for `python -m module module_args` on nproc ranks per node."""
    opts = torchrun_options() if options is None else options
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if rdzv.standalone:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(rdzv.nnodes), "--rdzv-backend", rdzv.backend]
        if rdzv.endpoint:
            cmd += ["--rdzv-endpoint", rdzv.endpoint]
        if rdzv.id:
            cmd += ["--rdzv-id", rdzv.id]
        if rdzv.node_rank is not None:
            cmd += ["--node-rank", str(rdzv.node_rank)]
    cmd += ["--max-restarts", "0", "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"]
    if "--shutdown-timeout" in opts:
        cmd += ["--shutdown-timeout", str(int(TEARDOWN_GRACE_S))]
    return cmd + ["-m", module, *module_args]


def launch(name: str, module: str, module_args: list[str], *, nproc: int, log_dir: Path,
           timeout_s: float, rdzv: Rendezvous | None = None, env: dict[str, str] | None = None
           ) -> LaunchResult:
    """Run `module` on nproc ranks under torchrun; raise LaunchError naming the failed rank.

    Whatever happens, every process torchrun started is gone when this returns or raises.
    """
    rdzv = rdzv or Rendezvous()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(module, module_args, nproc=nproc, rdzv=rdzv, log_dir=log_dir)
    launcher_log = log_dir / "torchrun.log"
    full_env = {**src_pythonpath(), "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.monotonic()
    with open(launcher_log, "wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        # torchrun and every rank it starts (ranks live in sessions of their own) are tracked
        # and torn down whatever happens: done, crashed, timed out, interrupted
        with Spawned(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                     grace_s=TEARDOWN_GRACE_S) as proc:
            timed_out = not proc.wait(timeout_s)
    result = LaunchResult(name, cmd, proc.returncode, time.monotonic() - t0, log_dir,
                          launcher_log, _rank_logs(log_dir, nproc))
    if timed_out:
        raise _timeout_error(result, timeout_s, nproc)
    if proc.returncode != 0:
        raise _failure_error(result)
    return result


def _rank_logs(log_dir: Path, nproc: int) -> list[RankLog]:
    """Per local rank, the stdout/stderr files of the latest torchrun attempt."""
    logs = []
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    for r in range(nproc):
        found = [a / str(r) for a in attempts if (a / str(r)).is_dir()]
        d = found[-1] if found else None
        logs.append(RankLog(r, d / "stdout.log" if d else None, d / "stderr.log" if d else None))
    return logs


_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _failure_error(res: LaunchResult) -> LaunchError:
    """torchrun exited non-zero: name the root-cause rank from its summary, with its log tail."""
    text = res.launcher_log.read_text(errors="replace")
    cause = text[text.find("Root Cause"):] if "Root Cause" in text else text
    m = _ROOT_CAUSE.search(cause)
    code = _EXITCODE.search(cause)
    rank = int(m.group(1)) if m else None
    local = int(m.group(2)) if m else None
    log = next((r for r in res.rank_logs if r.local_rank == local), None)
    if log is None:  # no summary (torchrun itself failed): the rank whose log shows an error
        log = next((r for r in res.rank_logs if "Traceback" in r.tail(200)), None)
        if log is not None:
            rank = log.progress()[0] if log.progress()[0] is not None else log.local_rank
    exit_txt = f" with exit code {code.group(1)}" if code else ""
    who = f"rank {rank}" if rank is not None else "a rank"
    if log is not None and local is not None and local != rank:
        who += f" (local rank {local} on this node)"
    tail = log.tail() if log else "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
    where = str(log.stderr) if log and log.stderr else str(res.launcher_log)
    msg = (f"{res.name}: {who} failed{exit_txt} after {res.wall_s:.1f} s; torchrun stopped the "
           f"other ranks and the whole group was torn down (no process left). Last lines of "
           f"{who}'s log ({where}):\n{_indent(tail)}")
    return LaunchError(msg, name=res.name, rank=rank, log_path=Path(where), log_tail=tail)


def _timeout_error(res: LaunchResult, timeout_s: float, nproc: int) -> LaunchError:
    """No exit within the timeout: name the rank that got least far, with its log tail."""
    seen = []
    for log in res.rank_logs:
        rank, phase, order = log.progress()
        seen.append((order, log.local_rank if rank is None else rank, phase or "no output", log))
    seen.sort(key=lambda s: (s[0], s[1]))
    states = ", ".join(f"rank {r}: {ph}" for _, r, ph, _ in sorted(seen, key=lambda s: s[1]))
    if not seen:
        return LaunchError(f"{res.name}: no rank finished within the timeout of {timeout_s:g} s "
                           "and no rank log was written; the whole group was torn down.",
                           name=res.name, timed_out=True, log_path=res.launcher_log)
    _, rank, phase, log = seen[0]
    tail = log.tail()
    msg = (f"{res.name}: timed out after {timeout_s:g} s (--timeout-s) with {nproc} rank(s) on "
           f"this node still running; the whole group (torchrun and every rank) was torn down, "
           f"no process left. Last progress: {states}. Rank {rank} got least far ('{phase}') and "
           f"is the likely hang; last lines of its log ({log.stderr}):\n{_indent(tail)}")
    return LaunchError(msg, name=res.name, rank=rank, timed_out=True, log_path=log.stderr,
                       log_tail=tail)


def _indent(text: str) -> str:
    return "\n".join("    " + ln for ln in (text or "(empty)").splitlines())
