"""The run's arithmetic that every stage shares: FLOPs per token, MFU (over the peak of
spec.precision.peak_key), and the bytes of optimizer state (one table for the plan, the quote's checkpoint
sizes and the pilot's MFU). Pure arithmetic over the architecture and the spec: no torch.

FLOPs per token (PaLM, appendix B): 6 N_trainable + 4 N_frozen + 12 L H Q T. Frozen weights
skip the weight-gradient matmul (2 of the 6). N counts the matmul weights a token passes
through: the input embedding is a lookup, not a matmul (a tied embedding still is one, as the
LM head), and a mixture-of-experts layer runs only its top-k experts, so N is the *active*
count. The attention term counts the full s x s score and value matmuls (no causal halving),
as PaLM and the MFU figures tunepilot compares with count them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tunepilot.model.arch import Arch, ParamCounts, lora_targets, param_counts, parameter_shapes
from tunepilot.spec.precision import DTYPE_BYTES

OPTIMIZER_STATES = {  # state tensors per trainable element (Adafactor: see optimizer_bytes)
    "adamw": 2, "paged_adamw": 2, "sgd": 1, "adamw_8bit": None, "paged_adamw_8bit": None,
    "adamw_8bit_torchao": None, "adamw_4bit": None, "adafactor": None,
}


MFU_RULE = ("MFU = training FLOPs per token (PaLM, at the mean processed sequence length) x "
            "token positions processed per second (padding included: the card computes them) / "
            "the card's dense peak at the spec's compute precision (spec.precision.peak_key)")


def mfu(arch: Arch, spec, positions_per_s: float, mean_sequence_length: float,
        peak_flops: float) -> float:
    """Model FLOP utilisation by MFU_RULE (a fraction): the one definition the pilot measures
    and the quote projects with."""
    return flops_per_token(arch, spec, mean_sequence_length).train * positions_per_s / peak_flops


def positions_per_s_at(arch: Arch, spec, mfu_value: float, mean_sequence_length: float,
                       peak_flops: float) -> float:
    """MFU_RULE solved for the throughput: token positions per second at this MFU."""
    return mfu_value * peak_flops / flops_per_token(arch, spec, mean_sequence_length).train


@dataclass(frozen=True)
class FlopsPerToken:
    """Training and forward-only FLOPs per token, with the numbers behind them. For the
    objectives, per token position the policy trains on, the step's other passes shared out:
    the reference's (and the old policy's, a reward model's) forward and generation's prefill
    (the decode is bound by memory bandwidth, not FLOPs: decode_seconds_per_position)."""

    train: float
    forward: float
    trainable_matmul_params: int
    frozen_matmul_params: int
    attention: float
    sequence_length: float
    extra_passes: float = 0.0
    """FLOPs per position of the objective's passes without gradient (reference, old
    log-probs, reward model, generation's prefill), included in train"""
    extra_how: str = ""

    @property
    def formula(self) -> str:
        extra = (f" + {self.extra_passes:,.0f} ({self.extra_how})" if self.extra_passes else "")
        return (f"6 x {self.trainable_matmul_params:,} trainable + 4 x "
                f"{self.frozen_matmul_params:,} frozen + {self.attention:,.0f} attention "
                f"(12 L H Q T at {self.sequence_length:,.0f} tokens){extra} = "
                f"{self.train:,.0f} FLOP/token (PaLM appendix B; for MoE the experts a token "
                "is computed through: its top-k, or every expert where transformers runs them "
                "all - Llama 4)")


def flops_per_token(arch: Arch, spec, sequence_length: float | None = None) -> FlopsPerToken:
    """FLOPs per trained token of the spec at ``sequence_length`` (default the spec's)."""
    seq = float(sequence_length if sequence_length is not None else spec.sequence_length)
    counts = param_counts(arch)
    lookup = 0 if arch.tied_embeddings else counts.embedding  # a lookup, not a matmul
    n_matmul = counts.active_per_token - lookup
    if arch.is_moe:  # the pairs the card computes: padded to a capacity, or every expert
        pairs = expert_pairs_per_token(arch, spec)
        n_matmul += round(counts.routed_experts * (pairs - arch.experts_per_token)
                          / arch.num_experts)
    if spec.method.is_lora:
        trainable, frozen = active_lora_params(arch, spec), n_matmul
    else:
        trainable, frozen = n_matmul, 0
    attn = 12.0 * arch.num_layers * arch.num_heads * arch.head_dim * seq
    train = 6.0 * trainable + 4.0 * frozen + attn
    forward = 2.0 * (trainable + frozen) + attn / 3
    extra, how = objective_passes(spec, 2.0 * n_matmul + attn / 3, seq)
    return FlopsPerToken(train + extra, forward, trainable, frozen, attn, seq, extra, how)


def expert_pairs_per_token(arch: Arch, spec) -> float:
    """Token-expert pairs the card computes per token: top-k, padded to spec.moe's capacity
    factor where one is set; every expert where the implementation runs them all
    (transformers' Llama 4: model/arch/moe.py ROUTES_EVERY_EXPERT). 0 for a dense model."""
    from tunepilot.model.arch.moe import ROUTES_EVERY_EXPERT

    if not arch.is_moe:
        return 0.0
    if arch.model_type in ROUTES_EVERY_EXPERT and spec.model.implementation == "transformers":
        return float(arch.num_experts)
    return spec.moe.pairs_per_token(arch.experts_per_token)


def objective_passes(spec, forward_per_token: float, seq: float) -> tuple[float, str]:
    """(FLOPs per trained position, what) of the objective's forwards without gradient: the
    DPO family's reference forward on both sequences; GRPO's prefill of the prompt (per
    completion with transformers' generate, once per prompt with vLLM's prefix caching), the
    reference's (beta > 0), the old policy's (num_iterations > 1) and a reward model's
    forwards, shared over the num_iterations updates of one generation batch."""
    from tunepilot.spec.objective import lengths

    o = spec.objective
    if o.kind == "sft":
        return 0.0, ""
    passes: list[tuple[float, str]] = []
    ref = o.reference_kind(spec.method.kind) not in ("none", "precomputed")
    if not o.generative:
        if ref:
            passes.append((1.0, "the reference's forward"))
    else:
        ln = lengths(spec)
        share = ln.prompt / max(ln.prompt + ln.completion, 1)
        per = 1.0 if o.generation.backend == "transformers" else 1.0 / o.generations
        passes.append((share * per, "generation's prefill"))
        if ref:
            passes.append((1.0, "the reference's forward"))
        if o.num_iterations > 1:
            passes.append((1.0, "the old policy's forward"))
        if o.reward_model != "none" or o.kind == "ppo":
            passes.append((1.0, "the reward model's forward"))
        passes = [(k / o.num_iterations, w) for k, w in passes]  # one batch, mu updates
    total = sum(k for k, _ in passes) * forward_per_token
    return total, " + ".join(f"{k:.3g} x forward for {w}" for k, w in passes)


def decode_seconds_per_position(arch: Arch, spec, hbm_bytes_per_s: float) -> float:
    """GRPO/RLOO/PPO's decode, per trained position: each of max_completion_length decode steps
    reads every weight and the generation batch's KV cache at its mean length (prompt + half
    the completion) from memory - bound by the card's HBM bandwidth (catalog), not its FLOPs
    (the bandwidth-bound floor: transformers' generate runs slower, which a pilot measures).
    A vLLM server decodes every rank's completions at once on its own cards (tensor parallel);
    each rank waits for it. 0 for objectives that do not generate."""
    from tunepilot.spec.objective import generation_batch, lengths

    o = spec.objective
    if not o.generative:
        return 0.0
    ln, g = lengths(spec), generation_batch(spec)
    cb = spec.precision.compute_bytes  # weights and KV cache in the compute dtype
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * cb
    server = o.generation.backend == "vllm-server"
    batch = g * spec.parallel.world_size if server else g  # a server decodes every rank's
    counts = param_counts(arch)  # a vision tower is not read by a text decode
    per_step = cb * (counts.total - counts.vision) + batch * kv_per_token * (ln.prompt
                                                                      + ln.completion / 2)
    seconds = ln.completion * per_step / hbm_bytes_per_s
    if server:
        seconds /= o.generation.server_devices
    return seconds / (g * ln.sequence) / o.num_iterations  # each rank waits for the decode


def active_lora_params(arch: Arch, spec) -> int:
    """LoRA parameters a token passes through: every adapter of the layers holding it, but of a
    MoE layer's routed experts only the top-k a token is routed to (a vision tower's adapters
    never run on text)."""
    rank = spec.method.lora_rank or 0
    total = 0.0
    for lin, factor in lora_targets(arch, spec.method.lora_targets).items():
        per = factor * rank * (lin.in_features + lin.out_features) * lin.count_per_layer
        if lin.routed:
            per = per * expert_pairs_per_token(arch, spec) / arch.num_experts
        total += per * lin.layers
    return int(total)


# --- optimizer state ---------------------------------------------------------------------------


def trainable_shapes(arch: Arch, spec) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters (for per-tensor optimizer arithmetic)."""
    if spec.method.is_lora:
        r = spec.method.lora_rank or 0
        shapes: list[tuple[int, ...]] = []
        targets = lora_targets(arch, spec.method.lora_targets, vision=True)
        for lin, mult in targets.items():
            if lin.peft_kind == "parameter":  # PEFT's ParamWrapper: one A and B for all experts
                rr = r * mult * lin.count_per_layer
                shapes += [(rr, lin.in_features), (lin.out_features, rr)] * lin.layers
                continue
            for _ in range(lin.count_per_layer * lin.layers):
                shapes += [(r * mult, lin.in_features), (lin.out_features, r * mult)]
        return shapes
    return parameter_shapes(arch)


def default_optimizer_impl(spec, stack: str) -> str:
    """PyTorch's own default: foreach when every tensor is on an accelerator, else for-loop."""
    return spec.optimizer.impl or ("for-loop" if stack == "cpu" else "foreach")


def optimizer_bytes(spec, trainable: int, shapes: list[tuple[int, ...]], impl: str
                    ) -> tuple[int, int]:
    """(optimizer state bytes, optimizer-step temporary bytes) for the trainable parameters.

    AdamW: exp_avg + exp_avg_sq in the state dtype. 8- and 4-bit (bitsandbytes, torchao): the
    quantized blocks of resources/optimizers.yaml per tensor (model/optimizers.py). SGD (momentum
    0.9, as tunepilot builds it): one momentum buffer. Adafactor (HF, beta1=None): a row and a
    column factor per matrix (fp32), a full second moment for vectors. foreach AdamW/SGD
    materialise one parameter-sized temporary (AdamW's sqrt(v) denominator); fused and 8-bit
    kernels update in place; the for-loop implementation holds one tensor's temporary at a time.
    """
    sdt = DTYPE_BYTES[spec.optimizer_state_dtype]
    name = spec.optimizer.name
    largest = max((_numel(s) for s in shapes), default=0)
    from tunepilot.model.optimizers import is_quantized, quantized_state_bytes

    if is_quantized(name):  # bitsandbytes / torchao 8- and 4-bit: resources/optimizers.yaml
        return quantized_state_bytes(name, shapes, DTYPE_BYTES[spec.trainable_dtype]), 0
    if name == "adafactor":
        state = sum(4 * (s[0] + s[1]) if len(s) == 2 else 4 * _numel(s) for s in shapes)
        return state, 4 * largest
    state = OPTIMIZER_STATES[name] * sdt * trainable
    temp = {"fused": 0, "foreach": sdt * trainable}.get(impl, sdt * largest)
    return state, temp


def optimizer_state_label(spec) -> str:
    """What optimizer_bytes counts, in words: '8-bit state: ...', 'state fp32', ..."""
    name = spec.optimizer.name
    from tunepilot.model.optimizers import is_quantized, optimizer_info

    if is_quantized(name):
        st = optimizer_info(name)["state"]
        per = st["bits"] / 8 * 2 + 2 * 4 / st["block"]
        return (f"{st['bits']}-bit state ({optimizer_info(name)['library']}): 2 moments in "
                f"{st['bits']}-bit codes + an fp32 scale per {st['block']}-element block, "
                f"{per:.2f} B/param")
    if name == "adafactor":
        return "factored fp32 second moment, no first moment"
    return f"state {spec.optimizer_state_dtype}"


def optimizer_state_bytes(arch: Arch, spec, trainable: int) -> int:
    """Bytes of optimizer state for the spec (what a checkpoint holds besides the weights)."""
    return optimizer_bytes(spec, trainable, trainable_shapes(arch, spec), "fused")[0]


def checkpoint_bytes(arch: Arch, spec, trainable: int) -> int:
    """A training checkpoint's tensor bytes: the trained parameters in their dtype
    (spec.trainable_dtype: LoRA adapters or a full run's parameters) + the optimizer state. The
    one rule for the plan and the quote."""
    return trainable * DTYPE_BYTES[spec.trainable_dtype] + optimizer_state_bytes(arch, spec,
                                                                                 trainable)


def task_counts(arch: Arch, spec) -> ParamCounts:
    """The parameters of the spec's model: a sequence-classification model has a
    num_labels x hidden score head instead of the vocabulary lm_head."""
    counts = param_counts(arch)
    if spec.model.task != "sequence-classification":
        return counts
    score = spec.model.num_labels * arch.hidden_size
    return dataclasses.replace(counts, total=counts.total - counts.lm_head + score,
                               lm_head=score)


def source_checkpoint_bytes_per_param(spec) -> int:
    """Bytes per parameter of the pretrained checkpoint the run loads: 4 for an fp32 run, else
    the 16-bit checkpoint as Hugging Face ships it (runtime.yaml, with its source)."""
    from tunepilot.resources import runtime_constants

    if spec.precision.all_fp32:
        return spec.precision.compute_bytes
    return int(runtime_constants()["host"]["source_checkpoint_bytes_per_param"])


def load_bytes(arch: Arch, spec) -> int:
    """The model-load bytes: the pretrained checkpoint the run starts from - every weight of
    the task's model (LoRA adapters are created, not loaded) x its bytes per parameter. The
    one rule for the quote's model-load term and the host plan's load RAM and disk."""
    return task_counts(arch, spec).total * source_checkpoint_bytes_per_param(spec)


EXPORT_RULE = ("an export is what `tunepilot export` copies off the machine: the run "
               "directory - its kept checkpoints (host.checkpoints_kept x one training "
               "checkpoint) and the stage results beside them (kilobytes, not counted)")


def export_bytes(spec, one_checkpoint_bytes: int) -> int:
    """The export bytes by EXPORT_RULE, from one checkpoint's bytes (checkpoint_bytes, or a
    measured checkpoint): the one rule for the quote's export term, the host plan and
    `tunepilot export`."""
    return spec.host.checkpoints_kept * int(one_checkpoint_bytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
