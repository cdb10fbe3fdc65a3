"""What the kernels (``spec.kernels``) and the adapter variants (``method.dora``,
``method.modules_to_save``) change in one step's memory: the arithmetic the analytic plan adds
to its stock derivation (plan/analytic/activations.py, plan/analytic/core.py). Pure arithmetic, no torch;
the trace stands in PyTorch code that saves the same tensors (plan/trace/kernel_standins.py).

Each figure is read off the kernel's own code (per token unless said otherwise):
  norms        Liger LigerRMSNormFunction / Unsloth fast_rms_layernorm save the input in its own
               dtype and one fp32 rstd per row (sb*h + 4); Liger's LayerNorm also the mean
               (sb*h + 8). Hugging Face's RMSNorm saves the fp32 upcast (4h) and, when its weight
               trains, the normalised value. Transformer Engine's fused norm keeps the same.
  gated MLP    Liger LigerSiLUMulFunction / LigerGELUMulFunction save (gate, up): 2 x i, not the
               stock 3 x i (gate, act(gate), up).
  RoPE         no change: Hugging Face's apply_rotary_pos_emb saves only the cos/sin every layer
               shares, as Liger's in-place kernel does; its effect is speed.
  attention    eager saves the (batch, heads, s, s) softmax output in fp32 and its 16-bit copy for
               the value matmul, and q plus K/V repeated to every head; sdpa, flash-attention 2/3
               and flex save q, k, v, the output and a fp32 logsumexp per head (no s x s term).
  loss         Liger fused linear cross-entropy (ops/fused_linear_cross_entropy.py) computes the
               gradients in the forward, chunk by chunk: it keeps grad_input (tokens, h), the
               lm_head's grad_weight when it trains and a fp32 loss per token; one chunk of
               next_pow2(ceil(tokens / ceil(V / h))) tokens' logits exists at a time. Cut
               Cross-Entropy (apple/ml-cross-entropy cce.py) saves its input e, the fp32
               log-sum-exp and the valid-token index, and recomputes blockwise in backward,
               allocating de and dc there. Unsloth computes its loss with Cut Cross-Entropy
               (unsloth_zoo.loss_utils.fused_linear_cross_entropy, UNSLOTH_ENABLE_CCE=1 by
               default). Liger's plain cross_entropy writes the gradient into the fp32 logits.
  DoRA         PEFT tuners/lora/dora.py DoraLinearLayer.forward: per forward an identity of
               in x in, lora_weight = B(A(I)).T, the base weight cast to the input's dtype, and
               weight + scaling * lora_weight for its row norm (weight-sized temporaries, the
               graph of lora_weight keeping the identity alive); saved for the magnitude's
               gradient: the base output and the adapter output (tokens, out) - and with
               dropout > 0 the base output is recomputed with F.linear on the cast weight,
               which autograd saves (a weight-sized tensor per DoRA layer).
"""

from __future__ import annotations

from tunepilot.errors import SpecError
from tunepilot.model.arch import Arch, LinearSpec, lora_targets
from tunepilot.model.flops import DTYPE_BYTES
from tunepilot.spec import RunSpec

# Modules PEFT's modules_to_save can train in full that the plan knows the size of, by the names
# transformers gives them (decoders' input embedding, output head, a classifier's score head).
EMBEDDING_NAMES = ("embed_tokens", "wte", "embed_in", "word_embeddings")
HEAD_NAMES = ("lm_head", "embed_out", "score")


# --------------------------------------------------------------------------- kernels in force


def fused_norm(arch: Arch, spec: RunSpec) -> str | None:
    """Which fused norm kernel replaces transformers' norm for this model, if any."""
    k = spec.kernels
    if k.unsloth:
        return "Unsloth"
    if k.transformer_engine:
        return "Transformer Engine"
    if ("rms_norm" if arch.norm_kind == "rms" else "layer_norm") in k.liger:
        return "Liger"
    return None


def norm_saved_per_token(arch: Arch, spec: RunSpec, sb: int) -> int | None:
    """Bytes one fused norm saves per token (None: transformers' own norm)."""
    if fused_norm(arch, spec) is None:
        return None
    stats = 4 if arch.norm_kind == "rms" else 8  # fp32 rstd (and mean) per row
    return sb * arch.hidden_size + stats


def fused_mlp(arch: Arch, spec: RunSpec) -> str | None:
    """Which fused gated-MLP kernel replaces act(gate) * up in a dense gated MLP, if any."""
    if arch.mlp_kind != "gated" or arch.num_experts > 1:
        return None
    k = spec.kernels
    if k.unsloth:
        return "Unsloth"
    if k.transformer_engine:
        return "Transformer Engine"
    if "swiglu" in k.liger or "geglu" in k.liger:
        return "Liger"
    return None


def attention_saved_per_token(arch: Arch, spec: RunSpec, cb: int) -> int:
    """What attention saves per token of one layer: eager's s x s softmax output (fp32, and the
    16-bit copy the value matmul saves) with q and K/V repeated to every head; the fused kernels
    (sdpa, flash-attention 2/3, flex) q, k, v, the output and a fp32 logsumexp."""
    hq = arch.num_heads * arch.head_dim
    hkv = arch.num_kv_heads * arch.head_dim
    if spec.kernels.attention == "eager":
        probs = arch.num_heads * spec.sequence_length * (4 + (cb if cb < 4 else 0))
        return cb * 3 * hq + probs
    return cb * (2 * hq + 2 * hkv) + 4 * arch.num_heads


def eager_attention_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """The s x s term eager attention adds over the fused kernels, all layers (0 otherwise)."""
    if spec.kernels.attention != "eager":
        return 0
    plain = spec.kernels.model_copy(update={"attention": "sdpa"})
    sdpa = attention_saved_per_token(arch, spec.model_copy(update={"kernels": plain}), cb)
    return (attention_saved_per_token(arch, spec, cb) - sdpa) * tokens * arch.num_layers


def loss_kernel(spec: RunSpec) -> str | None:
    """The loss kernel in use: a fused one (kernels.fused_loss), or Liger's plain cross_entropy."""
    if spec.model.task == "sequence-classification":
        return None
    fused = spec.kernels.fused_loss
    if fused is not None:
        return fused
    return "liger_cross_entropy" if "cross_entropy" in spec.kernels.liger else None


def validation_spec(spec: RunSpec) -> RunSpec:
    """The spec the validation pass computes its loss with. Liger's patched CausalLM forward
    fuses the loss only while training (lce_forward: `if self.training and labels is not None`;
    else "if in inference mode materialize logits" and the model's own loss_function): a
    validation pass holds the logits, their fp32 upcast and the log-softmax. Cut Cross-Entropy
    (use_lce: not train_only) and Unsloth keep theirs."""
    if spec.kernels.fused_loss != "liger_fused_linear_cross_entropy":
        return spec
    liger = [k for k in spec.kernels.liger if k != "fused_linear_cross_entropy"]
    return spec.with_changes(kernels=dict(spec.kernels.model_dump(), liger=liger))


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's fused linear cross-entropy chunk: next_pow2(ceil(tokens / ceil(V / h))), at most
    every token (ops/fused_linear_cross_entropy.py, chunk_mem_const 1)."""
    inc = -(-vocab // hidden)
    chunk = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(chunk, tokens)


def head_grad_bytes(arch: Arch, spec: RunSpec) -> int:
    """The lm_head's gradient when it trains (full fine-tune, or a modules_to_save copy): its
    parameter dtype, or the compute dtype of FSDP's unsharded lm_head."""
    if spec.method.is_lora and "lm_head" not in spec.method.modules_to_save:
        return 0
    if spec.method.is_lora:
        b = DTYPE_BYTES[spec.frozen_base_dtype]
    elif spec.parallel.strategy == "fsdp" and spec.parallel.world_size > 1:
        b = spec.precision.compute_bytes  # FSDP gathers it in the compute dtype
    else:
        b = spec.precision.parameter_bytes
    return b * arch.vocab_size * arch.hidden_size


def loss_bytes(arch: Arch, spec: RunSpec, cb: int, sb: int, tokens: int
               ) -> tuple[int, int, int] | None:
    """(kept at the loss, loss-backward transient, forward transient) of the loss kernel in use;
    None for transformers' own loss (plan/analytic/activations.logits_bytes)."""
    kind = loss_kernel(spec)
    V, h = arch.vocab_size, arch.hidden_size
    if kind in ("cut_cross_entropy", "unsloth"):
        kept = sb * h * tokens + (4 + 8) * tokens  # e, fp32 lse, int64 valid-token index
        return kept, sb * h * tokens + head_grad_bytes(arch, spec), 0  # de, dc
    if kind == "liger_fused_linear_cross_entropy":
        chunk = liger_chunk_tokens(tokens, V, h)
        kept = sb * h * tokens + head_grad_bytes(arch, spec)  # grad_input, grad_weight
        return kept, 0, cb * V * chunk + 4 * tokens  # one chunk's logits, the fp32 loss_1d
    if kind == "liger_cross_entropy":  # the fp32 logits hold their own gradient
        return 4 * V * tokens, cb * V * tokens, cb * V * tokens  # + lm_head's 16-bit output
    return None


def trained_head_input_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """A LoRA run's lm_head trained in full (modules_to_save) saves its input for its weight
    gradient (a frozen lm_head does not); a loss kernel keeps that input anyway."""
    if not spec.method.is_lora or "lm_head" not in spec.method.modules_to_save:
        return 0
    return 0 if loss_kernel(spec) else cb * arch.hidden_size * tokens


def offloads_activations(spec: RunSpec) -> bool:
    """Saved layer activations go to host memory: torchtune's activation_offloading, or
    Unsloth's gradient checkpointing (the checkpointed layer inputs)."""
    return spec.activation_offloading or spec.kernels.unsloth_gradient_checkpointing


def without_offload(spec: RunSpec) -> RunSpec:
    k = spec.kernels.model_copy(update={"unsloth_gradient_checkpointing": False})
    return spec.model_copy(update={"activation_offloading": False, "kernels": k})


# --------------------------------------------------------------------------- adapter variants


def dora_targets(arch: Arch, spec: RunSpec) -> dict[LinearSpec, int]:
    if not (spec.method.is_lora and spec.method.dora):
        return {}
    targets = lora_targets(arch, spec.method.lora_targets)
    fused = [s.name for s in targets if s.peft_kind == "parameter"]
    if fused:
        raise SpecError("method.dora", f"PEFT's DoRA wraps nn.Linear layers; {', '.join(fused)} "
                        "are raw parameters (fused MoE experts / router, target_parameters).",
                        "Drop dora, or target the attention projections only.")
    return targets


def dora_magnitude_params(arch: Arch, spec: RunSpec) -> int:
    """DoRA's trainable magnitude vectors: out_features per adapted matrix."""
    return sum(lin.out_features * lin.count_per_layer * lin.layers
               for lin in dora_targets(arch, spec))


def _dora_dtypes(spec: RunSpec) -> tuple[bool, int, int, bool]:
    """(autocast on, adapter/input bytes, 16-bit compute bytes, the base weight needs a cast
    to the adapter's dtype)."""
    autocast = spec.precision.mixed
    ab = DTYPE_BYTES[spec.trainable_dtype]
    base = "bf16" if spec.method.kind == "qlora" else spec.frozen_base_dtype
    return autocast, ab, spec.precision.compute_bytes, DTYPE_BYTES[base] != ab


def dora_saved_per_token(arch: Arch, spec: RunSpec) -> int:
    """Per token, one layer: the base output and the adapter output saved by DoRA's
    (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result."""
    autocast, ab, cb, _ = _dora_dtypes(spec)
    out_b = cb if autocast else ab  # lora_B's output; autocast makes it 16-bit
    base_b = cb if autocast or spec.method.lora_dropout == 0 else ab
    return int(sum(lin.out_features * lin.count_per_layer * (base_b + out_b)
                   * arch.layer_share(lin) for lin in dora_targets(arch, spec)
                   if lin.group != "head"))


def dora_saved_per_layer(arch: Arch, spec: RunSpec) -> int:
    """With lora_dropout > 0 DoRA recomputes the base output as F.linear(dropout(x), weight cast
    to x's dtype); autograd saves that weight (16-bit under autocast): per layer, not token."""
    if spec.method.lora_dropout == 0:
        return 0
    autocast, ab, cb, cast = _dora_dtypes(spec)
    if not cast and not autocast:
        return 0  # the base weight itself, already counted
    b = cb if autocast else ab
    return int(sum(b * lin.in_features * lin.out_features * lin.count_per_layer
                   * arch.layer_share(lin) for lin in dora_targets(arch, spec)
                   if lin.group != "head"))


def dora_transient(arch: Arch, spec: RunSpec) -> int:
    """The largest DoRA forward's temporaries: the in x in identity (its 16-bit cast under
    autocast) and A(I), lora_weight, the base weight cast to the adapter dtype, the scaled
    lora_weight and the sum whose row norm is taken."""
    autocast, ab, cb, cast = _dora_dtypes(spec)
    eye_b = cb if autocast else ab
    r = spec.method.lora_rank or 0
    out = 0
    for lin, mult in dora_targets(arch, spec).items():
        i, o = lin.in_features, lin.out_features
        dequant = 2 * i * o if spec.method.kind == "qlora" else 0
        out = max(out, eye_b * i * (i + r * mult) + ab * i * o * (3 + cast) + dequant)
    return out


def parameter_lora_saved_per_layer(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """LoRA on raw parameters (transformers >= 5's fused MoE experts and router, PEFT's
    target_parameters): PEFT's ParamWrapper makes W + scaling * (A B) per forward with
    torch.baddbmm and the grouped matmul saves it - a compute-dtype copy of every targeted
    weight per layer - with its input (each token once per routed expert) and the 16-bit
    A and B batches baddbmm saves."""
    if not spec.method.is_lora:
        return 0
    r = spec.method.lora_rank or 0
    k = arch.experts_per_token if arch.num_experts > 1 else 1
    out = 0
    for lin, mult in lora_targets(arch, spec.method.lora_targets).items():
        if lin.peft_kind != "parameter":
            continue
        routed = tokens * (k if lin.routed else 1)
        out += int(arch.layer_share(lin) * cb * (
            lin.numel + routed * lin.in_features
            + lin.count_per_layer * r * mult * (lin.in_features + lin.out_features)))
    return out


def saved_modules(arch: Arch, spec: RunSpec) -> list[tuple[str, int]]:
    """(name, parameters) of each module in method.modules_to_save: PEFT trains a copy of it."""
    out = []
    for name in spec.method.modules_to_save:
        if name in EMBEDDING_NAMES:
            out.append((name, arch.vocab_size * arch.hidden_size))
        elif name in HEAD_NAMES:
            classify = spec.model.task == "sequence-classification"
            if classify != (name == "score"):
                raise SpecError("method.modules_to_save", f"{name!r} is not a module of a "
                                f"{spec.model.task} model.", "Use lm_head for a causal LM, "
                                "score for a sequence-classification head.")
            if classify:
                continue  # PEFT's SEQ_CLS already trains the score head (split_params)
            bias = arch.vocab_size if arch.lm_head_bias else 0
            out.append((name, arch.vocab_size * arch.hidden_size + bias))
        else:
            raise SpecError("method.modules_to_save", f"{name!r} is not a module the plan can "
                            "size (embeddings and output heads).",
                            f"Use {', '.join(EMBEDDING_NAMES[:1] + HEAD_NAMES[:1])} (or this "
                            "model's names for them), or remove it.")
    return out


def saved_module_bytes(arch: Arch, spec: RunSpec) -> tuple[int, int]:
    """(parameters of the modules_to_save copies, bytes per parameter: the base dtype - PEFT
    deep-copies the module and upcasts only adapter layers)."""
    n = sum(numel for _, numel in saved_modules(arch, spec))
    return n, DTYPE_BYTES[spec.frozen_base_dtype]


def saved_module_optimizer_bytes(arch: Arch, spec: RunSpec, impl: str) -> tuple[int, int]:
    """(optimizer state, step temporary) of the modules_to_save copies: PyTorch keeps the state
    in the parameter's dtype, the copies' (the base dtype), whatever the adapters' is."""
    from tunepilot.model.flops import optimizer_bytes

    mods = saved_modules(arch, spec)
    n, _ = saved_module_bytes(arch, spec)
    opt = spec.optimizer.model_copy(update={"state_dtype": spec.frozen_base_dtype})
    shapes = [(numel // arch.hidden_size, arch.hidden_size) for _, numel in mods]
    return optimizer_bytes(spec.model_copy(update={"optimizer": opt}), n, shapes, impl)


# --------------------------------------------------------------------------- what the plan says


def in_use(spec: RunSpec) -> bool:
    """Whether the spec turns on a kernel or an adapter variant."""
    m = spec.method
    return spec.kernels.any or (m.is_lora and (m.dora or m.rslora or bool(m.modules_to_save)))

_LOSS_NOTES = {
    "liger_fused_linear_cross_entropy": "Liger fused linear cross-entropy: the (tokens, vocab) "
        "logits are never held - gradients made in the forward, {chunk} tokens' logits at a "
        "time; kept: grad_input (tokens x hidden){head}",
    "cut_cross_entropy": "Cut Cross-Entropy: no logits in memory - its input, a fp32 "
        "log-sum-exp and the valid-token index kept, recomputed blockwise in backward{head}",
    "unsloth": "Unsloth's loss: Cut Cross-Entropy (unsloth_zoo fused_linear_cross_entropy) - no "
        "logits in memory{head}",
    "liger_cross_entropy": "Liger cross_entropy: the fp32 logits are kept and hold their own "
        "gradient (no log-softmax copy, no separate gradient)",
}


def kernel_notes(arch: Arch, spec: RunSpec) -> list[str]:
    """What the plan assumes of the attention, norms, MLP, loss kernels and adapter variants."""
    from tunepilot.units import fmt_bytes

    k, notes = spec.kernels, []
    att = k.attention
    if att == "eager":
        s_by_s = eager_attention_bytes(arch, spec, 2, spec.batch.positions_per_micro_batch)
        notes.append("attention: eager - the (batch, heads, s, s) softmax output is saved per "
                     f"layer ({fmt_bytes(s_by_s)} over all layers in 16-bit compute)")
    else:
        what = "SDPA flash/memory-efficient kernel" if att == "sdpa" else "fused kernel"
        notes.append(f"attention: {att} ({what}, no s x s matrix)")
    norm = fused_norm(arch, spec)
    kind = "RMSNorm" if arch.norm_kind == "rms" else "LayerNorm"
    notes.append(f"norms: {norm}'s fused {kind} (its input and fp32 statistics saved)" if norm
                 else f"norms as Hugging Face's {kind}")
    mlp = fused_mlp(arch, spec)
    if mlp:
        glu = "SwiGLU" if arch.hidden_act == "silu" else "GeGLU"
        notes.append(f"gated MLP: {mlp}'s fused {glu} (saves gate and up: 2 x intermediate "
                     "per token, not 3)")
    elif {"swiglu", "geglu"} & set(k.liger):
        notes.append("Liger swiglu/geglu: no effect on this model's "
                     + ("MoE experts" if arch.num_experts > 1 else "plain MLP") + " (not modelled)")
    if "rope" in k.liger or k.unsloth:
        notes.append("RoPE kernel: no memory change (transformers' RoPE saves only the shared "
                     "cos/sin); its speed is in the time model")
    loss = loss_kernel(spec)
    if loss:
        chunk = liger_chunk_tokens(spec.batch.positions_per_micro_batch, arch.vocab_size,
                                   arch.hidden_size)
        head = head_grad_bytes(arch, spec)
        notes.append(_LOSS_NOTES[loss].format(chunk=chunk, head=(
            f" and the lm_head's gradient ({fmt_bytes(head)}, from the forward on)" if head and
            loss.startswith("liger") else f" (dc, the lm_head's gradient, {fmt_bytes(head)}, in "
            "backward)" if head else "")))
    if k.unsloth and spec.method.is_lora:
        notes.append("Unsloth's fused LoRA kernels are planned as PEFT's LoRA layers (which "
                     "save fp32 input casts Unsloth does not): an upper bound")
    if k.unsloth_gradient_checkpointing:
        notes.append("Unsloth gradient checkpointing: the checkpointed layer inputs in host "
                     "memory (pinned), two layers' worth on the device")
    if k.transformer_engine:
        notes.append("Transformer Engine: fused norms and gated MLP in BF16 (FP8 not modelled)")
    notes += _adapter_notes(arch, spec)
    return notes


def _adapter_notes(arch: Arch, spec: RunSpec) -> list[str]:
    from tunepilot.units import fmt_bytes

    m, notes = spec.method, []
    if m.is_lora and m.dora:
        n = len(dora_targets(arch, spec))
        per_layer = dora_saved_per_layer(arch, spec)
        notes.append(
            f"DoRA on {n} matrices per layer: {dora_magnitude_params(arch, spec):,} magnitude "
            f"parameters; {dora_saved_per_token(arch, spec):,} B per token per layer saved (base "
            "and adapter outputs); each forward's weight norm holds up to "
            f"{fmt_bytes(dora_transient(arch, spec))} of temporaries (identity, weight casts)"
            + (f"; with dropout {fmt_bytes(per_layer)} per layer of weight casts saved"
               if per_layer else ""))
    experts = parameter_lora_saved_per_layer(arch, spec, 2, 0) if m.is_lora else 0
    if experts:
        notes.append("LoRA on raw parameters (fused MoE experts): PEFT's target_parameters "
                     "builds W + BA each forward and the grouped matmul saves it - "
                     f"{fmt_bytes(experts)} per layer of merged weights (16-bit), with the routed "
                     "inputs")
        if (m.lora_dropout or m.dora) and spec.model.implementation != "megatron":
            notes.append("PEFT's adapter on a raw parameter (lora.ParamWrapper) takes no dropout "
                         "and no DoRA: PEFT refuses this method, so the run would not start - "
                         "set method.lora_dropout: 0 (and no DoRA), or list method.lora_targets "
                         "without the experts")
    if m.is_lora and m.rslora:
        notes.append("rsLoRA: scaling alpha/sqrt(r) instead of alpha/r - no memory or time "
                     "change")
    mods = saved_modules(arch, spec) if m.is_lora else []
    if mods:
        n, b = saved_module_bytes(arch, spec)
        notes.append(f"modules_to_save {', '.join(x for x, _ in mods)}: PEFT trains a copy of "
                     f"each ({n:,} parameters, {b} B each: weights, gradients and optimizer "
                     "state in the base dtype); the originals stay frozen")
    return notes
