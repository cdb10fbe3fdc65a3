"""One pilot in progress (``Session``): what it measured (``m``, pilot/measurements.py) and what
running it needs - shared by pilot/prepare.py, which makes it, and pilot/runner.py, which runs
it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tunepilot.pilot.measurements import Measurements
from tunepilot.pilot.stats import StopRule
from tunepilot.plan.trace.tracker import SIMULATED_OOM, StorageTracker

if TYPE_CHECKING:
    from tunepilot.catalog import Catalog
    from tunepilot.dataset import DataInfo
    from tunepilot.device import DeviceInfo
    from tunepilot.model.arch import Arch
    from tunepilot.pilot.steps import InstrumentedStep, StepMemory
    from tunepilot.results.plan import MemoryPlan
    from tunepilot.spec import RunSpec
    from tunepilot.training.build import Run

Progress = Callable[[str, int, int | None], None]
DEFAULT_MAX_STEPS = 100


@dataclass
class PilotOptions:
    """How the pilot runs (the CLI flags)."""

    steps: int | None = None
    """--steps N: exactly N measured steps; default adaptive."""
    max_steps: int = DEFAULT_MAX_STEPS
    memory_limit_bytes: int | None = None
    """--memory-limit: a simulated device cap on live tensor bytes (torch.OutOfMemoryError)."""
    find_max_batch: bool = False
    device: str | None = None
    """'cpu' forces the CPU; default: the first GPU torch sees, else the CPU."""
    base_dir: Path | None = None
    """where relative paths in the spec are resolved (the spec file's directory)."""
    catalog: Catalog | None = None
    check_memory: bool = True
    """refuse, before building anything, a run whose plan exceeds the local device's memory"""
    ranks: int | None = None
    """a rank of a sharded pilot (pilot/ranks.py): the FSDP spec on this many ranks; None: as
    the spec says (one device, or the spec's FSDP ranks under torchrun)"""
    probe_dir: str | None = None
    """a sharded pilot's checkpoint probe directory (the same on every rank)"""


class PilotOutOfMemory(Exception):
    """An out-of-memory error (the device's, or the simulated one) with the phase it
    happened in: the pilot ends with "does not fit" instead of crashing."""

    def __init__(self, phase: str, exc: BaseException, simulated: bool):
        super().__init__(str(exc))
        self.phase, self.error, self.simulated = phase, str(exc).splitlines()[0][:800], simulated


@dataclass
class Session:
    """One pilot in progress: what it measured (``m``, the typed Measurements that become
    pilot.json) and what running it needs (the options, the plan, the built run, the probes)."""

    spec: RunSpec
    m: Measurements
    options: PilotOptions
    plan: MemoryPlan
    log: Callable[[str], None]
    progress: Progress
    run_dir: Path
    data_info: DataInfo | None = None
    dataset: object = None
    longest: dict[str, int] | None = None
    longest_batch: dict | None = None
    run: Run | None = None
    params: dict[str, int] | None = None
    tracker: StorageTracker | None = None
    step: InstrumentedStep | None = None
    rule: StopRule | None = None
    step_memory: StepMemory | None = None
    tracked_peak_bytes: int | None = None
    sampler: object = None
    does_not_fit: PilotOutOfMemory | None = None
    search: dict | None = None
    provenance: dict | None = None
    tracker_live_at_oom: int | None = None
    rank: int = 0
    world_size: int = 1
    """the ranks of a sharded pilot (1: one device)"""

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def agree_max(self, value: float) -> float:
        """The largest ``value`` over the ranks (itself on one device): a sharded pilot's ranks
        take every decision on the same numbers - the slowest rank's step time - so they run
        the same steps (each holds collectives the others wait on)."""
        if not self.sharded:
            return value
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64,
                         device="cuda" if self.gpu else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    @property
    def pilot_spec(self) -> RunSpec:
        """The spec the pilot runs (one device or its FSDP ranks, the plan's levers off)."""
        return self.m.spec

    @property
    def device(self) -> DeviceInfo:
        return self.m.device

    @property
    def arch(self) -> Arch:
        return self.m.arch

    @property
    def gpu(self) -> bool:
        return self.m.gpu

    @property
    def device_type(self) -> str:
        """torch's device type: ROCm GPUs are "cuda" to torch too."""
        return "cuda" if self.gpu else "cpu"

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def oom_guard(self, phase: str) -> Iterator[None]:
        """Turn an out-of-memory error (the device's or the simulated one) into PilotOutOfMemory."""
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if self.tracker is not None:
                self.tracker_live_at_oom = self.tracker.live_bytes
            raise PilotOutOfMemory(phase, exc, SIMULATED_OOM in str(exc)) from None
