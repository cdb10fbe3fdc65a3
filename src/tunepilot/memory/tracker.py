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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("weights", "master_weights", "gradients", "optimizer", "activations", "temporary")
MODEL_STATE = frozenset(("weights", "master_weights", "gradients", "optimizer"))
# CUDA caching allocator: every block is a multiple of 512 bytes (kMinBlockSize); 0 bytes -> none.
CUDA_BLOCK_BYTES = 512

_TO_COPY = torch.ops.aten._to_copy.default


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

    def to_dict(self) -> dict:
        return {"name": self.name, "peak_bytes": self.peak_bytes,
                "peak_raw_bytes": self.peak_raw_bytes, "saved_bytes": self.saved_bytes,
                "weight_cast_bytes": self.weight_cast_bytes,
                "weight_cast_activations_bytes": self.weight_cast_activations_bytes, **{
                    f"{c}_bytes": self.by_category.get(c, 0) for c in CATEGORIES}}


class _Rec:
    __slots__ = ("nbytes", "raw", "storage_nbytes", "cat", "seq", "classified", "saved", "cast",
                 "ref")

    def __init__(self, nbytes: int, raw: int, storage_nbytes: int, cat: str, seq: int,
                 classified: bool):
        self.nbytes, self.raw, self.storage_nbytes = nbytes, raw, storage_nbytes
        self.cat, self.seq = cat, seq
        self.classified, self.saved, self.cast = classified, 0, False
        self.ref = None


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

    def __init__(self, block_bytes: int = CUDA_BLOCK_BYTES):
        super().__init__()
        self.block_bytes = block_bytes
        self._recs: dict[int, _Rec] = {}
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
        self._forward_recs: list[_Rec] = []

    # --- registration ------------------------------------------------------------------------
    def _storage(self, t):
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no one storage
            return None

    def _new(self, st, cat: str, classified: bool, parts: list[int] | None = None) -> _Rec:
        st_nb = st.nbytes()
        raw = st_nb if parts is None else sum(parts)
        nb = (round_block(raw, self.block_bytes) if parts is None
              else sum(round_block(x, self.block_bytes) for x in parts))
        self.seq += 1
        rec = _Rec(nb, raw, st_nb, cat, self.seq, classified)
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

    def _classify(self, rec: _Rec, cat: str) -> None:
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

    def _free(self, key: int, rec: _Rec) -> None:
        if self._recs.get(key) is rec:
            del self._recs[key]
        self.live_bytes -= rec.nbytes
        self.live_raw_bytes -= rec.raw
        self.by_category[rec.cat] -= rec.nbytes
        if rec.saved and rec.cat not in MODEL_STATE:
            self.saved_bytes -= rec.nbytes
        if rec.cast:
            self.weight_cast_bytes -= rec.nbytes
            if rec.cat == "activations":
                self.weight_cast_activations_bytes -= rec.nbytes

    def _resized(self, rec: _Rec, st_nb: int) -> None:
        raw = st_nb if rec.raw == rec.storage_nbytes else rec.raw * st_nb // max(rec.storage_nbytes, 1)
        rec.storage_nbytes = st_nb
        nb = round_block(raw, self.block_bytes)
        self.live_bytes += nb - rec.nbytes
        self.live_raw_bytes += raw - rec.raw
        self.by_category[rec.cat] += nb - rec.nbytes
        rec.nbytes, rec.raw = nb, raw
        self._note_peak()

    # --- the dispatch hook -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.num_ops += 1
        self.ops_seen.add(func)
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
        return out

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
        for p in self._open:
            if self.live_bytes > p.peak_bytes:
                p.peak_bytes = self.live_bytes
                p.seq = self.seq
                p.by_category = dict(self.by_category)
                p.saved_bytes = self.saved_bytes
                p.weight_cast_bytes = self.weight_cast_bytes
                p.weight_cast_activations_bytes = self.weight_cast_activations_bytes
            if self.live_raw_bytes > p.peak_raw_bytes:
                p.peak_raw_bytes = self.live_raw_bytes

    def open_window(self, name: str) -> Peak:
        p = Peak(name, self.live_bytes, self.live_raw_bytes, self.seq, dict(self.by_category),
                 self.saved_bytes, self.weight_cast_bytes, self.weight_cast_activations_bytes)
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

    def _unsave(self, rec: _Rec) -> None:
        rec.saved -= 1
        if rec.saved == 0 and rec.cat not in MODEL_STATE and rec.ref() is not None:
            self.saved_bytes -= rec.nbytes

    def live_by_category(self) -> dict:
        return dict(self.by_category)


# ============================================================================ the traced step
# Everything below runs in the trace's child process (tunepilot.memory.trace) or in a test.

# a micro-batch's peak may grow by the detached loss train_step keeps (one 512-byte block)
ACCUMULATION_TOLERANCE_BYTES = 4 * CUDA_BLOCK_BYTES
STEP2_MICRO_BATCHES = 3  # micro-batches traced in step 2 (1: no grads yet; 2, 3: accumulating)
_BNB_OPTIMIZERS = {"adamw_8bit": 8, "paged_adamw_8bit": 8, "paged_adamw": 32}
# bitsandbytes.optim.optimizer.Optimizer2State.init_state: 8-bit states for tensors with at least
# min_8bit_size (4096) elements, one fp32 absmax per 256-element block per state; fp32 below.
BNB_MIN_8BIT_SIZE = 4096
BNB_STATE_BLOCK = 256
# bitsandbytes.functional.quantize_4bit: NF4 codes packed two per byte, one absmax per 64 weights
# (fp32; with double quant 8-bit + one fp32 per 256 absmax + a 256-entry fp32 code), a 16-entry
# fp32 NF4 code per tensor.
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256


def nf4_parts(numel: int, double_quant: bool) -> list[int]:
    """The device allocations bitsandbytes makes for one NF4 weight of `numel` elements."""
    blocks = -(-numel // NF4_BLOCK)
    parts = [-(-numel // 2), 16 * 4]  # packed codes (uint8), the NF4 code table (fp32)
    if double_quant:
        parts += [blocks, 4 * -(-blocks // NF4_DQ_BLOCK), 4, 256 * 4]  # uint8 absmax, absmax2,
    else:  # offset, nested code
        parts += [4 * blocks]
    return parts


class _NF4Matmul(torch.autograd.Function):
    """bitsandbytes MatMul4Bit's memory behaviour on a stand-in 16-bit weight: the weight is
    dequantised into a weight-sized 16-bit temporary for the forward matmul and again for the
    input gradient; only the input is kept for backward (the frozen weight gets no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w = torch.empty_like(weight)  # dequantize_4bit(weight) -> (out, in) in compute dtype
        out = torch.nn.functional.linear(x, w, bias)
        del w
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty_like(ctx.weight)
        return grad @ w, None, None


def _nf4_forward(self, x):
    return _NF4Matmul.apply(x.to(self.weight.dtype), self.weight, self.bias)


class BnbStandIn(torch.optim.Optimizer):
    """bitsandbytes AdamW8bit / PagedAdamW8bit / PagedAdamW, for the trace (bitsandbytes is
    CUDA-only): the same state tensors (Optimizer2State.init_state), updated in place by one
    fused kernel, so the step adds no temporaries. Paged states live in CUDA managed memory,
    outside the caching allocator; they are counted here as device memory (when resident)."""

    def __init__(self, params, bits: int, lr: float = 1e-4):
        super().__init__(params, {"lr": lr})
        self.bits = bits

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    if self.bits == 8 and p.numel() >= BNB_MIN_8BIT_SIZE:
                        blocks = -(-p.numel() // BNB_STATE_BLOCK)
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
        return None


@dataclass
class _Built:
    model: torch.nn.Module
    fake_mode: object | None
    nf4: dict  # id(param) -> allocation parts
    notes: list


def _to_fake(model: torch.nn.Module, fake_mode) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape, stride and
    dtype (tied weights stay tied)."""
    memo: dict[int, torch.Tensor] = {}
    with fake_mode:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in memo:
                    t = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
                    memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    if id(b) not in memo:
                        memo[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype,
                                                          device="cpu")
                    mod._buffers[name] = memo[id(b)]


def _emulate_nf4(model: torch.nn.Module, spec) -> dict:
    """Turn the frozen nn.Linear layers bitsandbytes would quantize (every one but lm_head, unless
    method.quantize_lm_head; as tunepilot.models._build_qlora does) into NF4 stand-ins."""
    parts: dict[int, list[int]] = {}
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or ".lora_" in name:
            continue
        leaf = name.split(".")[-1]
        base = name.split(".")[-2] if leaf == "base_layer" else leaf
        if base == "lm_head" and not spec.method.quantize_lm_head:
            continue
        mod.forward = _nf4_forward.__get__(mod)
        parts[id(mod.weight)] = nf4_parts(mod.weight.numel(), spec.method.double_quant)
    return parts


def build_for_trace(spec, config: dict, *, fake: bool = True, device: str = "cpu") -> _Built:
    """The spec's model as tunepilot.models builds it: on meta then fake CPU tensors (fake), or
    real tensors on `device` (the fake-vs-real test, the GPU check)."""
    from tunepilot.models import build_model

    notes: list[str] = []
    bspec = spec
    if spec.method.kind == "qlora":
        method = dict(spec.method.model_dump(), kind="lora", base_dtype=spec.frozen_base_dtype)
        bspec = spec.with_changes(method=method)
        notes.append("QLoRA: bitsandbytes is CUDA-only, so the NF4 base is traced as "
                     f"{spec.frozen_base_dtype} frozen linears counted at NF4 size (codes + "
                     f"absmax{' with double quantization' if spec.method.double_quant else ''}"
                     "), each matmul dequantising a weight-sized bf16 temporary as bitsandbytes "
                     "does; the rest (LoRA, activations, optimizer) is traced")
    model = build_model(bspec, "meta" if fake else device, config=config)
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()  # its dispatch cache makes layers 2..L nearly free
        _to_fake(model, fake_mode)
    nf4 = _emulate_nf4(model, spec) if spec.method.kind == "qlora" else {}
    return _Built(model, fake_mode, nf4, notes)


def trace_optimizer(spec, model, stack: str, notes: list):
    from tunepilot.memory.analytic import default_optimizer_impl
    from tunepilot.models import trainable_parameters
    from tunepilot.training import build_optimizer

    o = spec.optimizer
    if o.name in _BNB_OPTIMIZERS:
        notes.append(f"optimizer {o.name}: bitsandbytes is CUDA-only; traced with a stand-in "
                     "holding the same state tensors (8-bit + absmax per 256 elements, fp32 "
                     "below 4096 elements), updated in place")
        return BnbStandIn(trainable_parameters(model), _BNB_OPTIMIZERS[o.name], o.lr), "bnb"
    impl = o.impl or default_optimizer_impl(spec, stack)
    if o.name in ("adamw", "sgd"):
        spec = spec.with_changes(optimizer=dict(o.model_dump(), impl=impl))
        notes.append(f"optimizer step: {o.name} {impl} implementation "
                     f"({'the spec' if o.impl else 'PyTorch default on ' + stack})")
    else:
        impl = "for-loop"
    return build_optimizer(spec, model), impl


def register_model(tracker: StorageTracker, model, spec, nf4: dict) -> dict:
    """Register parameters and buffers; return the figures the parent derives DDP/FSDP from."""
    mixed = spec.precision.endswith("-mixed")
    rows, seen = [], set()
    total = trainable = trainable_bytes = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        cat = "master_weights" if (p.requires_grad and mixed) else "weights"
        parts = nf4.get(id(p))
        tracker.register(p, cat, parts)
        nbytes = sum(parts) if parts else p.numel() * p.element_size()
        rows.append([int(p.shape[0]) if p.dim() else 1, int(nbytes), bool(p.requires_grad)])
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
            trainable_bytes += round_block(nbytes)
    for b in model.buffers():
        tracker.register(b, "weights")
    # the decoder layers: the ModuleList holding the most parameters (model.layers, gpt_neox.
    # layers, transformer.h, ... whatever the architecture calls it)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=[])
    layer_numel = sum(p.numel() for p in layers[0].parameters()) if len(layers) else 0
    in_layers = sum(p.numel() for lyr in layers for p in lyr.parameters())
    return {"total_params": total, "trainable_params": trainable,
            "trainable_bytes": trainable_bytes, "param_rows": rows, "layer_numel": layer_numel,
            "root_numel": total - in_layers, "total_base_numel": total}


def unpacked_sequences():
    """transformers checks position_ids for packed sequences (a data-dependent test) and, on
    fake tensors, assumes they may be packed and builds a 4-D mask. tunepilot's batches are one
    sequence per row (positions 0..s-1), which the real check finds: say so to transformers."""
    import contextlib
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda _ids: None)


# CUDA autocast's float32 list (PyTorch docs, "CUDA Ops that can autocast to float32"), the ops
# of it a decoder can call; CPU autocast leaves them in 16 bit, so on fake CPU tensors they are
# cast here. (The 16-bit lists - matmuls, linear, SDPA - agree between CPU and CUDA.)
_F = torch.nn.functional
_T = torch.Tensor
CUDA_AUTOCAST_FP32 = frozenset(f for f in (
    torch.pow, _T.pow, _T.__pow__, _T.__rpow__, torch.rsqrt, _T.rsqrt, torch.exp, _T.exp,
    torch.expm1, torch.log, _T.log, torch.log1p, torch.log2, torch.log10, torch.reciprocal,
    _T.reciprocal, torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv,
    _T.__rtruediv__, _T.__rdiv__, torch.softmax, _T.softmax, _F.softmax, torch.log_softmax,
    _T.log_softmax, _F.log_softmax, _F.softmin, _F.softplus, torch.layer_norm, _F.layer_norm,
    torch.group_norm, _F.group_norm, torch.sum, _T.sum, torch.prod, _T.prod, torch.cumsum,
    _T.cumsum, torch.cumprod, _T.cumprod, torch.norm, _T.norm, _F.normalize, torch.dist,
    torch.cdist, _F.cosine_similarity, _F.cross_entropy, _F.nll_loss, _F.mse_loss, _F.l1_loss,
    _F.smooth_l1_loss, _F.kl_div, _F.binary_cross_entropy_with_logits, torch.renorm,
) if f is not None)


class CudaAutocastRules(torch.overrides.TorchFunctionMode):
    """Under CPU autocast, run CUDA autocast's float32 ops in float32 as CUDA autocast does:
    16-bit floating inputs cast to fp32 (copies autograd may save), the op run in fp32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_AUTOCAST_FP32 and torch.is_autocast_enabled("cpu"):
            def up(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (
                    torch.bfloat16, torch.float16) else x

            args = tuple(up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def attention_path(tracker: StorageTracker) -> tuple[str, str]:
    names = {str(f) for f in tracker.ops_seen}
    kernels = sorted(n for n in names if "scaled_dot_product" in n)
    if any("flash_attention_for_cpu" in n for n in kernels):
        return ("sdpa-flash: the CPU flash kernel (saves output + logsumexp), as CUDA flash / "
                "memory-efficient attention on the target card; no s x s matrix", kernels[0])
    if kernels:
        return f"sdpa kernel {kernels[0]}", kernels[0]
    return ("sdpa-math or eager attention: an s x s attention matrix per head is saved "
            "(the target card's flash kernel would not)", "math")
