"""What one rank holds when the run is spread over devices: the analytic plan's model states
after data parallel (DDP, FSDP, DeepSpeed ZeRO-0..3), and the model and sequence one rank
computes under tensor, sequence and context parallel. Pure arithmetic, no torch.

  tensor (Megatron-style, Shoeybi et al. 2019)  each rank holds num_heads / t attention heads
      (K/V heads too, replicated when fewer than t), intermediate_size / t of the MLP and
      vocab / t of the embedding and lm_head (vocabulary-parallel embedding and cross-entropy):
      its weights, gradients and optimizer state are those of that narrower model. Activations
      follow Korthikanti et al. 2022 (Reducing Activation Recomputation, Table 2): without
      sequence parallel the hidden-sized tensors (norm inputs, the attention and MLP inputs, the
      residual) stay whole on every rank and the rest is split (sbh(10 + 24/t) without the s x s
      term); with sequence_parallel every activation is split (sbh x 34/t).
  context (ring attention)  each rank holds sequence_length / c tokens of every sample; K and V
      chunks travel round the ring (two in flight in forward, K, V and their gradients in
      backward).
  ZeRO (Rajbhandari et al. 2020; DeepSpeed stage_1_and_2.py / stage3.py @03dc2b92) over the
      data-parallel ranks N. The engine keeps the module in the 16-bit dtype under bf16/fp16
      (bf16.enabled: the whole module, LoRA adapters included, cast by DeepSpeedEngine) and an
      fp32 master copy in the optimizer, and computes in 16 bit without autocast:
        stage 0   16-bit weights and gradients, fp32 master and optimizer state, all whole;
                  under bf16 DeepSpeed runs BF16_Optimizer instead: an fp32 gradient buffer
                  whole, the fp32 master and optimizer state 1/N (bf16_optimizer.py)
        stage 1   + master weights and optimizer state 1/N (and the fp32 gradient partition the
                  step makes)
        stage 2   + 16-bit gradients 1/N (grads_in_partition), reduced through contiguous
                  reduce buckets of reduce_bucket_size elements (two with overlap_comm)
        stage 3   + 16-bit parameters 1/N, parameters under stage3_param_persistence_threshold
                  whole; while it computes a rank holds the gathered parameters: at most
                  stage3_max_live_parameters, the layers reused within stage3_max_reuse_distance
                  (the last layers of the forward, used again at once by the backward), the
                  prefetch bucket and the module in use; the step takes one sub_group_size
                  slice at a time (_optimizer_step hands the optimizer that slice's fp32
                  partition): its fp32 gradient and the optimizer's temporaries are that slice's;
                  the 16-bit gradient partition is one buffer
                  kept through every phase (grad_partitions_flat_buffer)
      model.implementation megatron: Megatron-LM's optimizer in these terms - stage 1 its
      distributed optimizer, stage 0 without - with its fp32 main-grad buffer whole and kept
      (6 + 12/d bytes per parameter; Megatron Core docs, Distributed Optimizer)
      offload_optimizer cpu/nvme moves the master weights, optimizer state, fp32 gradients and
      the step to the host; offload_param moves the 16-bit partitions (stage 3).
The rank's slice of the model under tensor and expert parallel is the architecture's
(model/arch/slices.py: tensor_slice, expert_slice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tunepilot.errors import SpecError
from tunepilot.model.arch import Arch, ParamCounts, expert_slice, tensor_slice
from tunepilot.model.shard import FSDP_UNSHARDED_LAYERS
from tunepilot.plan.analytic.states import States, nf4_constants_bytes
from tunepilot.results.plan import ParamSplit
from tunepilot.spec import RunSpec
from tunepilot.units import fmt_bytes

# ZeRO-3's live parameters: the forward's last layers are kept gathered while their reuse (the
# backward's first use) is nearer than stage3_max_reuse_distance elements fetched - the fetches
# between the two uses are the later layers' forward and backward, so about half the distance
# is kept (stage3.py PartitionedParameterCoordinator.release_sub_module).
REUSE_KEPT_FRACTION = 0.5


@dataclass(frozen=True)
class RankView:
    """The model and step one rank computes, for the activation arithmetic."""

    states_arch: Arch  # the parameters one rank holds before data-parallel sharding
    step_arch: Arch  # the layer shapes its activations have
    step_spec: RunSpec  # the step as one device runs it (its tokens, its compute precision)
    notes: list[str] = field(default_factory=list)


def fp32_grad_buffer(spec: RunSpec) -> bool:
    """The gradients accumulate (and are reduced) in one fp32 buffer: Megatron-LM's main grads
    under bf16 (its arguments force accumulate_allreduce_grads_in_fp32), or DeepSpeed's
    BF16_Optimizer - stage 0 under bf16 (engine.get_data_types: fp32 grad_accum_dtype)."""
    par = spec.parallel
    return spec.precision.computes_in_bf16 and (
        spec.model.implementation == "megatron"
        or (par.strategy == "deepspeed" and par.deepspeed.stage == 0))


def grads_kept(spec: RunSpec) -> bool:
    """The gradients live in a buffer allocated once and kept through every phase: Megatron's
    main-grad buffer, BF16_Optimizer's fp32 buffer, ZeRO-3's partition (stage3.py
    grad_partitions_flat_buffer) - not made in the backward and freed by zero_grad."""
    par = spec.parallel
    return (spec.model.implementation == "megatron" or fp32_grad_buffer(spec)
            or (par.strategy == "deepspeed" and par.deepspeed.stage == 3))


def step_precision(spec: RunSpec) -> str:
    """The precision one rank computes in: DeepSpeed's bf16/fp16 engines hold the module in 16
    bit and run without autocast (memory as bf16-true; the fp32 master copy lives in the ZeRO
    optimizer, see zero_states)."""
    if spec.parallel.strategy == "deepspeed" and spec.precision.mixed:
        return "bf16-true"
    return spec.precision


def rank_view(spec: RunSpec, arch: Arch) -> RankView:
    """What one rank holds and computes under tensor/sequence/context parallel and DeepSpeed."""
    par = spec.parallel
    if par.strategy == "deepspeed" and spec.precision.is_fp8:
        raise SpecError("precision", f"{spec.precision} under DeepSpeed is not planned.",
                        "Plan FP8 with strategy fsdp or ddp, or use bf16-mixed with deepspeed.")
    if par.strategy == "deepspeed" and spec.precision.deepspeed_engine != spec.precision:
        raise SpecError("precision", f"{spec.precision} is not how DeepSpeed trains: its bf16 "
                        "engine holds the module in bf16 but keeps an fp32 master copy and fp32 "
                        "optimizer state in the ZeRO optimizer, whatever dtype the model was "
                        "loaded in.", f"Write precision: {spec.precision.deepspeed_engine} for "
                        "a deepspeed run (bf16-true is FSDP's or DDP's pure-bf16 run).")
    t, c, sp = par.tensor, par.context, par.sequence_parallel
    split = c * (t if sp else 1)  # ranks a sample's tokens are divided over
    notes: list[str] = []
    changes: dict = {}
    if split > 1:
        changes["sequence_length"] = -(-spec.sequence_length // split)  # (the fit's search)
    if par.model_parallel:  # the step of one rank: its replicas shard, its tokens are its own
        changes["parallel"] = dict(par.model_dump(), devices=par.replicas, nodes=1, tensor=1,
                                   context=1, sequence_parallel=False)
    if step_precision(spec) != spec.precision:
        changes["precision"] = step_precision(spec)
        if spec.method.is_lora:  # DeepSpeedEngine casts the whole module, adapters included
            changes["method"] = dict(spec.method.model_dump(), adapter_dtype="bf16")
    step_spec = spec.with_changes(**changes) if changes else spec
    step_arch = tensor_slice(arch, t)
    states_arch = expert_slice(step_arch, par.expert)
    if t > 1:
        notes.append(f"tensor parallel {t}: each rank holds {states_arch.num_heads} of "
                     f"{arch.num_heads} attention heads, {states_arch.intermediate_size} of "
                     f"{arch.intermediate_size} MLP columns and 1/{t} of the vocabulary "
                     "(weights, gradients and optimizer state of that slice); activations "
                     + ("all split 1/t (sequence parallel: norms and residual split by tokens)"
                        if sp else "split 1/t except the hidden-sized ones (norm inputs, the "
                        "attention and MLP inputs), whole on every rank without "
                        "sequence_parallel"))
    if c > 1:
        notes.append(f"context parallel {c}: each rank holds {spec.sequence_length // c} of the "
                     f"{spec.sequence_length} tokens of every sample; K/V chunks travel round "
                     "the ring (ring buffers in the layers' working set)")
    if par.expert > 1:
        notes.append(f"expert parallel {par.expert}: each rank holds {arch.num_experts // par.expert} of "
                     f"the {arch.num_experts} routed experts of every MoE layer (model/arch slices)")
    return RankView(states_arch, arch if sp else step_arch, step_spec, notes)


def ring_bytes(spec: RunSpec, arch: Arch, cb: int, tokens: int) -> int:
    """Context parallel's ring buffers in the backward: the K and V chunk computed on and the
    one arriving, and their gradients travelling back (cb bytes each)."""
    if spec.parallel.context == 1:
        return 0
    return 2 * 2 * 2 * tokens * arch.kv_dim * cb


def sequence_parallel_bytes(spec: RunSpec, arch: Arch, cb: int, tokens: int) -> int:
    """Sequence parallel's all-gathered layer input (the whole sequence, hidden-sized) alive
    while a block's column-parallel linears run; `tokens` is this rank's share."""
    if not spec.parallel.sequence_parallel:
        return 0
    return cb * arch.hidden_size * tokens * spec.parallel.tensor


def parallelize(spec: RunSpec, arch: Arch, s: States, counts: ParamCounts, params: ParamSplit,
                cb: int) -> States:
    """The data-parallel strategy's share of the model states on one rank (the tensor-parallel
    slice already taken by `counts`/`params`)."""
    par = spec.parallel
    N = par.replicas
    if par.strategy == "fsdp":
        return _fsdp(spec, arch, s, counts, cb, N)
    if par.strategy == "deepspeed":
        return zero_states(spec, arch, s, counts, params)
    s.grads_persistent = grads_kept(spec)  # Megatron's main-grad buffer
    if par.strategy == "ddp" and N > 1:
        s.buckets = s.grads
        s.notes.append("DDP: gradient buckets are a second copy of the gradients "
                       "(gradient_as_bucket_view=False, PyTorch's default)")
    return s


def _fsdp(spec: RunSpec, arch: Arch, s: States, counts: ParamCounts, cb: int, N: int
          ) -> States:
    par = spec.parallel
    consts = nf4_constants_bytes(spec, arch)
    s.weights -= consts
    if par.expert > 1:  # the rank's experts shard over the N / expert ranks that hold them
        from tunepilot.plan.analytic.moe import expert_fractions, sharded_with_experts

        fw, ft = expert_fractions(arch, spec)
        s.weights = sharded_with_experts(s.weights, fw, N, par.expert)
        s.master, s.grads, s.optim, s.optim_temp = (sharded_with_experts(
            x, ft, N, par.expert) for x in (s.master, s.grads, s.optim, s.optim_temp))
        s.notes.append(f"expert parallel {par.expert} under FSDP: the routed experts a rank "
                       f"holds are sharded over the {N // par.expert} ranks holding the same "
                       f"ones (each expert 1/{N // par.expert}), the rest over all {N}")
    else:
        s.weights, s.master, s.grads, s.optim, s.optim_temp = (
            x // N for x in (s.weights, s.master, s.grads, s.optim, s.optim_temp))
    root = counts.embedding + counts.lm_head
    shard = s.weights + s.master  # the rank's shard as stored, before any offload
    s.checkpoint_bytes = shard + cb * root + shard * N * counts.per_layer // max(1, counts.total)
    if par.reshard_after_forward:
        s.unsharded = cb * (FSDP_UNSHARDED_LAYERS * counts.per_layer + root)
        what = "2 layers + root"
    else:
        s.unsharded, what = cb * counts.total, "all layers (reshard_after_forward: false)"
    s.notes.append(f"FSDP2 over {N} ranks: parameters, gradients and optimizer state sharded "
                   f"1/{N}; unsharded {what} in compute dtype")
    if par.cpu_offload:
        host = s.weights + s.master + s.grads + s.optim
        s.weights = s.master = s.optim = s.grads = s.optim_temp = 0
        s.notes.append(offload_note(host))
    if consts:
        s.weights += consts
        s.notes.append(constants_note(consts))
    return s


def constants_note(consts: int) -> str:
    return (f"QLoRA's quantization constants ({fmt_bytes(consts)}: bitsandbytes' QuantState, "
            "an attribute of each 4-bit weight, not a parameter) are whole on every rank: "
            "neither FSDP nor ZeRO-3 shards or offloads them")


def offload_note(host_bytes: int) -> str:
    return ("cpu_offload (FSDP2 CPUOffloadPolicy): sharded parameters, gradients and optimizer "
            f"state live in host memory, {fmt_bytes(host_bytes)} per rank (pinned), and the "
            "optimizer steps on the CPU; on the device: each layer's unsharded parameters while "
            "it computes, its gradients until they are reduce-scattered and copied out")


def zero_states(spec: RunSpec, arch: Arch, s: States, counts: ParamCounts, params: ParamSplit
                ) -> States:
    """DeepSpeed ZeRO's states on one rank (see the module docstring for each stage)."""
    ds, N = spec.parallel.deepspeed, spec.parallel.replicas
    b16 = spec.precision.compute_bytes  # the module's dtype (bf16/fp16 engine, or fp32)
    t = params.trainable
    weights = s.frozen_bytes + t * b16  # the module: frozen base as stored, trainables in b16
    master, grads, optim, temp = 4 * t, t * b16, s.optim, s.optim_temp
    step_grads = 4 * t  # the fp32 gradient the step hands the optimizer
    stage = ds.stage
    megatron = spec.model.implementation == "megatron"
    bf16_optimizer = fp32_grad_buffer(spec) and not megatron
    if megatron or bf16_optimizer:
        # Megatron-LM: one contiguous main-grad buffer, whole on every rank; its optimizer
        # steps on that buffer's shard - 6 + 12/d bytes per parameter with the distributed
        # optimizer (Megatron Core docs, Distributed Optimizer). DeepSpeed's BF16_Optimizer: the
        # same fp32 gradient buffer, the fp32 master and optimizer state partitioned over ranks.
        grads = t * (4 if fp32_grad_buffer(spec) else b16)
        step_grads = 0
    s.grads_persistent = grads_kept(spec)
    if stage >= 1 or bf16_optimizer:
        master, optim, temp, step_grads = master // N, optim // N, temp // N, step_grads // N
    if stage >= 2:
        grads //= N
    if stage == 3:  # stage3.py steps one sub_group_size slice of the partition at a time:
        # its fp32 gradient and the optimizer's temporaries (a foreach AdamW's) are that slice's
        part = max(1, t // N)
        step_grads = min(step_grads, 4 * ds.sub_group_size)
        temp = temp * min(part, ds.sub_group_size) // part
    h = arch.hidden_size
    bucket = ds.elements("reduce_bucket_size", h) * b16
    if stage == 0:
        s.buckets = min(bucket, t * b16)  # the flattened all-reduce bucket
    elif stage < 3:
        s.buckets = bucket * (2 if ds.overlaps else 1) if ds.contiguous_gradients else 0
    else:
        s.buckets = bucket
    notes = [_engine_words(spec, s, grads, t, bf16_optimizer)]
    consts = nf4_constants_bytes(spec, arch) if stage == 3 else 0
    if stage == 3:
        weights, gathered = _zero3_weights(spec, arch, counts, weights - consts, params, N)
        s.unsharded = gathered
        notes.append(f"ZeRO-3: up to {fmt_bytes(gathered)} of gathered 16-bit parameters while "
                     "it computes (stage3_max_live_parameters, the layers reused within "
                     "stage3_max_reuse_distance, the prefetch bucket, the module in use); "
                     "parameters under stage3_param_persistence_threshold kept whole")
    host = 0
    if ds.offload_optimizer != "none":
        host += master + optim + step_grads + (grads if stage >= 2 else 0)
        master = optim = temp = step_grads = 0
        if stage >= 2:
            grads = 0
        notes.append(f"offload_optimizer {ds.offload_optimizer}: master weights, optimizer "
                     f"state and gradient partitions in host memory ({fmt_bytes(host)} per rank), "
                     "the optimizer steps on the CPU")
    if ds.offload_param != "none":
        persistent = counts.norms * b16
        host += max(0, weights - persistent)
        notes.append(f"offload_param {ds.offload_param}: the 16-bit parameter partitions in "
                     "host memory; only the gathered and the persistent ones on the device")
        weights = min(weights, persistent)
    if consts:
        notes.append(constants_note(consts))
    s.weights, s.master, s.grads, s.optim = weights + consts, master, grads, optim
    s.optim_temp = temp + step_grads
    s.host = host
    s.notes += notes
    return s


def _engine_words(spec: RunSpec, s: States, grads: int, t: int, bf16_optimizer: bool) -> str:
    """The plan's line about the engine holding the states: ZeRO's stage, DeepSpeed's
    BF16_Optimizer or Megatron-LM's optimizer."""
    stage, N = spec.parallel.deepspeed.stage, spec.parallel.replicas
    b16 = spec.precision.compute_bytes
    if spec.model.implementation == "megatron":
        return (f"Megatron-LM's {'distributed ' if stage else ''}optimizer over {N} "
                f"data-parallel ranks: {b16 * 8}-bit parameters, a main-grad buffer of "
                f"{fmt_bytes(grads)} ({grads // max(1, t)} B per parameter, whole on every rank, "
                "kept between steps), fp32 main parameters and optimizer state "
                + (f"sharded 1/{N}" if stage else "whole") + f"; buckets {fmt_bytes(s.buckets)}")
    if bf16_optimizer:
        return (f"DeepSpeed without ZeRO under bf16 (BF16_Optimizer) over {N} ranks: the module "
                "in 16-bit, an fp32 gradient-accumulation buffer whole on every rank and kept "
                f"between steps ({fmt_bytes(grads)}), the fp32 master and optimizer state "
                f"partitioned 1/{N}; buckets {fmt_bytes(s.buckets)}")
    words = (f"DeepSpeed ZeRO-{stage} over {N} ranks: " + _zero_sharded_words(stage)
             + f"; the module in {b16 * 8}-bit, an fp32 master copy in the optimizer; reduce "
             f"buckets {fmt_bytes(s.buckets)}")
    if stage == 3:
        words += ("; its gradient partition one buffer allocated at the start and kept through "
                  "every phase (stage3.py grad_partitions_flat_buffer)")
    return words


def _zero_sharded_words(stage: int) -> str:
    return {0: "nothing sharded (master weights and optimizer state whole)",
            1: "master weights and optimizer state sharded",
            2: "master weights, optimizer state and gradients sharded",
            3: "parameters, master weights, optimizer state and gradients sharded"}[stage]


def _zero3_weights(spec: RunSpec, arch: Arch, counts: ParamCounts, weights: int,
                   params: ParamSplit, N: int) -> tuple[int, int]:
    """(the rank's 16-bit partition + the persistent parameters, the gathered parameters)."""
    ds = spec.parallel.deepspeed
    per_param = weights / max(1, params.total)
    h = arch.hidden_size
    persistent = counts.norms  # norms' weights (and biases) sit under any threshold in use
    partitioned = max(0, params.total - persistent)
    layer = counts.per_layer
    # the module computing is gathered whatever the limits (fetch_sub_module); the limits bound
    # what is prefetched and kept besides it
    live = max(min(largest_module(arch, counts), partitioned),
               min(ds.stage3_max_live_parameters,
                   int(REUSE_KEPT_FRACTION * ds.stage3_max_reuse_distance)
                   + ds.elements("stage3_prefetch_bucket_size", h) + max(layer, counts.lm_head),
                   partitioned))
    if ds.stage3_param_persistence_threshold == 0:
        persistent = 0
    return int(partitioned * per_param) // N + int(persistent * per_param), int(live * per_param)


def largest_module(arch: Arch, counts: ParamCounts) -> int:
    """The most parameters one module holds itself (ZeRO-3 gathers a module's own parameters
    for its forward and backward): the embedding, the LM head, a linear, or a fused experts
    module (every routed expert of a layer in its gate_up and down tensors)."""
    from tunepilot.model.arch import linear_modules

    modules: dict[str, int] = {}
    for lin in linear_modules(arch):
        own = lin.path.rsplit(".", 1)[0] if lin.peft_kind == "parameter" else lin.path
        modules[own] = modules.get(own, 0) + lin.numel
    return max([counts.embedding, counts.lm_head, *modules.values()])
