"""import (a trainer's config as a spec), catalog import, launch."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import JsonOpt, emit_json, say


class Trainer(str, Enum):
    axolotl = "axolotl"
    llamafactory = "llamafactory"
    trl = "trl"
    hf = "hf"
    litgpt = "litgpt"


@app.command("import")
def import_(
    config: Annotated[Path, typer.Argument(help="The trainer's config: axolotl or LLaMA-Factory "
                                           "YAML, `trl sft|dpo|grpo|... --config` YAML, "
                                           "TrainingArguments fields (JSON/YAML), or `litgpt "
                                           "finetune_lora|finetune_full --config` YAML.")],
    source: Annotated[Trainer | None, typer.Option(
        "--from", help="Which trainer wrote it (detected when omitted).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the spec here (YAML); without it the spec is printed.")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="A local tokenizer directory for a local dataset (the hub model's "
        "tokenizer is never downloaded).")] = None,
    data: Annotated[str | None, typer.Option(
        "--data", help="'synthetic': plan with synthetic tokens instead of the config's "
        "dataset (e.g. a hub dataset).")] = None,
    devices: Annotated[int | None, typer.Option(
        "--devices", min=1, max=4096, help="GPUs per node of a DDP/FSDP/DeepSpeed run "
        "(default 8).")] = None,
    objective: Annotated[str | None, typer.Option(
        "--objective", help="The trainer a TRL config is for (sft, dpo, kto, reward, grpo, "
        "rloo, ...: the file does not say; guessed from its keys when omitted).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read a trainer's config as a tunepilot spec: every key it maps is listed with the spec
    field it became, every key it ignores is listed too; a hub model id must be a shipped
    preset's, a dataset must be local. `plan`, `run` and `quote` also accept the config directly.

    Example: tunepilot import axolotl/examples/llama-3/lora-8b.yml --out llama3-lora.yaml
    """
    from tunepilot.errors import UserError
    from tunepilot.integrations.importers import ImportOptions, import_config, write_spec

    if data not in (None, "synthetic"):
        raise UserError("--data", f"{data!r} is not 'synthetic'.",
                        "Omit --data to read the config's own (local) dataset.")
    from typing import get_args

    from tunepilot.spec.objective import ObjectiveKind

    if objective is not None and objective not in get_args(ObjectiveKind):
        raise UserError("--objective", f"{objective!r} is not one of "
                        f"{', '.join(get_args(ObjectiveKind))}.")
    result = import_config(config, source.value if source else None, ImportOptions(
        tokenizer=tokenizer, synthetic_data=data == "synthetic", devices=devices,
        objective=objective))
    if out is not None:
        write_spec(result, out)
    if as_json:
        emit_json(result.to_dict() | {"written": str(out) if out else None})
        return
    from tunepilot.views.tools import render_import

    render_import(result, out)


catalog_app = typer.Typer(help="Catalogs of cards and prices.", no_args_is_help=True)
app.add_typer(catalog_app, name="catalog")


class CatalogSource(str, Enum):
    skypilot = "skypilot"


@catalog_app.command("import")
def catalog_import(
    file: Annotated[Path, typer.Argument(help="A SkyPilot catalog CSV (vms.csv of a cloud).")],
    out: Annotated[Path, typer.Option("--out", help="The catalog YAML to write (use it with "
                                      "--catalog everywhere).")],
    source: Annotated[CatalogSource, typer.Option("--from", help="The table's format.")] =
    CatalogSource.skypilot,
    region: Annotated[str | None, typer.Option(
        "--region", help="Prices of this region (default: the cheapest region per card).")] = None,
    as_of: Annotated[str | None, typer.Option(
        "--as-of", help="The prices' date, YYYY-MM-DD (default: the file's date).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read a price table into a partial override catalog: per card the on-demand price per
    card-hour (Price / AcceleratorCount, the cheapest region unless --region), the spot price on
    its own line, the instance type and region. Card facts (memory, peak FLOP/s) stay
    tunepilot's own; the table's GPU memory is checked against them; accelerators without facts
    are listed as unknown, not invented.

    Example: tunepilot catalog import ~/.sky/catalogs/v7/aws/vms.csv --out aws.yaml
    """
    from tunepilot.catalog.skypilot import import_vms_csv, write_catalog

    result = import_vms_csv(file, region=region, as_of=_check_date(as_of))
    write_catalog(result, out)
    if as_json:
        emit_json(result.to_dict() | {"written": str(out)})
        return
    from tunepilot.views.tools import render_catalog_import

    render_catalog_import(result, out)


def _check_date(text: str | None) -> str | None:
    from datetime import date

    from tunepilot.errors import UserError

    if text is None:
        return None
    try:
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise UserError("--as-of", f"{text!r} is not a date.", "Use YYYY-MM-DD.") from None


def _spot_for_launch(run_spec, spec: Path, card, count: int, cat, rate, from_dir):
    """The spot quote whose interval a --spot launch writes into the spec it runs."""
    from tunepilot.cost.quote import SpotAsk, quote
    from tunepilot.errors import UserError

    if card.pricing.spot_usd_per_hour is None:
        raise UserError("--spot", f"{card.id}'s offer lists no spot price (catalog "
                        "pricing.spot_usd_per_hour).", "Add it in --catalog, or drop --spot.")
    q = quote(run_spec, card_id=card.id, count=count, term_s=None, run_dir=from_dir,
              catalog=cat, base_dir=spec.parent, spot=SpotAsk(rate=rate))
    if not q.spot.finishes:
        raise UserError("--spot", q.spot.reason + ".", "Lower the interruption rate "
                        "(--spot-rate) or run on demand (drop --spot).")
    return q.spot


class Via(str, Enum):
    skypilot = "skypilot"
    slurm = "slurm"


@app.command()
def launch(
    spec: Annotated[Path, typer.Argument(help="The run spec (or a trainer config).")],
    card: Annotated[str, typer.Option("--card", help="The card to pilot on, e.g. h100.")],
    via: Annotated[str, typer.Option("--via", help="skypilot or slurm.")],
    out: Annotated[Path, typer.Option("--out", help="The task YAML / sbatch script to write.")],
    count: Annotated[int, typer.Option("--count", min=1, max=4096, help="Cards.")] = 1,
    hours: Annotated[str | None, typer.Option("--hours", help="Term to quote (and Slurm "
                                              "--time), e.g. 24.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(
        "--gpus-per-node", min=1, max=64, help="GPUs per node (default: min(count, 8)).")] = None,
    install: Annotated[str | None, typer.Option(
        "--install", help="The shell line that installs tunepilot on the node (default: from "
        "this tunepilot's source tree, uploaded or on the shared filesystem).")] = None,
    wheel: Annotated[Path | None, typer.Option(
        "--wheel", help="A tunepilot wheel (.whl) to install on the node, e.g. one built with "
        "`pip wheel --no-deps -w dist .`.")] = None,
    submit: Annotated[bool, typer.Option("--submit", help="Submit it (only when installed): "
                                         "sbatch; or sky launch -c NAME, then the copy-back and "
                                         "the teardown.")] = False,
    teardown: Annotated[str, typer.Option("--teardown", help="SkyPilot, after the copy-back: "
                                          "down (tear the cluster down) or stop.")] = "down",
    idle_minutes: Annotated[int | None, typer.Option(
        "--idle-minutes", min=1, max=10080, help="SkyPilot: stop (or tear down) the cluster "
        "after this many idle minutes anyway (default 30).")] = None,
    time_limit: Annotated[str | None, typer.Option(
        "--time-limit", help="Slurm --time of the pilot job, e.g. 2h or 90m (default: the "
        "pilot's projected wall time with a margin).")] = None,
    catalog: Annotated[Path | None, typer.Option("--catalog", help="A catalog YAML.")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Run on spot capacity: writes SPEC.spot"
                                       ".yaml beside the spec with checkpoint.every_steps at the "
                                       "interval that minimises the expected spot cost, and runs "
                                       "that.")] = False,
    spot_rate: Annotated[str | None, typer.Option(
        "--spot-rate", help="With --spot: interruptions per instance-hour, in [0, 1).")] = None,
    from_dir: Annotated[Path | None, typer.Option(
        "--from", help="With --spot: a run directory of this spec (its measured checkpoint "
        "save time sets the interval).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write (and with --submit, submit) a SkyPilot task or an sbatch script that runs the
    staged pilot on CARD x COUNT and brings the run directory back; then `quote --from` uses what
    was measured on that card. With --spot, on spot capacity, checkpointing at the interval the
    spot quote recommends (written into the spec the file runs).

    Example: tunepilot launch examples/llama3-8b-lora.yaml --card h100 --count 1 --via skypilot --out pilot.sky.yaml
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.cli.common import load_run_spec
    from tunepilot.cost.terms import parse_duration
    from tunepilot.launch import plan_launch

    run_spec = load_run_spec(spec, quiet=as_json)
    cat = load_catalog(catalog)
    the_card = cat.get(card)
    term_s = parse_duration(hours, None, required=False)
    h = float(term_s) / 3600 if term_s else None
    limit_s = _launch_flags(via, spot, spot_rate, from_dir, time_limit)
    spot_quote = _spot_for_launch(run_spec, spec, the_card, count, cat, spot_rate, from_dir) \
        if spot else None
    text, plan = plan_launch(spec, run_spec, the_card, count=count, via=via, out=out, hours=h,
                             gpus_per_node=gpus_per_node, install=install, wheel=wheel,
                             spot=spot_quote, teardown=teardown, idle_minutes=idle_minutes,
                             time_limit_s=limit_s, catalog=cat)
    _write_launch(plan, text, out, via, submit, as_json)


def _launch_flags(via: str, spot: bool, spot_rate: str | None, from_dir: Path | None,
                  time_limit: str | None) -> float | None:
    """The flags that apply only together, checked; the Slurm time limit in seconds."""
    from tunepilot.errors import UserError
    from tunepilot.launch.walltime import parse_time_limit

    if not spot and (spot_rate is not None or from_dir is not None):
        raise UserError("--spot-rate" if spot_rate is not None else "--from",
                        "applies with --spot.", "Add --spot, or drop it.")
    limit_s = parse_time_limit(time_limit) if time_limit else None
    if time_limit and via != "slurm":
        raise UserError("--time-limit", "applies to --via slurm (a SkyPilot cluster is "
                        "stopped or torn down after its job instead).", "Drop it.")
    return limit_s


def _write_launch(plan, text: str, out: Path, via: str, submit: bool, as_json: bool) -> None:
    """Write the task file (an sbatch script executable), submit it if asked, show the plan."""
    from tunepilot.launch import submit as do_submit
    from tunepilot.store import atomic_write_bytes

    for w in plan.warnings:
        say(f"warning: {w}")
    atomic_write_bytes(out, text.encode())
    if via == "slurm":
        out.chmod(0o755)
    if submit:
        plan.submitted = do_submit(plan, out)
    if as_json:
        emit_json(plan.to_dict())
        return
    from tunepilot.views.tools import render_launch

    render_launch(plan)
