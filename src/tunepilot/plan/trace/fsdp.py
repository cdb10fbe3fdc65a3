"""One FSDP rank's training step, traced (the child side of a sharded traced plan).

The trace builds the spec's model on fake tensors as for one device, then shards it exactly as
the scaling worker does on real ranks (tunepilot.model.shard.shard_model: FSDP2 ``fully_shard``
per decoder layer then the root, or FSDP1 where the spec says so) under a *fake* process group
of the spec's world size (``dist.init_process_group("fake", ...)``: collectives return at once,
their buffers are allocated as on a real rank), and runs the same two optimizer steps as the
single-device trace, as rank 0. What it sees, as torchtitan's memory estimator does with
PyTorch's FSDPMemTracker:

  sharded states     parameters, gradients and optimizer state are DTensors; the tracker counts
                     their local shards (dim-0 chunks, FSDP2's padding; FSDP1's flat shards)
  unsharded params   FSDP frees and re-allocates the unsharded parameters by resizing storages
                     in place; StorageTracker.track_resizes follows them ("unsharded")
  all-gather         the flat all-gather buffer of a layer and its copy-out, FSDP's implicit
                     forward prefetch and explicit backward prefetch (the next layer's
                     all-gather issued before the current layer's reshard), in program order
  reduce-scatter     the gradient buffer handed to the reduce-scatter, and the sharded output
  autocast           under *-mixed precision the unsharded fp32 parameters are cast per matmul,
                     and autograd keeps the casts it needs, as on a real rank
The streams (all-gather, reduce-scatter) run in program order here; the allocation log puts their
buffers on their own streams for the allocator replay (plan/reserve/allocator.py).

QLoRA under FSDP: the frozen linears are replaced by their packed 4-bit storage - a
(numel / codes-per-element, 1) tensor of method.quant_storage's dtype (bnb_4bit_quant_storage),
sharded like every parameter - with the quantization constants (absmax; with double
quantization 8-bit absmax + their fp32 constants) as buffers, which FSDP does not shard: each
rank holds all of them, as bitsandbytes' quant_state stays whole on every rank. Each matmul
dequantises a weight-sized 16-bit temporary in forward and again in backward (MatMul4Bit).

CPU offload (parallel.cpu_offload): the trace runs on one device type, so the sharded states
(parameters, gradients, optimizer state: by their tracked role) are moved to the host after the
trace, and the optimizer step with them (plan/trace/core.py); the unsharded parameters, all-gather
and reduce-scatter buffers and activations stay on the device, as traced.
"""

from __future__ import annotations

import contextlib

import torch

from tunepilot.plan.trace.standins import NF4_BLOCK, NF4_DQ_BLOCK, quantized_linears

_STORAGE_DTYPES = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp32": torch.float32}


def is_sharded(spec) -> bool:
    return spec.parallel.strategy == "fsdp" and spec.parallel.world_size > 1


def fake_process_group(world_size: int):
    """A fake process group of `world_size` ranks, this process rank 0, and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and dist.get_world_size() != world_size:
        dist.destroy_process_group()  # a test process traces several world sizes
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    return init_device_mesh("cpu", (world_size,))


def release_fake_process_group() -> None:
    """Destroy the fake process group a trace set up, so that nothing after it in the same
    process (a test, the GPU check) sees a world of several ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def shard_traced(model, spec, mesh, notes: list[str]):
    """The model sharded as the scaling worker shards it (no offload: see the module note)."""
    from tunepilot.model.shard import shard_model

    v = spec.parallel.fsdp_version
    model = shard_model(model, spec, mesh=mesh, device=torch.device("cpu") if v == 1 else None)
    how = ("FSDP2 fully_shard per decoder layer then the root" if v == 2 else
           "FSDP1 flat parameters per decoder layer and per trainable module, FULL_SHARD, "
           "BACKWARD_PRE prefetch")
    notes.append(f"FSDP traced per rank: {how}, reshard_after_forward "
                 f"{str(spec.parallel.reshard_after_forward).lower()}, under a fake process "
                 f"group of {spec.parallel.world_size} ranks (rank 0's shards, unsharded "
                 "parameters, all-gather and reduce-scatter buffers as FSDP allocates them)")
    return model


@contextlib.contextmanager
def fsdp1_on_fake_tensors(active: bool):
    """FSDP1 asks whether its flat parameter still points at the local shard by comparing data
    pointers, which fake tensors do not have (all 0): compare the storages themselves."""
    if not active:
        yield
        return
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    def same_storage(a, b) -> bool:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    orig_same, orig_catch = _flat_param._same_storage, _runtime_utils._catch_all_reshard

    def catch_all_reshard(state) -> None:
        h = state._handle
        if h and same_storage(h.flat_param, h.flat_param._local_shard) and \
                not h._skipped_use_sharded_views:
            return
        if h:
            _runtime_utils._reshard(state, h, _runtime_utils._should_free_in_backward(state, h))

    _flat_param._same_storage, _runtime_utils._catch_all_reshard = same_storage, catch_all_reshard
    try:
        yield
    finally:
        _flat_param._same_storage, _runtime_utils._catch_all_reshard = orig_same, orig_catch


def mark_unsharded(model, tracker) -> None:
    """Label every unsharded-parameter buffer FSDP holds (after its lazy init, i.e. after the
    first step), so the ones it never resizes - the root's, kept from forward to backward -
    count as FSDP's working memory, not as saved activations."""
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)  # FSDP2
        group = getattr(get(), "_fsdp_param_group", None) if callable(get) else None
        for fp in getattr(group, "fsdp_params", None) or []:
            for t in fp.all_gather_outputs:
                tracker.mark_unsharded(t)
        flat = getattr(getattr(m, "_handle", None), "flat_param", None)  # FSDP1
        for name in ("_full_param_padded", "_full_prec_full_param_padded"):
            t = getattr(flat, name, None)
            if isinstance(t, torch.Tensor):
                tracker.mark_unsharded(t)


def fsdp1_init_events(model, tracker, offload: bool) -> tuple[list[list[int]], set[int]]:
    """The device allocations of FSDP1's initialisation, as the FSDP1 recipes load (answer.ai's
    low_memory, accelerate's cpu_ram_efficient_loading: sync_module_states from rank 0), unit by
    unit in wrap order (children before the root): the unit's parameters materialised whole,
    flattened into one flat parameter, the rank's shard copied out, the whole copies freed.
    The caching allocator keeps those blocks: the reserve the step starts from. Returns the
    events (idents below 0) and the allocation idents of the shards they take over from the
    tracker's registration (with `offload` the shard goes to the host: none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    events: list[list[int]] = []
    taken: set[int] = set()
    ident = -1
    units = [m for m in FSDP.fsdp_modules(model) if m._handle is not None]
    for m in reversed(units):  # auto-wrap wraps the children before their parent
        flat = m._handle.flat_param
        size = flat.element_size()
        params = []
        for numel in flat._numels:
            events.append([1, ident, numel * size, 0])
            params.append(ident)
            ident -= 1
        events.append([1, ident, flat._unpadded_unsharded_size.numel() * size, 0])
        flat_id, ident = ident, ident - 1
        events += [[-1, i, 0, 0] for i in params]
        rec = tracker.record_of_storage(flat.untyped_storage())
        if rec is not None and not offload and rec.event >= 0:
            events.append(list(tracker.events[rec.event]))
            taken.add(tracker.events[rec.event][1])
        events.append([-1, flat_id, 0, 0])
    return events, taken


# ---------------------------------------------------------------------------- FSDP + QLoRA


class _PackedNF4Matmul(torch.autograd.Function):
    """bitsandbytes MatMul4Bit on packed storage: the (out, in) weight dequantised into a 16-bit
    temporary for the forward matmul and again for the input gradient; nothing saved but the
    packed weight (a parameter)."""

    @staticmethod
    def forward(ctx, x, packed, out_features: int, bias):
        w = x.new_empty(out_features, x.shape[-1])  # dequantize_4bit -> (out, in)
        out = torch.nn.functional.linear(x, w, bias)
        del w
        ctx.shape = (out_features, x.shape[-1])
        ctx.packed = packed
        return out

    @staticmethod
    def backward(ctx, grad):
        w = grad.new_empty(ctx.shape)
        return grad @ w, None, None, None


def _packed_forward(self, x):
    x = x.to(self.compute_dtype)
    return _PackedNF4Matmul.apply(x, self.weight, self.out_features, self.bias)


def packed_nf4(model, spec) -> int:
    """Replace the linears bitsandbytes would quantize (as plan/trace/standins.emulate_nf4 picks
    them) by their packed 4-bit storage in spec.quant_storage_dtype plus the quantization
    constants as buffers; the number replaced. Call on the meta model, before to_fake."""
    storage = _STORAGE_DTYPES[spec.quant_storage_dtype]
    codes_per_element = 2 * torch.empty((), dtype=storage).element_size()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.frozen_base_dtype,
                                                                   torch.bfloat16)
    n = 0
    for mod in quantized_linears(model, spec):
        numel = mod.weight.numel()
        dev = mod.weight.device
        packed = torch.empty(-(-numel // codes_per_element), 1, dtype=storage, device=dev)
        mod.weight = torch.nn.Parameter(packed, requires_grad=False)
        blocks = -(-numel // NF4_BLOCK)
        if spec.method.double_quant:  # 8-bit absmax, fp32 constants per 256, the nested code
            mod.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev))
            mod.register_buffer("absmax2", torch.empty(-(-blocks // NF4_DQ_BLOCK),
                                                       dtype=torch.float32, device=dev))
        else:
            mod.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=dev))
        mod.compute_dtype = compute
        mod.forward = _packed_forward.__get__(mod)
        n += 1
    return n
