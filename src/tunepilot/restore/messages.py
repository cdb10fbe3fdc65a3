"""What crosses the restore proof's process boundaries, typed: the fresh process's job, what
each process of a proof reports (the original, the fresh process, a rank of the sharded proof)
and what the callbacks record in the user's own trainer (ROLE.json). The verdict builders read
these, never a dict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tunepilot.proc.messages import Message as _Message
from tunepilot.results.restore import StepRecord


class DeterminismReport(_Message):
    requested: bool = True
    held: bool = True
    nondeterministic_ops: list[str] = Field(default_factory=list)
    strict: bool = False
    """deterministic algorithms forced (not warn-only)"""


class FreshJob(_Message):
    """The fresh process of the single-process proof: load the checkpoint, train M steps."""

    spec: dict[str, Any]
    spec_hash: str
    base_dir: str | None = None
    device: str
    threads: int
    total_steps: int
    steps_after: int
    checkpoint: str
    hook: str | None = None
    strict_determinism: bool = False
    """deterministic algorithms forced (restore/worker.strict_default), as the original ran"""


class ShardedJob(_Message):
    """One launch of the sharded proof: every rank trains (original) or loads and trains."""

    spec: dict[str, Any]
    role: Literal["original", "resumed"]
    strategy: str
    device: str
    threads: int = 1
    steps_before: int
    steps_after: int
    accumulation: int
    checkpoint: str
    out: str
    base_dir: str | None = None


class ProcessReport(_Message):
    """What one process of a proof reports: the state it holds (digests), the checkpoint it
    saved or loaded, the steps it trained - or why it could not (error, crashed)."""

    rank: int | None = None
    world_size: int | None = None
    spec: dict[str, Any] | None = None
    spec_hash: str | None = None
    base_dir: str | None = None
    device: str | None = None
    device_info: dict[str, Any] | None = None
    threads: int | None = None
    total_steps: int | None = None
    steps_before: int | None = None
    steps_after: int | None = None
    checkpoint: str | None = None
    save: dict[str, Any] | None = None
    """CheckpointInfo as JSON (the original)"""
    load: dict[str, Any] | None = None
    """CheckpointInfo as JSON (the fresh process)"""
    digest: dict[str, Any] | None = None
    """a hash per tensor and per piece of state (restore/worker.py state_digest)"""
    steps: list[StepRecord] = Field(default_factory=list)
    deterministic: DeterminismReport | None = None
    global_losses: list[float] | None = None
    global_useful_tokens: list[int] | None = None
    error: dict[str, Any] | None = None
    crashed: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.crashed is not None

    @property
    def load_s(self) -> float | None:
        return (self.load or {}).get("seconds")


class CallbackStep(_Message):
    step: int
    loss: float | None = None
    loss_bits: str | None = None
    lr: float | None = None
    lr_bits: str | None = None
    fingerprints: list[str] = Field(default_factory=list)


class CallbackProof(_Message):
    """ROLE.json: what the callback recorded in one run of the user's trainer under the proof."""

    role: Literal["reference", "resumed"]
    save_at: int
    stop_at: int
    first_step: int | None = None
    checkpoint: str | None = None
    save_s: float | None = None
    steps: list[CallbackStep] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
