"""The console, tables and figure cells every view shares."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tunepilot.results.figure import Figure
from tunepilot.units import fmt_bytes, fmt_number, fmt_rate, fmt_seconds

console = Console(highlight=False)
if not console.is_terminal:  # piped or captured: don't squeeze tables into 80 columns
    console = Console(highlight=False, width=160)


def emit_json(data: object) -> None:
    """Write JSON to stdout (the only thing a --json command prints there)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def show(result: Any, as_json: bool, view: Callable[[Any], None] | None = None) -> None:
    """The end of every command: the result as JSON for machines, or the view for people."""
    if as_json or view is None:
        emit_json(result.to_dict() if hasattr(result, "to_dict") else
                  [r.to_dict() if hasattr(r, "to_dict") else r for r in result]
                  if isinstance(result, list) else result)
        return
    view(result)


def show_committed(result: Any, as_json: bool, view: Callable[[Any], None], done: str) -> None:
    """The end of a command whose change is already committed (a booking, a cancellation): the
    reply, as show() writes it - and when stdout cannot take it (closed, a broken pipe) the
    change is not undone and the exit stays 0: ``done`` (what was committed, with its id) goes
    to stderr instead, so a script that retries on failure does not book twice."""
    try:
        if sys.stdout is None:
            raise OSError("stdout is closed")
        try:
            show(result, as_json, view)
        except SystemExit:  # rich's Console.on_broken_pipe: stdout went to devnull, exit 1
            raise BrokenPipeError("broken pipe") from None
        sys.stdout.flush()
    except (OSError, ValueError) as exc:  # EPIPE, EBADF; ValueError: a closed file object
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.write(f"{done} (committed; the reply could not be written to stdout: "
                             f"{exc}) - do not run it again\n")
            sys.stderr.flush()
        with contextlib.suppress(OSError, ValueError):  # nothing more goes to a broken stdout
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until the process ends


def table(title: str, columns: list[str], right: Iterable[str] = ()) -> Table:
    right = set(right)
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    return t


def cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return fmt_number(v)
    return escape(str(v))


def fig(f: Figure | None, *, decimal_bytes: bool = False) -> str:
    """A figure's value in its unit, chosen by size: bytes as KiB/MiB/GiB, seconds as ms/s/h,
    rates per second, fractions as percentages; '-' when not measured."""
    if f is None or f.value is None:
        return "-"
    v, unit = f.value, f.unit
    if unit == "bytes":
        return fmt_bytes(v, decimal=decimal_bytes)
    if unit == "s":
        return fmt_seconds(v)
    if unit == "fraction":
        return f"{v:.1%}"
    if unit.endswith("/s"):
        return fmt_rate(v, unit)
    return f"{fmt_number(v)} {unit}"


def basis(f: Figure | None) -> str:
    if f is None or f.basis == "not measured":
        return "[dim]not measured[/dim]"
    return "[green]measured[/green]" if f.basis == "measured" else "[yellow]projected[/yellow]"


def why(f: Figure | None) -> str:
    return (f.how or "") if f is not None and f.value is None else ""


def notes(lines: Iterable[str], prefix: str = "note") -> None:
    for n in lines:
        console.print(f"{prefix}: {escape(n)}")
