"""The console, tables and figure cells every view shares."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tunepilot.results.figure import Figure
from tunepilot.units import fmt_bytes, fmt_number, fmt_rate, fmt_seconds

console = Console(highlight=False)
if not console.is_terminal:  # piped or captured: don't squeeze tables into 80 columns
    console = Console(highlight=False, width=160)


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
