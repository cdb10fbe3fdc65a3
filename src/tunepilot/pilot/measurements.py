"""What a pilot measured, as one typed object: tunepilot's own pilot (pilot/runner.py) and the
callbacks' Recorder (integrations/recorder.py) both fill a ``Measurements``, and
``pilot.assemble.pilot_result`` turns either into the same PilotResult (pilot.json). No torch
work happens here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunepilot.catalog import Catalog
    from tunepilot.device import DeviceInfo, SamplerReading
    from tunepilot.model.arch import Arch
    from tunepilot.pilot.load import MachineLoad
    from tunepilot.spec import RunSpec


@dataclass
class StepRecord:
    """One measured optimizer step."""

    wall_s: float
    data_wait_s: float
    forward_s: float | None
    backward_s: float | None
    optimizer_s: float | None
    useful_tokens: int
    padded_tokens: int
    sequence_length: int
    """padded length of the step's longest micro-batch"""
    loss: float | None
    samples: int | None = None
    """sequences the step trained on (None: micro_batch_size x accumulation)"""
    generation_s: float | None = None
    """GRPO/RLOO: generating the step's completions (None: the step generated nothing)"""
    generated_tokens: int | None = None


@dataclass
class AllocatorPeaks:
    """The caching allocator's counters (CUDA/HIP), bytes unless named otherwise."""

    model_load_peak_allocated_bytes: int | None = None
    first_step_peak_allocated_bytes: int | None = None
    first_step_peak_reserved_bytes: int | None = None
    steady_peak_allocated_bytes: int | None = None
    """warm-up step 2 onwards: the steady state the plan describes"""
    steady_peak_reserved_bytes: int | None = None
    max_reserved_bytes: int | None = None
    """over every segment (model load, first step, steady)"""
    num_alloc_retries: int = 0
    num_ooms: int = 0

    def note_segment(self, segment: str, allocated: int, reserved: int) -> None:
        """The peaks of one segment ('first_step' or 'steady')."""
        setattr(self, f"{segment}_peak_allocated_bytes", allocated)
        setattr(self, f"{segment}_peak_reserved_bytes", reserved)
        self.max_reserved_bytes = max(self.max_reserved_bytes or 0, reserved)


@dataclass
class ValidationPass:
    seconds: float
    num_batches: int | None = None
    loss: float | None = None
    useful_tokens: int | None = None
    batches_from: str = "the training data, a second shuffle (the spec names no validation set)"
    count: int = 1
    """passes seen (a callback run may evaluate several times; seconds is the last)"""


@dataclass
class CheckpointWrite:
    seconds: float | None = None
    """the (last) write's wall time"""
    nbytes: int | None = None
    files: int | None = None
    kind: str | None = None
    method: str | None = None
    unavailable: str | None = None
    """why there is no timing (no disk, the write failed, the run saved none)"""
    count: int = 1
    total_s: float | None = None


@dataclass
class StageTimes:
    """Seconds of the pilot's stages (None: not measured, with the reason beside it)."""

    setup_s: float | None = None
    setup_covers: str = ("device probe, plan, data read + tokenisation (not the model load, not "
                         "warm-up)")
    model_load_s: float | None = None
    model_load_why: str = "the model did not load"
    warmup_s: float | None = None
    measure_s: float | None = None
    total_s: float | None = None
    total_covers: str | None = None


@dataclass
class Measurements:
    """Everything one pilot measured, and what it needs to be read (spec, arch, device)."""

    spec: RunSpec
    """the spec the measured steps ran (the pilot's single-device spec, or the one derived
    from a callback run)"""
    arch: Arch
    device: DeviceInfo
    source: str = "pilot"
    trainer: str = "tunepilot"
    catalog: Catalog | None = None
    steps: list[StepRecord] = field(default_factory=list)
    warmup: list[StepRecord] = field(default_factory=list)
    stop_rule: str | None = None
    stopped_because: str | None = None
    load: MachineLoad | None = None
    allocator: AllocatorPeaks = field(default_factory=AllocatorPeaks)
    reading: SamplerReading | None = None
    """the device-wide (NVML/amdsmi) or, on a CPU, the RSS sampler's reading"""
    validation: ValidationPass | None = None
    checkpoint: CheckpointWrite | None = None
    times: StageTimes = field(default_factory=StageTimes)
    notes: list[str] = field(default_factory=list)
    split_how: str | None = None
    """how forward/backward/optimizer were split (None: by the pilot's rule)"""
    losses: tuple[float, float] | None = None
    """(first, last) training loss as the user's trainer logged it (callbacks)"""
    generation_peak_bytes: int | None = None
    """the tracked peak while completions were generated (KV cache included), bytes"""
    generation_how: str | None = None
    """how generation ran and was timed (backend, what the peak covers)"""

    @property
    def gpu(self) -> bool:
        return self.device.kind != "cpu"
