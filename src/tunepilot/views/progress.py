"""Progress while long work runs, on stderr (never stdout, which --json keeps for its result):
a bar or a spinner on a terminal; off a terminal (CI logs, pipes, nohup) a timestamped line when
the phase changes and, while a phase lasts, a "still running" line every few seconds, so a log
shows the work is alive even through one long silent call (a model build, a trace, a child
process). TUNEPILOT_PROGRESS_EVERY_S sets the interval (default 5 s).

    progress(what)  -> callback(phase, done, total)   counted work (pilot steps, data files)
    messages(what)  -> say(message[, done, total])     stage-level messages (run, restore, scale)
    ticking(what, phase)                               one long call with nothing to count
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

LINE_EVERY_S = 5.0

Progress = Callable[[str, int, int | None], None]
Say = Callable[..., None]  # say(message) or say(message, done, total)


def _every_s() -> float:
    try:
        value = float(os.environ.get("TUNEPILOT_PROGRESS_EVERY_S", LINE_EVERY_S))
    except ValueError:
        return LINE_EVERY_S
    return value if 0.05 <= value <= 3600 else LINE_EVERY_S


class _Pace:
    """How fast a counted phase goes: the interval of the latest unit (a step) and the time the
    rest will take at the pace so far."""

    def __init__(self, now: float):
        self.start, self.first_done, self.first_at = now, None, now
        self.done, self.at, self.interval = 0, now, None

    def update(self, now: float, done: int) -> None:
        if self.first_done is None and done > 0:
            self.first_done, self.first_at = done, now
        if done > self.done and self.done > 0:
            self.interval = (now - self.at) / (done - self.done)
        if done != self.done:
            self.done, self.at = done, now

    def words(self, total: int | None, now: float) -> str:
        """' 7/100 (last 0.41 s each, about 38 s left)', or just the count early on."""
        count = f" {self.done}/{total}" if total else (f" {self.done}" if self.done else "")
        parts = []
        since = now - self.at
        if self.interval is not None:
            parts.append(f"last {_secs(self.interval)} each")
            if since > max(1.0, 2 * self.interval):  # the current one is taking long
                parts.append(f"this one {_secs(since)} so far")
        elif self.done:
            parts.append(f"{_secs(since)} since the last")
        if total and self.first_done is not None and self.done > self.first_done:
            per = (self.at - self.first_at) / (self.done - self.first_done)
            parts.append(f"about {_secs(max(total - self.done, 0) * per)} left at this pace")
        return count + (f" ({', '.join(parts)})" if parts else "")


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class _Lines:
    """Progress as log lines: 'pilot [12.3 s] measure steps 7/100 (last 0.41 s each, about
    38 s left at this pace)'; a heartbeat thread adds the same line with '(still running)' when
    nothing was written for a while."""

    def __init__(self, what: str, stream, every_s: float | None = None):
        self.what, self.stream = what, stream
        self.every_s = _every_s() if every_s is None else every_s
        self.t0 = time.monotonic()
        self.phase: str | None = None
        self.total: int | None = None
        self.pace = _Pace(self.t0)
        self.last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        with self._lock:
            if phase != self.phase:
                self.pace = _Pace(now)
            self.pace.update(now, done)
            self.total = total
            if phase == self.phase and now - self.last < self.every_s:
                return
            self.phase = phase
            self._write(now, "")

    def _write(self, now: float, suffix: str) -> None:
        self.last = now
        self.stream.write(f"{self.what} [{now - self.t0:6.1f} s] {self.phase}"
                          f"{self.pace.words(self.total, now)}{suffix}\n")
        self.stream.flush()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 2)):
            now = time.monotonic()
            with self._lock:
                if self.phase is not None and now - self.last >= self.every_s:
                    self._write(now, " (still running)")

    def __enter__(self) -> _Lines:
        self._thread = threading.Thread(target=self._beat, name="tunepilot-progress",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def progress(what: str) -> Iterator[Progress]:
    """A progress callback(phase, done, total) for one command's long work."""
    err = _console()
    if not err.is_terminal:
        with _Lines(what, sys.stderr) as lines:
            yield lines
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        current: dict = {"phase": None, "task": None}

        def update(phase: str, done: int, total: int | None) -> None:
            if phase != current["phase"]:  # a new phase: a new bar (its own total, or none)
                if current["task"] is not None:
                    bar.remove_task(current["task"])
                current["phase"], current["task"] = phase, bar.add_task(phase, total=total)
            bar.update(current["task"], completed=done)

        yield update


@contextlib.contextmanager
def messages(what: str) -> Iterator[Say]:
    """say(message) for stage-level messages, each printed once (a repeat is left to the
    heartbeat), and say(message, done, total) for counted work inside one (the pilot's steps):
    the count, the last step's time and what is left at this pace. On a terminal each message
    stays on screen and a spinner with the elapsed time shows the current one and its count."""
    err = _console()
    if not err.is_terminal:
        with _Lines(what, sys.stderr) as lines:
            def say(msg: str, done: int | None = None, total: int | None = None) -> None:
                if done is not None:
                    lines(msg, done, total)
                elif msg != lines.phase:
                    lines(msg, 0, None)

            yield say
        return
    t0 = time.monotonic()
    with err.status(what) as status:
        last: list[str] = []
        pace = _Pace(t0)

        def say(msg: str, done: int | None = None, total: int | None = None) -> None:
            nonlocal pace
            now = time.monotonic()
            if not last or last[-1] != msg:
                last.append(msg)
                pace = _Pace(now)
                err.print(f"{what} [{now - t0:6.1f} s] {msg}", markup=False)
            if done is not None:
                pace.update(now, done)
            status.update(msg + (pace.words(total, now) if done is not None else ""))

        yield say


@contextlib.contextmanager
def ticking(what: str, phase: str) -> Iterator[None]:
    """For work with no steps to count (a trace in a child process, a model build): a spinner
    with the elapsed time on a terminal, else the phase and a line every few seconds that it
    still runs."""
    with progress(what) as say:
        say(phase, 0, None)
        yield
