"""plan, presets, cards."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import CatalogOpt, JsonOpt, SpecArg, load_run_spec, show, view
from tunepilot.errors import UserError


@app.command()
def plan(
    spec: SpecArg,
    card: Annotated[
        list[str] | None, typer.Option("--card", help="Fit only these cards (repeatable).")
    ] = None,
    catalog: CatalogOpt = None,
    headroom: Annotated[
        float, typer.Option(help="Fraction of card memory to keep free.", min=0.0, max=0.9)
    ] = 0.10,
    trace: Annotated[
        bool, typer.Option("--trace", help="Trace the real training step on fake tensors (CPU).")
    ] = False,
    calibrate: Annotated[
        Path | None, typer.Option("--calibrate", help="A pilot's run directory: apply the "
                                  "residuals it measured to this plan (plan/calibrate.py).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The memory one device needs, component by component, and the fit on each card.

    Example: tunepilot plan examples/llama3-8b-lora.yaml --card h100 --card h200
    """
    from tunepilot.catalog import load_catalog, warn_if_stale
    from tunepilot.plan.api import make_plan

    run_spec = load_run_spec(spec)
    cat = load_catalog(catalog)
    warn_if_stale(cat)
    if calibrate is not None and trace:
        raise UserError("--calibrate", "applies to the analytic plan (the pilot's residuals "
                        "are measured against it).", "Drop --trace or --calibrate.")
    method = "calibrated" if calibrate is not None else "traced" if trace else "analytic"
    tick = contextlib.nullcontext()
    if trace:
        from tunepilot.views.progress import ticking

        tick = ticking("plan", "tracing the training step on fake tensors")
    with tick:
        result = make_plan(run_spec, method, catalog=cat, card_ids=card, headroom=headroom,
                           base_dir=spec.parent, run_dir=calibrate)
    show(result, as_json, view("plan.render_plan", run_spec, headroom))


@app.command()
def presets(as_json: JsonOpt = False) -> None:
    """List the shipped model presets with their parameter counts (MoE: active per token).

    Example: tunepilot presets --json
    """
    from tunepilot.model.arch import Arch, list_presets, load_preset, param_counts

    rows = []
    for name in list_presets():
        arch = Arch.from_config(load_preset(name))
        counts = param_counts(arch)
        rows.append({"preset": name, "hf_id": arch.hf_id, "model_type": arch.model_type,
                     "params": counts.total, "active_params": counts.active_per_token,
                     "layers": arch.num_layers,
                     "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size})
    from tunepilot.views.plan import render_rows

    show(rows, as_json, lambda r: render_rows("Model presets", list(r[0]), r))


@app.command()
def cards(catalog: CatalogOpt = None, as_json: JsonOpt = False) -> None:
    """List the cards of the catalog with their datasheet figures and prices.

    Example: tunepilot cards --catalog my-prices.yaml
    """
    from tunepilot.catalog import load_catalog, warn_if_stale

    cat = load_catalog(catalog)
    warn_if_stale(cat)
    rows = [{"card": c.id, "name": c.name, "memory_gb": c.memory_gb,
             "capacity_bytes": c.capacity_bytes, "bf16_dense_tflops": c.peak_tflops.bf16,
             "hbm_tbps": c.hbm_bandwidth_tbps, "stack": c.software_stack,
             "usd_per_hour": str(c.pricing.on_demand_usd_per_hour),
             "price_as_of": c.pricing.as_of} for c in cat.cards]
    from tunepilot.views.plan import render_rows

    show(rows, as_json, lambda r: render_rows(
        f"Cards (prices as of {cat.as_of}; use --catalog for yours)", list(r[0]), r))
