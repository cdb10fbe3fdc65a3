"""The analytic memory plan: pure arithmetic over the model's architecture and the run spec.

No torch import on this path (it is what `tunepilot plan` runs in milliseconds). The model is the
implementation tunepilot's pilot runs: Hugging Face transformers decoders with SDPA attention (a
flash/memory-efficient kernel, so no s x s term), PEFT LoRA, PyTorch optimizers, autocast for the
*-mixed precisions. Byte counts per token are derived in the comments from what autograd saves.

The peak is taken over the step's timeline (a list of phases), not as a sum of maxima:
  forward-end    inside autocast: saved activations, autocast's weight casts, the logits and
                 their fp32 upcast
  loss-backward  the cross-entropy backward: saved activations and the fp32 loss gradients
  backward-end   all gradients materialised, activations freed
  optimizer-step gradients + optimizer state + the optimizer's temporaries
Optimizer state exists from step 1 on, so every phase includes it (the plan is of step 2+).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from tunepilot.arch import (
    Arch,
    LinearSpec,
    linear_modules,
    lora_param_count,
    lora_targets,
    param_counts,
)
from tunepilot.spec import RunSpec

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

# Bytes per element by dtype name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# NF4 (bitsandbytes / QLoRA paper, Dettmers et al. 2023, section 3): 4-bit codes = 0.5 B/param,
# plus one fp32 absmax per block of 64 weights (4/64 B/param); with double quantization the absmax
# values are 8-bit with one fp32 constant per 256 of them (1/64 + 4/(64*256) B/param).
NF4_BYTES_PER_PARAM = 0.5
NF4_ABSMAX_BYTES_PER_PARAM = 4 / 64
NF4_DQ_ABSMAX_BYTES_PER_PARAM = 1 / 64 + 4 / (64 * 256)
# bitsandbytes 8-bit optimizers: two uint8 states + one fp32 absmax per 256-element block each
# (bitsandbytes Optimizer2State.init_state, blocksize 256).
ADAM8BIT_BYTES_PER_PARAM = 2 + 2 * 4 / 256
# The chunk a chunked loss computes at once (tokens); tunepilot's own chunked loss uses the same.
CHUNKED_LOSS_TOKENS = 1024
# FSDP2 keeps the current and the prefetched layer unsharded while resharding after forward.
FSDP_UNSHARDED_LAYERS = 2


@cache
def runtime_constants() -> dict:
    import yaml

    return yaml.safe_load((DATA_DIR / "runtime.yaml").read_text())


@dataclass
class Phase:
    """Live bytes by component at one point of the step's timeline."""

    name: str
    weights_bytes: int = 0
    master_weights_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    temporary_bytes: int = 0
    collective_buffers_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.master_weights_bytes + self.gradients_bytes
                + self.optimizer_bytes + self.activations_bytes + self.temporary_bytes
                + self.collective_buffers_bytes)


@dataclass
class ParamSplit:
    total: int
    trainable: int
    frozen: int


@dataclass
class MemoryPlan:
    """What one device needs for one training step of the spec (bytes; GiB = 2**30)."""

    fidelity: str
    params: ParamSplit
    per_device: dict
    phases: list[Phase]
    peak_phase: str
    bytes_per_param: dict
    tokens_per_micro_batch: int
    tokens_per_optimizer_step: int
    world_size: int
    strategy: str
    stack: str
    assumptions: list[str] = field(default_factory=list)
    cards: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phases"] = [dict(asdict(p), total_bytes=p.total_bytes) for p in self.phases]
        return d


# --- the arithmetic --------------------------------------------------------------------------


def _dtypes(spec: RunSpec) -> tuple[int, int, int]:
    """(compute bytes, residual-stream bytes, trainable-param bytes) for the precision.

    Under autocast (*-mixed) matmuls run in 16 bit while fp32 parameters keep the residual stream
    in fp32; a LoRA run's 16-bit frozen base keeps the stream in 16 bit. bf16-true is all bf16,
    fp32 all fp32. PEFT keeps LoRA adapters in fp32 whatever the base (autocast_adapter_dtype).
    """
    cb = 4 if spec.precision == "fp32" else 2
    if spec.method.is_lora:
        sb = DTYPE_BYTES[spec.frozen_base_dtype]
        return cb, sb, 4
    if spec.precision == "bf16-true":
        return 2, 2, 2
    return cb, 4, 4  # fp32, or *-mixed with fp32 parameters


# Which per-layer input a linear reads: matmul inputs are saved per input tensor, not per linear
# (q, k and v share one input; gate and up share one).
_O_NAMES = {"o_proj", "dense", "out_proj", "c_proj"}
_DOWN_NAMES = {"down_proj", "fc2", "dense_4h_to_h", "w2", "c_proj"}


def _input_group(lin: LinearSpec) -> str:
    if lin.group == "attention":
        return "o_in" if lin.name in _O_NAMES else "attn_in"
    if lin.group == "mlp" and lin.name in _DOWN_NAMES:
        return "down_in"
    return "mlp_in"  # gate/up (and the MoE router) read the MLP's input


def _layer_activation_bytes_per_token(arch: Arch, spec: RunSpec, cb: int, sb: int) -> int:
    """Bytes autograd saves for one decoder layer, per token, without checkpointing.

    A matmul saves its input only when its weight needs a gradient: full fine-tuning saves every
    linear's input (cb per feature); a frozen LoRA base saves none, and the adapters save theirs
    (see _lora_saved_bytes_per_token). A norm saves its input in fp32 (HF RMSNorm upcasts: 4h;
    LayerNorm: 4h under autocast/fp32, 2h under bf16-true) and, when its weight trains, the
    normalised value (sb*h).
    SDPA (flash / memory-efficient): q, k, v and the output (cb*(2*hq + 2*hkv)) + fp32 logsumexp.
    MLP gated (SwiGLU/GeGLU): the gate output (saved by the activation), act(gate) and the up
    output (saved by the product): 3*cb*i per routed expert; plain (GELU): the fc1 output.
    """
    h = arch.hidden_size
    hq = arch.num_heads * arch.head_dim
    hkv = arch.num_kv_heads * arch.head_dim
    i = arch.intermediate_size
    k = arch.experts_per_token if arch.num_experts > 1 else 1
    full = spec.method.kind == "full"
    if arch.norm_kind == "rms":
        per_norm = 4 * h + (sb * h if full else 0)
    else:
        per_norm = (4 if sb == 4 else 2) * h
    norms = arch.norms_per_layer * per_norm
    sdpa = cb * (2 * hq + 2 * hkv) + 4 * arch.num_heads
    mlp = (3 if arch.mlp_kind == "gated" else 1) * cb * i * k
    if arch.num_experts > 1:
        mlp += cb * h * k + 4 * arch.num_experts  # tokens gathered per expert + router logits
    total = norms + sdpa + mlp
    if full:
        parallel = arch.family == "phi" or arch.norms_per_layer == 1  # one input, attn + MLP
        total += cb * (h + hq + (0 if parallel else h) + i * k)  # attn, o, mlp, down inputs
    else:
        total += _lora_saved_bytes_per_token(arch, spec, cb)
    return total


def _lora_saved_bytes_per_token(arch: Arch, spec: RunSpec, cb: int) -> int:
    """What LoRA layers save: each adapted input once per input tensor - PEFT keeps adapters in
    fp32, so on a bf16-true base lora_A saves the fp32 cast of its input (4*in), under autocast
    the 16-bit cast back (cb*in), under fp32 the input itself; dropout > 0 adds a mask (1 B) and
    its output (cb) per input feature per adapter; lora_A's output (r values) is saved for
    lora_B."""
    r = spec.method.lora_rank or 0
    per_feature = 4 if spec.precision == "bf16-true" else cb
    extra = 0
    inputs: dict[str, int] = {}
    for lin, mult in _lora_targets(arch, spec):
        extra += r * mult * per_feature * lin.count_per_layer
        if spec.method.lora_dropout > 0:
            extra += (1 + cb) * lin.in_features * lin.count_per_layer
        group = _input_group(lin)
        inputs[group] = max(inputs.get(group, 0), per_feature * lin.in_features)
    return extra + sum(inputs.values())


def _lora_targets(arch: Arch, spec: RunSpec) -> list[tuple[LinearSpec, int]]:
    """The matrices PEFT wraps for the spec's targets, each with its rank multiple (PEFT gives a
    fused gate_up expert parameter rank 2r)."""
    return list(lora_targets(arch, spec.method.lora_targets).items())


def _activations(arch: Arch, spec: RunSpec, cb: int, sb: int, tokens: int) -> tuple[int, int]:
    """(saved activations of all layers at the end of forward, one layer's working set).

    full checkpointing keeps only each layer's input (sb*h per token) and recomputes one layer at
    a time in backward; selective (op-level SAC as torchtitan does it) keeps matmul and SDPA
    outputs and recomputes the elementwise ops.
    """
    h = arch.hidden_size
    per_layer = _layer_activation_bytes_per_token(arch, spec, cb, sb) * tokens
    L = arch.num_layers
    ac = spec.activation_checkpointing
    if ac == "none":
        return L * per_layer, 0
    if ac == "full":
        return L * sb * h * tokens, per_layer
    hq = arch.num_heads * arch.head_dim
    hkv = arch.num_kv_heads * arch.head_dim
    k = arch.experts_per_token if arch.num_experts > 1 else 1
    mm_outs = cb * (hq + 2 * hkv + h + h) + cb * arch.intermediate_size * k * (
        2 if arch.mlp_kind == "gated" else 1)
    kept = (sb * h + mm_outs + cb * hq + 4 * arch.num_heads) * tokens
    return L * kept, per_layer


def _logits(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> tuple[int, int]:
    """(logits bytes retained at the loss, cross-entropy transient in the loss backward).

    HF computes logits (cb*V per token), upcasts them to fp32 for the loss, and log_softmax saves
    its fp32 output (4V); the 16-bit logits die with the model output when only the loss is kept
    (tunepilot's step keeps only the loss). In the loss backward the fp32 gradients of
    log_softmax's output and of its input exist together (2 x 4V). A chunked loss (recomputed per
    chunk) holds this for CHUNKED_LOSS_TOKENS at a time instead of all tokens.
    """
    V = arch.vocab_size
    t = min(tokens, CHUNKED_LOSS_TOKENS) if spec.chunked_loss else tokens
    retained = 4 * V * t
    transient = 8 * V * t
    if spec.chunked_loss:  # the final hidden states are kept for the recompute
        retained += cb * arch.hidden_size * tokens
    return retained, transient


def _optimizer_bytes(spec: RunSpec, trainable: int, shapes: list[tuple[int, ...]], stack: str
                     ) -> tuple[int, int]:
    """(optimizer state bytes, optimizer-step temporary bytes) for the trainable parameters.

    AdamW: exp_avg + exp_avg_sq in the state dtype. 8-bit: ADAM8BIT_BYTES_PER_PARAM. SGD:
    one momentum buffer. Adafactor (HF, beta1=None): a row and a column factor per matrix (fp32),
    a full second moment for vectors. foreach AdamW materialises one parameter-sized temporary
    (the sqrt(v) denominator); fused and 8-bit kernels update in place; the for-loop
    implementation holds one tensor's temporary at a time.
    """
    sdt = DTYPE_BYTES[spec.optimizer_state_dtype]
    name = spec.optimizer.name
    largest = max((_numel(s) for s in shapes), default=0)
    if name in ("adamw", "paged_adamw"):
        state = 2 * sdt * trainable
    elif name in ("adamw_8bit", "paged_adamw_8bit"):
        return int(ADAM8BIT_BYTES_PER_PARAM * trainable), 0
    elif name == "sgd":
        state = sdt * trainable
    else:  # adafactor
        state = sum(4 * (s[0] + s[1]) if len(s) == 2 else 4 * _numel(s) for s in shapes)
        return state, 4 * largest
    impl = default_optimizer_impl(spec, stack)
    if impl == "fused":
        temp = 0
    elif impl == "foreach":
        temp = sdt * trainable
    else:
        temp = sdt * largest
    return state, temp


def default_optimizer_impl(spec: RunSpec, stack: str) -> str:
    """PyTorch's own default: foreach when every tensor is on an accelerator, else for-loop."""
    return spec.optimizer.impl or ("for-loop" if stack == "cpu" else "foreach")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _trainable_shapes(arch: Arch, spec: RunSpec) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters (for per-tensor optimizer arithmetic)."""
    if spec.method.is_lora:
        r = spec.method.lora_rank or 0
        shapes: list[tuple[int, ...]] = []
        for lin, mult in _lora_targets(arch, spec):
            for _ in range(lin.count_per_layer * arch.num_layers):
                shapes += [(r * mult, lin.in_features), (lin.out_features, r * mult)]
        return shapes
    shapes = [(arch.vocab_size, arch.hidden_size)]
    if not arch.tied_embeddings:
        shapes.append((arch.vocab_size, arch.hidden_size))
    for lin in linear_modules(arch):
        shapes += [(lin.out_features, lin.in_features)] * (lin.count_per_layer * arch.num_layers)
    shapes += [(arch.hidden_size,)] * (arch.norms_per_layer * arch.num_layers + 1)
    return shapes


def split_params(arch: Arch, spec: RunSpec) -> ParamSplit:
    counts = param_counts(arch)
    if spec.method.is_lora:
        lora = lora_param_count(arch, spec.method.lora_targets, spec.method.lora_rank or 1)
        return ParamSplit(total=counts.total + lora, trainable=lora, frozen=counts.total)
    return ParamSplit(total=counts.total, trainable=counts.total, frozen=0)


def analytic_plan(spec: RunSpec, arch: Arch, stack: str = "cuda") -> MemoryPlan:
    """Plan one device's memory for the spec, for a card whose software stack is `stack`."""
    cb, sb, pb = _dtypes(spec)
    params = split_params(arch, spec)
    counts = param_counts(arch)
    N = spec.parallel.world_size
    strategy = spec.parallel.strategy
    fsdp = strategy == "fsdp"
    shard = N if fsdp else 1
    tokens = spec.tokens_per_micro_batch
    notes: list[str] = []
    mixed = spec.precision.endswith("-mixed")

    # -- parameters -------------------------------------------------------------------------
    linear_weights = sum(m.in_features * m.out_features * m.count_per_layer
                         for m in linear_modules(arch)) * arch.num_layers
    lm_head_weights = arch.vocab_size * arch.hidden_size
    if spec.method.kind == "qlora":
        quant = linear_weights + (lm_head_weights if spec.method.quantize_lm_head and
                                  not arch.tied_embeddings else 0)
        absmax = (NF4_DQ_ABSMAX_BYTES_PER_PARAM if spec.method.double_quant
                  else NF4_ABSMAX_BYTES_PER_PARAM)
        frozen_bytes = (int(quant * (NF4_BYTES_PER_PARAM + absmax))
                        + DTYPE_BYTES[spec.frozen_base_dtype] * (counts.total - quant))
        notes.append("QLoRA: NF4 base (bitsandbytes) for the decoder linears"
                     + (" and lm_head" if spec.method.quantize_lm_head else "")
                     + "; embeddings, norms" + ("" if spec.method.quantize_lm_head else
                                                 " and lm_head") + " kept in 16 bit")
    else:
        frozen_bytes = params.frozen * (DTYPE_BYTES[spec.frozen_base_dtype] if params.frozen else 0)
    trainable_store = pb
    trainable_bytes = params.trainable * trainable_store
    if mixed:  # the fp32 parameters the optimizer updates are the master copy
        weights, master = frozen_bytes, trainable_bytes
    else:
        weights, master = frozen_bytes + trainable_bytes, 0
    grads = params.trainable * trainable_store
    shapes = _trainable_shapes(arch, spec)
    optim, optim_temp = _optimizer_bytes(spec, params.trainable, shapes, stack)

    # -- sharding ---------------------------------------------------------------------------
    unsharded = 0
    if fsdp:
        weights, master, grads, optim = (x // shard for x in (weights, master, grads, optim))
        optim_temp //= shard
        per_layer_params = counts.per_layer
        root = counts.embedding + counts.lm_head
        if spec.parallel.reshard_after_forward:
            unsharded = cb * (FSDP_UNSHARDED_LAYERS * per_layer_params + root)
        else:
            unsharded = cb * counts.total
        notes.append(f"FSDP2 over {N} ranks: parameters, gradients and optimizer state sharded "
                     f"1/{N}; unsharded {'2 layers + root' if spec.parallel.reshard_after_forward else 'all layers (reshard_after_forward: false)'} in compute dtype")
        if spec.parallel.cpu_offload:
            weights = master = optim = 0
            grads = 0
            optim_temp = 0
            notes.append("cpu_offload: sharded parameters, gradients and optimizer state on host")
    buckets = 0
    if strategy == "ddp" and N > 1:
        buckets = params.trainable * trainable_store
        notes.append("DDP: gradient buckets are a second copy of the gradients "
                     "(gradient_as_bucket_view=False, PyTorch's default)")

    # -- activations ------------------------------------------------------------------------
    saved, layer_ws = _activations(arch, spec, cb, sb, tokens)
    casts_fwd = casts_bwd = 0
    if mixed and (spec.method.kind == "full" or spec.frozen_base_dtype == "fp32"):
        # autocast casts each fp32 weight to 16 bit per matmul and caches the trainable ones
        # until the forward ends; autograd saves the casts for the input gradients - unless the
        # layer is checkpointed, then only lm_head's (outside the checkpointed layers) survives.
        casts_fwd = 2 * (linear_weights + lm_head_weights) // shard
        casts_bwd = casts_fwd if spec.activation_checkpointing == "none" else \
            2 * lm_head_weights // shard
    logits_kept, logits_transient = _logits(arch, spec, cb, tokens)
    t_logits = min(tokens, CHUNKED_LOSS_TOKENS) if spec.chunked_loss else tokens
    logits_fwd = (cb + 4) * arch.vocab_size * t_logits  # lm_head output + its fp32 upcast
    dequant = 0
    if spec.method.kind == "qlora":  # one linear dequantised to bf16 at a time
        dequant = 2 * max(m.in_features * m.out_features for m in linear_modules(arch))
    accumulating = spec.gradient_accumulation_steps > 1
    largest_weight = max([m.numel * (m.count_per_layer if m.peft_kind == "parameter" else 1)
                          for m in linear_modules(arch)] + [lm_head_weights])  # fused experts
    acc_grads = grads if accumulating else 0

    phases = [
        Phase("forward-end", weights, master, acc_grads, optim,
              saved + casts_fwd + logits_kept, logits_fwd + unsharded, buckets),
        Phase("loss-backward", weights, master, acc_grads, optim,
              saved + casts_bwd + logits_kept, logits_transient + unsharded, buckets),
        Phase("backward-end", weights, master, grads, optim, layer_ws,
              cb * largest_weight + dequant + unsharded, buckets),
        Phase("optimizer-step", weights, master, grads, optim, 0, optim_temp, buckets),
    ]
    if accumulating:
        notes.append(f"gradient accumulation ({spec.gradient_accumulation_steps} micro-batches): "
                     "gradients of earlier micro-batches stay alive through later forwards")
    peak = max(phases, key=lambda p: p.total_bytes)
    load_peak = _load_peak(spec, counts.total, frozen_bytes, trainable_bytes, largest_weight, shard)
    per_device = per_device_figures(phases, buckets, stack, N, load_peak)
    allocated = max(p.total_bytes for p in phases)
    if load_peak > allocated:
        notes.append("loading the model sets the peak, not the training step "
                     "(bf16 base loaded before quantization: method.quantize_on_load: false)")
    if not arch.known_layout:
        notes.append(f"model_type {arch.model_type!r} has no known layer layout: parameter "
                     "counts are a llama-style estimate (use plan --trace for the real model)")
    notes.append(f"attention: SDPA flash/memory-efficient kernel (no s x s matrix); "
                 f"norms as Hugging Face's {'RMSNorm' if arch.norm_kind == 'rms' else 'LayerNorm'}")
    impl = default_optimizer_impl(spec, stack)
    if spec.optimizer.name in ("adamw", "paged_adamw", "sgd"):
        notes.append(f"optimizer step: {impl} implementation "
                     + ("(one parameter-sized temporary)" if impl == "foreach" else ""))

    bpp = _bytes_per_param(params, weights, master, grads, optim, shard)
    return MemoryPlan(
        fidelity="analytic", params=params, per_device=per_device, phases=phases,
        peak_phase=peak.name if load_peak <= allocated else "model-load",
        bytes_per_param=bpp, tokens_per_micro_batch=tokens,
        tokens_per_optimizer_step=tokens * spec.gradient_accumulation_steps * N,
        world_size=N, strategy=strategy, stack=stack, assumptions=notes)


def per_device_figures(phases: list[Phase], buckets: int, stack: str, world_size: int,
                       load_peak: int = 0) -> dict:
    """The per_device block shared by the analytic and the traced plan: each component's largest
    size over the timeline, the allocated peak (the largest phase, or the model load when that
    is larger), the allocator's reserve (runtime.yaml slack) and the runtime outside the
    allocator (context, workspaces, and the collective library's buffers when world_size > 1)."""
    rt = runtime_constants()
    allocated = max([p.total_bytes for p in phases] + [load_peak])
    reserved = int(allocated * (1 + rt["allocator"]["reserve_slack_fraction"]))
    st = rt["stacks"].get(stack, rt["stacks"]["cuda"])
    overhead = st["context_bytes"] + st["library_workspace_bytes"]
    if world_size > 1:
        overhead += st["collective_bytes_per_rank_group"]
    return {
        "weights_bytes": max(p.weights_bytes for p in phases),
        "gradients_bytes": max(p.gradients_bytes for p in phases),
        "optimizer_bytes": max(p.optimizer_bytes for p in phases),
        "master_weights_bytes": max(p.master_weights_bytes for p in phases),
        "activations_bytes": max(p.activations_bytes for p in phases),
        "temporary_bytes": max(p.temporary_bytes for p in phases),
        "collective_buffers_bytes": buckets,
        "allocated_peak_bytes": allocated,
        "reserved_peak_bytes": reserved,
        "runtime_overhead_bytes": overhead,
        "device_peak_bytes": reserved + overhead,
        "load_peak_bytes": load_peak,
    }


def _load_peak(spec: RunSpec, total: int, frozen_bytes: int, trainable_bytes: int,
               largest_weight: int, shard: int) -> int:
    """The model-load peak (lesson 8: loading can set the peak). Quantize-on-load (transformers +
    bitsandbytes) holds the quantized model plus one bf16 tensor; quantize-after-load holds the
    whole bf16 base for a moment."""
    if spec.method.kind == "qlora" and not spec.method.quantize_on_load:
        return 2 * total // shard
    return (frozen_bytes + trainable_bytes) // shard + 2 * largest_weight


def _bytes_per_param(params: ParamSplit, weights: int, master: int, grads: int, optim: int,
                     shard: int) -> dict:
    """Bytes per parameter by component, per the parameters they belong to (the worked example)."""
    tr = max(params.trainable, 1)
    total = max(params.total, 1)
    return {
        "weights_per_param": weights * shard / total,
        "master_weights_per_trainable_param": master * shard / tr,
        "gradients_per_trainable_param": grads * shard / tr,
        "optimizer_per_trainable_param": optim * shard / tr,
        "model_states_per_param": (weights + master + grads + optim) * shard / total,
    }
