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
    calibrate: Annotated[
        Path | None, typer.Option("--calibrate", help="A pilot's run directory: apply the "
                                  "residuals it measured to this plan (memory/calibration.py).")
    ] = None,
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
    if calibrate is not None:
        if trace:
            raise UserError("--calibrate", "applies to the analytic plan (the pilot's residuals "
                            "are measured against it).", "Drop --trace or --calibrate.")
        from tunepilot.memory.calibration import make_calibrated_plan

        result = make_calibrated_plan(run_spec, calibrate, catalog=cat, card_ids=card,
                                      headroom=headroom, base_dir=spec.parent)
    elif trace:
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
    """List the shipped model presets with their parameter counts.

    Example: tunepilot presets --json
    """
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
    """List the cards of the catalog with their datasheet figures and example prices.

    Example: tunepilot cards --catalog my-prices.yaml
    """
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


@app.command()
def pilot(
    spec: SpecArg,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="Exactly N measured steps (default: adaptive, until the 95% CI of the "
        "mean step time is under 2%).", min=1)] = None,
    max_steps: Annotated[int, typer.Option(
        "--max-steps", help="Most measured steps of the adaptive rule.", min=1)] = 100,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Run directory (default runs/<spec name>-<spec hash[:8]>).")] = None,
    find_max_batch: Annotated[bool, typer.Option(
        "--find-max-batch", help="Also search the largest micro-batch whose full steps fit.")
    ] = False,
    memory_limit: Annotated[str | None, typer.Option(
        "--memory-limit", help="Simulate a device with this much memory for tensors: bytes or "
        "a size like 24GiB / 80GB (raises the allocator's out-of-memory error past it).")] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Real training steps of the run on this machine (GPU or CPU), worst case first: does a
    full step fit, how long does it take, how much memory, and how well the plan predicted it.
    Writes pilot.json, manifest.json and logs/pilot.log to the run directory. Exit code 1 when
    the run does not fit.

    Example: tunepilot pilot examples/tiny.yaml --out runs/tiny --json
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.pilot.memtrack import parse_bytes
    from tunepilot.pilot.render import pilot_progress
    from tunepilot.pilot.runner import PilotOptions, run_pilot
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    options = PilotOptions(steps=steps, max_steps=max_steps, find_max_batch=find_max_batch,
                           memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None,
                           base_dir=spec.parent, catalog=load_catalog(catalog))
    with pilot_progress() as progress:
        result = run_pilot(run_spec, out, options, progress=progress)
    if as_json:
        emit_json(result.to_dict())
    else:
        from tunepilot.pilot.render import render_pilot

        render_pilot(result.to_dict(), str(result.run_dir / "pilot.json"))
    if not result.fits:
        sys.stderr.write(f"pilot: {result.data['verdict']}\n")
        raise typer.Exit(code=1)


# --- quotes and the ledger (tunepilot.cost, tunepilot.ledger; rendered by tunepilot.render_cost) --

DbOpt = Annotated[Path | None, typer.Option(
    "--db", help="The ledger database (default: $TUNEPILOT_DB, else ledger.sqlite3 in the user "
    "data directory).")]
HoursOpt = Annotated[str | None, typer.Option("--hours", help="Term length in hours, e.g. 72.")]
DaysOpt = Annotated[str | None, typer.Option("--days", help="Term length in days, e.g. 3.")]
OptionOpt = Annotated[list[str] | None, typer.Option(
    "--option", help="A card option as NAME=QUANTITY (repeatable), e.g. storage_gb_month=500.")]
FromOpt = Annotated[Path | None, typer.Option(
    "--from", help="A run directory of this spec (pilot/restore/scale/export results).")]
BookingArg = Annotated[int, typer.Argument(help="The booking id (see `tunepilot bookings`).")]


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
    save: Annotated[bool, typer.Option("--save", help="Save to the ledger; prints a QUOTE_ID.")] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The time the job needs on COUNT x CARD, the term's itemised cost, and the cost per million
    useful tokens; every figure marked measured or projected. Without --hours/--days the term is
    the cheapest one covering the job plus the safety margin.

    Example: tunepilot quote examples/llama3-8b-lora.yaml --card h200 --count 1 --days 2
    """
    from tunepilot import cost
    from tunepilot import ledger as ledger_lib
    from tunepilot.catalog import load_catalog
    from tunepilot.pricing import parse_duration
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    term_s = parse_duration(hours, days, required=False)
    result = cost.quote(run_spec, card_id=card, count=count, term_s=term_s, options=option,
                        run_dir=from_dir, catalog=load_catalog(catalog), base_dir=spec.parent)
    body = result.to_dict()
    if save:
        body["quote_id"] = ledger_lib.save_quote(db, body)
    if as_json:
        emit_json(body)
        return
    from tunepilot.render import console
    from tunepilot.render_cost import render_quote

    render_quote(result)
    if save:
        console.print(f"saved as quote {body['quote_id']}: tunepilot book --quote "
                      f"{body['quote_id']} --start <UTC time>")


@app.command()
def compare(spec: SpecArg, from_dir: FromOpt = None, catalog: CatalogOpt = None,
            as_json: JsonOpt = False) -> None:
    """Every card x count that fits (1, 2, 4, 8 and the fewest FSDP needs), ranked by cost per
    million useful tokens on the cheapest term that covers the job, with time to finish.

    Example: tunepilot compare examples/llama3-8b-lora.yaml
    """
    from tunepilot import cost
    from tunepilot.catalog import load_catalog
    from tunepilot.spec import load_spec

    result = cost.compare(load_spec(spec), run_dir=from_dir, catalog=load_catalog(catalog),
                          base_dir=spec.parent)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_cost import render_compare

    render_compare(result)


@app.command()
def book(
    start: Annotated[str, typer.Option("--start", help="UTC start, e.g. 2026-12-01T09:00Z, or now.")],
    card: Annotated[str | None, typer.Option("--card", help="The card, e.g. h200.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="How many cards.")] = None,
    hours: HoursOpt = None,
    days: DaysOpt = None,
    quote_id: Annotated[str | None, typer.Option("--quote", help="A QUOTE_ID from quote --save.")] = None,
    option: OptionOpt = None,
    catalog: CatalogOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Allocate cards from the inventory for [start, start + hours); refused (exit 3) with what
    is free instead when any overlapping interval would exceed the inventory.

    Example: tunepilot book --card h200 --count 1 --start 2026-12-01T09:00Z --hours 72
    """
    from tunepilot import ledger as ledger_lib
    from tunepilot.catalog import load_catalog

    result = ledger_lib.book(load_catalog(catalog), db=db, card_id=card, count=count, start=start,
                             hours=hours, days=days, quote_id=quote_id, options=option)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_cost import render_booking

    render_booking(result)


@app.command()
def bookings(
    card: Annotated[str | None, typer.Option("--card", help="Only this card.")] = None,
    include_all: Annotated[bool, typer.Option("--all", help="Include cancelled bookings.")] = False,
    catalog: CatalogOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the ledger's bookings (active ones; --all adds the cancelled).

    Example: tunepilot bookings --card h200 --all
    """
    from tunepilot import ledger as ledger_lib
    from tunepilot.catalog import load_catalog

    card_id = load_catalog(catalog).get(card).id if card else None
    rows = ledger_lib.bookings(db, card_id, include_all)
    if as_json:
        emit_json([b.to_dict() for b in rows])
        return
    from tunepilot.render_cost import render_bookings

    render_bookings(rows)


@app.command()
def cancel(booking_id: BookingArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Cancel a booking per its card's cancellation policy; the refund (in cents) is added to its
    invoice and the cards are free again.

    Example: tunepilot cancel 3
    """
    from tunepilot import ledger as ledger_lib

    result = ledger_lib.cancel(db, booking_id)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_cost import render_cancellation

    render_cancellation(result)


@app.command()
def invoice(booking_id: BookingArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """A booking's invoice: line items and total in cents.

    Example: tunepilot invoice 3 --json
    """
    from tunepilot import ledger as ledger_lib

    result = ledger_lib.invoice(db, booking_id)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_cost import render_invoice

    render_invoice(result)


@app.command()
def usage(
    booking_id: BookingArg,
    hours_used: Annotated[str, typer.Option("--hours-used", help="Hours the cards were used.")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Record the hours a booking was actually used: utilisation = used / booked.

    Example: tunepilot usage 3 --hours-used 61.5
    """
    from tunepilot import ledger as ledger_lib

    result = ledger_lib.usage(db, booking_id, hours_used)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_cost import render_usage

    render_usage(result)


@app.command("ledger")
def ledger_summary(db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Spend by card and month (billed, refunded, net, in cents).

    Example: tunepilot ledger --db ./team-ledger.sqlite3
    """
    from tunepilot import ledger as ledger_lib

    rows = ledger_lib.spend(db)
    if as_json:
        emit_json(rows)
        return
    from tunepilot.render_cost import render_spend

    render_spend(rows)


@app.command()
def scale(
    spec: SpecArg,
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks per node (GPUs, or CPU ranks).",
                                       min=1)],
    strategy: Annotated[str, typer.Option("--strategy", help="ddp, fsdp or both.")] = "both",
    steps: Annotated[int, typer.Option("--steps", help="Measured optimizer steps per run.",
                                       min=1)] = 5,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Unmeasured steps first.",
                                              min=0)] = 2,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default "
                                             "runs/<spec>-<hash>).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cuda or cpu (gloo).")] = "auto",
    nnodes: Annotated[int, typer.Option("--nnodes", help="torchrun --nnodes.", min=1)] = 1,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="torchrun --node-rank."
                                                  )] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint",
                                                      help="torchrun --rdzv-endpoint host:port "
                                                      "(the first node).")] = None,
    rdzv_backend: Annotated[str, typer.Option("--rdzv-backend", help="torchrun --rdzv-backend."
                                              )] = "c10d",
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", help="torchrun --rdzv-id (same on "
                                                "every node).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Per launch; the whole group "
                                             "is torn down after it.", min=1)] = 600.0,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Scaling test on torchrun: 1 rank vs N ranks with DDP and FSDP at the same global batch,
    after a preflight (devices, topology, NUMA, collective library, bus bandwidth).

    Example: tunepilot scale examples/tiny.yaml --nproc 2 --strategy both
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.scaling.launch import Rendezvous
    from tunepilot.scaling.runner import scale as run_scale
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    choices = {"both": ("ddp", "fsdp"), "ddp": ("ddp",), "fsdp": ("fsdp",)}
    if strategy not in choices:
        raise UserError("--strategy", f"{strategy!r} is not ddp, fsdp or both.")
    if device not in ("auto", "cuda", "cpu"):
        raise UserError("--device", f"{device!r} is not auto, cuda or cpu.")
    if out is None:
        from tunepilot.pilot.runner import default_run_dir

        out = default_run_dir(run_spec)
    rdzv = Rendezvous(nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint,
                      backend=rdzv_backend, id=rdzv_id)
    result = run_scale(run_spec, nproc, choices[strategy], out=out, steps=steps,
                       warmup_steps=warmup_steps, base_dir=spec.parent, device=device, rdzv=rdzv,
                       timeout_s=timeout_s, catalog=load_catalog(catalog),
                       progress=lambda msg: sys.stderr.write(f"scale: {msg}\n"))
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.scaling.render import render_scale

    render_scale(result.to_dict())


# --- restore proof and export (tunepilot.restore, tunepilot.export; rendered by render_restore) --


@app.command()
def restore(
    spec: SpecArg,
    steps_before: Annotated[int, typer.Option("--steps-before", help="Steps before the save (K).",
                                              min=1)] = 4,
    steps_after: Annotated[int, typer.Option("--steps-after", help="Steps compared after it (M).",
                                             min=1)] = 4,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default "
                                             "runs/<spec>-<hash>).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prove a checkpoint resumes the run exactly: train K steps, save, train M more; a fresh
    process loads it, checks every component (model and optimizer tensors, scheduler and LR,
    RNG streams, data position, step) and trains the same M steps, which must match bit for
    bit on CPU. Writes restore.json. Exit code 1 when the proof fails, naming the component.

    Example: tunepilot restore examples/tiny.yaml --steps-before 4 --steps-after 4
    """
    from tunepilot.restore import failure_message, verify_restore
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    if out is None:
        from tunepilot.pilot.runner import default_run_dir

        out = default_run_dir(run_spec)
    result = verify_restore(run_spec, steps_before, steps_after, out, base_dir=spec.parent)
    if as_json:
        emit_json(result.to_dict())
    else:
        from tunepilot.render_restore import render_restore

        render_restore(result.to_dict(), str(Path(out) / "restore.json"))
    if not result.passed:
        sys.stderr.write(f"error: {failure_message(result)}\n")
        raise typer.Exit(code=1)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run directory, e.g. runs/tiny-full-1a2b3c4d")],
    dest: Annotated[str, typer.Argument(help="Where to: a path, file://, s3://bucket/prefix, "
                                        "gs://bucket/prefix (any fsspec URL).")],
    as_json: JsonOpt = False,
) -> None:
    """Copy a run's artifacts off the machine and verify every file's SHA-256 at the
    destination; files already there intact are skipped, so running it again resumes.
    Writes export.json (bytes, seconds, bytes_per_s). Exit code 1 when a file did not arrive
    intact.

    Example: tunepilot export runs/tiny-full-1a2b3c4d s3://my-bucket/runs/tiny
    """
    from tunepilot.export import export_run

    result = export_run(run_dir, dest)
    if as_json:
        emit_json(result.to_dict())
        return
    from tunepilot.render_restore import render_export

    render_export(result.to_dict(), str(Path(run_dir) / "export.json"))


# --- the staged pilot end to end (tunepilot.pipeline) and its report (tunepilot.report) -----------


@app.command()
def run(
    spec: SpecArg,
    card: Annotated[str | None, typer.Option("--card", help="Quote this card (with --count and "
                                             "--hours); default: compare every card.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Cards in the term.", min=1)] = None,
    hours: HoursOpt = None,
    days: DaysOpt = None,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", help="Ranks for the scaling stage (default: the GPUs here; skipped with one)."
    )] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Run directory (default runs/<spec name>-<spec hash[:8]>).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Re-run stages already completed.")
                     ] = False,
    memory_limit: Annotated[str | None, typer.Option(
        "--memory-limit", help="Simulate a device with this much tensor memory (e.g. 2GiB).")
    ] = None,
    no_trace: Annotated[bool, typer.Option("--no-trace", help="Analytic plan only.")] = False,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The staged pilot: plan, pilot, restore proof, scaling, quote - each a gate for the next -
    then the decision and the HTML report. A failed gate stops with its reason (exit 1).
    Re-running the same spec reuses completed stages unless --force.

    Example: tunepilot run examples/tiny.yaml --nproc 2 --out runs/tiny
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.pilot.runner import default_run_dir
    from tunepilot.pricing import check_count, parse_duration
    from tunepilot.spec import load_spec

    run_spec = load_spec(spec)
    cat = load_catalog(catalog)
    term_s = parse_duration(hours, days, required=False)  # checked before any stage runs
    if (card is None) != (count is None) or (card is None) != (term_s is None):
        raise UserError("--card", "give --card, --count and --hours (or --days) together, or "
                        "none of them (then every card is compared).")
    if card is not None:
        card = cat.get(card).id
        check_count(count)
    mem = None
    if memory_limit:
        from tunepilot.pilot.memtrack import parse_bytes

        mem = parse_bytes(memory_limit)
    from tunepilot.pipeline import RunOptions

    opts = RunOptions(card=card, count=count, term_s=term_s, nproc=nproc, force=force,
                      memory_limit_bytes=mem, trace=not no_trace, base_dir=spec.parent,
                      catalog=cat)
    _run_and_report(run_spec, out or default_run_dir(run_spec), opts, as_json)


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
    from importlib.resources import files

    import yaml

    from tunepilot.pipeline import RunOptions
    from tunepilot.spec import spec_from_dict

    run_spec = spec_from_dict(yaml.safe_load(files("tunepilot").joinpath("data/demo.yaml")
                                             .read_text()), source="demo.yaml")
    opts = RunOptions(nproc=2, force=True, pilot_max_steps=20, scale_steps=3)
    _run_and_report(run_spec, out, opts, as_json)


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
    import time

    from tunepilot.pipeline import GateFailed, run_pipeline
    from tunepilot.report.html import build_report

    t0 = time.perf_counter()

    def say(msg: str) -> None:
        sys.stderr.write(f"[{time.perf_counter() - t0:6.1f} s] {msg}\n")
        sys.stderr.flush()

    try:
        result = run_pipeline(run_spec, out, opts, say=say)
        failed = None
    except GateFailed as exc:
        result, failed = exc.result, exc
    html, _ = build_report(out)
    if as_json:
        emit_json(dict(result.to_dict(), report_html=str(html)))
    else:
        from tunepilot.render import render_decision

        render_decision(result, html)
    if failed is not None:
        raise typer.Exit(code=1)


def main() -> None:
    """Console-script entry point: user errors exit 2 with one paragraph, never a traceback.

    Usage errors (unknown option, missing argument) are click's: exit 2 with the usage line.
    """
    import os

    # tunepilot never downloads: models come from shipped configs, data and tokenizers from disk
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
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
