"""Model states of the analytic plan: the parameters by role (frozen, trainable), the bytes of
the weights, master weights, gradients and optimizer state of the whole (unsharded) model. How
they are split over ranks is plan/analytic/parallel.py. Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tunepilot.model.arch import Arch, ParamCounts, linear_modules, lora_param_count
from tunepilot.model.flops import (
    DTYPE_BYTES,
    default_optimizer_impl,
    optimizer_bytes,
    task_counts,
    trainable_shapes,
)
from tunepilot.plan.analytic import variants
from tunepilot.plan.analytic.activations import precision_bytes
from tunepilot.plan.analytic.phases import frozen_copies_bytes
from tunepilot.results.plan import ParamSplit
from tunepilot.spec import RunSpec

# NF4 (bitsandbytes / QLoRA paper, Dettmers et al. 2023, section 3): 4-bit codes = 0.5 B/param,
# plus one fp32 absmax per block of 64 weights (4/64 B/param); with double quantization the absmax
# values are 8-bit with one fp32 constant per 256 of them (1/64 + 4/(64*256) B/param).
NF4_BYTES_PER_PARAM = 0.5
NF4_ABSMAX_BYTES_PER_PARAM = 4 / 64
NF4_DQ_ABSMAX_BYTES_PER_PARAM = 1 / 64 + 4 / (64 * 256)


def split_params(arch: Arch, spec: RunSpec) -> ParamSplit:
    counts = task_counts(arch, spec)
    if spec.method.is_lora:
        lora = lora_param_count(arch, spec.method.lora_targets, spec.method.lora_rank or 1)
        if spec.model.task == "sequence-classification":  # PEFT's SEQ_CLS trains the head
            lora += counts.lm_head  # (a trainable copy beside the frozen original)
        # DoRA's magnitude vectors; the modules_to_save copies (plan/analytic/variants.py)
        lora += variants.dora_magnitude_params(arch, spec) + \
            variants.saved_module_bytes(arch, spec)[0]
        return ParamSplit(total=counts.total + lora, trainable=lora, frozen=counts.total)
    return ParamSplit(total=counts.total, trainable=counts.total, frozen=0)


@dataclass
class States:
    """Model states of one device (bytes), before and after sharding."""

    weights: int
    master: int
    grads: int
    optim: int
    optim_temp: int
    frozen_bytes: int
    trainable_bytes: int
    linear_weights: int
    lm_head_weights: int
    unsharded: int = 0
    buckets: int = 0
    host: int = 0  # bytes an offload moved to host memory (DeepSpeed ZeRO-Offload)
    # the gradients live in a buffer allocated once and kept through every phase (Megatron's
    # main-grad buffer, ZeRO-3's gradient partition, DeepSpeed's bf16 optimizer's fp32 buffer)
    grads_persistent: bool = False
    # FSDP1's sharded save: the rank's shard cloned, the root and one layer unsharded
    checkpoint_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def frozen_bytes(spec: RunSpec, arch: Arch, params: ParamSplit, counts: ParamCounts,
                  linear_weights: int, lm_head_weights: int, notes: list[str],
                  fused_weights: int = 0) -> int:
    """The frozen base: NF4 codes + absmax for QLoRA's quantized linears, else its dtype."""
    if spec.method.kind != "qlora":
        return params.frozen * (DTYPE_BYTES[spec.frozen_base_dtype] if params.frozen else 0)
    m = spec.method
    quant = linear_weights + (lm_head_weights if m.quantize_lm_head and
                              not arch.tied_embeddings else 0)
    absmax = NF4_DQ_ABSMAX_BYTES_PER_PARAM if m.double_quant else NF4_ABSMAX_BYTES_PER_PARAM
    notes.append("QLoRA: NF4 base (bitsandbytes) for the decoder linears"
                 + (" and lm_head" if m.quantize_lm_head else "") + "; embeddings, norms"
                 + ("" if m.quantize_lm_head else " and lm_head") + " kept in 16 bit")
    if fused_weights:
        notes.append(f"QLoRA on fused MoE experts: {fused_weights / 1e9:.2f}B parameters of routed "
                     "experts (and router) are 3-D parameters in transformers >= 5, not "
                     f"nn.Linear, so bitsandbytes leaves them in {spec.frozen_base_dtype} "
                     "(a checkpoint with linearized experts, as axolotl ships for Llama 4, "
                     "quantizes them)")
    return (int(quant * (NF4_BYTES_PER_PARAM + absmax))
            + DTYPE_BYTES[spec.frozen_base_dtype] * (counts.total - quant))


def nf4_constants_bytes(spec: RunSpec, arch: Arch) -> int:
    """QLoRA's quantization constants (bitsandbytes' QuantState: the absmax, and the nested
    constants under double quantization). They are attributes of each Params4bit, not
    parameters, so neither FSDP nor ZeRO-3 shards them: every rank holds them whole."""
    if spec.method.kind != "qlora":
        return 0
    m = spec.method
    quant = sum(x.in_features * x.out_features * x.count_per_layer * x.layers
                for x in linear_modules(arch) if x.peft_kind == "module")
    if m.quantize_lm_head and not arch.tied_embeddings:
        quant += arch.vocab_size * arch.hidden_size
    return int(quant * (NF4_DQ_ABSMAX_BYTES_PER_PARAM if m.double_quant
                        else NF4_ABSMAX_BYTES_PER_PARAM))


def model_states(spec: RunSpec, arch: Arch, stack: str, params: ParamSplit,
                  counts: ParamCounts) -> States:
    """Weights, master weights, gradients and optimizer state of the unsharded model."""
    _, _, pb = precision_bytes(spec)
    notes: list[str] = []
    # bitsandbytes quantizes nn.Linear modules only: fused MoE experts (3-D parameters, as
    # transformers >= 5 stores them) stay in the base dtype under QLoRA
    linears = linear_modules(arch)
    linear_weights = sum(m.in_features * m.out_features * m.count_per_layer * m.layers
                         for m in linears if m.peft_kind == "module")
    fused_weights = sum(m.numel * m.layers for m in linears if m.peft_kind == "parameter")
    lm_head_weights = (spec.model.num_labels if spec.model.task == "sequence-classification"
                       else arch.vocab_size) * arch.hidden_size
    frozen = frozen_bytes(spec, arch, params, counts, linear_weights, lm_head_weights, notes,
                          fused_weights)
    copies, copy_b = variants.saved_module_bytes(arch, spec)  # modules_to_save: base dtype
    trainable_bytes = (params.trainable - copies) * pb + copies * copy_b
    if spec.precision.mixed:  # the fp32 parameters updated are the master copy
        weights, master = frozen, trainable_bytes
    else:
        weights, master = frozen + trainable_bytes, 0
    impl = default_optimizer_impl(spec, stack)
    optim, temp = optimizer_bytes(spec, params.trainable - copies, trainable_shapes(arch, spec),
                                  impl)
    if copies:  # their state in their own dtype; foreach steps each dtype's group in turn
        o2, t2 = variants.saved_module_optimizer_bytes(arch, spec, impl)
        optim, temp = optim + o2, (temp + t2 if copy_b == pb else max(temp, t2))
    frozen_copies = frozen_copies_bytes(spec, counts.total)  # a reference / reward-model copy
    if frozen_copies:
        notes.append(f"a frozen copy of the model for the {_copies(spec)} in the compute dtype "
                     f"({frozen_copies / 2**30:,.2f} GiB) among the weights")
    return States(weights + frozen_copies, master, trainable_bytes, optim, temp, frozen,
                   trainable_bytes, linear_weights, lm_head_weights, notes=notes)


def _copies(spec: RunSpec) -> str:
    o = spec.objective
    names = ["reference"] if o.reference_kind(spec.method.kind) == "copy" else []
    return " and ".join(names + (["reward model"] if o.reward_model == "copy" else []))


@dataclass(frozen=True)
class StateBytes:
    """The model states of the whole (unsharded) model, for the host plan."""

    params: int
    trainable: int
    model_states: int
    """weights + master weights + gradients + optimizer state (bytes)"""


def state_bytes(spec: RunSpec, arch: Arch, stack: str = "cuda") -> StateBytes:
    """The unsharded model states, by the same rule as the device plan (FSDP's CPU offload moves
    each rank's 1/N of them to host memory)."""
    params = split_params(arch, spec)
    s = model_states(spec, arch, stack, params, task_counts(arch, spec))
    return StateBytes(params.total, params.trainable, s.weights + s.master + s.grads + s.optim)
