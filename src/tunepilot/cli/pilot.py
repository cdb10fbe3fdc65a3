"""pilot, and watch (any training command, measured from outside)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import (
    CatalogOpt,
    JsonOpt,
    NoMemoryCheckOpt,
    OutOpt,
    SpecArg,
    load_run_spec,
    show,
)

MemoryLimitOpt = Annotated[str | None, typer.Option(
    "--memory-limit", help="Simulate a device with this much memory for tensors: bytes or a "
    "size like 24GiB / 80GB (raises the allocator's out-of-memory error past it); per rank "
    "for a sharded (FSDP) pilot.")]


@app.command()
def pilot(
    spec: SpecArg,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="Exactly N measured steps (default: adaptive, until the 95% CI of the "
        "mean step time is under 2%).", min=1)] = None,
    max_steps: Annotated[int, typer.Option(
        "--max-steps", help="Most measured steps of the adaptive rule.", min=1)] = 100,
    out: OutOpt = None,
    find_max_batch: Annotated[bool, typer.Option(
        "--find-max-batch", help="Also search the largest micro-batch whose full steps fit.")
    ] = False,
    memory_limit: MemoryLimitOpt = None,
    no_memory_check: NoMemoryCheckOpt = False,
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
    from tunepilot.cli.common import out_dir
    from tunepilot.pilot.runner import PilotOptions, run_pilot
    from tunepilot.units import parse_bytes
    from tunepilot.views.pilot import render_pilot
    from tunepilot.views.progress import progress

    run_spec = load_run_spec(spec)
    options = PilotOptions(steps=steps, max_steps=max_steps, find_max_batch=find_max_batch,
                           memory_limit_bytes=parse_bytes(memory_limit) if memory_limit else None,
                           base_dir=spec.parent, catalog=load_catalog(catalog),
                           check_memory=not no_memory_check)
    out = out_dir(out, run_spec)
    with progress("pilot") as say:
        result = run_pilot(run_spec, out, options, progress=say)
    show(result, as_json, lambda r: render_pilot(r, str(Path(out) / "pilot.json")))
    if not result.fits:
        sys.stderr.write(f"pilot: {result.does_not_fit.message if result.does_not_fit else result.verdict}\n")
        raise typer.Exit(code=1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def watch(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Run directory to write (pilot.json, "
                                      "manifest.json, logs/watch.log).")],
    spec: Annotated[Path | None, typer.Option(
        "--spec", help="The run's spec (or trainer config), to tie the measurements to it for "
        "`quote --from`.")] = None,
    interval_s: Annotated[float, typer.Option("--interval-s", help="Sampling interval.",
                                              min=0.01)] = 0.2,
    as_json: JsonOpt = False,
) -> None:
    """Run any training command as a child and measure its whole process tree: device memory
    per process and device-wide (NVML/amdsmi; RSS on a CPU), CPU and wall time, exit code, and
    the first step when TunepilotCallback runs inside it. Writes a run directory that `report`
    and `quote --from` accept. SIGINT/SIGTERM reach the whole tree; nothing is left running.

    Example: tunepilot watch --out runs/axolotl -- axolotl train my.yml
    """
    from tunepilot.integrations.watch import watch_command
    from tunepilot.views.pilot import render_pilot

    cmd = list(ctx.args)
    run_spec = load_run_spec(spec) if spec else None
    result = watch_command(cmd, out, spec=run_spec, interval_s=interval_s)
    show(result, as_json, lambda r: render_pilot(r, str(out / "pilot.json")))
    if result.watched is not None and result.watched.exit_code:
        sys.stderr.write(f"watch: the command exited with code {result.watched.exit_code}\n")
        raise typer.Exit(code=1)
