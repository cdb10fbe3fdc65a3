"""What crosses the scaling test's process boundary, typed: the job every rank reads, and the
record each rank writes back (rank<R>.json, all_ranks.json). Written and read by the one pair of
helpers in proc/child.py (write_message / read_message), validated once on the way in."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tunepilot.proc.messages import Message as _Message


class ScaleJob(_Message):
    """One launch of the scaling test: what every rank runs."""

    spec: dict[str, Any]
    """the RunSpec as JSON (validated again by the rank: spec_from_dict)"""
    strategy: Literal["single", "ddp", "fsdp"]
    micro_batch: int = Field(gt=0)
    accumulation: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    warmup_steps: int = Field(ge=0)
    steps: int = Field(gt=0)
    device: Literal["cpu", "cuda"]
    out: str
    threads: int = Field(default=1, gt=0)
    base_dir: str | None = None


class RankStep(_Message):
    """One optimizer step of one rank."""

    step: int
    measured: bool
    loss_local: float
    loss_global: float
    wall_s: float
    useful_tokens: int
    padded_tokens: int
    data_wait_s: float
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    comm_inflight_s: float | None = None
    comm_exposed_s: float | None = None
    comm_buckets: int | None = None
    samples: list[str] = Field(default_factory=list)


class RankRecord(_Message):
    """What one rank measured (status ok) or why it stopped (does_not_fit)."""

    rank: int
    strategy: str
    status: Literal["ok", "does_not_fit"] = "ok"
    error: str | None = None
    local_rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    pid: int | None = None
    device: str | None = None
    backend: str | None = None
    threads: int | None = None
    cpu_affinity: list[int] = Field(default_factory=list)
    micro_batch_size: int | None = None
    accumulation: int | None = None
    global_batch_samples: int | None = None
    warmup_steps: int | None = None
    reshard_after_forward: bool | None = None
    params_local: int | None = None
    memory: dict[str, Any] = Field(default_factory=dict)
    """{"peak_bytes": Figure as JSON}: the allocator's peak (CUDA) or the RSS peak (CPU)"""
    comm_measure: str | None = None
    steps: list[RankStep] = Field(default_factory=list)

    @property
    def peak_memory_bytes(self) -> int | None:
        return (self.memory.get("peak_bytes") or {}).get("value")

    @property
    def host_peak_rss_bytes(self) -> int | None:
        """The rank's whole-process peak RSS (host RAM), where the rank recorded it."""
        return (self.memory.get("host_peak_rss_bytes") or {}).get("value")

    @property
    def memory_measure(self) -> str | None:
        return (self.memory.get("peak_bytes") or {}).get("what")


class GatheredRanks(_Message):
    """all_ranks.json: every rank's record, gathered over the process group by local rank 0."""

    world_size: int
    ranks: list[RankRecord]
