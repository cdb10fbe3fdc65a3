"""scale: 1 rank vs N ranks on torchrun."""

from __future__ import annotations

from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import (
    CatalogOpt,
    Device,
    JsonOpt,
    NoMemoryCheckOpt,
    OutOpt,
    SpecArg,
    Strategy,
    load_run_spec,
    out_dir,
    show,
)


@app.command()
def scale(
    spec: SpecArg,
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks per node (GPUs, or CPU ranks).",
                                       min=1)],
    strategy: Annotated[Strategy, typer.Option("--strategy", help="ddp, fsdp or both.")
                        ] = Strategy.both,
    steps: Annotated[int, typer.Option("--steps", help="Measured optimizer steps per run.",
                                       min=1)] = 5,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Unmeasured steps first.",
                                              min=0)] = 2,
    out: OutOpt = None,
    device: Annotated[Device, typer.Option("--device", help="auto, cuda or cpu (gloo).")
                      ] = Device.auto,
    nnodes: Annotated[int, typer.Option("--nnodes", help="torchrun --nnodes.", min=1)] = 1,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="torchrun --node-rank."
                                                  )] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", help="torchrun --rdzv-endpoint host:port (the first node).")] = None,
    rdzv_backend: Annotated[str, typer.Option("--rdzv-backend", help="torchrun --rdzv-backend."
                                              )] = "c10d",
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", help="torchrun --rdzv-id (same on "
                                                "every node).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Per launch; the whole group "
                                             "is torn down after it.", min=1)] = 600.0,
    no_memory_check: NoMemoryCheckOpt = False,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Scaling test on torchrun: 1 rank vs N ranks with DDP and FSDP at the same global batch,
    after a preflight (devices, topology, NUMA, collective library, bus bandwidth). Every
    strategy asked for runs even when another crashes; exit code 1 when one crashed (its error
    and log lines are in scale.json).

    Example: tunepilot scale examples/tiny.yaml --nproc 2 --strategy both
    """
    from tunepilot.catalog import load_catalog
    from tunepilot.scaling.launch import Rendezvous
    from tunepilot.scaling.runner import scale as run_scale
    from tunepilot.views.progress import messages
    from tunepilot.views.scale import render_scale

    run_spec = load_run_spec(spec)
    choices = {"both": ("ddp", "fsdp"), "ddp": ("ddp",), "fsdp": ("fsdp",)}
    rdzv = Rendezvous(nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint,
                      backend=rdzv_backend, id=rdzv_id)
    with messages("scale") as say:
        result = run_scale(run_spec, nproc, choices[strategy.value],
                           out=out_dir(out, run_spec), steps=steps, warmup_steps=warmup_steps,
                           base_dir=spec.parent, device=device.value, rdzv=rdzv,
                           timeout_s=timeout_s, catalog=load_catalog(catalog),
                           check_memory=not no_memory_check, progress=say)
    show(result, as_json, render_scale)
    if any(r.status == "failed" for r in result.strategies.values()):
        raise typer.Exit(code=1)  # every strategy ran and scale.json is written; one crashed
