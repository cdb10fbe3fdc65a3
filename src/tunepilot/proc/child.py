"""The one way tunepilot runs work in a fresh Python process (the traced plan, the restore
proof's fresh process, the scaling worker under torchrun): a job file in, a result file out.

    parent:  run_child("tunepilot.plan.trace.step", job, TraceResult, timeout_s=...) -> TraceResult
    child:   if __name__ == "__main__": sys.exit(child_main(handler, TraceJob))
             # handler(job: TraceJob) -> TraceResult
Job and result are proc/messages.py Messages, validated once on the way in. The child always
writes its result file while Python lives: {"status": "ok", ...the result} or {"status":
"error", "reason": ..., "error": {...}}. The parent turns a timeout, a signal (an abort inside
PyTorch), a missing result or one it cannot read into ChildFailed with the reason (and the
child's last stderr line).

``TUNEPILOT_CHILD_HOOK=module:function`` is called at the start of every child: the test suite's
fault injection (tests/support) plugs in there, so none of it lives in the library.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tunepilot.errors import TunepilotError, UserError

if TYPE_CHECKING:  # pydantic on first use: the CLI imports this module at every start-up
    from pydantic import BaseModel

    from tunepilot.proc.messages import Message

M = TypeVar("M", bound="BaseModel")
R = TypeVar("R", bound="Message")  # a child's result
J = TypeVar("J", bound="Message")  # a child's job

HOOK_ENV = "TUNEPILOT_CHILD_HOOK"
STDERR_TAIL_LINES = 5


class ChildFailed(TunepilotError):
    """A child process that did not produce a result; the message is the reason."""

    def __init__(self, reason: str, error: dict | None = None):
        self.reason = reason
        self.error = error or {}
        super().__init__(reason)


def src_pythonpath(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default os.environ) with this copy of tunepilot first on PYTHONPATH, so a child
    imports the very code that started it, installed or not."""
    env = dict(os.environ if env is None else env)
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def run_child(module: str, job: Message, result: type[R], *, timeout_s: float,
              what: str = "the child process", env: dict[str, str] | None = None,
              log_path: Path | None = None, workdir: Path | None = None) -> R:
    """Run ``python -m module JOB RESULT`` and return its result as ``result``; ChildFailed
    with the reason.
    The child dies with tunepilot and its job directory goes with it (spawn.Spawned's
    sentinel); a directory left by an earlier tunepilot that could not clean up (the machine
    went down) is removed by the next run (it is named after its tunepilot's process id)."""
    from tunepilot.proc.spawn import run_to_end

    _sweep_stale_dirs(Path(workdir) if workdir is not None else Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{CHILD_DIR_PREFIX}{os.getpid()}-",
                                     dir=workdir) as tmp:
        job_path, res_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(job.model_dump_json())
        cmd = [sys.executable, "-m", module, str(job_path), str(res_path)]
        full_env = src_pythonpath(env)
        full_env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        err_path = log_path or Path(tmp) / "stderr.log"
        with open(err_path, "wb") as err:
            rc, timed_out = run_to_end(cmd, timeout_s=timeout_s, env=full_env,
                                       stdout=subprocess.DEVNULL, stderr=err, reaper=True,
                                       cleanup=Path(tmp))
        if timed_out:
            raise ChildFailed(f"{what} took longer than {timeout_s:.0f} s")
        stderr = err_path.read_bytes()
        raw = _read_result(res_path)
    if raw is not None and raw.get("status") == "ok":
        return _typed(result, raw, what)
    if raw is not None and raw.get("status") == "error":
        raise ChildFailed(raw.get("reason", f"{what} failed"), raw.get("error"))
    raise ChildFailed(_died(what, rc, stderr.decode(errors="replace")))


def _typed(result: type[R], raw: dict, what: str) -> R:
    """The child's result validated into ``result``, or ChildFailed saying why it could not be
    read (another version of tunepilot wrote it, or it is damaged)."""
    from pydantic import ValidationError

    raw.pop("status", None)
    try:
        return result.model_validate(raw)
    except ValidationError as exc:
        raise ChildFailed(f"{what}'s result is not a {result.__name__} this version of "
                          f"tunepilot can read ({str(exc).splitlines()[0][:300]})") from None


CHILD_DIR_PREFIX = "tunepilot-child-"


def _sweep_stale_dirs(parent: Path) -> None:
    """Remove tunepilot-child-<pid>-* directories whose tunepilot process no longer runs (it
    was killed before it could clean up)."""
    import shutil

    from tunepilot.proc.spawn import pid_alive

    with contextlib.suppress(OSError):
        for d in parent.glob(f"{CHILD_DIR_PREFIX}*-*"):
            pid = d.name[len(CHILD_DIR_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


def _read_result(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text()) if path.exists() else None
    except (OSError, json.JSONDecodeError):  # killed while writing it
        return None
    return data if isinstance(data, dict) else None


def _died(what: str, rc: int, stderr: str) -> str:
    if rc < 0:
        try:
            how = f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            how = f"was killed by signal {-rc}"
        how += " (an abort inside PyTorch, or the OS ran out of memory)"
    else:
        how = f"exited with code {rc} without a result"
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    tail = f": {lines[-1][:300]}" if lines else ""
    return f"{what} {how}{tail}"


# --- the child side ----------------------------------------------------------------------------

class Terminated(BaseException):
    """SIGTERM (or SIGHUP) reached tunepilot; raised so cleanup runs (exit code 128 + signal)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def raise_on_terminate() -> None:
    """Turn SIGTERM and SIGHUP into Terminated in the main thread (the CLI installs it), so a
    terminated `tunepilot scale` tears down its torchrun group instead of orphaning it."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, _frame):
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def load_object(ref: str) -> Any:
    """'package.module:name' -> the object."""
    module, _, name = ref.partition(":")
    obj = importlib.import_module(module)
    for part in name.split(".") if name else []:
        obj = getattr(obj, part)
    return obj


def call_hook() -> None:
    """The test-support hook named by TUNEPILOT_CHILD_HOOK, if any (see the module docstring)."""
    ref = os.environ.get(HOOK_ENV)
    if ref:
        load_object(ref)()


def child_main(handler: Callable[[J], Message], job: type[J],
               argv: list[str] | None = None) -> int:
    """Read the job as ``job``, run ``handler``, write its result message - always, as long as
    Python lives."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write("usage: python -m MODULE JOB.json RESULT.json (started by tunepilot)\n")
        return 2
    job_path, res_path = Path(argv[0]), Path(argv[1])
    call_hook()
    try:
        out = handler(read_message(job, job_path))
        result = dict(out.model_dump(mode="json"), status="ok")
    except Exception as exc:  # every failure becomes a stated reason for the parent
        result = {"status": "error", "reason": describe(exc), "error": _error_dict(exc)}
    res_path.write_text(json.dumps(result, default=str))
    return 0


def read_job(argv: list[str] | None, model: type[M]) -> M:
    """The job of a per-rank entry point started by torchrun (``python -m MODULE JOB.json``),
    validated into ``model`` (read_message): ranks write their own result files
    (OUT/rank{R}.json), so there is no RESULT argument."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m MODULE JOB.json (started by tunepilot under torchrun)\n")
        raise SystemExit(2)
    return read_message(model, Path(argv[0]))


def write_message(path: Path, message: BaseModel) -> Path:
    """A typed message that crosses a process boundary, as JSON (the one writer): written whole
    or not at all (a temporary file renamed over it), so a reader never sees half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(message.model_dump_json(indent=1))
    os.replace(tmp, path)
    return path


def read_message(model: type[M], path: Path) -> M:
    """A typed message read back and validated once (the one reader): a file another version
    of tunepilot wrote, or a damaged one, is a TunepilotError naming the file."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError) as exc:
        first = str(exc).splitlines()[0][:300]
        raise TunepilotError(f"{path} is not a {model.__name__} this version of tunepilot can "
                             f"read ({first})") from None


def describe(exc: BaseException) -> str:
    """One line for an error: its message and the innermost tunepilot frame it came from."""
    msg = exc.render() if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
    return f"{msg.strip()[:600]}{where(exc)}"


def _error_dict(exc: BaseException) -> dict:
    to_dict = getattr(exc, "to_dict", None)
    return to_dict() if callable(to_dict) else {"error": type(exc).__name__,
                                                 "message": str(exc)[:2000]}


def where(exc: BaseException) -> str:
    """' (in tunepilot/training/step.py:111 compute_loss)': the innermost frame of tunepilot's own."""
    frames = [(Path(f.filename).as_posix(), f) for f in traceback.extract_tb(exc.__traceback__)]
    ours = [(name, f) for name, f in frames if "/tunepilot/" in name]
    if not ours:
        return ""
    name, f = ours[-1]
    return f" (in tunepilot/{name.split('/tunepilot/')[-1]}:{f.lineno} {f.name})"
