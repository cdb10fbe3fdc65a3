"""quote and compare."""

from __future__ import annotations

from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import (
    CatalogOpt,
    DaysOpt,
    DbOpt,
    FromOpt,
    HoursOpt,
    JsonOpt,
    OptionOpt,
    SpecArg,
    emit_json,
    load_run_spec,
)

SpotRateOpt = Annotated[str | None, typer.Option(
    "--spot-rate", help="Spot interruptions per instance-hour, in [0, 1) (default: the offer's "
    "pricing.spot_interruptions_per_hour, else cost_model.yaml's).")]


def _spot_ask(rate: str | None, minutes: str | None):
    from tunepilot.cost.quote import SpotAsk
    from tunepilot.cost.terms import parse_positive

    interval = None if minutes is None else float(
        parse_positive(minutes, "checkpoint-minutes", "minutes")) * 60
    return SpotAsk(rate=rate, interval_s=interval)


@app.command()
def quote(
    spec: SpecArg,
    card: Annotated[str, typer.Option("--card", help="The card, e.g. h200.")],
    count: Annotated[int, typer.Option("--count", help="How many cards.")] = 1,
    hours: HoursOpt = None,
    days: DaysOpt = None,
    option: OptionOpt = None,
    from_dir: FromOpt = None,
    catalog: CatalogOpt = None,
    save: Annotated[bool, typer.Option("--save", help="Save to the ledger; prints a QUOTE_ID.")
                    ] = False,
    db: DbOpt = None,
    spot_rate: SpotRateOpt = None,
    checkpoint_minutes: Annotated[str | None, typer.Option(
        "--checkpoint-minutes", help="Price the spot term at this checkpoint interval instead "
        "of the one that minimises its expected cost.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The time the job needs on COUNT x CARD, the term's itemised cost, and the cost per million
    useful tokens; every figure marked measured or projected. Without --hours/--days the term is
    the cheapest one covering the job plus the safety margin. Where the offer has a spot rate,
    the same job on spot beside it: the checkpoint interval that minimises the expected cost
    (from the measured save time with --from), the expected interruptions, lost work and cost
    with a spread. The host plan at COUNT cards is checked against the offer's host RAM.

    Example: tunepilot quote examples/llama3-8b-lora.yaml --card h200 --count 1 --days 2
    """
    from tunepilot.catalog import load_catalog, warn_if_stale
    from tunepilot.cost.quote import quote as quote_of
    from tunepilot.cost.terms import parse_duration

    run_spec = load_run_spec(spec)
    term_s = parse_duration(hours, days, required=False)
    cat = load_catalog(catalog)
    warn_if_stale(cat)
    result = quote_of(run_spec, card_id=card, count=count, term_s=term_s, options=option,
                      run_dir=from_dir, catalog=cat, base_dir=spec.parent,
                      spot=_spot_ask(spot_rate, checkpoint_minutes))
    body = result.to_dict()
    if save:
        from tunepilot import ledger

        body["quote_id"] = ledger.save_quote(db, result)
    if as_json:
        emit_json(body)
        return
    from tunepilot.views.common import console
    from tunepilot.views.cost import render_quote

    render_quote(result)
    if save:
        console.print(f"saved as quote {body['quote_id']}: tunepilot book --quote "
                      f"{body['quote_id']} --start <UTC time>")


@app.command()
def compare(spec: SpecArg, from_dir: FromOpt = None, catalog: CatalogOpt = None,
            spot_rate: SpotRateOpt = None,
            precision: Annotated[list[str] | None, typer.Option(
                "--precision", help="Rank the spec at this precision too (repeat it: bf16-mixed, "
                "fp8-tensorwise, fp8-rowwise, fp8-te, ...).")] = None,
            as_json: JsonOpt = False) -> None:
    """Every card x count that fits (1, 2, 4, 8 and the fewest FSDP needs), ranked by cost per
    million useful tokens on the cheapest term that covers the job, with time to finish; runs
    that fit only with less headroom than the plan asks are ranked after runs with room; the
    on-demand job and the spot term's expected cost side by side; offers whose host RAM cannot
    hold a node of the run are not ranked, with the binding resource.

    Example: tunepilot compare examples/llama3-8b-lora.yaml --precision bf16-mixed
    --precision fp8-tensorwise
    """
    from tunepilot.catalog import load_catalog, warn_if_stale
    from tunepilot.cli.common import show, view
    from tunepilot.cost.compare import compare as compare_of

    cat = load_catalog(catalog)
    warn_if_stale(cat)
    result = compare_of(load_run_spec(spec), run_dir=from_dir, catalog=cat,
                        base_dir=spec.parent, spot=_spot_ask(spot_rate, None),
                        precisions=precision)
    show(result, as_json, view("cost.render_compare"))
