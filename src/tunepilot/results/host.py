"""The host plan (per node: host RAM and local disk beside the device plan) and how it fits an
offer's machine. Every figure is projected; bytes (GiB = 2^30, disk as sold in GB = 10^9)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tunepilot.results.base import Model
from tunepilot.results.figure import Figure

HostPhaseName = Literal["model-load", "training", "checkpoint-save"]
Resource = Literal["device memory", "host RAM", "local disk"]


class HostComponent(Model):
    """One thing a node holds in host RAM: per process, how many processes hold it, per node."""

    name: str
    bytes_per_rank: int
    """held by each process that holds it (0 where only the node holds it once)"""
    holders: int
    """processes of the node that hold it (ranks, or ranks x workers)"""
    bytes_per_node: int
    phases: list[HostPhaseName]
    """the phases it is alive in"""
    pinned: bool = False
    """page-locked: the kernel cannot swap or reclaim it"""
    how: str


class HostPhase(Model):
    name: HostPhaseName
    bytes_per_node: int


class DiskItem(Model):
    name: str
    bytes_per_node: int
    how: str


class HostPlan(Model):
    """Host RAM and local disk of one node for the spec's layout (projected)."""

    ranks_per_node: int
    nodes: int
    load: str
    """how the weights reach the devices (host.load resolved: per-rank, rank0, mmap)"""
    components: list[HostComponent]
    phases: list[HostPhase]
    peak_bytes_per_node: int
    peak_phase: HostPhaseName
    disk: list[DiskItem]
    disk_bytes_per_node: int
    export_bytes: int = 0
    """what `tunepilot export` copies off at the end (model/flops.py EXPORT_RULE): the kept
    checkpoints of every node, already on disk under checkpoints"""
    needs_host_ram: bool
    """training state lives in host memory (CPU offload, activation offload, async staging):
    an offer that lists no host RAM cannot be checked"""
    notes: list[str] = Field(default_factory=list)

    def component(self, name: str) -> HostComponent | None:
        return next((c for c in self.components if c.name == name), None)


class HostFit(Model):
    """The host plan against an offer's machine, and which resource binds."""

    cards_per_node: int
    host_peak_bytes_per_node: int
    host_ram_bytes_per_node: int | None
    """the node's share of the instance's host RAM; None: the offer lists none"""
    host_usable_bytes_per_node: int | None
    host_fits: bool | None
    disk_bytes_per_node: int
    local_disk_bytes_per_node: int | None
    disk_fits: bool | None
    export_bytes: int = 0
    """what `tunepilot export` copies off at the end (HostPlan.export_bytes)"""
    utilisation: dict[str, float]
    """resource -> need / usable (device memory at the plan's headroom)"""
    binds: Resource
    """the resource nearest its limit"""
    reason: str | None = None
    """why the offer is refused (or cannot be checked), naming the resource"""
    hint: str | None = None
    """how to make the node fit (with ``reason``)"""
    warning: str | None = None
    """the local disk is too small: checkpoints must go to network storage (not a refusal)"""
    instance: str | None = None
    source: str | None = None
    """where the offer's host figures come from"""
    measured_rss_bytes_per_process: Figure | None = None
    """the pilot's whole-process peak RSS (pilot.json), beside the plan's per-process figures"""
    measured_rss_bytes_per_node: Figure | None = None
    """the scaling test's largest node: the sum of its ranks' peak RSS (scale.json)"""

    @property
    def fits(self) -> bool:
        """Host RAM does not refuse the offer (a disk too small only warns: network storage)."""
        return self.reason is None
