"""plan.json: the memory one device needs (every figure projected; bytes, GiB = 2^30)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, computed_field, model_validator

from tunepilot.results.base import Model, StageResult
from tunepilot.results.host import HostFit, HostPlan

COMPONENTS = ("weights", "master_weights", "gradients", "optimizer", "activations", "temporary",
              "collective_buffers")
# what a trace measures per phase: every component but the collective buffers, which the plan
# adds (DDP's gradient buckets; the runtime's collective library)
TRACED_COMPONENTS = COMPONENTS[:-1]


class Phase(Model):
    """Live bytes by component at one point of the step's timeline."""

    name: str
    weights_bytes: int = 0
    master_weights_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    temporary_bytes: int = 0
    collective_buffers_bytes: int = 0

    @computed_field
    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f"{c}_bytes") for c in COMPONENTS)

    @classmethod
    def of(cls, name: str, parts: dict[str, int]) -> Phase:
        """A phase from its components by name (bytes; a component not given is 0)."""
        return cls(name=name, **{f"{c}_bytes": int(parts.get(c, 0)) for c in COMPONENTS})

    @classmethod
    def make(cls, name: str, weights: int = 0, master_weights: int = 0, gradients: int = 0,
             optimizer: int = 0, activations: int = 0, temporary: int = 0,
             collective_buffers: int = 0) -> Phase:
        """A phase from its components in COMPONENTS order (bytes)."""
        return cls(name=name, weights_bytes=weights, master_weights_bytes=master_weights,
                   gradients_bytes=gradients, optimizer_bytes=optimizer,
                   activations_bytes=activations, temporary_bytes=temporary,
                   collective_buffers_bytes=collective_buffers)

    @property
    def states_bytes(self) -> int:
        """Weights, master weights, gradients and optimizer state: what does not grow with
        tokens."""
        return (self.weights_bytes + self.master_weights_bytes + self.gradients_bytes
                + self.optimizer_bytes)

    @property
    def is_optimizer(self) -> bool:
        return self.name.startswith("optimizer")

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, obj: Any) -> Any:
        if isinstance(obj, dict):  # total_bytes is derived: accept it on the way back in
            obj = {k: v for k, v in obj.items() if k != "total_bytes"}
        return obj


class ParamSplit(Model):
    total: int
    trainable: int
    frozen: int


class PerDevice(Model):
    """Each component's largest size over the timeline, and the three peaks."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    master_weights_bytes: int
    activations_bytes: int
    temporary_bytes: int
    collective_buffers_bytes: int
    allocated_peak_bytes: int
    """what torch.cuda.max_memory_allocated reports"""
    reserved_peak_bytes: int
    """the caching allocator's reserve"""
    runtime_overhead_bytes: int
    """context, workspaces, collective buffers: outside the allocator"""
    device_peak_bytes: int
    """reserved + runtime: what NVML reports"""
    load_peak_bytes: int
    load_stranded_bytes: int = 0
    """blocks the model load freed that the caching allocator keeps and the step cannot reuse
    (reserved beside the step)"""


class DevicesNeeded(Model):
    ddp: int | None
    fsdp: int | None
    ddp_tight: int | None = None
    """1 when one card fits only with less free memory than the headroom asked (ddp is None)"""
    fsdp_tight: int | None = None
    """the fewest FSDP ranks that fit with less headroom than asked, when fewer than ``fsdp``"""


class CardFit(Model):
    """One row of the fit table."""

    card: str
    capacity_bytes: int
    device_peak_bytes: int
    fits: bool
    headroom_fraction: float
    devices_needed: DevicesNeeded
    max_micro_batch: int
    max_sequence_length: int
    peak_phase: str | None = None
    """the phase that sets this card's device peak (with vLLM's colocated reserve, if any)"""
    generation_reserve_bytes: int = 0
    """vLLM colocated: gpu_memory_utilization x this card's memory, outside PyTorch's
    allocator (computed: vLLM's allocator does not run on a CPU)"""
    host: HostFit | None = None
    """the host plan against the card's offer (host RAM, local disk) and which resource binds"""
    headroom_asked: float = 0.10
    """the free fraction of the card the fit asked for (plan --headroom)"""


class MemoryPlan(StageResult):
    """What one device needs for one training step of the spec."""

    STAGE = "plan"
    fidelity: str
    """analytic | trace | analytic+calibrated"""
    basis: Literal["projected"] = "projected"
    params: ParamSplit
    per_device: PerDevice
    phases: list[Phase]
    peak_phase: str
    bytes_per_param: dict[str, float]
    tokens_per_micro_batch: int
    tokens_per_optimizer_step: int
    world_size: int
    strategy: str
    stack: str
    assumptions: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    """what the plan holds true but the run should not do as asked (past the model's context)"""
    cards: list[CardFit] = Field(default_factory=list)
    host: HostPlan | None = None
    """host RAM and local disk per node for the spec's layout (plan/host.py)"""
    trace: dict[str, Any] | None = None
    """what the trace saw (traced plans), or why it fell back"""
    differences: list[dict[str, Any]] = Field(default_factory=list)
    """traced plans: components whose traced and analytic figures differ by more than 5%"""

    def card(self, card_id: str) -> CardFit | None:
        return next((c for c in self.cards if c.card == card_id), None)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)
