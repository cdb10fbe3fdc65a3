"""What crosses the traced plan's process boundary, typed: the job (spec, model config, stack)
and the trace's result (phases of step 2, the model's parameters, the peaks, the attention path).
The child writes it, the parent validates it once (child.read_message's rule); a result another
version wrote fails as one stated reason and the plan falls back to the analytic one."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tunepilot.proc.messages import Message as _Message


class TraceJob(_Message):
    spec: dict[str, Any]
    config: dict[str, Any]
    stack: str
    rank_step: bool = False  # also replay without the optimizer steps (DeepSpeed's rank)


class TracedPhase(_Message):
    """One phase's peak (a window of the tracker), bytes by component."""

    name: str
    peak_bytes: int
    peak_raw_bytes: int
    saved_bytes: int = 0
    weight_cast_bytes: int = 0
    weight_cast_activations_bytes: int = 0
    labelled_bytes: dict[str, int] = Field(default_factory=dict)  # unsharded, all-gather, ...
    # by component, the instant the most bytes other than gradients were live (tracker.Peak)
    sans_grad_bytes: dict[str, int] = Field(default_factory=dict)
    weights_bytes: int = 0
    master_weights_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    temporary_bytes: int = 0


class TracedAllocator(_Message):
    """The traced allocations replayed through the CUDA caching allocator's rules
    (plan/reserve/allocator.py): the peak of reserved segments, bytes."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    training_reserved_peak_bytes: int  # without the validation pass
    training_allocated_peak_bytes: int
    expandable_reserved_peak_bytes: int  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    num_segments: int
    num_allocations: int
    reserved_by_stream: dict[str, int] = Field(default_factory=dict)
    # the same replay without the single device's optimizer steps (a DeepSpeed rank's view):
    # reserved_peak_bytes, allocated_peak_bytes, expandable_reserved_peak_bytes; empty if none
    rank_step: dict[str, int] = Field(default_factory=dict)


class TracedModel(_Message):
    """The traced model's parameters: counts, trainable bytes, one row per parameter (its first
    dimension, its bytes, whether it trains), the decoder layer's size."""

    total_params: int
    trainable_params: int
    trainable_bytes: int
    param_rows: list[tuple[int, int, bool]]
    layer_numel: int
    root_numel: int
    total_base_numel: int
    buffer_bytes: int = 0  # buffers (FSDP keeps them whole on the device: QLoRA's absmax)


class TraceResult(_Message):
    """Two optimizer steps traced; the peaks of step 2 by phase, and how they were found."""

    phases: list[TracedPhase]
    peak_bytes: int
    peak_raw_bytes: int
    saved_bytes_at_peak: int
    step1_peak_bytes: int
    micro_batch_peaks_bytes: list[int] = Field(default_factory=list)
    accumulation_peak_stable: bool = True
    accumulation_growth_bytes_per_micro_batch: int = 0
    attention_path: str
    attention_kernel: str
    optimizer_impl: str
    num_ops: int
    notes: list[str] = Field(default_factory=list)
    model: TracedModel
    allocator: TracedAllocator | None = None
    world_size: int = 1  # the ranks the step was traced as one of (FSDP: a fake process group)
    strategy: str = "single"
    fsdp_version: int | None = None  # FSDP traced per rank: 1 or 2
    child_wall_s: float
    child_peak_rss_bytes: int
    traced_on: str
    cuda_max_memory_allocated_bytes: int | None = None
    cuda_max_memory_reserved_bytes: int | None = None

    def facts(self) -> dict[str, Any]:
        """What the plan's ``trace`` block keeps of the result."""
        return self.model_dump(include={
            "attention_path", "attention_kernel", "optimizer_impl", "step1_peak_bytes",
            "micro_batch_peaks_bytes", "accumulation_peak_stable", "peak_raw_bytes", "num_ops",
            "child_wall_s", "child_peak_rss_bytes", "saved_bytes_at_peak", "traced_on",
            "allocator", "world_size", "fsdp_version"}, exclude={"allocator": {"version"}})
