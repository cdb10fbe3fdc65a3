"""Activation arithmetic of the analytic plan: what autograd saves per token and layer, what
checkpointing keeps, and the logits and cross-entropy term. Derived in the docstrings from the
ops each implementation runs; pure arithmetic, no torch.
"""

from __future__ import annotations

from tunepilot.model.arch import Arch, LinearSpec, linear_modules, lora_targets
from tunepilot.model.flops import DTYPE_BYTES
from tunepilot.plan.analytic import moe, variants
from tunepilot.spec import CHUNKED_LOSS_TOKENS, LITGPT_LM_HEAD_CHUNK, RunSpec

COMPILE_SAVED_FRACTION = 0.8  # Inductor's min-cut partitioner: pointwise outputs recomputed


def precision_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(compute bytes, residual-stream bytes, trainable-param bytes) for the precision.

    Under autocast (*-mixed) matmuls run in 16 bit while fp32 parameters keep the residual stream
    in fp32; a LoRA run's 16-bit frozen base keeps the stream in 16 bit. bf16-true is all bf16,
    fp32 all fp32. PEFT keeps LoRA adapters in fp32 whatever the base (autocast_adapter_dtype)
    unless method.adapter_dtype: bf16.
    """
    cb = spec.precision.compute_bytes
    if spec.method.is_lora:
        sb = DTYPE_BYTES[spec.frozen_base_dtype]
        return cb, sb, DTYPE_BYTES[spec.trainable_dtype]
    pb = spec.precision.parameter_bytes  # the stream is in the parameters' dtype
    return cb, pb, pb  # fp32; *-mixed with fp32 parameters; bf16-true all bf16


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


def layer_activation_bytes_per_token(arch: Arch, spec: RunSpec, cb: int, sb: int) -> int:
    """Bytes autograd saves for one decoder layer, per token, without checkpointing.

    A matmul saves its input only when its weight needs a gradient: full fine-tuning saves every
    linear's input (cb per feature); a frozen LoRA base saves none, and the adapters save theirs
    (see _lora_saved_bytes_per_token). A norm saves its input in fp32 (HF RMSNorm upcasts: 4h;
    LayerNorm: 4h under autocast/fp32, 2h under bf16-true) and, when its weight trains, the
    normalised value (sb*h).
    SDPA (flash / memory-efficient): q, k, v and the output (cb*(2*hq + 2*hkv)) + fp32 logsumexp.
    MLP gated (SwiGLU/GeGLU): the gate output (saved by the activation), act(gate) and the up
    output (saved by the product): 3*cb*i; plain (GELU): the fc1 output. An MoE model's router
    and routed experts: plan/analytic/moe.py, averaged over the layers (its dense and shared
    MLPs here).
    Fused kernels (Liger, Unsloth, Transformer Engine), eager attention and DoRA change these
    terms as plan/analytic/variants.py derives them.
    """
    h = arch.hidden_size
    hq = arch.num_heads * arch.head_dim
    ik = moe.unrouted_width_per_token(arch) if arch.is_moe else arch.intermediate_size
    full = spec.method.kind == "full"
    per_norm = variants.norm_saved_per_token(arch, spec, sb)  # a fused norm kernel's, or:
    if per_norm is None and arch.norm_kind == "rms":
        per_norm = 4 * h + (sb * h if full else 0)
    elif per_norm is None:
        per_norm = (4 if sb == 4 else 2) * h
    norms = arch.norms_per_layer * per_norm + qk_norm_saved_per_token(arch, spec, cb)
    sdpa = variants.attention_saved_per_token(arch, spec, cb)  # eager: + the s x s term
    # Megatron-core's fused bias-SwiGLU and Liger's / Unsloth's SwiGLU and GeGLU save only the
    # (gate, up) pair: 2 x i, not 3 x i
    fused_glu = spec.model.implementation == "megatron" or variants.fused_mlp(arch, spec)
    gated = 2 if fused_glu else 3
    saved_per_i = (gated if arch.mlp_kind == "gated" else 1) + python_activation_saves(arch, spec)
    mlp = saved_per_i * cb * ik
    if arch.is_moe:  # the router and the routed experts, in the MoE layers
        mlp += arch.num_moe_layers * moe.routed_saved_per_token(arch, spec, cb, sb) \
            // arch.num_layers
    total = norms + sdpa + mlp + cb * litgpt_fused_qkv_features(arch, spec)
    if full:
        parallel = arch.family == "phi" or arch.norms_per_layer == 1  # one input, attn + MLP
        total += cb * (h + hq + (0 if parallel else h) + ik)  # attn, o, mlp, down inputs
        # (the routed experts' GEMM inputs are moe.routed_saved_per_token's)
    else:
        total += _lora_saved_bytes_per_token(arch, spec, cb) + \
            variants.dora_saved_per_token(arch, spec)
    return total


def qk_norm_saved_per_token(arch: Arch, spec: RunSpec, cb: int) -> int:
    """What one layer's q/k norms (Arch.qk_norm: Qwen3, Gemma 3, OLMo 2/3, Apertus...) save per
    token: HF's RMSNorm keeps its fp32 input (4 B per q and k feature) and each row's rsqrt (a
    row per head, or one for all of q and one for k: OLMo), and, when its weight trains, the
    normalised value in the projection's dtype (cb). Measured on the CPU: tests/test_arch_plan.py."""
    if arch.qk_norm == "none":
        return 0
    heads = arch.num_heads + arch.num_kv_heads
    rows = 2 if arch.qk_norm == "full" else heads
    full = spec.method.kind == "full"
    return heads * arch.head_dim * (4 + (cb if full else 0)) + 4 * rows


PYTHON_ACTIVATIONS = {"gelu_new": 3, "gelu_fast": 4, "quick_gelu": 1}
"""transformers' activations written as Python elementwise ops, and the intermediate-sized
tensors autograd saves beyond the activation's input: NewGELU (gelu_new: GPT-2, Phi) saves
tanh's output, 0.5*x and 1+tanh; FastGELU also x*(1+0.044715x^2); QuickGELU sigmoid's
output. LitGPT, torchtune, torchtitan and Megatron call the fused F.gelu(approximate="tanh"),
which saves its input only."""


def python_activation_saves(arch: Arch, spec: RunSpec) -> int:
    """Extra intermediate-sized tensors saved per layer by a Python-coded activation (0 for a
    fused one, and for every implementation but transformers')."""
    if spec.model.implementation != "transformers" or variants.fused_mlp(arch, spec):
        return 0
    return PYTHON_ACTIVATIONS.get(arch.hidden_act, 0)


def _lora_saved_bytes_per_token(arch: Arch, spec: RunSpec, cb: int) -> int:
    """What LoRA layers save: PEFT keeps adapters in fp32, so on a bf16-true base lora_A saves the
    fp32 cast of its input (4*in), under autocast the 16-bit cast back (cb*in), under fp32 the
    input itself; dropout > 0 adds a mask (1 B) and its output (cb) per input feature per
    adapter; lora_A's output (r values) is saved for lora_B. Where the adapters' dtype is the
    stream's, adapters reading the same tensor (q, k, v; gate, up) share one saved input; where
    it differs, PEFT casts the input per adapted module (lora.Linear._cast_input_dtype), so each
    saves its own copy (measured on an H200: QLoRA all-linear on Llama-3.2-1B saved 19.57 GB of
    activations, the shared-input count 17.94)."""
    r = spec.method.lora_rank or 0
    fp32_adapters = spec.trainable_dtype == "fp32"
    bf16_true = not spec.precision.mixed and not spec.precision.all_fp32
    per_feature = 4 if bf16_true and fp32_adapters else cb
    extra = 0
    per_module = fp32_adapters and not spec.precision.all_fp32  # a cast copy per adapted module
    inputs: dict[str, int] = {}
    for lin, mult in lora_targets(arch, spec.method.lora_targets).items():
        if lin.peft_kind == "parameter":  # fused MoE experts: plan/analytic/variants.py
            continue
        share = arch.layer_share(lin)  # MoE models: a matrix only some layers hold
        extra += int(share * r * mult * per_feature * lin.count_per_layer)
        if spec.method.lora_dropout > 0:
            extra += int(share * (1 + cb) * lin.in_features * lin.count_per_layer)
        if per_module:
            extra += int(share * per_feature * lin.in_features * lin.count_per_layer)
            continue
        group = _input_group(lin)
        inputs[group] = max(inputs.get(group, 0), int(share * per_feature * lin.in_features))
    return extra + sum(inputs.values()) + cb * litgpt_kept_features(arch, spec)


def litgpt_fused_qkv_features(arch: Arch, spec: RunSpec) -> int:
    """Per token, the q and k widths of LitGPT's fused qkv output that stay alive with the v the
    attention saves (a view of that output when K/V heads = query heads; model/litgpt.py), where
    transformers' split projections - which the other implementations' counts follow - keep v
    alone."""
    if spec.model.implementation != "litgpt" or arch.num_kv_heads != arch.num_heads:
        return 0
    from tunepilot.model.litgpt import QKV_SPLIT

    names = {lin.name for lin in linear_modules(arch) if lin.group == "attention"}
    return 2 * arch.num_heads * arch.head_dim if set(QKV_SPLIT) <= names else 0


def litgpt_kept_features(arch: Arch, spec: RunSpec) -> int:
    """Per token, the adapter output features LitGPT's fused-qkv LoRA keeps for the backward
    when it adapts some but not all of q, k and v: zero_pad's index_copy saves its source, the
    enabled parts' output (model/litgpt.py)."""
    if spec.model.implementation != "litgpt" or not spec.method.is_lora:
        return 0
    from tunepilot.model.litgpt import QKV_FUSED, QKV_SPLIT, part_widths, partial_qkv

    linears = {lin.name: lin for lin in linear_modules(arch) if lin.group == "attention"}
    adapted = {lin.name for lin in lora_targets(arch, spec.method.lora_targets)}
    kept = sum(int(arch.layer_share(linears[n]) * linears[n].out_features)
               for n in partial_qkv(adapted, set(linears)))
    parts = spec.method.lora_qkv_parts
    if parts is not None and not any(n in adapted for n in QKV_FUSED):
        from tunepilot.errors import SpecError

        split = [n for n in QKV_SPLIT if n in linears]
        raise SpecError(
            field="method.lora_qkv_parts",
            message=f"{parts} names parts of a fused query/key/value matrix, but LoRA adapts "
                    f"none here ({arch.model_type}: "
                    + (f"split {', '.join(split)}" if split else "no fused qkv matrix")
                    + f" in lora_targets {spec.method.lora_targets}).",
            hint=("Name the adapted projections in method.lora_targets (e.g. [q_proj, v_proj]) "
                  "and remove lora_qkv_parts." if split else
                  "Add the fused qkv module to method.lora_targets, or remove lora_qkv_parts."))
    if parts is not None and len(set(parts)) < 3:
        widths = part_widths(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        kept += sum(int(arch.layer_share(linears[n]) * sum(widths[p] for p in parts))
                    for n in QKV_FUSED if n in adapted)
    return kept


def saved_activations(arch: Arch, spec: RunSpec, cb: int, sb: int, tokens: int) -> tuple[int, int]:
    """(saved activations of all layers at the end of forward, one layer's working set).

    full checkpointing keeps only each layer's input (sb*h per token) and recomputes one layer at
    a time in backward; selective (op-level SAC) keeps matmul and SDPA outputs and recomputes
    the elementwise ops; selective-op (torchtitan's per-op SAC) keeps only every other matmul
    output of a layer, and the SDPA outputs.
    """
    h = arch.hidden_size
    per_layer = layer_activation_bytes_per_token(arch, spec, cb, sb) * tokens + \
        variants.dora_saved_per_layer(arch, spec) + \
        variants.parameter_lora_saved_per_layer(arch, spec, cb, tokens)
    if arch.is_moe:  # per MoE layer, whatever the tokens (the eager loop's weight casts)
        per_layer += arch.num_moe_layers * moe.routed_layer_bytes(arch, spec, cb, sb) \
            // arch.num_layers
    if spec.torch_compile:  # modelled, not traced: the trace runs eager
        per_layer = int(per_layer * COMPILE_SAVED_FRACTION)
    L = arch.num_layers
    ac = spec.activation_checkpointing
    if ac == "none":
        return on_device(spec, L * per_layer, L), 0
    if ac == "full":
        return on_device(spec, L * sb * h * tokens, L), per_layer
    hq = arch.num_heads * arch.head_dim
    hkv = arch.num_kv_heads * arch.head_dim
    inter = arch.mlp_width_per_token
    if ac == "selective-op":
        # torchtitan's per-op SAC: the layer's 1st, 3rd, 5th, ... matmul output is kept, every
        # second one recomputed: q, v, gate, down kept (k, o, up recomputed); non-gated: q, v, fc1
        mm_outs = cb * (hq + hkv + inter + (h if arch.mlp_kind == "gated" else 0))
    else:
        mm_outs = cb * (hq + 2 * hkv + h + h) + cb * inter * (
            2 if arch.mlp_kind == "gated" else 1)
    kept = (sb * h + mm_outs + cb * hq + 4 * arch.num_heads) * tokens
    return on_device(spec, L * kept, L), per_layer


def layer_backward_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """The last layer's backward working set, alive with every layer's saved activations: the
    MLP's input gradients - of the down projection's input, act(gate) and up, and gate (3 x i
    per routed expert; 1 x i when a fused GLU writes its gradients into its saved inputs; 2 x i
    for a plain MLP). Smaller than the loss's transient unless a loss kernel removes that."""
    if arch.mlp_kind != "gated":
        per_i = 2
    else:
        per_i = 1 if variants.fused_mlp(arch, spec) else 3
    width = moe.largest_layer_width(arch, spec) if arch.is_moe else arch.intermediate_size
    return per_i * cb * width * tokens


OFFLOAD_LAYERS_ON_DEVICE = 2
"""activation_offloading (torchtune's OffloadActivations): the decoder layers' saved tensors
leave for host memory as the forward goes on and come back one layer ahead of the backward;
the device holds about the layer in use and the one in flight. MODELLED (the trace runs
without offloading)."""


def on_device(spec: RunSpec, saved_layers_bytes: int, num_layers: int) -> int:
    """The decoder layers' saved activations still on the device (all, unless offloaded)."""
    if not variants.offloads_activations(spec) or num_layers <= OFFLOAD_LAYERS_ON_DEVICE:
        return saved_layers_bytes
    return saved_layers_bytes * OFFLOAD_LAYERS_ON_DEVICE // num_layers


def logits_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> tuple[int, int]:
    """(logits bytes retained at the loss, cross-entropy transient in the loss backward).

    transformers computes logits (cb*V per token), upcasts them to fp32 for the loss, and
    log_softmax saves its fp32 output (4V); the 16-bit logits die with the model output when only
    the loss is kept (tunepilot's step keeps only the loss). In the loss backward the fp32
    gradients of log_softmax's output and of its input exist together (2 x 4V). A chunked loss
    (recomputed per chunk) holds this for CHUNKED_LOSS_TOKENS at a time instead of all tokens.
    Other implementations (model.implementation): LitGPT's chunked cross-entropy keeps every
    chunk (lit_gpt/utils.py chunked_cross_entropy): the 16-bit logits (cb*V) and the
    log-softmax cross-entropy saves, in the logits' dtype (fp32 under autocast), for all
    tokens; its backward works a 128-position chunk at a time;
    torchtune's CEWithChunkedOutputLoss through chunked_loss; Megatron's vocab-parallel
    cross-entropy (fused or not: megatron/core/tensor_parallel/cross_entropy.py) copies the
    logits to fp32 and turns them into the softmax it keeps in place, then writes the gradient
    into it and casts it to the logits' dtype (4V kept, cbV in the backward);
    torchtitan computes it as transformers does. sequence-classification: a
    num_labels head on the last token - no vocabulary-sized logits at all.
    """
    V = arch.vocab_size
    impl = spec.model.implementation
    if spec.model.task == "sequence-classification":
        n = spec.model.num_labels * spec.micro_batch_size
        return 4 * n, 8 * n
    kernel = variants.loss_bytes(arch, spec, cb, precision_bytes(spec)[1], tokens)
    if kernel is not None:  # Liger / Cut Cross-Entropy / Unsloth: plan/analytic/variants.py
        return kernel[0], kernel[1]
    if spec.loss_is_chunked:
        t = min(tokens, CHUNKED_LOSS_TOKENS)
        retained = 4 * V * t + cb * arch.hidden_size * tokens  # hidden states for the recompute
        return retained, 8 * V * t
    if spec.litgpt_loss:
        ls = 4 if spec.precision.mixed else cb  # log-softmax saved per chunk (fp32 under autocast)
        chunk = min(tokens, LITGPT_LM_HEAD_CHUNK * spec.micro_batch_size)
        return (cb + ls) * V * tokens, 2 * ls * V * chunk
    head_input = variants.trained_head_input_bytes(arch, spec, cb, tokens)
    if impl == "megatron":  # its fp32 softmax kept, the gradient written into it, cast to cb
        return 4 * V * tokens + head_input, cb * V * tokens
    return 4 * V * tokens + head_input, 8 * V * tokens


def logits_forward_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """The lm_head output and its fp32 upcast alive at the end of the forward (per chunk where
    the loss is chunked; for Megatron's loss the 16-bit logits beside the fp32 softmax it keeps,
    computed in place; none for classification)."""
    V = arch.vocab_size
    impl = spec.model.implementation
    if spec.model.task == "sequence-classification":
        return 4 * spec.model.num_labels * spec.micro_batch_size
    kernel = variants.loss_bytes(arch, spec, cb, precision_bytes(spec)[1], tokens)
    if kernel is not None:
        return kernel[2]
    if spec.loss_is_chunked:
        return (cb + 4) * V * min(tokens, CHUNKED_LOSS_TOKENS)
    if impl == "megatron":
        return cb * V * tokens
    if spec.litgpt_loss:
        return 0  # its 16-bit logits are the retained ones
    path = spec.hf_loss_path  # an older transformers' loss copies the shifted fp32 logits
    if path == "fp32-output":  # the fp32 upcast (the 16-bit logits freed) and its copy
        return 8 * V * tokens
    if path == "shift-copy":  # the 16-bit logits, the upcast and its copy
        return (cb + 8) * V * tokens
    return (cb + 4) * V * tokens


def kept_output_bytes(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """loop_keeps_output: the logits a loop's kept model output holds from its micro-batch's
    loss through the backward and the optimizer step (and the next micro-batch's forward,
    to-next-forward) - fp32 where the forward upcast them (transformers before 4.46), else
    the lm_head's 16-bit output."""
    if spec.output_kept == "none":
        return 0
    return (4 if spec.hf_loss_path == "fp32-output" else cb) * arch.vocab_size * tokens


def logprob_bytes(arch: Arch, spec: RunSpec, cb: int, rows: int) -> dict[str, int]:
    """The log-prob term of the DPO family and GRPO (training/preference.py: TRL's selective_log_softmax)
    for ``rows`` sequences of one micro-batch, in bytes:

      kept        what the loss keeps for backward: each row's log-softmax output - fp32 under
                  autocast (CUDA autocast runs log_softmax in fp32), 16 bit under bf16-true;
                  under fp32 the logits themselves (a logsumexp per row keeps its input)
      forward     the logits, alive until the log-probs are taken (cb x V per position), and
                  one row's fp32 upcast
      reference   a forward without gradient (the reference's, or the old policy's): its
                  logits, and one row's fp32 upcast and log-softmax
      backward    the loss backward, row by row: a row's log-softmax gradient (fp32 under
                  autocast), its 16-bit cast and the previous row's - or, at the end, the rows'
                  16-bit gradients and their stack, once the kept outputs are freed
    Positions: every token of a pair's rows (TRL's concatenated forward), the completion + 1 of
    a generated row (TRL's logits_to_keep). A chunked loss (chunked_loss: TRL 1.x's fused LM
    head) holds the logits of CHUNKED_LOSS_TOKENS positions at a time instead."""
    from tunepilot.spec.objective import lengths, logits_rows_positions

    V = arch.vocab_size
    positions = logits_rows_positions(spec, rows)
    per_row = positions // max(rows, 1)
    if spec.loss_is_chunked:
        kept, backward = logits_bytes(arch, spec, cb, positions)
        fwd = logits_forward_bytes(arch, spec, cb, positions)
        return {"kept": kept, "forward": fwd, "reference": fwd + 4 * V * min(
            positions, CHUNKED_LOSS_TOKENS), "backward": backward}
    row = V * min(per_row, lengths(spec).sequence)  # elements of one row's logits
    T = V * positions
    if spec.precision.all_fp32:  # logits fp32: gather + a logsumexp per row (their input kept)
        return {"kept": 4 * T, "forward": 4 * 4 * row, "reference": 4 * T + 16 * row,
                "backward": 12 * T}  # the gather's scatter, the rows' stack, their sum
    if not spec.precision.mixed:  # bf16-true: a 16-bit log_softmax per row, its output kept
        return {"kept": cb * T, "forward": cb * T + 2 * cb * row,
                "reference": cb * T + 2 * cb * row, "backward": 2 * cb * T}
    kept = 4 * T  # autocast: each row's log_softmax runs (and is kept) in fp32
    backward = max((4 + 2 * cb) * row, 2 * cb * T - kept)
    return {"kept": kept, "forward": cb * T + 4 * row, "reference": cb * T + 8 * row,
            "backward": backward}


def no_grad_layer_bytes(arch: Arch, cb: int, tokens: int) -> int:
    """One decoder layer's working set in a forward without gradient (the reference's, a
    validation pass, a prefill): its MLP intermediates (gate, up and their product, or fc1 and
    its activation), the largest of the layer's tensors."""
    return (3 if arch.mlp_kind == "gated" else 2) * cb * arch.largest_mlp_width * tokens
