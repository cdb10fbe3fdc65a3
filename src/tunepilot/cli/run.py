"""run (the staged pilot), demo, report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import (
    CatalogOpt,
    DaysOpt,
    HoursOpt,
    JsonOpt,
    NoMemoryCheckOpt,
    OutOpt,
    SpecArg,
    emit_json,
    load_run_spec,
    out_dir,
)
from tunepilot.errors import UserError


@app.command()
def run(
    spec: SpecArg,
    card: Annotated[str | None, typer.Option("--card", help="Quote this card (with --count and "
                                             "--hours); default: compare every card.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Cards in the term.", min=1)] = None,
    hours: HoursOpt = None,
    days: DaysOpt = None,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", help="Ranks for the scaling stage (default: the sharded pilot's ranks, else "
        "the GPUs here; skipped with one)."
    )] = None,
    out: OutOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Re-run stages already completed.")
                     ] = False,
    memory_limit: Annotated[str | None, typer.Option(
        "--memory-limit", help="Simulate a device with this much tensor memory (e.g. 2GiB); per "
        "rank for a sharded run.")
    ] = None,
    no_trace: Annotated[bool, typer.Option("--no-trace", help="Analytic plan only.")] = False,
    pilot_max_steps: Annotated[int, typer.Option(
        "--pilot-max-steps", help="Most measured pilot steps (it stops earlier once the mean "
        "step time is known to +-2%).", min=2, max=100_000)] = 30,
    scale_steps: Annotated[int, typer.Option(
        "--scale-steps", help="Measured optimizer steps per scaling run.", min=2, max=100_000)
    ] = 4,
    no_memory_check: NoMemoryCheckOpt = False,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The staged pilot: plan, pilot, restore proof, scaling, quote - each a gate for the next -
    then the decision and the HTML report. A failed gate stops with its reason (exit 1). A gate
    whose measurement cannot tell the answer apart (a step time known only to +-25%, a scaling
    efficiency above 100%) is inconclusive: the stages go on, and the decision says what to
    re-run instead of what to book (ready: false; exit 0). Re-running the same spec reuses
    completed stages unless --force.

    Example: tunepilot run examples/tiny.yaml --nproc 2 --out runs/tiny
    """
    from tunepilot.catalog import load_catalog, warn_if_stale
    from tunepilot.cost.terms import check_count, parse_duration
    from tunepilot.pipeline import RunOptions
    from tunepilot.units import parse_bytes

    run_spec = load_run_spec(spec)
    cat = load_catalog(catalog)
    warn_if_stale(cat)
    term_s = parse_duration(hours, days, required=False)  # checked before any stage runs
    if (card is None) != (count is None) or (card is None) != (term_s is None):
        raise UserError("--card", "give --card, --count and --hours (or --days) together, or "
                        "none of them (then every card is compared).")
    if card is not None:
        card = cat.get(card).id
        check_count(count)
    opts = RunOptions(card=card, count=count, term_s=term_s, nproc=nproc, force=force,
                      memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None,
                      trace=not no_trace, base_dir=spec.parent, catalog=cat,
                      pilot_max_steps=pilot_max_steps, scale_steps=scale_steps,
                      check_memory=not no_memory_check)
    _run_and_report(run_spec, out_dir(out, run_spec), opts, as_json)


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Run directory.")] = Path("runs/demo"),
    as_json: JsonOpt = False,
) -> None:
    """The whole staged pilot on this CPU with the shipped tiny model, text set and tokenizer:
    no arguments, no files, no GPU, nothing downloaded; 2-rank gloo scaling included. Writes
    RUN_DIR/report.html. Runs again from scratch each time (--force).

    Example: tunepilot demo --out runs/demo
    """
    from tunepilot.pipeline import RunOptions
    from tunepilot.resources import DEMO_SPEC_YAML
    from tunepilot.spec import load_spec

    opts = RunOptions(nproc=2, force=True, pilot_max_steps=20, scale_steps=3)
    _run_and_report(load_spec(DEMO_SPEC_YAML), out, opts, as_json)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (from run, demo or pilot).")],
    as_json: JsonOpt = False,
) -> None:
    """Write RUN_DIR/report.html (self-contained: inline CSS and SVG, no network at view time)
    and RUN_DIR/report.md (a summary to paste into a PR or ticket).

    Example: tunepilot report runs/demo
    """
    from tunepilot.report.html import build_report

    html, md = build_report(run_dir)
    if as_json:
        emit_json({"report_html": str(html), "report_md": str(md)})
    else:
        sys.stdout.write(f"report: {html}\nsummary: {md}\n")


def _run_and_report(run_spec, out: Path, opts, as_json: bool) -> None:
    from tunepilot.pipeline import GateFailed, run_pipeline
    from tunepilot.report.html import build_report
    from tunepilot.views.progress import messages
    from tunepilot.views.run import render_decision

    try:
        with messages("run") as say:
            result = run_pipeline(run_spec, out, opts, say=say)
        failed = None
    except GateFailed as exc:
        result, failed = exc.result, exc
    html, _ = build_report(out)
    if as_json:
        emit_json(dict(result.to_dict(), report_html=str(html)))
    else:
        render_decision(result, html)
    if failed is not None:
        raise typer.Exit(code=1)
