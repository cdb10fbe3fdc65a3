"""The staged pilot's gates and its decision, at the end of `run` / `demo`."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.results.decision import Decision
from tunepilot.views.common import console, table


def render_decision(result: Decision, report_path=None) -> None:
    t = table(f"Staged pilot: {escape(result.spec_label)} ({escape(result.run_dir)})",
              ["stage", "verdict", "summary"])
    style = {"passed": "green", "failed": "red", "skipped": "dim", "inconclusive": "yellow"}
    for g in result.gates:
        verdict = f"[{style.get(g.status, '')}]{g.status}[/]" + (" (reused)" if g.reused else "")
        t.add_row(g.stage, verdict, escape(g.summary))
    console.print(t)
    for w in result.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(w)}")
    colour = "green" if result.ready else \
        "yellow" if result.decision.startswith("Inconclusive") else "red"
    console.print(f"[bold {colour}]" + escape(result.decision) + "[/]")
    if report_path:
        console.print(f"report: {report_path}")
