"""The callbacks' side of `tunepilot restore --trainer hf|lightning -- CMD` (restore/trainer.py).

tunepilot runs the user's script twice with these variables set:
    TUNEPILOT_RESTORE_PROOF       the proof directory
    TUNEPILOT_RESTORE_ROLE        reference | resumed
    TUNEPILOT_RESTORE_SAVE_AT     K: the reference saves a checkpoint after step K
    TUNEPILOT_RESTORE_STOP_AT     K + M: both runs stop after this step
    TUNEPILOT_RESTORE_CHECKPOINT  the resumed run: what resume_from() returns
The recorder records, per optimizer step, exactly what a resumed run must reproduce: the
SHA-256 of every micro-batch's input_ids and labels (forward pre-hook), the sum of the model's
losses (forward hook, float.hex), and the LR after the step; the reference copies checkpoint-K
aside (the user's save_total_limit may rotate it away). It writes PROOF/ROLE.json at the end.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

PROOF_ENV = "TUNEPILOT_RESTORE_PROOF"
ROLE_ENV = "TUNEPILOT_RESTORE_ROLE"
SAVE_AT_ENV = "TUNEPILOT_RESTORE_SAVE_AT"
STOP_AT_ENV = "TUNEPILOT_RESTORE_STOP_AT"
PROOF_CHECKPOINT_ENV = "TUNEPILOT_RESTORE_CHECKPOINT"


class ProofRecorder:
    def __init__(self, directory: Path, role: str, save_at: int, stop_at: int):
        self.dir, self.role, self.save_at, self.stop_at = directory, role, save_at, stop_at
        self.steps: list[dict] = []
        self._fingerprints: list[str] = []
        self._losses: list = []
        self.checkpoint: str | None = None
        self.first_step: int | None = None
        self.notes: list[str] = []
        self.save_s: float | None = None

    @classmethod
    def from_env(cls) -> ProofRecorder | None:
        d = os.environ.get(PROOF_ENV)
        if not d:
            return None
        return cls(Path(d), os.environ.get(ROLE_ENV, "reference"),
                   int(os.environ.get(SAVE_AT_ENV, "0")), int(os.environ.get(STOP_AT_ENV, "0")))

    def attach(self, model) -> None:
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        model.register_forward_hook(self._outputs)

    def _inputs(self, module, args, kwargs):
        if not module.training:
            return None
        h = hashlib.sha256()
        for key in ("input_ids", "labels"):
            t = kwargs.get(key, args[0] if key == "input_ids" and args else None)
            if t is not None:
                t = t.detach().to("cpu").contiguous()
                h.update(f"{key}{tuple(t.shape)}".encode())
                h.update(t.numpy().tobytes())
        self._fingerprints.append(h.hexdigest()[:16])
        return None

    def _outputs(self, module, args, output):
        if not module.training:
            return None
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None:
            self._losses.append(loss.detach())
        return None

    def record(self, step: int, lr: float | None) -> tuple[bool, bool]:
        """The optimizer step just done; (save a checkpoint now, stop now)."""
        if self.first_step is None:
            self.first_step = step
        loss = float(sum(x.float() for x in self._losses).item()) if self._losses else None
        self.steps.append({"step": step, "loss": loss,
                           "loss_bits": float(loss).hex() if loss is not None else None,
                           "lr": lr, "lr_bits": float(lr).hex() if lr is not None else None,
                           "fingerprints": list(self._fingerprints)})
        self._fingerprints, self._losses = [], []
        return (self.role == "reference" and step == self.save_at,
                bool(self.stop_at and step >= self.stop_at))

    def step_end(self, state, control, optimizer) -> None:
        """transformers.Trainer: record, and steer the Trainer with its control object."""
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
        save, stop = self.record(int(state.global_step), lr)
        if save:
            control.should_save = True
        if stop:
            control.should_training_stop = True

    def lightning_step_end(self, trainer) -> None:
        """Lightning: record; save the reference's checkpoint with trainer.save_checkpoint
        (as ModelCheckpoint does from the same hook), stop with trainer.should_stop."""
        opt = trainer.optimizers[0] if trainer.optimizers else None
        lr = float(opt.param_groups[0]["lr"]) if opt is not None else None
        save, stop = self.record(int(trainer.global_step), lr)
        if save:
            self.dir.mkdir(parents=True, exist_ok=True)
            dst = self.dir / f"checkpoint-{self.save_at}.ckpt"
            t0 = time.perf_counter()
            trainer.save_checkpoint(dst)
            self.save_s = time.perf_counter() - t0
            self.checkpoint = str(dst)
        if stop:
            trainer.should_stop = True

    def saved(self, checkpoint: Path, state, seconds: float | None = None) -> None:
        if self.role != "reference" or int(state.global_step) != self.save_at:
            return
        self.save_s = seconds
        dst = self.dir / f"checkpoint-{self.save_at}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(checkpoint, dst)
        self.checkpoint = str(dst)

    def write(self) -> None:
        from tunepilot.proc.child import write_message
        from tunepilot.restore.messages import CallbackProof

        write_message(self.dir / f"{self.role}.json", CallbackProof(
            role=self.role, save_at=self.save_at, stop_at=self.stop_at,
            first_step=self.first_step, checkpoint=self.checkpoint, save_s=self.save_s,
            steps=self.steps, notes=self.notes))
