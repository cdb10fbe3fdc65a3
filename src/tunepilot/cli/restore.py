"""restore (tunepilot's step, sharded, or the user's HF Trainer script), verify, export."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import JsonOpt, NoMemoryCheckOpt, OutOpt, load_run_spec, out_dir, show
from tunepilot.errors import UserError


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def restore(
    ctx: typer.Context,
    spec: Annotated[Path | None, typer.Argument(
        help="The run spec (or a trainer config); none with --trainer (the script is the run)."
    )] = None,
    steps_before: Annotated[int, typer.Option("--steps-before", help="Steps before the save (K).",
                                              min=1)] = 4,
    steps_after: Annotated[int, typer.Option("--steps-after", help="Steps compared after it (M).",
                                             min=1)] = 4,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", help="Ranks (torchrun): a sharded checkpoint of the spec's ddp/fsdp run.",
        min=1)] = None,
    resume_nproc: Annotated[int | None, typer.Option(
        "--resume-nproc", help="Load the sharded checkpoint on this many ranks instead "
        "(resharding; the continuation must match within tolerance).", min=1)] = None,
    trainer: Annotated[str | None, typer.Option(
        "--trainer", help="hf or lightning: prove the user's own script (the command after --) "
        "resumes exactly.")] = None,
    out: OutOpt = None,
    no_memory_check: NoMemoryCheckOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Prove a checkpoint resumes the run exactly: train K steps, save, train M more; a fresh
    process loads it, checks every component (model and optimizer tensors, scheduler and LR,
    RNG streams, data position, step; per rank when sharded) and trains the same M steps,
    which must match bit for bit on CPU. Writes restore.json. Exit code 1 when the proof fails,
    naming the component.

    Examples: tunepilot restore examples/tiny.yaml --steps-before 4 --steps-after 4
              tunepilot restore examples/tiny-fsdp.yaml --nproc 2 --resume-nproc 1
              tunepilot restore --trainer hf --out runs/mine -- python train.py
    """
    from tunepilot.views.progress import messages
    from tunepilot.views.restore import render_restore

    if trainer is not None:
        # click fills the optional SPEC with the command's first word: it is the command's
        cmd = ([str(spec)] if spec is not None else []) + list(ctx.args)
        with messages("restore") as say:
            result, out = _trainer_proof(trainer, cmd, out, steps_before, steps_after, say)
    else:
        if spec is None:
            raise UserError("SPEC", "is required (or --trainer hf -- CMD ... for your own "
                            "script).", "E.g. tunepilot restore examples/tiny.yaml")
        if ctx.args:
            raise UserError("SPEC", f"unexpected arguments {ctx.args[:3]}.",
                            "A command after -- is only for --trainer hf.")
        run_spec = load_run_spec(spec)
        out = out_dir(out, run_spec)
        with messages("restore") as say:
            result = _proof(run_spec, spec, out, steps_before, steps_after, nproc,
                            resume_nproc, not no_memory_check, say)
    show(result, as_json, lambda r: render_restore(r, str(Path(out) / "restore.json")))
    if not result.passed:
        sys.stderr.write(f"error: {result.failure_message()}\n")
        raise typer.Exit(code=1)


def _proof(run_spec, spec: Path, out: Path, k: int, m: int, nproc, resume_nproc,
           check_memory: bool, say):
    if nproc is None and resume_nproc is None:
        from tunepilot.restore import verify_restore

        return verify_restore(run_spec, k, m, out, base_dir=spec.parent,
                              check_memory=check_memory, progress=say)
    from tunepilot.restore.sharded import verify_sharded_restore

    return verify_sharded_restore(run_spec, nproc or run_spec.parallel.world_size, k, m, out,
                                  resume_nproc=resume_nproc, base_dir=spec.parent,
                                  progress=say)


def _trainer_proof(trainer: str, cmd: list[str], out, k: int, m: int, say):
    from tunepilot.restore.trainer import verify_trainer_restore

    if trainer not in ("hf", "lightning"):
        raise UserError("--trainer", f"{trainer!r} is not hf or lightning.",
                        "Use --trainer hf (transformers.Trainer, TRL, axolotl) or lightning.")
    if not cmd:
        raise UserError("--trainer", "needs the command that runs your script after --.",
                        "E.g. tunepilot restore --trainer hf --out runs/mine -- python train.py")
    out = Path(out or "runs/trainer-restore")
    return verify_trainer_restore(cmd, out, trainer=trainer, steps_before=k, steps_after=m,
                                  progress=say), out


@app.command()
def verify(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint directory: tunepilot's "
                                               "(manifest.json) or an HF Trainer checkpoint-N/.")],
    as_json: JsonOpt = False,
) -> None:
    """Check a checkpoint without a spec: the manifest, every file's size and SHA-256, every
    component present and loadable in a fresh process - each problem named by file, rank and
    component. An HF Trainer checkpoint-N/ is checked for what resuming needs (weights,
    optimizer, scheduler, RNG per rank, trainer_state.json). Exit code 1 on any problem.

    Example: tunepilot verify runs/tiny/checkpoints/restore-step-000004
    """
    from tunepilot.checkpoint.inspect import inspect_checkpoint
    from tunepilot.views.restore import render_verify

    report = inspect_checkpoint(checkpoint)
    show(report, as_json, render_verify)
    if not report.ok:
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
    intact or a checkpoint is damaged.

    Example: tunepilot export runs/tiny-full-1a2b3c4d s3://my-bucket/runs/tiny
    """
    from tunepilot.checkpoint.export import export_run
    from tunepilot.views.restore import render_export

    result = export_run(run_dir, dest)
    show(result, as_json, lambda r: render_export(r, str(Path(run_dir) / "export.json")))
