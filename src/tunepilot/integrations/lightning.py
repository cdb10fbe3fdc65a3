"""Pilot the user's own Lightning run.

    from tunepilot.integrations.lightning import TunepilotCallback
    trainer = L.Trainer(..., callbacks=[TunepilotCallback(out_dir="runs/my-run")])

Records what the HF callback records (integrations/hf.py), from Lightning's hooks: an optimizer
step is ``accumulate_grad_batches`` training batches; the data wait is the time before each
batch's ``on_train_batch_start``; tokens are read from the batch (a dict with input_ids / labels
/ attention_mask, or a tuple whose first tensor is the ids and second the labels); validation is
timed from ``on_validation_start`` to ``on_validation_end``. The spec is derived from the
transformers model inside the LightningModule, or given as ``spec=PATH``.
"""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from tunepilot.integrations.recorder import Recorder, default_out_dir, guarded, process_age_s
from tunepilot.restore.callbacks import PROOF_CHECKPOINT_ENV, PROOF_ENV, ProofRecorder

__all__ = ["TunepilotCallback", "resume_from"]

_PRECISION = {"bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed", "bf16-true": "bf16-true",
              "bf16": "bf16-mixed", "16": "fp16-mixed", "transformer-engine": "fp8-te",
              "transformer-engine-float16": "fp8-te"}


def _lightning_flag(trainer) -> str:
    """Lightning's own precision flag (a string of Lightning's, not a tunepilot precision):
    _PRECISION translates it, as an importer translates a trainer config's keys."""
    return str(trainer.precision)


_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Adafactor": "adafactor",
               "AdamW8bit": "adamw_8bit", "PagedAdamW": "paged_adamw",
               "PagedAdamW8bit": "paged_adamw_8bit"}


class TunepilotCallback(Callback):
    """Records the user's own Lightning steps; writes a tunepilot run directory at the end."""

    def __init__(self, out_dir: str | Path | None = None, *, warmup_steps: int = 2,
                 name: str | None = None, spec: str | Path | None = None):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.name, self.spec_path = name, Path(spec) if spec else None
        self.recorder = Recorder(None, source="lightning-callback", trainer="lightning.Trainer",
                                 warmup_steps=warmup_steps)
        self.disabled = False
        self._startup_s = None
        self._batch_end = 0.0
        self._val_start = None
        self._micro_batch = 0
        self._losses: list[float] = []
        self.proof = ProofRecorder.from_env()

    @guarded
    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank != 0:
            self.recorder.disabled = True
            return
        name = self.name or type(pl_module).__name__.lower()
        self.recorder.out_dir = self.out_dir or default_out_dir(name)
        if self.proof is not None:
            from tunepilot.integrations.derive import find_hf_model

            self.recorder.out_dir = self.proof.dir / self.proof.role
            self.proof.attach(find_hf_model(pl_module) or pl_module)
        self._startup_s = process_age_s()
        self.recorder.start()
        self._batch_end = time.perf_counter()

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        accum = max(1, int(trainer.accumulate_grad_batches))
        if batch_idx % accum == 0:
            self.recorder.begin_step()
        else:
            self.recorder.add_wait(time.perf_counter() - self._batch_end)
        ids, labels, mask = _tensors(batch)
        if ids is not None:
            self._micro_batch = max(self._micro_batch, int(ids.shape[0]))
        self.recorder.add_batch(ids, labels, mask)

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accum = max(1, int(trainer.accumulate_grad_batches))
        if (batch_idx + 1) % accum == 0:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            loss = loss * accum if hasattr(loss, "item") else loss  # Lightning divides by accum
            self.recorder.end_step()
            if self.proof is not None:
                self.proof.lightning_step_end(trainer)
            if hasattr(loss, "item") and len(self.recorder.steps) % 10 == 1:
                self._losses.append(float(loss.detach().float().item()))
        self._batch_end = time.perf_counter()

    @guarded
    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    @guarded
    def on_validation_end(self, trainer, pl_module):
        if self._val_start is not None and self.recorder.started:
            self.recorder.evaluation(time.perf_counter() - self._val_start)
            self._batch_end = time.perf_counter()
        self._val_start = None

    @guarded
    def on_train_end(self, trainer, pl_module):
        from tunepilot.integrations.derive import derive_spec, find_hf_model, provenance_model

        if self.proof is not None:
            self.proof.write()
        rec = self.recorder
        seq = max((x.sequence_length for x in rec.steps + rec.warmup), default=0) or 1
        accum = max(1, int(trainer.accumulate_grad_batches))
        if self.spec_path is not None:
            from tunepilot.model.arch import resolve_arch
            from tunepilot.spec import load_spec

            spec = load_spec(self.spec_path)
            arch, model_info = resolve_arch(spec, self.spec_path.parent), {}
        else:
            model = find_hf_model(pl_module)
            if model is None:
                raise ValueError("no transformers model in the LightningModule: pass "
                                 "TunepilotCallback(spec='my-spec.yaml')")
            opt = trainer.optimizers[0] if trainer.optimizers else None
            spec, arch, notes = derive_spec(
                model, rec.out_dir, micro_batch_size=self._micro_batch or 1,
                accumulation=accum, sequence_length=seq,
                precision=_PRECISION.get(_lightning_flag(trainer), "fp32"),
                optimizer=_OPTIMIZERS.get(type(opt).__name__, "adamw") if opt else None,
                lr=opt.param_groups[0].get("lr") if opt else None,
                world_size=max(1, int(trainer.world_size)), name=self.name or rec.out_dir.name,
                max_steps=int(trainer.max_steps) if (trainer.max_steps or 0) > 0 else None)
            rec.notes.extend(notes)
            model_info = provenance_model(model)
        self.result = rec.finish(spec, arch, provenance_model=model_info,
                                 startup_s=self._startup_s, losses=self._losses)


def resume_from(ckpt_path: str | Path | None = None) -> str | None:
    """What to pass to ``trainer.fit(..., ckpt_path=...)``: ``ckpt_path`` as given (None: start
    fresh; Lightning also takes "last"); under `tunepilot restore --trainer lightning` the
    checkpoint the proof resumes from (and None for the reference run)."""
    import os

    if os.environ.get(PROOF_ENV):
        return os.environ.get(PROOF_CHECKPOINT_ENV) or None
    return None if ckpt_path is None else str(ckpt_path)


def _tensors(batch):
    """(input_ids, labels, attention_mask) of a batch, whichever of them it has."""
    if isinstance(batch, dict):
        return batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
    if isinstance(batch, list | tuple):
        ts = [b for b in batch if hasattr(b, "shape")]
        return (ts[0] if ts else None), (ts[1] if len(ts) > 1 else None), None
    return (batch if hasattr(batch, "shape") else None), None, None
