"""restore.json: the verdict of a restore proof, component by component (docs/restore.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure, missing


class ComponentCheck(Model):
    name: str
    passed: bool
    detail: str
    rank: int | None = None
    """the rank this check is about (sharded proofs); None: the whole checkpoint"""


class StepRecord(Model):
    """One optimizer step as a resumed run must reproduce it."""

    step: int
    loss: float
    loss_bits: str
    """float.hex of the loss: exact (the fp32 loss is held exactly in a Python float)"""
    lr: float
    lr_bits: str
    fingerprints: list[str] = Field(default_factory=list)
    useful_tokens: int = 0
    grad_norm: float | None = None


class CheckpointRef(Model):
    path: str
    kind: str
    files: int
    step: int
    world_size: int = 1


class Determinism(Model):
    requested: bool = True
    held: bool = True
    nondeterministic_ops: list[str] = Field(default_factory=list)
    strict: bool = False
    """deterministic algorithms forced (a GPU): ops without a deterministic kernel raise"""


class Trajectories(Model):
    original: list[StepRecord] = Field(default_factory=list)
    restored: list[StepRecord] = Field(default_factory=list)


class RestoreResult(StageResult):
    """A checkpoint counts only if a fresh process resumes the run exactly."""

    STAGE = "restore"
    passed: bool
    failed_components: list[str] = Field(default_factory=list)
    components: list[ComponentCheck]
    first_divergence: dict[str, Any] | None = None
    save_s: Figure = Field(default_factory=missing("s"))
    load_s: Figure = Field(default_factory=missing("s", "the fresh process did not load it"))
    checkpoint_bytes: Figure = Field(default_factory=missing("bytes"))
    save_bytes_per_s: Figure = Field(default_factory=missing("B/s"))
    load_bytes_per_s: Figure = Field(default_factory=missing("B/s"))
    async_save_unblock_s: Figure | None = None
    steps_before: int
    steps_after: int
    checkpoint: CheckpointRef | None = None
    device: dict[str, Any] = Field(default_factory=dict)
    deterministic: Determinism = Field(default_factory=Determinism)
    loss_max_abs_diff: Figure = Field(default_factory=missing("nats/token", "no restored steps"))
    steps: Trajectories = Field(default_factory=Trajectories)
    trainer: str = "tunepilot"
    """whose loop was proven: tunepilot's own step, or the user's (hf, lightning)"""
    nproc: int = 1
    resume_nproc: int | None = None
    """ranks that loaded the checkpoint when they differ from the ranks that saved it"""
    tolerance: str | None = None
    hook: str | None = None
    """a test-support hook that altered the run on purpose (tests only)"""
    notes: list[str] = Field(default_factory=list)
    """what the proof could not check for this spec (an FP8 run's bf16 stand-in)"""

    @model_validator(mode="after")
    def _failed(self) -> RestoreResult:
        names = list(dict.fromkeys(c.name for c in self.components if not c.passed))
        object.__setattr__(self, "failed_components", names)
        return self

    @property
    def failed(self) -> list[ComponentCheck]:
        return [c for c in self.components if not c.passed]

    def failure_message(self) -> str:
        """One line: which components failed and why (the first is the cause)."""
        failed = self.failed
        parts = [f"{c.name}{'' if c.rank is None else f' on rank {c.rank}'} ({c.detail})"
                 for c in failed[:3]]
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        return "restore proof failed: " + "; ".join(parts) + more
