"""Live tensor bytes, counted op by op, and a simulated device-memory cap.

``TensorMemoryTracker`` is a TorchDispatchMode: every ATen op's outputs are checked, and each
tensor *storage* not seen before is counted once (views share their base's storage and add
nothing) and uncounted by a weakref finalizer when it is freed. Storages that existed before the
tracker (parameters, optimizer state) are adopted with ``adopt``. What it sees is the bytes of
tensors ATen ops return: a kernel's internal scratch buffers (e.g. inside SDPA or cuBLAS) and the
allocator's rounding are not in it - that is the "gap" the pilot reports separately.

With ``limit_bytes`` it raises ``torch.OutOfMemoryError`` - the type the CUDA/HIP caching
allocator raises - as soon as the live bytes pass the limit, so ``--memory-limit`` exercises the
pilot's out-of-memory path exactly as a real device would.

Regions: the pilot marks where in a step it is ("step": forward + backward, "optimizer"). The
first op that runs inside an autograd node marks "backward-start" (the moment all of forward's
saved activations are alive), which is how the activations of a step are measured.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tunepilot.errors import UserError

SIMULATED_OOM = "simulated device memory limit"  # starts the message of a simulated OOM
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, field: str = "--memory-limit") -> int:
    """'12884901888', '12 GiB', '1.5GB', '512MiB' -> bytes (GiB = 2^30, GB = 10^9)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise UserError(field, f"{text!r} is not a size.",
                            "Give bytes or a number with a unit: 12GiB, 1.5GB, 512MiB "
                            "(GiB = 2^30 bytes, GB = 10^9).")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(field, f"{text!r} is not a positive size.")
    return value


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                  ) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what lives between steps."""
    out: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for st in optimizer.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


class TensorMemoryTracker(TorchDispatchMode):
    """Counts live storage bytes on one device type; optionally caps them (simulated OOM)."""

    def __init__(self, device_type: str, limit_bytes: int | None = None):
        super().__init__()
        self.device_type = device_type
        self.limit_bytes = limit_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_ooms = 0
        self.region = "idle"
        self.region_peaks: dict[str, int] = {}
        self.marks: dict[str, int] = {}  # live bytes at the first time each mark was reached
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # --- bookkeeping ---------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count storages made outside the tracker (weights, optimizer state); returns bytes added."""
        added = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                added += self._track(t)
        self._update_peak()
        return added

    def enter(self, region: str) -> None:
        """Start a region (its own peak) and record the live bytes at its start."""
        self.region = region
        self.marks.setdefault(region + "-start", self.live_bytes)
        self.region_peaks[region] = max(self.region_peaks.get(region, 0), self.live_bytes)

    def reset_marks(self) -> None:
        self.marks.clear()
        self.region_peaks.clear()

    def check_limit(self, what: str = "") -> None:
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            self.num_ooms += 1
            raise torch.OutOfMemoryError(
                f"{SIMULATED_OOM} (--memory-limit {self.limit_bytes} bytes): "
                f"{self.live_bytes} bytes of tensors live{what}")

    def _track(self, t: torch.Tensor) -> int:
        if t.device.type != self.device_type:
            return 0
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or wrapper tensors
            return 0
        if st in self._seen:
            return 0
        n = st.nbytes()
        self._seen[st] = n
        weakref.finalize(st, self._free, n)
        self.live_bytes += n
        return n

    def _free(self, n: int) -> None:
        self.live_bytes -= n

    def _update_peak(self) -> None:
        live = self.live_bytes
        if live > self.peak_bytes:
            self.peak_bytes = live
        if live > self.region_peaks.get(self.region, 0):
            self.region_peaks[self.region] = live

    # --- the dispatch hook ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.region == "step" and "backward-start" not in self.marks and \
                torch._C._current_autograd_node() is not None:
            self.marks["backward-start"] = self.live_bytes
        out = func(*args, **(kwargs or {}))
        added = 0
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                added += self._track(t)
        if added:
            self._update_peak()
            self.check_limit(f" after {func} allocated {added} bytes")
        return out
