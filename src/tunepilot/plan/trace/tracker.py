"""A dispatch-mode memory tracker: every storage's lifetime, the peak live bytes, and who holds them.

`StorageTracker` is a ``TorchDispatchMode``: it sees the output of every aten op (real or fake
tensors alike), registers each new storage once (views share their base's storage, so a storage
is counted once however many tensors look at it) and follows its lifetime with a weak reference:
PyTorch keeps a storage's Python object alive exactly as long as the C++ ``StorageImpl`` lives, so
the weakref callback fires when the allocator would get the memory back. Sizes are kept twice:
as the CUDA caching allocator rounds them (512-byte blocks, ``kMinBlockSize`` in
c10/cuda/CUDACachingAllocator.cpp) and unrounded.

Attribution is by identity, not by guess:

  weights / master_weights  parameter (and buffer) storages, registered before the step
  gradients                 a trainable parameter's ``.grad`` storage (post-accumulate-grad hook)
  optimizer                 storages in ``optimizer.state`` (registered after each step)
  activations               what a forward leaves alive for backward: tensors autograd saved
                            (``saved_tensors_hooks``) and anything else allocated in the forward
                            and still alive at its end (checkpointed layers' inputs, logits)
  temporary                 the rest: working memory that dies within its phase

A storage's first classification is its role; it is applied retroactively to the peaks already
recorded (a gradient is allocated by a backward op a moment before autograd stores it in
``.grad``), so a peak's breakdown always adds up to its total.

The same tracker is the pilot's: ``limit_bytes`` raises ``torch.OutOfMemoryError`` - the type the
CUDA/HIP caching allocator raises - as soon as live bytes pass the limit (``--memory-limit``
simulates a smaller device), ``device_type`` counts only that device's storages, and regions
(``enter``) mark where in a step it is: the first op inside an autograd node marks
"backward-start", the moment all of forward's saved activations are alive. What it sees is the
bytes of tensors ATen ops return: a kernel's internal scratch (inside SDPA or cuBLAS) is not.

Sharded steps (FSDP under a fake process group): a DTensor's own dispatch runs first and the
tracker sees the local ops it turns into; ``track_resizes`` follows the storages FSDP frees and
re-allocates in place (``UntypedStorage.resize_``, which no dispatch mode sees), labelled
"unsharded"; the buffers handed to all-gather and reduce-scatter are labelled as such. With
``log_events`` every allocation and release is kept in order (plan/reserve/allocator.py replays them
through the caching allocator's rules for the reserved peak).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("weights", "master_weights", "gradients", "optimizer", "activations", "temporary")
MODEL_STATE = frozenset(("weights", "master_weights", "gradients", "optimizer"))
# CUDA caching allocator: every block is a multiple of 512 bytes (kMinBlockSize); 0 bytes -> none.
CUDA_BLOCK_BYTES = 512

_TO_COPY = torch.ops.aten._to_copy.default
# c10d ops a process group runs (fake or real): the buffer each hands over, by argument index.
_COLLECTIVE_BUFFERS: dict = {}
with contextlib.suppress(AttributeError, RuntimeError):
    _COLLECTIVE_BUFFERS = {torch.ops.c10d._allgather_base_.default: (0, "all-gather"),
                           torch.ops.c10d._reduce_scatter_base_.default: (1, "reduce-scatter")}
# grouped GEMM (transformers' grouped_mm experts): the CPU kernel takes bf16 only, CUDA's and
# ROCm's run other dtypes through their fallback (aten/native/cuda/GroupedBlas.cpp
# _grouped_mm_fallback: a loop of mm_out into an output of the inputs' dtype)
_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = getattr(_GROUPED_MM, "default", None)
UNSHARDED = "unsharded"  # label of a storage FSDP resizes in place (an unsharded parameter)
# FSDP's own CUDA streams, by label: FSDP2 allocates the all-gather buffer on its all-gather
# stream and copies out on the default one; FSDP1 resizes the unsharded flat parameter itself on
# its unshard stream (_runtime_utils._unshard). Reduce-scatter: the post-backward stream.
STREAM_OF_LABEL = {"all-gather": 1, "reduce-scatter": 2}
FSDP1_STREAM_OF_LABEL = {"all-gather": 1, UNSHARDED: 1, "reduce-scatter": 2}
SIMULATED_OOM = "simulated device memory limit"  # starts the message of a simulated OOM


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _gpu_grouped_mm(func, args, kwargs):
    """A traced (fake) grouped GEMM in fp32/fp16 as the GPU's fallback runs it: an output of the
    inputs' dtype (or out_dtype). The CPU kernel takes bf16 only, so the shape comes from it on
    bf16 copies - made below this mode, never counted as allocations."""
    a, b = args[0], args[1]
    out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 and args[4] else a.dtype)
    rest = [x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x for x in args[2:4]]
    shape = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest,
                 **{k: v for k, v in kwargs.items() if k != "out_dtype"}).shape
    return a.new_empty(shape, dtype=out_dtype)


def round_block(nbytes: int, block: int = CUDA_BLOCK_BYTES) -> int:
    """Bytes the CUDA caching allocator hands out for a request of `nbytes` (0 stays 0)."""
    return -(-nbytes // block) * block if nbytes > 0 else 0


@dataclass
class Peak:
    """The largest live total seen while a window was open, with its breakdown at that instant."""

    name: str
    peak_bytes: int
    peak_raw_bytes: int  # unrounded storage bytes (its own maximum, may be at another instant)
    seq: int  # allocation counter at the peak
    by_category: dict = field(default_factory=dict)
    saved_bytes: int = 0  # of which autograd's saved tensors (not parameters)
    weight_cast_bytes: int = 0  # of which 16-bit copies of parameters made by autocast
    weight_cast_activations_bytes: int = 0  # of those, the ones held as activations
    labels: dict = field(default_factory=dict)  # labelled storages' bytes at the peak
    # the instant the most bytes other than gradients were live, and its breakdown: where the
    # gradients are sharded as they are made (ZeRO-2/3) or stepped at once (optimizer in the
    # backward) that instant, not the one with every gradient, is the run's peak
    sans_grad_seq: int = -1
    sans_grad: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "peak_bytes": self.peak_bytes,
                "sans_grad_bytes": dict(self.sans_grad),
                "peak_raw_bytes": self.peak_raw_bytes, "saved_bytes": self.saved_bytes,
                "weight_cast_bytes": self.weight_cast_bytes,
                "weight_cast_activations_bytes": self.weight_cast_activations_bytes,
                "labelled_bytes": {k: v for k, v in self.labels.items() if v}, **{
                    f"{c}_bytes": self.by_category.get(c, 0) for c in CATEGORIES}}


class StorageRecord:
    """One tracked storage: its bytes (rounded to the allocator's blocks, and raw), category,
    allocation order (seq), label and the index of its allocation event in the log."""

    __slots__ = ("nbytes", "raw", "storage_nbytes", "cat", "seq", "classified", "saved", "cast",
                 "ref", "label", "parts", "event")

    def __init__(self, nbytes: int, raw: int, storage_nbytes: int, cat: str, seq: int,
                 classified: bool):
        self.nbytes, self.raw, self.storage_nbytes = nbytes, raw, storage_nbytes
        self.cat, self.seq = cat, seq
        self.classified, self.saved, self.cast = classified, 0, False
        self.ref = None
        self.label: str | None = None
        self.parts: list[int] | None = None
        self.event = -1  # index of its allocation event(s) in the log


class _Packed:
    """What autograd stores for a saved tensor while our hooks are on; its death = the release."""

    __slots__ = ("tensor", "rec", "tracker", "__weakref__")

    def __init__(self, tensor, rec, tracker):
        self.tensor, self.rec, self.tracker = tensor, rec, tracker

    def __del__(self):
        self.tracker._unsave(self.rec)


class StorageTracker(TorchDispatchMode):
    """Follow every storage the step allocates; record peaks per named window.

    Use: register the model's parameters (``register``), then ``with tracker:`` around the step,
    ``window(name)`` around phases, ``end_forward()`` after the loss, ``classify(t, cat)`` for
    gradients and optimizer state. Counters are in bytes.
    """

    def __init__(self, block_bytes: int = CUDA_BLOCK_BYTES, *, limit_bytes: int | None = None,
                 device_type: str | None = None, log_events: bool = False):
        super().__init__()
        # (+1 alloc | -1 free, allocation id, raw bytes, stream): the allocator's view, in order
        self.events: list[list[int]] | None = [] if log_events else None
        self.label_bytes: dict[str, int] = {}
        self.stream_of_label = STREAM_OF_LABEL  # FSDP1_STREAM_OF_LABEL for an FSDP1 trace
        self.block_bytes = block_bytes
        self.limit_bytes = limit_bytes
        self.device_type = device_type
        self.peak_bytes = 0  # the largest live total since the tracker began (or reset_peak)
        self.num_ooms = 0
        self.region = "idle"
        self.region_peaks: dict[str, int] = {}
        self.marks: dict[str, int] = {}  # live bytes when each mark was first reached
        self._recs: dict[int, StorageRecord] = {}
        self.live_bytes = 0
        self.live_raw_bytes = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.saved_bytes = 0
        self.weight_cast_bytes = 0
        self.weight_cast_activations_bytes = 0
        self.seq = 0
        self.num_ops = 0
        self.ops_seen: set = set()
        self._open: list[Peak] = []
        self.peaks: list[Peak] = []  # closed windows, in order
        self._in_forward = False
        self._forward_recs: list[StorageRecord] = []

    # --- the public view of what is tracked ---------------------------------------------------
    def record_of(self, t: torch.Tensor) -> StorageRecord | None:
        """The record of ``t``'s storage (None: not tracked, or not on the tracked device)."""
        st = self._storage(t)
        return None if st is None else self._recs.get(st._cdata)

    def record_of_storage(self, st) -> StorageRecord | None:
        """The record of an untyped storage (None: not tracked)."""
        return self._recs.get(st._cdata)

    def records(self) -> list[StorageRecord]:
        """Every live record."""
        return list(self._recs.values())

    # --- registration ------------------------------------------------------------------------
    def _storage(self, t):
        t = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no one storage
            return None

    def _new(self, st, cat: str, classified: bool, parts: list[int] | None = None) -> StorageRecord:
        st_nb = st.nbytes()
        raw = st_nb if parts is None else sum(parts)
        nb = (round_block(raw, self.block_bytes) if parts is None
              else sum(round_block(x, self.block_bytes) for x in parts))
        self.seq += 1
        rec = StorageRecord(nb, raw, st_nb, cat, self.seq, classified)
        rec.parts = parts
        self._log_alloc(rec)
        key = st._cdata
        rec.ref = weakref.ref(st, lambda _r, k=key, rec=rec: self._free(k, rec))
        self._recs[key] = rec
        self.live_bytes += nb
        self.live_raw_bytes += raw
        self.by_category[cat] += nb
        if self._in_forward and not classified:
            self._forward_recs.append(rec)
        self._note_peak()
        return rec

    def register(self, t: torch.Tensor, cat: str, parts: list[int] | None = None) -> None:
        """Count `t`'s storage as `cat` (parameters, buffers) from now on. `parts` replaces its
        size by the allocations it stands for, each rounded on its own (a 4-bit weight, traced
        as a 16-bit tensor: packed codes + absmax constants)."""
        st = self._storage(t)
        if st is None:
            return
        rec = self._recs.get(st._cdata)
        if rec is None:
            self._new(st, cat, True, parts)
        elif not rec.classified:
            self._classify(rec, cat)

    def adopt(self, tensors, cat: str = "weights") -> int:
        """Count storages made outside the tracker (parameters, optimizer state, a batch) as
        ``cat``; the bytes added (a storage seen before adds nothing)."""
        before = self.live_bytes
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.register(t, cat)
        return self.live_bytes - before

    def classify(self, t: torch.Tensor, cat: str) -> None:
        """Give `t`'s storage the role `cat` if it has none yet (the first role sticks)."""
        st = self._storage(t)
        if st is None:
            return
        rec = self._recs.get(st._cdata)
        if rec is None:  # allocated where no op showed it (e.g. before the mode was entered)
            self._new(st, cat, True)
        elif not rec.classified:
            self._classify(rec, cat)

    def _classify(self, rec: StorageRecord, cat: str) -> None:
        old = rec.cat
        rec.cat, rec.classified = cat, True
        if old == cat:
            return
        self.by_category[old] -= rec.nbytes
        self.by_category[cat] += rec.nbytes
        if rec.saved and cat in MODEL_STATE:
            self.saved_bytes -= rec.nbytes
        cast_act = rec.cast and cat == "activations"
        if cast_act:
            self.weight_cast_activations_bytes += rec.nbytes
        # The storage has been alive since rec.seq, so it was part of every peak taken after.
        for p in self._open + self.peaks:
            if p.seq >= rec.seq:
                p.by_category[old] -= rec.nbytes
                p.by_category[cat] += rec.nbytes
                if cast_act:
                    p.weight_cast_activations_bytes += rec.nbytes
            if p.sans_grad_seq >= rec.seq and cat != "gradients":  # not yet in .grad then
                p.sans_grad[old] -= rec.nbytes
                p.sans_grad[cat] += rec.nbytes

    def _free(self, key: int, rec: StorageRecord) -> None:
        if self._recs.get(key) is rec:
            del self._recs[key]
        self._log_free(rec)
        if rec.label:
            self.label_bytes[rec.label] -= rec.nbytes
        self.live_bytes -= rec.nbytes
        self.live_raw_bytes -= rec.raw
        self.by_category[rec.cat] -= rec.nbytes
        if rec.saved and rec.cat not in MODEL_STATE:
            self.saved_bytes -= rec.nbytes
        if rec.cast:
            self.weight_cast_bytes -= rec.nbytes
            if rec.cat == "activations":
                self.weight_cast_activations_bytes -= rec.nbytes

    def _resized(self, rec: StorageRecord, st_nb: int) -> None:
        raw = st_nb if rec.raw == rec.storage_nbytes else rec.raw * st_nb // max(rec.storage_nbytes, 1)
        self._log_free(rec)  # the allocator frees the old block and allocates the new size
        rec.storage_nbytes = st_nb
        nb = round_block(raw, self.block_bytes)
        self.live_bytes += nb - rec.nbytes
        self.live_raw_bytes += raw - rec.raw
        self.by_category[rec.cat] += nb - rec.nbytes
        if rec.label:
            self.label_bytes[rec.label] += nb - rec.nbytes
        rec.nbytes, rec.raw = nb, raw
        rec.parts = None
        self._log_alloc(rec)
        self._note_peak()

    # --- labels, resizes and the allocation log -------------------------------------------------
    def _log_alloc(self, rec: StorageRecord) -> None:
        if self.events is None or rec.raw <= 0:
            rec.event = -1
            return
        rec.event = len(self.events)
        stream = self.stream_of_label.get(rec.label or "", 0)
        for i, part in enumerate(rec.parts or [rec.raw]):
            self.events.append([1, rec.seq * 64 + i, part, stream])

    def _log_free(self, rec: StorageRecord) -> None:
        if self.events is None or rec.event < 0:
            return
        for i in range(len(rec.parts or [rec.raw])):
            self.events.append([-1, rec.seq * 64 + i, 0, 0])
        rec.event = -1

    def label(self, t: torch.Tensor, name: str) -> None:
        """Label `t`'s storage (the first label sticks): its bytes are reported by label at each
        peak, and the allocation log puts FSDP's collective buffers on their own stream."""
        st = self._storage(t)
        rec = self._recs.get(st._cdata) if st is not None else None
        if rec is not None and not rec.label:
            self._set_label(rec, name)

    def _set_label(self, rec: StorageRecord, name: str) -> None:
        rec.label = name
        self.label_bytes[name] = self.label_bytes.get(name, 0) + rec.nbytes
        if self.events is not None and rec.event >= 0 and name in self.stream_of_label:
            for i in range(len(rec.parts or [rec.raw])):
                self.events[rec.event + i][3] = self.stream_of_label[name]

    @contextlib.contextmanager
    def track_resizes(self):
        """Follow ``UntypedStorage.resize_`` (FSDP's unshard / reshard of parameters, which no
        dispatch mode sees, as PyTorch's own FSDP memory tracker does): a storage that grows from
        nothing is a new allocation labelled "unsharded" (temporary: FSDP frees it again)."""
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = orig(st, size)
            if tracker.device_type is None or st.device.type == tracker.device_type:
                tracker._storage_resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield self
        finally:
            torch.UntypedStorage.resize_ = orig

    def _storage_resized(self, st) -> None:
        rec = self._recs.get(st._cdata)
        if rec is None:
            if st.nbytes() > 0:
                rec = self._new(st, "temporary", True)
                self._label_unsharded(rec)
            return
        self._label_unsharded(rec)
        if st.nbytes() != rec.storage_nbytes:
            self._resized(rec, st.nbytes())

    def mark_unsharded(self, t: torch.Tensor) -> None:
        """`t` is an unsharded parameter buffer FSDP owns (one it never resizes, e.g. the root's
        when FSDP keeps it between forward and backward): label it, count it as temporary."""
        st = self._storage(t)
        rec = self._recs.get(st._cdata) if st is not None else None
        if rec is not None:
            self._label_unsharded(rec)

    def _label_unsharded(self, rec: StorageRecord) -> None:
        if rec.label is None:
            self._set_label(rec, UNSHARDED)
        if rec.cat != "temporary":  # working memory FSDP frees again, not a saved activation
            self._classify(rec, "temporary")
        rec.classified = True

    # --- the dispatch hook -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.region == "step" and "backward-start" not in self.marks and \
                torch._C._current_autograd_node() is not None:
            self.marks["backward-start"] = self.live_bytes
        if _DTENSOR is not None and any(issubclass(t, _DTENSOR) for t in types):
            return NotImplemented  # DTensor's dispatch first: the tracker sees its local ops
        before = self.live_bytes
        if func is _GROUPED_MM and args[0].dtype != torch.bfloat16 and _fake(args[0]):
            out = _gpu_grouped_mm(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        self.num_ops += 1
        self.ops_seen.add(func)
        self._see_all(out, func, args)
        if func in _COLLECTIVE_BUFFERS:
            i, name = _COLLECTIVE_BUFFERS[func]
            if len(args) > i and isinstance(args[i], torch.Tensor):
                self.label(args[i], name)
        if self.limit_bytes is not None and self.live_bytes > before:
            self.check_limit(f" after {func} allocated {self.live_bytes - before} bytes")
        return out

    def _see_all(self, out, func, args) -> None:
        if isinstance(out, torch.Tensor):
            self._see(out, func, args)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, func, args)
                elif isinstance(o, (tuple, list)):
                    for x in o:
                        if isinstance(x, torch.Tensor):
                            self._see(x, func, args)

    def _see(self, t: torch.Tensor, func, args) -> None:
        st = self._storage(t)
        if st is None:
            return
        rec = self._recs.get(st._cdata)
        if rec is not None:
            st_nb = st.nbytes()
            if st_nb != rec.storage_nbytes:  # resize_ / set_ grew or shrank it
                self._resized(rec, st_nb)
            return
        rec = self._new(st, "temporary", False)
        if func is _TO_COPY and args and isinstance(args[0], torch.Tensor):
            src = self._storage(args[0])
            srec = self._recs.get(src._cdata) if src is not None else None
            if srec is not None and srec.cat in ("weights", "master_weights"):
                rec.cast = True  # autocast's 16-bit copy of a parameter
                self.weight_cast_bytes += rec.nbytes

    # --- peaks -------------------------------------------------------------------------------
    def _note_peak(self) -> None:
        live = self.live_bytes
        if live > self.peak_bytes:
            self.peak_bytes = live
        if live > self.region_peaks.get(self.region, 0):
            self.region_peaks[self.region] = live
        for p in self._open:
            if self.live_bytes > p.peak_bytes:
                p.peak_bytes = self.live_bytes
                p.seq = self.seq
                p.by_category = dict(self.by_category)
                p.saved_bytes = self.saved_bytes
                p.weight_cast_bytes = self.weight_cast_bytes
                p.weight_cast_activations_bytes = self.weight_cast_activations_bytes
                p.labels = dict(self.label_bytes)
            if self.live_raw_bytes > p.peak_raw_bytes:
                p.peak_raw_bytes = self.live_raw_bytes
            if live - self.by_category["gradients"] > \
                    sum(p.sans_grad.values()) - p.sans_grad.get("gradients", 0):
                p.sans_grad_seq, p.sans_grad = self.seq, dict(self.by_category)

    def open_window(self, name: str) -> Peak:
        p = Peak(name, self.live_bytes, self.live_raw_bytes, self.seq, dict(self.by_category),
                 self.saved_bytes, self.weight_cast_bytes, self.weight_cast_activations_bytes,
                 dict(self.label_bytes), self.seq, dict(self.by_category))
        self._open.append(p)
        return p

    def close_window(self, p: Peak) -> Peak:
        self._open.remove(p)
        self.peaks.append(p)
        return p

    def begin_forward(self) -> None:
        self._in_forward = True
        self._forward_recs = []

    def end_forward(self) -> None:
        """What the forward allocated and is still alive is held for backward: activations."""
        self._in_forward = False
        for rec in self._forward_recs:
            if rec.ref() is not None and not rec.classified:
                self._classify(rec, "activations")
        self._forward_recs = []

    # --- autograd's saved tensors ------------------------------------------------------------
    def saved_tensors_hooks(self):
        """A context in which every tensor autograd saves is counted as saved until released."""

        def pack(t: torch.Tensor):
            st = self._storage(t)
            rec = self._recs.get(st._cdata) if st is not None else None
            if rec is None:
                return t
            rec.saved += 1
            if rec.saved == 1 and rec.cat not in MODEL_STATE:
                self.saved_bytes += rec.nbytes
            return _Packed(t, rec, self)

        def unpack(x):
            return x.tensor if isinstance(x, _Packed) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _unsave(self, rec: StorageRecord) -> None:
        rec.saved -= 1
        if rec.saved == 0 and rec.cat not in MODEL_STATE and rec.ref() is not None:
            self.saved_bytes -= rec.nbytes

    # --- the pilot's regions and limit -------------------------------------------------------
    def enter(self, region: str) -> None:
        """Start a region (its own peak) and record the live bytes at its start."""
        self.region = region
        self.marks.setdefault(region + "-start", self.live_bytes)
        self.region_peaks[region] = max(self.region_peaks.get(region, 0), self.live_bytes)

    def reset_marks(self) -> None:
        self.marks.clear()
        self.region_peaks.clear()

    def check_limit(self, what: str = "") -> None:
        """Raise the allocator's out-of-memory error when live bytes pass ``limit_bytes``."""
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            self.num_ooms += 1
            raise torch.OutOfMemoryError(
                f"{SIMULATED_OOM} (--memory-limit {self.limit_bytes} bytes): "
                f"{self.live_bytes} bytes of tensors live{what}")


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except (ImportError, RuntimeError):  # a build without torch.distributed
        return None
    return DTensor


_DTENSOR = _dtensor_class()


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): this rank's shard
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


