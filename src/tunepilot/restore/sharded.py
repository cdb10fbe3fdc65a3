"""The restore proof of a sharded run (`tunepilot restore SPEC --nproc N [--resume-nproc N']`).

1. N ranks under torchrun (the spec's strategy: DDP or FSDP2, gloo on CPU, NCCL on GPU) train K
   steps, digest their state (their own shards), save one sharded checkpoint (every rank its
   shard, one manifest; checkpoint/state.py) and train M more steps recording each step exactly.
2. A fresh process group - N ranks again, or N' (resharding: DCP redistributes the tensors,
   each rank takes the RNG streams of rank r % N and the data position of the same global
   sample) - loads it, digests, and trains the same M steps.
3. The verdict: with N ranks on both sides, every component per rank (model and optimizer
   shards, scheduler and LR, RNG streams, data position, step) and every continued step
   (per-rank batch fingerprints, LR, loss bits) must be identical. Resharded, per-rank shards
   are not comparable one to one: the scheduler, the step and the *global* loss of every
   continued step are compared, the loss within RESHARD_LOSS_RTOL (another rank count reduces
   in another order: it is not bit-exact), and the result says so.

Each rank runs ``python -m tunepilot.restore.sharded JOB.json`` and writes OUT/rank{R}.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.restore.messages import ProcessReport, ShardedJob
from tunepilot.results.figure import Figure
from tunepilot.results.restore import (
    CheckpointRef,
    ComponentCheck,
    RestoreResult,
    StepRecord,
    Trajectories,
)
from tunepilot.spec import RunSpec
from tunepilot.spec.fp8 import stand_in_note

LAUNCH_TIMEOUT_S = 1800


def verify_sharded_restore(spec: RunSpec, nproc: int, steps_before: int, steps_after: int,
                           run_dir: Path | str, *, resume_nproc: int | None = None,
                           base_dir: Path | None = None, progress=None,
                           device: str | None = None) -> RestoreResult:
    """Save on ``nproc`` ranks, resume on ``resume_nproc`` (default the same); restore.json."""
    from tunepilot.proc.child import write_message
    from tunepilot.restore.proof import check_steps
    from tunepilot.scaling.launch import launch
    from tunepilot.store import RunDir

    say = progress or (lambda msg: None)
    check_steps(steps_before, steps_after)
    strategy = spec.parallel.strategy if spec.parallel.strategy in ("ddp", "fsdp") else "ddp"
    resume = resume_nproc or nproc
    resume_accumulation = _check_batch(spec, nproc, resume)
    run = RunDir(run_dir)
    spec_hash = spec.spec_hash()
    run.check_spec(spec_hash)
    kind = device or _device_kind(nproc, resume)
    ckpt = run.path / spec.checkpoint.dir / f"restore-sharded-step-{steps_before:06d}"
    work = run.path / "restore-sharded"
    threads = max(1, (os.cpu_count() or 2) // max(nproc, resume))
    env = {"OMP_NUM_THREADS": str(threads)} if kind == "cpu" else {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    records = {}
    for role, n in (("original", nproc), ("fresh", resume)):
        say(f"{role}: {n} rank(s), {strategy}")
        out = work / role
        accumulation = spec.gradient_accumulation_steps if role == "original" else \
            resume_accumulation
        job = write_message(work / f"{role}.job.json", ShardedJob(
            spec=spec.model_dump(mode="json"), role="original" if role == "original" else
            "resumed", strategy=strategy, device=kind, threads=threads,
            steps_before=steps_before, steps_after=steps_after, accumulation=accumulation,
            checkpoint=str(ckpt), out=str(out),
            base_dir=str(base_dir) if base_dir is not None else None))
        launch(f"restore {role}", "tunepilot.restore.sharded", [str(job)], nproc=n,
               log_dir=run.logs_dir() / f"restore-{role}", timeout_s=LAUNCH_TIMEOUT_S, env=env)
        records[role] = _read(out, n)
    result = _verdict(records["original"], records["fresh"], nproc, resume, ckpt, kind)
    if (note := stand_in_note(spec, "restore")) is not None:
        result = result.model_copy(update={"notes": [*result.notes, note]})
    run.write(result, spec_hash)
    if run.manifest().device is None:
        run.update_manifest(spec=spec.model_dump(mode="json"))
    return result


def _device_kind(nproc: int, resume: int) -> str:
    import torch

    n = max(nproc, resume)
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "cpu"


def _check_batch(spec: RunSpec, nproc: int, resume: int) -> int:
    """The resumed run's accumulation: the same global batch on ``resume`` ranks."""
    if nproc < 1 or resume < 1:
        raise UserError("--nproc", "needs at least 1 rank.")
    per_step = nproc * spec.gradient_accumulation_steps  # micro-batches per optimizer step
    if per_step % resume:
        raise UserError("--resume-nproc", f"{resume} ranks cannot keep the global batch of "
                        f"{nproc} ranks x {spec.gradient_accumulation_steps} accumulation x "
                        f"micro-batch {spec.micro_batch_size} ({per_step} micro-batches per "
                        f"step do not split over {resume} ranks).",
                        f"Use a --resume-nproc that divides {per_step}.")
    return per_step // resume


def _read(out: Path, n: int) -> list[ProcessReport]:
    from tunepilot.proc.child import read_message

    return [read_message(ProcessReport, out / f"rank{r}.json") for r in range(n)]


# --- the verdict ---------------------------------------------------------------------------
def _verdict(orig: list[ProcessReport], fresh: list[ProcessReport], nproc: int, resume: int,
             ckpt: Path, kind: str) -> RestoreResult:
    from tunepilot.checkpoint import CheckpointInfo
    from tunepilot.restore import compare as cmp

    save = CheckpointInfo(**orig[0].save)
    load_s = max(r.load_s for r in fresh) if all(r.load is not None for r in fresh) else None
    base = dict(steps_before=orig[0].steps_before, steps_after=orig[0].steps_after,
                device={"kind": kind, "ranks": nproc},
                checkpoint=CheckpointRef(path=str(ckpt), kind=save.kind, files=len(save.files),
                                         step=save.step, world_size=save.world_size),
                save_s=Figure.measured(save.seconds, "s",
                                       how="all ranks, fsync and SHA-256 of every file"),
                checkpoint_bytes=Figure.measured(save.bytes, "bytes", kind=save.kind),
                save_bytes_per_s=Figure.measured(save.bytes / save.seconds if save.seconds
                                                 else None, "B/s"),
                nproc=nproc, resume_nproc=resume if resume != nproc else None)
    errors = [r for r in fresh if r.failed]
    if errors:
        names = cmp.component_names(orig[0].digest.get("grad_scaler") is not None)
        return RestoreResult(passed=False, components=cmp.load_failure(errors[0], names),
                             **base)
    checks = [ComponentCheck(name=cmp.CHECKSUMS, passed=True,
                             detail=f"{len(save.files)} files of {nproc} ranks, {save.bytes:,} "
                                    "bytes: every SHA-256 matches the manifest")]
    if resume == nproc:
        traj_ref, traj_got, max_diff, divergence = [], [], 0.0, None
        for r in range(nproc):
            checks += cmp.state_checks(orig[r].digest, fresh[r].digest, rank=r)
            ref, got = orig[r].steps, fresh[r].steps
            gpu = kind == "cuda"
            traj, div, diff = cmp.compare_steps(ref, got, cmp.GPU_LOSS_RTOL if gpu else None,
                                                "GPU, deterministic mode not possible")
            for c in traj:
                c.rank = r
            checks += traj
            divergence = divergence or div
            max_diff = max(max_diff, diff or 0.0)
            if r == 0:
                traj_ref, traj_got = ref, got
        tolerance = "bit-exact per rank" if kind == "cpu" else \
            f"loss within rtol {cmp.GPU_LOSS_RTOL:g} per rank (GPU)"
    else:
        a, b = orig[0].digest, fresh[0].digest
        checks.append(cmp._scheduler(a[cmp.SCHEDULER], b[cmp.SCHEDULER], None))
        checks.append(cmp._plain(cmp.PROGRESS, a[cmp.PROGRESS]["step"],
                                 b[cmp.PROGRESS]["step"], "optimizer step", None))
        traj_ref, traj_got = _global(orig), _global(fresh)
        traj, divergence, max_diff = cmp.compare_steps(
            traj_ref, traj_got, cmp.RESHARD_LOSS_RTOL, f"resharded from {nproc} to {resume} "
            "ranks: another reduction order")
        for c in traj:
            if c.name == cmp.BATCHES:
                c.detail = c.detail.replace("batch fingerprints identical", "the same global "
                                            "count of useful tokens (the same samples)")
        checks += traj
        tolerance = (f"resharded {nproc} -> {resume} ranks at the same global batch: the "
                     f"global loss of every continued step within rtol "
                     f"{cmp.RESHARD_LOSS_RTOL:g} (not bit-exact: another rank count reduces in "
                     "another order), its useful tokens identical; per-rank shards, RNG and "
                     "data positions are not comparable one to one")
    return RestoreResult(
        passed=all(c.passed for c in checks), components=checks, first_divergence=divergence,
        load_s=Figure.measured(load_s, "s", how="the slowest rank, SHA-256 verification of "
                               "every file included"),
        load_bytes_per_s=Figure.measured(save.bytes / load_s if load_s else None, "B/s"),
        loss_max_abs_diff=Figure.measured(max_diff, "nats/token"),
        steps=Trajectories(original=traj_ref, restored=traj_got), tolerance=tolerance, **base)


def _global(records: list[ProcessReport]) -> list[StepRecord]:
    """Rank 0's steps with the global loss (every rank's share summed) in place of its own."""
    r0 = records[0]
    return [s.model_copy(update={"loss": g, "loss_bits": float(g).hex(), "fingerprints": [],
                                 "useful_tokens": u})
            for s, g, u in zip(r0.steps, r0.global_losses or [], r0.global_useful_tokens or [],
                               strict=True)]


# --- one rank ------------------------------------------------------------------------------
def rank_main(job: ShardedJob) -> ProcessReport:
    import torch
    import torch.distributed as dist

    from tunepilot.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from tunepilot.proc.child import write_message
    from tunepilot.restore.messages import DeterminismReport
    from tunepilot.restore.worker import deterministic, seed_everything, state_digest, train
    from tunepilot.scaling.worker import init_group, placement
    from tunepilot.training.build import build_run

    rank, _, device = init_group(job.device, job.threads)
    world = dist.get_world_size()
    spec = RunSpec.model_validate(job.spec)
    k, m = job.steps_before, job.steps_after
    record = ProcessReport(rank=rank, world_size=world, steps_before=k, steps_after=m)
    out = Path(job.out) / f"rank{rank}.json"
    with deterministic(str(device)) as det:
        seed_everything(spec.seed)
        run = build_run(spec, device, total_steps=k + m,
                        base_dir=Path(job.base_dir) if job.base_dir else None,
                        rank=rank, world_size=world,
                        **placement(job.strategy, spec, device))
        state, stream = run.state, run.stream
        if job.role == "original":
            train(state, stream, spec, k, accumulation=job.accumulation)
            record.digest = state_digest(state, stream, spec)
            info = save_checkpoint(Path(job.checkpoint), state, stream, spec,
                                   extra={"purpose": "sharded restore proof"})
            record.save = info.to_dict()
        else:
            try:
                info = load_checkpoint(Path(job.checkpoint), state, stream, spec)
            except CheckpointError as exc:
                record.error = exc.to_dict()
                write_message(out, record)
                dist.destroy_process_group()
                return record
            record.load = info.to_dict()
            record.digest = state_digest(state, stream, spec)
        steps = train(state, stream, spec, m, accumulation=job.accumulation)
    losses = torch.tensor([s.loss for s in steps], dtype=torch.float64, device=device)
    useful = torch.tensor([s.useful_tokens for s in steps], dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(losses)  # SUM: each rank's loss is its share of the global mean
        dist.all_reduce(useful)
    record.global_useful_tokens = [int(x) for x in useful.tolist()]
    record.steps = steps
    record.global_losses = [float(x) / world for x in losses.tolist()]
    record.deterministic = DeterminismReport(**det)
    write_message(out, record)
    dist.destroy_process_group()
    return record


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from tunepilot.proc.child import read_job
    from tunepilot.proc.spawn import LAUNCHERS, die_with_parent

    die_with_parent(parent_runs=LAUNCHERS)
    job = read_job(argv, ShardedJob)
    record(rank_main)(job)
    return 0


if __name__ == "__main__":
    code = main()
    # Every record is on disk and the process group destroyed: skip the interpreter's teardown,
    # where gloo's C++ worker threads can abort the process after the work is done (as in
    # tunepilot.scaling.worker; seen here on a loaded 2-core machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
