"""The restore proof of the user's own HF Trainer script (`tunepilot restore --trainer hf -- CMD`).

The script adds ``TunepilotCallback()`` and passes ``resume_from()`` to
``trainer.train(resume_from_checkpoint=...)``; nothing else changes. tunepilot runs it twice
(restore/callbacks.py has the variables that steer the callback):
1. the reference: K + M steps, a checkpoint after step K (copied aside), every step's batch
   fingerprints, summed loss bits and LR recorded;
2. a fresh process resuming from checkpoint K, stopped after step K + M, recording the same.
The checkpoint is checked for what resuming needs (checkpoint/hf.py), then the M continued steps
are compared: other batches name the data position (e.g. ``ignore_data_skip=True``), another
LR the scheduler, the same batches and LR with another loss the RNG streams or the optimizer
state. Bit-exact on CPU; on a GPU within GPU_LOSS_RTOL.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.restore import callbacks as pf
from tunepilot.restore import compare as cmp
from tunepilot.restore.messages import CallbackProof
from tunepilot.results.figure import Figure
from tunepilot.results.restore import (
    CheckpointRef,
    ComponentCheck,
    Determinism,
    RestoreResult,
    StepRecord,
    Trajectories,
)

RUN_TIMEOUT_S = 3600


def verify_trainer_restore(cmd: list[str], out: Path, *, trainer: str = "hf",
                           steps_before: int = 4, steps_after: int = 4,
                           progress=None) -> RestoreResult:
    from tunepilot.proc.child import read_message
    from tunepilot.restore.proof import check_steps
    from tunepilot.store import RunDir

    say = progress or (lambda msg: None)
    check_steps(steps_before, steps_after)
    if trainer not in ("hf", "lightning"):
        raise UserError("--trainer", f"{trainer!r} is not hf or lightning.",
                        "Use --trainer hf (transformers.Trainer, TRL, axolotl) or lightning.")
    run = RunDir(out)
    proof_dir = run.path / "trainer-restore"
    proof_dir.mkdir(parents=True, exist_ok=True)
    k, total = steps_before, steps_before + steps_after
    env = {pf.PROOF_ENV: str(proof_dir.resolve()), pf.SAVE_AT_ENV: str(k),
           pf.STOP_AT_ENV: str(total)}
    base = dict(steps_before=k, steps_after=steps_after, trainer=trainer,
                device={"kind": "the script's own"},
                deterministic=Determinism(requested=False, held=False))
    for role in ("reference", "resumed"):
        (proof_dir / f"{role}.json").unlink(missing_ok=True)
    say(f"reference: {' '.join(cmd)} ({total} steps, a checkpoint after step {k})")
    failed = _run(cmd, {**env, pf.ROLE_ENV: "reference"}, run, "reference")
    if failed:
        return _failed(run, base, "reference_run", failed)
    ref_file = proof_dir / "reference.json"
    if not ref_file.is_file():
        return _failed(run, base, "callback", "the script ran without TunepilotCallback: add "
                       f"callbacks=[TunepilotCallback()] (tunepilot.integrations.{trainer}) to "
                       "its Trainer")
    ref = read_message(CallbackProof, ref_file)
    if not ref.checkpoint or len(ref.steps) < total:
        return _failed(run, base, "reference_run", f"the reference ran {len(ref.steps)} "
                       f"steps and saved {'no checkpoint' if not ref.checkpoint else ''}"
                       f" - it needs max_steps >= {total}")
    ck = Path(ref.checkpoint)
    problems = _checkpoint_checks(ck) if trainer == "hf" else _lightning_checks(ck)
    say(f"resumed: a fresh process from {ck.name}")
    failed = _run(cmd, {**env, pf.ROLE_ENV: "resumed", pf.PROOF_CHECKPOINT_ENV: str(ck)}, run,
                  "resumed")
    if failed:
        return _failed(run, base, "fresh_process", failed, problems)
    got = read_message(CallbackProof, proof_dir / "resumed.json")
    return _verdict(run, base, ref, got, ck, problems, k, trainer)


def _run(cmd: list[str], env: dict[str, str], run, role: str) -> str | None:
    """Run the script; None when it exited 0, else why (with its log's last line)."""
    log = run.logs_dir() / f"trainer-restore-{role}.log"
    from tunepilot.proc.spawn import run_to_end

    try:
        with open(log, "wb") as f:  # the script and what it starts die with tunepilot
            rc, timed_out = run_to_end(cmd, timeout_s=RUN_TIMEOUT_S, env={**os.environ, **env},
                                       stdout=f, stderr=subprocess.STDOUT, reaper=True)
    except OSError as exc:  # not found, not executable
        raise UserError("CMD", f"{cmd[0]!r} cannot be run ({exc.strerror or exc}).",
                        "Check the command after -- (e.g. python train.py).") from None
    if timed_out:
        return f"the {role} run took over {RUN_TIMEOUT_S} s"
    if rc:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"the {role} run exited with code {rc}: {tail[0][:300]} (see {log})"
    return None


def _checkpoint_checks(ck: Path) -> list[ComponentCheck]:
    from tunepilot.checkpoint.hf import hf_layout

    files, problems = hf_layout(ck)
    checks = [ComponentCheck(name=c, passed=False, rank=r, detail=f"{f or c}: {msg}")
              for c, f, msg, r in problems]
    if not checks:
        n = sum(len(v) for v in files.values())
        checks.append(ComponentCheck(name=cmp.CHECKSUMS, passed=True, detail=f"{ck.name}: "
                                     f"weights, optimizer, scheduler, RNG ({len(files['rng'])}"
                                     f" file(s)) and trainer state present ({n} files)"))
    return checks


def _files(ck: Path) -> list[Path]:
    return [ck] if ck.is_file() else [p for p in ck.rglob("*") if p.is_file()]


def _lightning_checks(ck: Path) -> list[ComponentCheck]:
    """What a Lightning .ckpt holds for a resume: model, optimizer, schedulers, the loops'
    progress and the dataloaders' state (only a stateful loader has one: without it a
    mid-epoch resume re-reads the epoch from its start)."""
    import pickle

    import torch

    try:
        try:
            body = torch.load(ck, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # hyper-parameters of arbitrary types
            body = torch.load(ck, map_location="cpu", weights_only=False)
    except Exception as exc:  # a checkpoint that does not load is the finding
        return [ComponentCheck(name=cmp.CHECKSUMS, passed=False,
                               detail=f"{ck.name} does not load: {exc}")]
    missing = [k for k in ("state_dict", "optimizer_states", "loops") if not body.get(k)]
    fit = (body.get("loops") or {}).get("fit_loop") or {}
    loaders = (fit.get("state_dict") or {}).get("combined_loader")
    note = "" if loaders else (
        "; no dataloader state (a plain DataLoader): a mid-epoch resume re-reads the epoch "
        "from its start unless the loader is stateful (torchdata's StatefulDataLoader)")
    return [ComponentCheck(name=cmp.CHECKSUMS, passed=not missing, detail=(
        f"{ck.name}: " + (f"missing {', '.join(missing)}" if missing else
                          "model, optimizer, schedulers and loop progress present") + note))]


def _records(body: CallbackProof, first: int) -> list[StepRecord]:
    return [StepRecord(step=s.step, loss=s.loss or 0.0, loss_bits=s.loss_bits or "",
                       lr=s.lr or 0.0, lr_bits=s.lr_bits or "", fingerprints=s.fingerprints)
            for s in body.steps if s.step > first]


def _verdict(run, base: dict, ref: CallbackProof, got: CallbackProof, ck: Path, problems: list[ComponentCheck],
             k: int, trainer: str = "hf") -> RestoreResult:
    checks = list(problems)
    if got.first_step != k + 1:
        how = ("trainer.train(resume_from_checkpoint=resume_from())" if trainer == "hf" else
               "trainer.fit(..., ckpt_path=resume_from())")
        checks.append(ComponentCheck(name=cmp.PROGRESS, passed=False, detail=(
            f"the fresh process started at step {got.first_step}, not {k + 1}: pass "
            f"{how}")))
    else:
        checks.append(ComponentCheck(name=cmp.PROGRESS, passed=True,
                                     detail=f"resumed at step {k + 1}"))
    a = _records(ref, k)
    b = [r for r in _records(got, k)]
    traj, divergence, max_diff = cmp.compare_steps(a, b, None)
    by = {c.name: c for c in traj}
    if not by[cmp.BATCHES].passed:
        checks.append(ComponentCheck(name=cmp.DATA, passed=False, detail=(
            f"{by[cmp.BATCHES].detail}: the data position was not restored (the resumed run "
            "trained on other samples - e.g. ignore_data_skip=True, or a sampler or iterable "
            "dataset that does not skip what was consumed)")))
    else:
        checks.append(ComponentCheck(name=cmp.DATA, passed=True,
                                     detail="every continued step trained on the same batches"))
    if not by[cmp.LR].passed:
        checks.append(ComponentCheck(name=cmp.SCHEDULER, passed=False, detail=(
            f"{by[cmp.LR].detail}: the LR schedule was not restored (scheduler.pt)")))
    else:
        checks.append(ComponentCheck(name=cmp.SCHEDULER, passed=True,
                                     detail="every continued step had the same LR (bits)"))
    loss = by[cmp.LOSS]
    if not loss.passed and by[cmp.BATCHES].passed and by[cmp.LR].passed:
        loss = ComponentCheck(name=cmp.LOSS, passed=False, detail=(
            f"{loss.detail}: same batches and LR, another loss - the RNG streams (dropout) or "
            "the optimizer state were not restored"))
    checks.append(loss)
    result = RestoreResult(
        passed=all(c.passed for c in checks), components=checks, first_divergence=divergence,
        checkpoint=CheckpointRef(path=str(ck), kind=f"{trainer}-trainer",
                                 files=len(_files(ck)), step=k),
        checkpoint_bytes=Figure.measured(sum(p.stat().st_size for p in _files(ck)), "bytes"),
        loss_max_abs_diff=Figure.measured(max_diff, "nats/token"),
        save_s=(Figure.measured(ref.save_s, "s", what="the trainer's own checkpoint save, "
                                "in the reference run") if ref.save_s is not None else
                Figure.missing("s", "the save was not timed")),
        load_s=Figure.missing("s", "the trainer loads it inside the script (not timed "
                              "apart from its start-up)"),
        steps=Trajectories(original=a, restored=b), tolerance="bit-exact (same machine)",
        **base)
    run.write(result)
    return result


def _failed(run, base: dict, component: str, detail: str,
            extra: list[ComponentCheck] | None = None) -> RestoreResult:
    result = RestoreResult(passed=False, components=[
        ComponentCheck(name=component, passed=False, detail=detail), *(extra or [])], **base)
    run.write(result)
    return result
