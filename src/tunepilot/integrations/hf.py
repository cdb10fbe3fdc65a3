"""Pilot the user's own Hugging Face Trainer (and TRL, axolotl: both run a Trainer) run.

    from tunepilot.integrations.hf import TunepilotCallback
    trainer = Trainer(..., callbacks=[TunepilotCallback(out_dir="runs/my-run")])

At the end of training the run directory holds pilot.json + manifest.json (as `tunepilot pilot`
writes them) and spec.yaml (the spec derived from the model and the TrainingArguments), so

    tunepilot quote runs/my-run/spec.yaml --from runs/my-run --card h100-sxm-80gb --hours 24
    tunepilot report --from runs/my-run

work on it. What it records: each optimizer step's wall time (device-synchronised at the step's
end), the data wait before it, the padded and useful (labels != -100) tokens of its micro-batches
(read by a forward pre-hook on the model, summed on the device, read once per step), the allocator
peaks and the device-wide peak (NVML/amdsmi; RSS on CPU), each evaluation's and each save's time
and the checkpoint's bytes. Any internal error becomes one warning; the user's run goes on.

``resume_from(run_dir_or_checkpoint)`` is the checkpoint to pass to
``trainer.train(resume_from_checkpoint=...)``: the newest complete ``checkpoint-N`` (one that
`tunepilot verify` would pass), or None to start fresh.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from tunepilot.integrations.recorder import (
    Recorder,
    default_out_dir,
    dir_bytes,
    guarded,
    process_age_s,
)
from tunepilot.restore.callbacks import PROOF_CHECKPOINT_ENV, PROOF_ENV, ProofRecorder

__all__ = ["TunepilotCallback", "resume_from"]


class TunepilotCallback(TrainerCallback):
    """Records the user's own Trainer steps; writes a tunepilot run directory at the end."""

    def __init__(self, out_dir: str | Path | None = None, *, warmup_steps: int = 2,
                 name: str | None = None):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.name = name
        self.recorder = Recorder(None, source="hf-callback", trainer="transformers.Trainer",
                                 warmup_steps=warmup_steps)
        self.disabled = False
        self._hook = None
        self._model = None
        self._startup_s: float | None = None
        self._last_event = 0.0
        self._losses: list[float] = []
        self.result = None
        self.proof = ProofRecorder.from_env()

    # --- Trainer events --------------------------------------------------------------------
    @guarded
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            self.recorder.disabled = True
            return
        self.recorder.out_dir = self.out_dir or default_out_dir(_run_name(args, self.name))
        if self.proof is not None:
            self.recorder.out_dir = self.proof.dir / self.proof.role
        self._model = model
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
            self._generate = wrap_generate(model, self.recorder)
            if self.proof is not None:
                self.proof.attach(model)
        self._startup_s = process_age_s()
        self.recorder.start()
        self._last_event = time.perf_counter()

    def _count(self, module, args, kwargs):
        import torch

        # a forward without gradient is no trained token: TRL's reference forward, GRPO's
        # generation and its old/reference log-probs (the training forward has gradients)
        if getattr(self.recorder, "disabled", False) or not module.training or \
                not torch.is_grad_enabled():
            return None
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.recorder.add_batch(ids, kwargs.get("labels"), kwargs.get("attention_mask"))
        except Exception as exc:  # never break the forward
            self._off(exc, "counting tokens")
        return None

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.begin_step()

    @guarded
    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.recorder.end_step()
        if self.proof is not None:
            self.proof.step_end(state, control, optimizer)
        self._last_event = time.perf_counter()

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and isinstance(logs.get("loss"), int | float):
            self._losses.append(float(logs["loss"]))
        self.recorder.other_work_done()
        self._last_event = time.perf_counter()

    @guarded
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        runtime = (metrics or {}).get("eval_runtime")
        secs = float(runtime) if isinstance(runtime, int | float) else \
            time.perf_counter() - self._last_event
        self.recorder.evaluation(secs)
        self._last_event = time.perf_counter()

    @guarded
    def on_save(self, args, state, control, **kwargs):
        secs = time.perf_counter() - self._last_event
        ck = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.recorder.checkpoint(secs, dir_bytes(ck) if ck.is_dir() else 0)
        if ck.is_dir():  # SHA-256 of every file, so `tunepilot verify` can call it intact
            from tunepilot.checkpoint.hf import write_hf_manifest
            write_hf_manifest(ck, state.global_step, world_size=int(args.world_size or 1))
        if self.proof is not None:
            self.proof.saved(ck, state, secs)
        self._last_event = time.perf_counter()

    @guarded
    def on_train_end(self, args, state, control, model=None, **kwargs):
        from tunepilot.integrations.derive import derive_spec, provenance_model

        self._remove_hook()
        if self.proof is not None:
            self.proof.write()
        rec = self.recorder
        model = model or self._model
        seq = max((x.sequence_length for x in rec.steps + rec.warmup), default=0) or 1
        objective = objective_of(args, seq, rec.notes)
        spec, arch, notes = derive_spec(
            model, rec.out_dir, micro_batch_size=args.per_device_train_batch_size,
            accumulation=args.gradient_accumulation_steps, sequence_length=seq,
            bf16=bool(args.bf16), fp16=bool(args.fp16), optim=_optim_name(args),
            lr=args.learning_rate, gradient_checkpointing=bool(args.gradient_checkpointing),
            world_size=max(1, int(getattr(args, "world_size", 1) or 1)),
            name=self.name or rec.out_dir.name, max_steps=int(state.max_steps or 0),
            eval_every_steps=_every(args, "eval"), save_every_steps=_every(args, "save"),
            objective=objective)
        rec.notes.extend(notes)
        self.result = rec.finish(spec, arch, provenance_model=provenance_model(model),
                                 startup_s=self._startup_s, losses=self._losses)

    # --- helpers ---------------------------------------------------------------------------
    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if getattr(self, "_generate", None) is not None and self._model is not None:
            self._model.__dict__.pop("generate", None)  # the class's generate again
            self._generate = None

    def _off(self, exc: Exception, what: str) -> None:
        import warnings

        self.recorder.disabled = True
        self._remove_hook()
        warnings.warn(f"tunepilot: {what} failed ({type(exc).__name__}: {exc}); tunepilot "
                      "stops recording, your run goes on.", RuntimeWarning, stacklevel=2)


def wrap_generate(model, recorder):
    """Time the model's generate (TRL's GRPO/RLOO without vLLM) as the step's generation phase:
    seconds (synchronised on a GPU) and the tokens generated. Returns the original method."""
    import functools

    original = model.generate

    @functools.wraps(original)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            seqs = getattr(out, "sequences", out)
            if seqs.is_cuda:
                import torch

                torch.cuda.synchronize()
            new = (seqs.shape[-1] - ids.shape[-1]) * seqs.shape[0] if ids is not None else 0
            recorder.generation(time.perf_counter() - t0, int(new))
        except Exception:  # never break the user's generation
            pass
        return out

    model.generate = timed
    return original


# TRL's trainer configs -> the objective they train (the config's class names it)
_TRL_KINDS = {"DPOConfig": "dpo", "ORPOConfig": "orpo", "CPOConfig": "cpo", "KTOConfig": "kto",
              "GRPOConfig": "grpo", "RLOOConfig": "rloo"}


def objective_of(args, sequence_length: int, notes: list[str]) -> dict | None:
    """The spec's objective of a TRL trainer's config (None: SFT / a plain Trainer)."""
    kind = _TRL_KINDS.get(type(args).__name__)
    if kind is None:
        if type(args).__name__ == "RewardConfig":
            notes.append("TRL's RewardTrainer: recorded as the model's own task (the spec is "
                         "derived from the model)")
        return None
    o: dict = {"kind": kind}
    beta = getattr(args, "beta", None)
    if isinstance(beta, int | float):
        o["beta"] = float(beta)
    loss = getattr(args, "loss_type", None)
    loss = loss[0] if isinstance(loss, list | tuple) and len(loss) == 1 else loss
    if isinstance(loss, str) and kind in ("dpo", "cpo", "grpo"):
        o["loss_type"] = loss
    if getattr(args, "precompute_ref_log_probs", False):
        o["reference"] = "precomputed"
    if kind in ("grpo", "rloo"):
        c = int(getattr(args, "max_completion_length", 512) or 512)
        o.update(num_generations=int(args.num_generations), max_completion_length=c,
                 max_prompt_length=max(1, sequence_length - c),
                 num_iterations=int(getattr(args, "num_iterations", 1) or 1))
        spg = getattr(args, "steps_per_generation", None)
        if spg:
            o["steps_per_generation"] = int(spg)
        if getattr(args, "use_vllm", False):
            mode = getattr(args, "vllm_mode", "colocate")
            o["generation"] = {"backend": f"vllm-{mode}"} if mode == "server" else {
                "backend": "vllm-colocate",
                "gpu_memory_utilization": float(args.vllm_gpu_memory_utilization)}
    return o


def _every(args, what: str) -> int | None:
    """eval_steps / save_steps when the trainer evaluates / saves by steps (else None)."""
    strategy = getattr(args, f"{what}_strategy", None)
    if str(getattr(strategy, "value", strategy)) != "steps":
        return None
    every = getattr(args, f"{what}_steps", None)
    if isinstance(every, float) and every < 1:  # a fraction of the run's steps
        return None
    return int(every) if every else None


def _optim_name(args) -> str:
    optim = getattr(args, "optim", "adamw_torch")
    return str(getattr(optim, "value", optim))


def _run_name(args, name: str | None) -> str:
    import re

    raw = name or getattr(args, "run_name", None) or Path(str(args.output_dir)).name or "run"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(raw)).strip("-") or "run"


def resume_from(path: str | Path | None = None) -> str | None:
    """The newest ``checkpoint-N`` under ``path`` (a Trainer output_dir, or a checkpoint itself)
    that holds everything a resume needs (weights, optimizer, scheduler, RNG, trainer state);
    None when there is none (start fresh). An incomplete newer checkpoint is skipped, with a
    warning naming what it lacks. Under `tunepilot restore --trainer hf` it is the checkpoint
    the proof resumes from (and None for the reference run)."""
    import os
    import warnings

    from tunepilot.checkpoint.hf import hf_checkpoint_problems

    if os.environ.get(PROOF_ENV):
        return os.environ.get(PROOF_CHECKPOINT_ENV) or None
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        return None
    candidates = [p] if p.name.startswith("checkpoint-") else sorted(
        (c for c in p.glob("checkpoint-*") if c.is_dir() and c.name[11:].isdigit()),
        key=lambda c: int(c.name[11:]), reverse=True)
    for c in candidates:
        problems = hf_checkpoint_problems(c)
        if not problems:
            return str(c)
        warnings.warn(f"tunepilot: {c} is not resumable as is ({'; '.join(problems)}); "
                      "trying an older one.", RuntimeWarning, stacklevel=2)
    return None
