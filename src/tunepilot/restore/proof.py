"""The restore proof on one process: a checkpoint counts only if a fresh process resumes the run
exactly.

1. This process trains K steps, records a digest of every component (the SHA-256 of every model
   and optimizer tensor, the scheduler state and current LR, each RNG stream, the data position,
   the step count), saves a checkpoint, and trains M more steps recording, per step, the loss as
   exact bits (float.hex), the batch fingerprint(s) and the LR.
2. A fresh Python process (tunepilot.restore.worker, through tunepilot.proc.child) builds the run from
   the spec, loads the checkpoint (verified while read), digests every component the same way
   before it trains, then trains the same M steps recording the same.
3. The verdict (restore/compare.py) compares component by component, then step by step: batch
   fingerprints and LRs identical, losses bit-identical on CPU (deterministic algorithms on in
   both processes). On a GPU it reports the largest absolute loss difference and whether
   deterministic mode held.
"""

from __future__ import annotations

from pathlib import Path

from tunepilot.checkpoint import CheckpointInfo, save_checkpoint
from tunepilot.errors import UserError
from tunepilot.proc.child import ChildFailed, run_child
from tunepilot.restore import compare as cmp
from tunepilot.restore.messages import DeterminismReport, FreshJob, ProcessReport
from tunepilot.restore.worker import (
    build,
    deterministic,
    is_determinism_error,
    load_hook,
    nondeterministic_ops,
    seed_everything,
    state_digest,
    strict_default,
    train,
)
from tunepilot.results.figure import Figure
from tunepilot.results.restore import CheckpointRef, ComponentCheck, RestoreResult
from tunepilot.spec import RunSpec
from tunepilot.spec.fp8 import stand_in_note
from tunepilot.store import RunDir

DEFAULT_STEPS_BEFORE = 4
DEFAULT_STEPS_AFTER = 4
WORKER_TIMEOUT_S = 1800  # the fresh process builds the model and trains M steps; generous


def check_steps(steps_before: int, steps_after: int) -> None:
    if steps_before < 1 or steps_after < 1:
        raise UserError("--steps-before" if steps_before < 1 else "--steps-after",
                        f"needs at least 1 step (got {min(steps_before, steps_after)}).",
                        "The proof saves after K >= 1 steps and compares M >= 1 steps after.")


def verify_restore(spec: RunSpec, steps_before: int = DEFAULT_STEPS_BEFORE,
                   steps_after: int = DEFAULT_STEPS_AFTER, run_dir: Path | str | None = None, *,
                   base_dir: Path | None = None, device: str | None = None, catalog=None,
                   hook: str | None = None, check_memory: bool = True,
                   progress=None) -> RestoreResult:
    """Train, save, train on; resume in a fresh process; compare. Writes RUN_DIR/restore.json.
    ``hook`` names a test-support object that alters the run on purpose (tests only)."""
    from tunepilot.catalog import load_catalog
    from tunepilot.device import probe_device

    check_steps(steps_before, steps_after)
    if run_dir is None:
        raise UserError("--out", "the restore proof needs a run directory for its checkpoint.")
    say = progress or (lambda _msg: None)
    run = RunDir(run_dir)
    spec_hash = spec.spec_hash()
    run.check_spec(spec_hash)
    info = probe_device(catalog or load_catalog(), device=device)
    if check_memory:
        _check_memory(spec, info, base_dir)
    say(f"original: build the model, train {steps_before} steps, save, train {steps_after} more")
    strict = strict_default(info.torch_device)
    try:
        original = run_original(spec, steps_before, steps_after, run.path, base_dir,
                                info.torch_device, strict=strict)
    except RuntimeError as exc:
        if not (strict and is_determinism_error(exc)):
            raise
        ops = nondeterministic_ops([str(exc).splitlines()[0]])
        say(f"original: {', '.join(ops) or 'an op'} has no deterministic kernel here: again "
            "with deterministic algorithms warn-only, compared within the GPU tolerance")
        original = run_original(spec, steps_before, steps_after, run.path, base_dir,
                                info.torch_device, strict=False)
        original.deterministic.nondeterministic_ops = sorted(
            set(original.deterministic.nondeterministic_ops) | set(ops))
        original.deterministic.held = False
    original.device_info = dict(info.summary(), torch_device=info.torch_device)
    release_device_cache()  # the fresh process must not find this one's reserve held
    h = load_hook(hook)
    if hasattr(h, "after_save"):
        h.after_save(Path(original.checkpoint))
    say(f"fresh process: load the checkpoint, train the same {steps_after} steps")
    result = verdict(original, run_fresh(original, run.path, hook), hook)
    if (note := stand_in_note(spec, "restore")) is not None:
        result = result.model_copy(update={"notes": [*result.notes, note]})
    run.write(result, spec_hash)
    if run.manifest().device is None:  # the pilot writes it; the cost stage reads card_id there
        run.update_manifest(device=info.summary(), spec=spec.model_dump(mode="json"))
    return result


def release_device_cache() -> None:
    """Hand the caching allocator's reserve back to the driver (the original side's tensors are
    gone): a GPU's memory this process keeps cached is memory the fresh process cannot have."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_memory(spec: RunSpec, info, base_dir: Path | None) -> None:
    """The plan against the local device's memory, before minutes of building (the proof
    holds the run twice: this process and the fresh one after it)."""
    from tunepilot.model.arch import resolve_arch
    from tunepilot.pilot.prepare import check_plan_fits_device, single_device_spec
    from tunepilot.plan.analytic.core import analytic_plan

    single, _ = single_device_spec(spec)
    plan = analytic_plan(single, resolve_arch(single, base_dir), info.kind)
    check_plan_fits_device(single, plan, info, what="restore proof")


def run_original(spec: RunSpec, steps_before: int, steps_after: int, run_path: Path,
                 base_dir: Path | None, device: str, *, strict: bool = False) -> ProcessReport:
    """Train K steps, digest, save, train M steps; everything the fresh process must match.
    ``strict``: deterministic algorithms forced (restore/worker.strict_default)."""
    import torch

    total_steps = steps_before + steps_after
    ckpt = run_path / spec.checkpoint.dir / f"restore-step-{steps_before:06d}"
    with deterministic(device, strict) as det:
        seed_everything(spec.seed)
        state, stream = build(spec, total_steps, base_dir, device)
        train(state, stream, spec, steps_before)
        digest = state_digest(state, stream, spec)
        info = save_checkpoint(ckpt, state, stream, spec, extra={"purpose": "restore proof"})
        steps = train(state, stream, spec, steps_after)
    return ProcessReport(
        spec=spec.model_dump(mode="json"), spec_hash=spec.spec_hash(),
        base_dir=str(base_dir) if base_dir is not None else None, device=device,
        threads=torch.get_num_threads(), total_steps=total_steps, steps_before=steps_before,
        steps_after=steps_after, checkpoint=str(ckpt), save=info.to_dict(), digest=digest,
        steps=steps, deterministic=DeterminismReport(**det))


def run_fresh(original: ProcessReport, run_path: Path, hook: str | None) -> ProcessReport:
    """Run the fresh process on the original's checkpoint; its report (or why it failed)."""
    logs = RunDir(run_path).logs_dir()
    job = FreshJob(spec=original.spec, spec_hash=original.spec_hash, base_dir=original.base_dir,
                   device=original.device, threads=original.threads,
                   total_steps=original.total_steps, steps_after=original.steps_after,
                   checkpoint=original.checkpoint, hook=hook,
                   strict_determinism=bool(original.deterministic and
                                           original.deterministic.strict))
    env = {}
    if original.device.startswith("cuda"):
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    try:
        return run_child("tunepilot.restore.worker", job, ProcessReport,
                         timeout_s=WORKER_TIMEOUT_S, what="the fresh process", env=_env(env),
                         log_path=logs / "restore-fresh.log")
    except ChildFailed as exc:
        return ProcessReport(crashed=exc.reason)


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    return {**os.environ, **extra}


def verdict(original: ProcessReport, fresh: ProcessReport, hook: str | None) -> RestoreResult:
    """The typed result of one proof from what both processes reported."""
    save = CheckpointInfo(**original.save)
    ref = original.steps
    base = dict(steps_before=original.steps_before, steps_after=original.steps_after,
                device=original.device_info or {"torch_device": original.device},
                checkpoint=CheckpointRef(path=original.checkpoint, kind=save.kind,
                                         files=len(save.files), step=save.step,
                                         world_size=save.world_size),
                save_s=Figure.measured(save.seconds, "s",
                                       includes="fsync and SHA-256 of every file"),
                checkpoint_bytes=Figure.measured(save.bytes, "bytes", kind=save.kind),
                save_bytes_per_s=Figure.measured(save.bytes / save.seconds if save.seconds
                                                 else None, "B/s"), hook=hook)
    names = cmp.component_names(original.digest.get("grad_scaler") is not None)
    if fresh.failed:
        return RestoreResult(passed=False, components=cmp.load_failure(fresh, names),
                             deterministic=cmp.determinism(original.deterministic),
                             steps={"original": ref}, **base)
    checks = [ComponentCheck(name=cmp.CHECKSUMS, passed=True,
                             detail=f"{len(save.files)} files, {save.bytes:,} bytes: every "
                                    "SHA-256 matches the manifest")]
    checks += cmp.state_checks(original.digest, fresh.digest)
    got = fresh.steps
    det = cmp.determinism(original.deterministic, fresh.deterministic)
    gpu = original.device.startswith("cuda") and not det.held
    traj, divergence, max_diff = cmp.compare_steps(
        ref, got, cmp.GPU_LOSS_RTOL if gpu else None,
        "GPU, deterministic mode not possible")
    load_s = fresh.load_s
    return RestoreResult(
        passed=all(c.passed for c in checks + traj), components=checks + traj,
        first_divergence=divergence, deterministic=det,
        load_s=Figure.measured(load_s, "s", includes="SHA-256 verification of every file"),
        load_bytes_per_s=Figure.measured(save.bytes / load_s if load_s else None, "B/s"),
        loss_max_abs_diff=Figure.measured(max_diff, "nats/token"),
        tolerance=cmp.tolerance(gpu, det),
        steps={"original": ref, "restored": got}, **base)
