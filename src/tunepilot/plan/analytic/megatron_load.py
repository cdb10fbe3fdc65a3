"""Megatron-LM's model load on the device, and what the load leaves in the caching allocator.

Megatron builds the model's parameters on the device, a tensor each, then wraps the model in its
DistributedDataParallel, which allocates contiguous buffers and moves the parameters into them
(megatron/core/distributed/param_and_grad_buffer.py, Megatron-LM core_v0.13.0 c550cf6c):
  grad_data   torch.zeros(numel, grad_dtype): the main-grad buffer (fp32 under bf16), always
  param_data  torch.zeros(numel, param_dtype) - "Only re-map param tensors if using distributed
              optimizer" - each parameter is copied in and its first tensor freed
              (param.data = new_param_data; param.data.detach().copy_(old_param_data);
              del old_param_data)
The dense parameters' buffers are made first and the experts' (their own expert-data-parallel
buffers) after, so the load peaks at the module, the buffers made so far and the group's second
copy of its parameters.

The first tensors go back to the caching allocator, which keeps them: Megatron's
empty_unused_memory_level is 0 by default (no empty_cache). A cached block serves only a
request it fits (c10/cuda/CUDACachingAllocator.cpp; plan/reserve/allocator.py): a tensor of up
to 1 MiB sits in a 2 MiB small-pool segment, one of 1-10 MiB in a 20 MiB segment, a larger one
in its own. The step's activations are token-sized (the rank's tokens x hidden, and larger), so
the tensors whose blocks are smaller than that stay reserved through the run, beside it. Under
expandable segments the freed pages serve any later request: nothing stays.
"""

from __future__ import annotations

from tunepilot.model.arch import Arch, ParamCounts, linear_modules
from tunepilot.plan.analytic.states import States
from tunepilot.plan.reserve.allocator import round_size, segment_size
from tunepilot.spec import RunSpec

# Megatron fuses q, k and v into linear_qkv, and a gated MLP's gate and up into linear_fc1
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}


def distributed_optimizer(spec: RunSpec) -> bool:
    """Megatron's distributed optimizer (written as ZeRO stage 1): its DDP re-maps the
    parameters into a contiguous param buffer."""
    par = spec.parallel
    return par.strategy == "deepspeed" and par.deepspeed.stage >= 1


def megatron_load(spec: RunSpec, arch: Arch, step_spec: RunSpec, counts: ParamCounts,
                  s: States, *, expandable: bool) -> tuple[int, int]:
    """(the load peak, the bytes of first parameter tensors it leaves stranded in the cache) of
    one rank; `arch` is the rank's slice (tensor and expert parallel), `step_spec` the step it
    computes (its tokens under sequence and context parallel)."""
    b16 = spec.precision.compute_bytes
    module = s.frozen_bytes + (s.trainable_bytes * b16) // spec.precision.parameter_bytes
    trainable = s.trainable_bytes // spec.precision.parameter_bytes
    if not distributed_optimizer(spec):
        return module + s.grads, 0  # the main-grad buffer made beside the module
    full = spec.method.kind == "full"
    experts = min(counts.routed_experts, trainable) if full else 0
    dense = trainable - experts
    grad = s.grads / max(1, trainable)  # bytes per parameter of the main-grad buffer
    peak = module + dense * (b16 + grad)
    if experts:
        peak = max(peak, int(module + experts * b16 + trainable * grad))
    if expandable or not full:
        return int(peak), 0  # adapters: first tensors of a few MiB, nothing that matters
    token_bytes = step_spec.batch.positions_per_micro_batch * arch.hidden_size * b16
    return int(peak), stranded_bytes(arch, counts, b16, token_bytes)


def stranded_bytes(arch: Arch, counts: ParamCounts, b16: int, token_bytes: int) -> int:
    """The rank's 16-bit parameter tensors, as Megatron holds them (linear_qkv, linear_fc1, one
    tensor per expert matrix), whose cached blocks are smaller than a token-sized activation of
    `token_bytes` bytes."""
    sizes: list[int] = []
    fused: dict[tuple[str, str, int], int] = {}  # (module, tensor, layers) -> bytes per layer
    for lin in linear_modules(arch, "fused"):
        size = lin.in_features * lin.out_features * b16
        if lin.routed or lin.name not in FUSED:  # an expert's matrix, or a tensor of its own
            sizes += [size] * (lin.count_per_layer * lin.layers)
        else:
            key = (lin.path.rsplit(".", 1)[0], FUSED[lin.name], lin.layers)
            fused[key] = fused.get(key, 0) + size
    sizes += [size for (_, _, layers), size in fused.items() for _ in range(layers)]
    sizes += [n * b16 for n in (counts.embedding, counts.lm_head) if n]
    return sum(n for n in sizes if segment_size(round_size(n)) < token_bytes)


def megatron_load_note(spec: RunSpec, load_peak: int, stranded: int) -> str:
    """The plan's line about Megatron's load."""
    from tunepilot.units import fmt_bytes

    if not distributed_optimizer(spec):
        return (f"Megatron load: the module and its main-grad buffer, {fmt_bytes(load_peak)} "
                "(no param buffer without the distributed optimizer)")
    words = (f"Megatron load: its DDP copies the parameters into the distributed optimizer's "
             f"param buffer beside the main-grad buffer, {fmt_bytes(load_peak)} at the peak")
    if stranded:
        words += (f"; the first copies it frees stay cached (no empty_cache) in blocks smaller "
                  f"than the step's token-sized activations: {fmt_bytes(stranded)} reserved "
                  "beside the run (expandable_segments would reuse them)")
    return words
