"""The `tunepilot` command line: parse, call one library function, render, map errors to exit codes.

All logic lives in the library; rendering lives in tunepilot.render. Heavy imports (torch,
transformers) happen inside the commands that need them, so `plan`, `quote` and `book` start fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.errors import TunepilotError, UserError

app = typer.Typer(
    name="tunepilot",
    help="Which accelerator, how many, for how long, and what each useful trained token costs - "
    "measured before the term is booked.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
CatalogOpt = Annotated[
    Path | None, typer.Option("--catalog", help="A catalog YAML that overrides or adds cards.")
]
SpecArg = Annotated[Path, typer.Argument(help="The run spec (YAML), e.g. examples/llama3-8b-lora.yaml")]


def emit_json(data: object) -> None:
    """Write JSON to stdout (the only thing a --json command prints there)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


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
    as_json: JsonOpt = False,
) -> None:
    """The memory one device needs, component by component, and the fit on each card.

    Example: tunepilot plan examples/llama3-8b-lora.yaml --card h100 --card h200
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.memory.plan import make_plan
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    cat = load_catalog(catalog)
    if trace:
        from tunepilot.memory.trace import make_traced_plan

        result = make_traced_plan(run_spec, catalog=cat, card_ids=card, headroom=headroom,
                                  base_dir=spec.parent)
    else:
        result = make_plan(run_spec, catalog=cat, card_ids=card, headroom=headroom,
                           base_dir=spec.parent)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render import render_plan

    render_plan(run_spec, result, cat, headroom)


@app.command()
def presets(as_json: JsonOpt = False) -> None:
    """List the shipped model presets with their parameter counts."""
    from tunepilot.arch import Arch, list_presets, load_preset, param_counts

    rows = []
    for name in list_presets():
        cfg = load_preset(name)
        arch = Arch.from_config(cfg)
        rows.append({"preset": name, "hf_id": arch.hf_id, "model_type": arch.model_type,
                     "params": param_counts(arch).total, "layers": arch.num_layers,
                     "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size})
    if as_json:
        emit_json(rows)
        return
    from tunepilot.render import table

    table("Model presets", ["preset", "hf_id", "model_type", "params", "layers", "hidden_size",
                            "vocab_size"], rows)


@app.command()
def cards(catalog: CatalogOpt = None, as_json: JsonOpt = False) -> None:
    """List the cards of the catalog with their datasheet figures and example prices."""
    from tunepilot.catalog import load_catalog

    cat = load_catalog(catalog)
    rows = [{"card": c.id, "name": c.name, "memory_gb": c.memory_gb,
             "capacity_bytes": c.capacity_bytes, "bf16_dense_tflops": c.peak_tflops.bf16,
             "hbm_tbps": c.hbm_bandwidth_tbps, "stack": c.software_stack,
             "usd_per_hour": str(c.pricing.on_demand_usd_per_hour)} for c in cat.cards]
    if as_json:
        emit_json(rows)
        return
    from tunepilot.render import table

    table(f"Cards (prices are examples as of {cat.as_of}; use --catalog for yours)",
          list(rows[0]), rows)


def main() -> None:
    """Console-script entry point: user errors exit 2 with one paragraph, never a traceback.

    Usage errors (unknown option, missing argument) are click's: exit 2 with the usage line.
    """
    try:
        app()
    except UserError as exc:
        _fail(exc, exc.exit_code)
    except TunepilotError as exc:
        _fail(exc, exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


def _fail(exc: TunepilotError, code: int) -> None:
    if "--json" in sys.argv:
        payload = exc.to_dict() if isinstance(exc, UserError) else {"error": type(exc).__name__,
                                                                   "message": str(exc)}
        sys.stdout.write(json.dumps(payload) + "\n")
    sys.stderr.write(f"error: {exc}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
