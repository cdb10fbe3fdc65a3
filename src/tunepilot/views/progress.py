"""Progress while long work runs, on stderr (never stdout, which --json keeps for its result):
a bar on a terminal; off a terminal (CI logs, pipes, nohup) a timestamped line when the phase
changes and every few seconds while it lasts, so a log shows the work is alive."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

LINE_EVERY_S = 5.0

Progress = Callable[[str, int, int | None], None]


class _Lines:
    """Progress as log lines: 'pilot [12.3 s] measure steps 7/100'."""

    def __init__(self, what: str, stream, every_s: float = LINE_EVERY_S):
        self.what, self.stream, self.every_s = what, stream, every_s
        self.t0 = time.monotonic()
        self.phase: str | None = None
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if phase == self.phase and now - self.last < self.every_s:
            return
        self.phase, self.last = phase, now
        count = f" {done}/{total}" if total else (f" {done}" if done else "")
        self.stream.write(f"{self.what} [{now - self.t0:6.1f} s] {phase}{count}\n")
        self.stream.flush()


@contextlib.contextmanager
def progress(what: str) -> Iterator[Progress]:
    """A progress callback(phase, done, total) for one command's long work."""
    from rich.console import Console

    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        yield _Lines(what, sys.stderr)
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
def ticking(what: str, phase: str, every_s: float = LINE_EVERY_S) -> Iterator[None]:
    """For work with no steps to count (a trace in a child process, a model build): a spinner
    with the elapsed time on a terminal, else a line every few seconds that it still runs."""
    import threading

    with progress(what) as say:
        say(phase, 0, None)
        if not isinstance(say, _Lines):  # rich refreshes the spinner and elapsed time itself
            yield
            return
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(every_s):
                say(phase, 0, None)

        thread = threading.Thread(target=tick, name="tunepilot-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=2)
