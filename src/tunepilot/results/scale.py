"""scale.json: 1 rank vs N ranks under torchrun, DDP and FSDP, at the same global batch."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure


class BatchPlan(Model):
    """How the global batch is held equal between 1 rank and W ranks."""

    global_batch_samples: int
    world_size: int
    micro_batch_size: int
    accumulation: int
    baseline_accumulation: int
    sequence_length: int
    note: str | None = None
    positions_per_step: int | None = None
    """token positions per optimizer step, sequences per sample included (spec/batch.py)"""
    baseline_world_size: int = 1
    """the baseline's ranks: the smallest count whose plan fits (FSDP when more than 1)"""

    @property
    def arithmetic(self) -> str:
        positions = self.positions_per_step or self.global_batch_samples * self.sequence_length
        b = self.baseline_world_size
        return (f"{self.micro_batch_size} micro-batch x {self.accumulation} accumulation x "
                f"{self.world_size} ranks = {self.micro_batch_size} x "
                f"{self.baseline_accumulation} x {b} rank{'s' if b > 1 else ''} = "
                f"{self.global_batch_samples} samples per optimizer step (<= {positions:,} "
                "token positions)")


class Distribution(Model):
    median: float
    mean: float
    min: float
    max: float
    values: list[float]


class LaunchSummary(Model):
    """One launch (all its ranks): throughput, step times, memory, losses, sample order."""

    world_size: int
    strategy: str
    backend: str
    micro_batch_size: int
    accumulation: int
    measured_steps: int
    useful_tokens: int
    useful_tokens_per_s: float
    step_time_s: Distribution
    peak_memory_bytes_per_rank: int | None
    losses: list[float]
    loss_spread_between_ranks: float
    samples: list[list[str]] = Field(default_factory=list)
    ranks_reported: list[int]
    per_rank: list[dict[str, Any]]
    host_peak_rss_bytes_per_node: dict[str, int] = Field(default_factory=dict)
    """host name -> the sum of its ranks' peak RSS (measured; an upper bound of the node's
    peak host RAM)"""


class StrategyResult(Model):
    """One strategy against the 1-rank baseline (or why it could not run)."""

    status: str  # ok | does_not_fit | failed (a rank crashed or hung: error, log_tail)
    nproc: int
    world_size: int
    efficiency: float | None = None
    useful_tokens_per_s: float | None = None
    error: str | None = None
    launch_error: str | None = None
    log_tail: str | None = None
    """the failing rank's last log lines (failed, does_not_fit)"""
    log: str | None = None
    """the failing rank's log file"""
    baseline_useful_tokens_per_s: float | None = None
    speedup: float | None = None
    step_time_s_median: float | None = None
    peak_memory_bytes_per_rank: int | None = None
    baseline_peak_memory_bytes: int | None = None
    overhead_s_per_step: float | None = None
    overhead_fraction: float | None = None
    loss_max_abs_diff: float | None = None
    loss_tolerance: float | None = None
    loss_agrees: bool | None = None
    loss_per_step: dict[str, list[float]] | None = None
    data_order_same: bool | None = None
    data_order_first_mismatch_step: int | None = None
    samples_checked: int | None = None
    ranks_reported: list[int] = Field(default_factory=list)
    all_ranks_reported: bool | None = None
    global_batch_samples: int | None = None
    figures: dict[str, Figure] = Field(default_factory=dict)
    run: dict[str, Any] | None = None
    note: str | None = None


class NodeFacts(Model):
    """preflight.node: what this node offers the ranks (cpulists as text, '0-15,32-47')."""

    kind: str
    device_count: int
    device_names: list[str] = Field(default_factory=list)
    card_id: str | None = None
    usable_cpus: str = ""
    numa_cpus: dict[str, str] = Field(default_factory=dict)
    device_pci: list[str | None] = Field(default_factory=list)
    device_numa: list[int | None] = Field(default_factory=list)
    device_local_cpus: list[str] = Field(default_factory=list)
    topo_index: list[int | None] = Field(default_factory=list)
    p2p: dict[str, bool] = Field(default_factory=dict)
    collective: dict[str, Any] = Field(default_factory=dict)
    torch_version: str = ""
    notes: list[str] = Field(default_factory=list)
    backend: str = ""


class TopologyFacts(Model):
    source: str
    devices: list[str] = Field(default_factory=list)
    links: dict[str, str] = Field(default_factory=dict)
    cpu_affinity: dict[str, str] = Field(default_factory=dict)
    numa_node: dict[str, int | None] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class RankPlacement(Model):
    """Where one local rank runs: its device, the CPUs near it, the CPUs it may run on."""

    local_rank: int
    device: str
    placement: str
    may_run_on_cpus: str = ""
    may_run_on_numa_nodes: list[int] = Field(default_factory=list)
    threads: int | None = None
    name: str | None = None
    pci: str | None = None
    topology_gpu: int | None = None
    numa_node: int | None = None
    near_cpus: str | None = None
    note: str | None = None


class PreflightWarning(Model):
    code: str
    message: str


class PreflightResult(Model):
    """The preflight's findings: the node, its topology, each rank's placement, the collective
    library, the bus bandwidth measured (or why not) against the catalog link."""

    nproc: int
    nnodes: int
    node: NodeFacts
    threads_per_rank: int | None = None
    topology: TopologyFacts
    ranks: list[RankPlacement]
    collective: dict[str, Any] = Field(default_factory=dict)
    bus_bandwidth: dict[str, Any] = Field(default_factory=dict)
    """the all-reduce/all-gather benchmark's rows, or {"unavailable": why}"""
    link: dict[str, Any] = Field(default_factory=dict)
    """the catalog link of the card and the measured busbw's share of it, or why not"""
    warnings: list[PreflightWarning] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class Recommendation(Model):
    strategy: str | None
    reason: str
    inconclusive: bool = False
    """the measurement cannot tell the strategies apart (efficiency above 1 on CPU ranks is
    noise): nothing is recommended, and the reason says what to re-run"""


class ScalingResult(StageResult):
    STAGE = "scale"
    label: str
    nproc: int
    nnodes: int
    world_size: int
    device: str
    steps: int
    warmup_steps: int
    global_batch: BatchPlan
    preflight: PreflightResult
    baseline: LaunchSummary
    strategies: dict[str, StrategyResult]
    recommendation: Recommendation
    warnings: list[dict[str, str]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    run_dir: str | None = None
