"""pilot.json: what a pilot measured on the local device (docs/pilot.md has every key).

Written by `tunepilot pilot`, by the HF / Lightning callbacks on the user's own loop and by
`tunepilot watch`; every block defaults to "not measured", so a producer that sees less (a
watched process sees no step times) still writes a valid result and says what it could not see.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure, missing

PILOT_SOURCES = ("tunepilot pilot", "hf-callback", "lightning-callback", "watch")


def _fig(unit: str, why: str = "not measured"):
    return Field(default_factory=missing(unit, why))


def _said(unit: str, description: str):
    """A figure field with its meaning (in the JSON schema too)."""
    return Field(default_factory=missing(unit), description=description)


class DoesNotFit(Model):
    micro_batch_size: int
    sequence_length: int
    phase: str
    simulated: bool
    error: str
    message: str
    live_tensor_bytes_at_oom: int | None = None
    device: str | None = None
    """which device ran out: 'the local CPU (...)' or 'cuda:0 (NVIDIA H200)'"""


class DeviceBlock(Model):
    kind: str = "unknown"
    name: str = "unknown"
    card_id: str | None = None
    count: int = 1
    memory: Figure = _fig("bytes")


class RunBlock(Model):
    label: str = ""
    method: str | None = None
    precision: str | None = None
    optimizer: str | None = None
    micro_batch_size: int | None = None
    sequence_length: int | None = None
    gradient_accumulation_steps: int | None = None
    activation_checkpointing: str | None = None
    tokens_per_optimizer_step: Figure = _fig("tokens")
    objective: str | None = None
    """what was trained: sft, dpo, grpo, ... (spec/objective.py)"""
    trainer: str | None = None
    """the loop that ran: tunepilot's own, or the user's (transformers.Trainer, Lightning, ...)"""


class LongestBatch(Model):
    micro_batch_size: int
    sequence_length: int
    useful_tokens: Figure
    padded_tokens: Figure
    rule: str


class DataBlock(Model):
    source: str = "unknown"
    num_samples: Figure = _fig("samples")
    truncated_samples: Figure = _fig("samples")
    longest_sample_tokens: Figure = _fig("tokens")
    path: str | None = None
    tokenizer: str | None = None
    notes: list[str] = Field(default_factory=list)
    longest_batch: LongestBatch | None = None
    packing: bool = False
    format: str = "text"
    train_on: str = "all"
    """completions: only completion / assistant tokens are useful (labels != -100)"""
    chat_template: str | None = None
    packed_rows: int | None = None
    skipped_rows: int = 0


class Timings(Model):
    """How long each part of the pilot took, and the checkpoint it wrote."""

    model_load_s: Figure = _fig("s")
    setup_s: Figure = _fig("s")
    warmup_s: Figure = _fig("s")
    measure_s: Figure = _fig("s")
    validation_pass_s: Figure = _fig("s")
    checkpoint_write_s: Figure = _fig("s")
    checkpoint_bytes: Figure = _fig("bytes")
    checkpoint_bytes_per_s: Figure = _fig("bytes/s")
    checkpoint_method: str | None = None
    pilot_total_s: Figure = _fig("s")


class WarmupStep(Model):
    wall_s: Figure
    loss: float | None
    batch: str = "longest"


class StepsBlock(Model):
    warmup: Figure = _fig("steps")
    measured: Figure = _fig("steps")
    stop_rule: str | None = None
    stopped_because: str | None = None
    ci95_relative: Figure = _fig("fraction")
    warmup_steps: list[WarmupStep] = Field(default_factory=list)
    confidence: str | None = None
    """'converged' or a warning: the 95% CI is wider than +-10%, the machine was loaded"""


class StepTime(Model):
    """The distribution of the measured steps' wall time."""

    mean_s: Figure = _fig("s")
    p50_s: Figure = _fig("s")
    p90_s: Figure = _fig("s")
    p99_s: Figure = _fig("s")
    min_s: Figure = _fig("s")
    max_s: Figure = _fig("s")
    std_s: Figure = _fig("s")
    ci95_half_width_s: Figure = _fig("s")
    cv: Figure = _fig("fraction")
    timer: str | None = None


class Split(Model):
    """Where a step's time went (per-step means over the split steps)."""

    forward_s: Figure = _said("s", "forward and loss, synchronised")
    backward_s: Figure = _said("s", "backward, synchronised")
    optimizer_s: Figure = _said("s", "clip, optimizer step, zero_grad, schedule")
    data_wait_s: Figure = _said("s", "waiting on the data loader")
    other_s: Figure = _said("s", "the rest: host-to-device copies, bookkeeping, Python")
    generation_s: Figure | None = None
    """GRPO/RLOO: generating the completions (its own phase, before the forward)"""
    num_split_steps: Figure | None = None
    how: str | None = None


class DataWait(Model):
    """Time waiting on the data loader before each step, and the steps that stalled."""

    mean_s: Figure = _said("s", "mean data wait per step")
    max_s: Figure = _said("s", "the longest data wait")
    num_stalls: Figure = _said("steps", "steps whose data wait passed stall_threshold")
    stall_threshold: str | None = None
    fraction_of_step_time: Figure | None = None


class Throughput(Model):
    """Tokens, samples and steps per second over the measured steps."""

    useful_tokens_per_s: Figure = _fig("tokens/s")
    """supervised target tokens (labels != -100) per second: what the quote divides by"""
    padded_tokens_per_s: Figure = _fig("tokens/s")
    """every token position of the batches (padding included) per second"""
    useful_fraction: Figure = _fig("fraction")
    samples_per_s: Figure = _fig("samples/s")
    optimizer_steps_per_s: Figure = _fig("steps/s")
    useful_tokens: Figure | None = None
    padded_tokens: Figure | None = None
    mean_sequence_length: Figure | None = None
    """the mean padded length of the measured micro-batches (MFU's length; the quote's too)"""


class AllocatorMemory(Model):
    """The caching allocator's counters (CUDA/HIP only)."""

    peak_allocated_bytes: Figure = _fig("bytes")
    """torch.cuda.max_memory_allocated from warm-up step 2 on (the plan's step 2+)"""
    peak_reserved_bytes: Figure = _fig("bytes")
    """torch.cuda.max_memory_reserved over the same steps"""
    first_step_peak_allocated_bytes: Figure = _fig("bytes")
    model_load_peak_allocated_bytes: Figure = _fig("bytes")
    num_alloc_retries: Figure = _fig("count")
    """cudaMalloc retries after freeing the cache: memory near the card's capacity"""
    num_ooms: Figure = _fig("count")


def no_allocator(why: str = "CPU: no caching allocator (CUDA/HIP only)") -> AllocatorMemory:
    """Every allocator figure "not measured" with the reason (a CPU run has no such allocator)."""
    return AllocatorMemory(**{k: Figure.missing(getattr(AllocatorMemory(), k).unit, why)
                              for k in AllocatorMemory.model_fields})


class DeviceMemory(Model):
    """Device-wide memory (NVML/amdsmi): what the allocator never sees is in it."""

    source: str | None = None
    baseline_bytes: Figure = _fig("bytes")
    peak_bytes: Figure = _fig("bytes")
    peak_minus_baseline_bytes: Figure = _fig("bytes")
    gap_bytes: Figure = _fig("bytes")
    interval_s: float | None = None
    num_samples: int | None = None
    per_process: dict[str, Any] | None = None
    """`watch`: the peak device memory of each process of the tree"""


class ProcessMemory(Model):
    """The process's resident memory (a CPU pilot's device memory)."""

    baseline_rss_bytes: Figure | None = None
    peak_rss_bytes: Figure = _fig("bytes")
    rss_growth_bytes: Figure | None = None
    rss_minus_tracked_bytes: Figure | None = None
    source: str | None = None
    covers: str | None = None


class ProbeStep(Model):
    what: str
    weights_bytes: Figure
    gradients_bytes: Figure
    optimizer_bytes: Figure
    activations_bytes: Figure
    forward_backward_temporary_bytes: Figure
    optimizer_temporary_bytes: Figure
    temporary_bytes: Figure
    peak_bytes: Figure


class TrackedMemory(Model):
    peak_bytes: Figure = _fig("bytes")
    method: str | None = None
    probe_step: ProbeStep | None = None


class MemoryBlock(Model):
    allocator: AllocatorMemory = Field(default_factory=AllocatorMemory)
    device: DeviceMemory = Field(default_factory=DeviceMemory)
    process: ProcessMemory = Field(default_factory=ProcessMemory)
    tracked: TrackedMemory = Field(default_factory=TrackedMemory)
    memory_limit_bytes: Figure | None = None


class ValidationBlock(Model):
    num_batches: int | None = None
    seconds: Figure = _fig("s")
    loss: Figure | None = None
    useful_tokens: Figure | None = None
    batches_from: str | None = None


class LossBlock(Model):
    first: Figure | None = None
    last: Figure | None = None


class SearchTry(Model):
    micro_batch_size: int
    fits: bool
    tracked_peak_bytes: int | None


class MaxBatchSearch(Model):
    max_micro_batch: Figure
    reached_search_cap: bool
    limit: str | None
    accumulation_tried: int
    tries: list[SearchTry]
    seconds: Figure
    rule: str


class PerStep(Model):
    wall_s: Figure = Field(default_factory=lambda: Figure.measured([], "s"))
    data_wait_s: Figure = Field(default_factory=lambda: Figure.measured([], "s"))
    useful_tokens: Figure = Field(default_factory=lambda: Figure.measured([], "tokens"))
    padded_tokens: Figure = Field(default_factory=lambda: Figure.measured([], "tokens"))
    loss: Figure = Field(default_factory=lambda: Figure.measured([], "nats/token"))


class Residual(Model):
    planned: Figure
    measured: Figure
    what: str
    residual_bytes: Figure | None = None
    ratio: Figure | None = None


class PlanVsMeasured(Model):
    plan_fidelity: str
    stack: str
    peak_phase: str
    components: dict[str, Residual]
    note: str


class Calibration(Model):
    stack: str
    card_id: str | None
    device: str | None
    model_config_sha256: str | None
    spec_hash: str | None
    micro_batch_size: int | None
    sequence_length: int | None
    ratios: dict[str, float]
    reserve_slack_fraction: float | None = None
    runtime_overhead_bytes: int | None = None


class GenerationBlock(Model):
    """GRPO/RLOO: the generation phase of the measured steps, timed and tracked on its own."""

    backend: str
    seconds_per_step: Figure = _fig("s")
    fraction_of_step_time: Figure = _fig("fraction")
    generated_tokens_per_s: Figure = _fig("tokens/s")
    """completion tokens generated / generation seconds"""
    peak_bytes: Figure = _fig("bytes")
    """the tracked peak while generating (weights, optimizer state, KV cache, logits)"""
    how: str | None = None


class MachineLoad(Model):
    """How busy the machine was while steps were measured (a loaded machine measures slow)."""

    logical_cores: int | None = None
    load_average_1m: float | None = None
    cpu_steal_fraction: float | None = None
    loaded: bool = False
    note: str | None = None


class Watched(Model):
    """`tunepilot watch`: the command that ran and what its process tree used."""

    command: list[str]
    exit_code: int | None
    wall_s: Figure
    cpu_s: Figure
    processes: int
    """distinct processes seen in the tree over the run"""
    first_step_s: Figure | None = None
    """seconds from the start to the first optimizer step (TunepilotCallback's marker)"""
    signal: str | None = None
    """the signal that ended it, when one did"""


class RankPilot(Model):
    """One rank of a sharded pilot: its memory peaks, its step time, its plan."""

    rank: int
    fits: bool = True
    allocated_peak_bytes: Figure = _said(
        "bytes", "the steady-state peak: torch.cuda.max_memory_allocated from warm-up step 2 on "
        "(GPU), or the tracked tensor peak of warm-up step 2 (CPU), as one device's pilot "
        "measures it")
    reserved_peak_bytes: Figure = _said("bytes", "torch.cuda.max_memory_reserved (GPU only)")
    device_peak_bytes: Figure = _said(
        "bytes", "the rank's device-wide peak minus its baseline (NVML/amdsmi; GPU only)")
    step_time_median_s: Figure = _said("s", "the rank's median measured step")
    step_time_mean_s: Figure = _fig("s")
    planned_allocated_peak_bytes: Figure = _said(
        "bytes", "the per-rank plan's allocated peak (projected)")
    plan_ratio: Figure = _said("ratio", "measured / planned allocated peak")
    tracked_peak_bytes: Figure = _said(
        "bytes", "the tracked tensor peak over every tracked step (with --memory-limit: every "
        "step, against the limit)")
    peak_rss_bytes: Figure = _said("bytes", "the rank process's peak resident memory")
    useful_tokens: Figure = _said("tokens", "useful tokens of the rank's measured steps")
    error: str | None = None
    """why the rank did not fit (its out-of-memory error), or why it has no record"""


class PilotResult(StageResult):
    """Everything one pilot measured; docs/pilot.md describes every key."""

    STAGE = "pilot"
    source: str = "tunepilot pilot"
    fits: bool = False
    verdict: str = "not measured"
    does_not_fit: DoesNotFit | None = None
    device: DeviceBlock = Field(default_factory=DeviceBlock)
    run: RunBlock = Field(default_factory=RunBlock)
    params: dict[str, Figure] = Field(default_factory=dict)
    data: DataBlock = Field(default_factory=DataBlock)
    timings: Timings = Field(default_factory=Timings)
    steps: StepsBlock = Field(default_factory=StepsBlock)
    step_time: StepTime = Field(default_factory=StepTime)
    split: Split = Field(default_factory=Split)
    data_wait: DataWait = Field(default_factory=DataWait)
    throughput: Throughput = Field(default_factory=Throughput)
    mfu: Figure = _fig("fraction")
    memory: MemoryBlock = Field(default_factory=MemoryBlock)
    validation: ValidationBlock = Field(default_factory=ValidationBlock)
    loss: LossBlock = Field(default_factory=LossBlock)
    find_max_batch: MaxBatchSearch | None = None
    per_step: PerStep = Field(default_factory=PerStep)
    machine_load: MachineLoad | None = None
    generation: GenerationBlock | None = None
    """GRPO/RLOO: the generation phase (absent for objectives that generate nothing)"""
    watched: Watched | None = None
    world_size: int = 1
    """ranks the pilot ran (a sharded pilot: the spec's FSDP ranks under torchrun)"""
    ranks: list[RankPilot] = Field(default_factory=list)
    """a sharded pilot: every rank's figures (the slowest rank's time and the largest rank's
    memory make the figures above)"""
    notes: list[str] = Field(default_factory=list)
    plan_vs_measured: PlanVsMeasured | None = None
    calibration: Calibration | None = None
    log: str | None = None

    @property
    def useful_tokens_per_s(self) -> float | None:
        return self.throughput.useful_tokens_per_s.value
