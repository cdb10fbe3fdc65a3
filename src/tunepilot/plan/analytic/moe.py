"""The routed experts' memory in the analytic plan: what one MoE layer's experts save per token,
per layer, and hold for a moment, by the implementation transformers (>= 5) runs them with
(spec.moe.implementation; integrations/moe.py). Pure arithmetic, no torch; each term derived from
the code below and matched byte for byte by tests/test_moe_plan.py, which measures the tensors
autograd saves on the CPU.

Per token and MoE layer, with k' token-expert pairs per token (top_k; padded to the capacity
with spec.moe.capacity_factor; the busiest rank's share under expert parallel; every expert
for transformers' Llama 4, whose Llama4TextMoe runs all of them on every token, the router's
score zero outside the top-k):
  router     (router_saved_per_token) its fp32 softmax or sigmoid (4 E) and the top-k indices
             (8 k); renormalised top-k weights add them and their sum (4 k + 4); DeepSeek-V3's
             grouped pick its mask (E), the groups' top-2 indices, the gathered and divided
             weights; gpt-oss's the top-k indices and the softmax over them (k, 16 bit).
             DeepSeek's routers compute in fp32: the input's fp32 cast (4 h) when the router
             trains
  per pair   grouped_mm: the sort's permutation, its token index and the inverse (3 x 8 B);
             the gate_up output and act(gate) (3 i; gpt-oss's clamped, sigmoid-gated GLU 6 i)
             and the expert's output, kept for the routing-weight product (h), in the
             experts' compute dtype; the routing weight (16 bit). Full fine-tuning (expert
             weights trained) adds the GEMMs' inputs: the gathered token (h) and the down
             projection's input (i).
             eager (a loop over the experts hit): the same and one more h (the token gathered
             per expert), one index fewer.
             batched_mm: the same and a copy of the expert's weights per pair (3 i h).
  compute dtype: grouped_mm and batched_mm are not autocast ops - they run in the weights'
             dtype (fp32 under *-mixed with fp32 parameters: twice the bytes, and fp32 GEMMs);
             the eager loop's F.linear is autocast's (16 bit) - but each expert's weight slice
             is cast to 16 bit and saved, no leaf to cache: 2 x 3 i h per expert per layer.
Transient: the eager loop's one-hot expert mask (tokens x k x (E + 1), int64); under expert
parallel the all-to-all's dispatch and combine buffers (tokens x k' x h, 16 bit, each way).
"""

from __future__ import annotations

from tunepilot.model.arch import Arch
from tunepilot.model.arch.moe import ROUTES_EVERY_EXPERT
from tunepilot.spec import RunSpec

INDEX_BYTES = 8  # int64 indices (torch.sort, torch.topk, torch.where)
# i-sized tensors the experts' gating saves per pair: the gate_up output (2 i) and act(gate);
# gpt-oss's _apply_gate: gate_up, the clamped gate, its sigmoid, up + 1 and the GLU (6 i)
GATE_SAVES = {"gpt_oss": 6}
# routers whose top-k weights stay fp32 (Mixtral's softmax of logits.float(); DeepSeek's fp32
# router); the others cast them to the compute dtype
FP32_ROUTING_WEIGHTS = {"mixtral", "deepseek_v2", "deepseek_v3"}


def implementation(arch: Arch, spec: RunSpec) -> str:
    """How the experts run: spec.moe.implementation, or 'all' (Llama 4's dense routing)."""
    if arch.model_type in ROUTES_EVERY_EXPERT and spec.model.implementation == "transformers":
        return "all"
    return spec.moe.implementation


def expert_parallel(spec: RunSpec) -> int:
    return int(getattr(spec.parallel, "expert", 1) or 1)


def pairs_per_token(arch: Arch, spec: RunSpec) -> float:
    """Token-expert pairs one rank computes per token of its micro-batch (see the module)."""
    if implementation(arch, spec) == "all":
        return float(arch.num_experts)
    return spec.moe.pairs_per_token(arch.experts_per_token, expert_parallel(spec))


def compute_bytes(arch: Arch, spec: RunSpec, cb: int, sb: int) -> int:
    """Bytes per element of the experts' activations: the weights' dtype (sb, the stream's)
    for grouped_mm, which is no autocast op; the autocast compute dtype (cb) for the loops'
    F.linear and batched_mm's torch.bmm."""
    return sb if implementation(arch, spec) == "grouped_mm" else cb


def routed_saved_per_token(arch: Arch, spec: RunSpec, cb: int, sb: int) -> int:
    """Bytes one MoE layer's router and routed experts save per token (see the module)."""
    impl = implementation(arch, spec)
    ce = compute_bytes(arch, spec, cb, sb)
    h, i = arch.hidden_size, arch.intermediate_size
    full = spec.method.kind == "full"
    weight = 4 if arch.model_type in FP32_ROUTING_WEIGHTS else cb
    per_pair = ce * (GATE_SAVES.get(arch.model_type, 3) * i + h) + weight
    if full:
        per_pair += ce * (h + i)  # the GEMMs' inputs, for the experts' weight gradients
    if impl == "all":  # Llama 4: hidden.repeat(E) x score, then bmm - no output kept
        per_pair += sb * h - ce * h
    elif impl == "grouped_mm":
        per_pair += 3 * INDEX_BYTES  # the sort's permutation, the token index, the inverse
    elif impl == "batched_mm":
        per_pair += ce * 3 * i * h  # gate_up_proj[expert_ids], down_proj[expert_ids]
    else:  # the loops: the token gathered per expert (stream dtype), two indices
        per_pair += sb * h + 2 * INDEX_BYTES
    if full and any(s.routed and s.has_bias for s in arch.decoder):
        per_pair += INDEX_BYTES  # the bias gather's index
    router = router_saved_per_token(arch, spec, cb)
    return int(router + pairs_per_token(arch, spec) * per_pair)


def router_saved_per_token(arch: Arch, spec: RunSpec, cb: int) -> int:
    """Bytes the router saves per token (see the module; its input is the layer's MLP input,
    counted with the other matmul inputs)."""
    e, k = arch.num_experts, arch.experts_per_token
    if arch.router == "topk_softmax":
        return INDEX_BYTES * k + cb * k
    out = 4 * e + INDEX_BYTES * k
    if arch.router == "sigmoid_grouped":
        out += e + 2 * INDEX_BYTES * arch.router_groups + 4 * k
    elif arch.router == "softmax_grouped":
        out += e + INDEX_BYTES * arch.router_groups
    if arch.router_norm:
        out += 4 * k + 4
    if arch.model_type.startswith("deepseek") and spec.method.kind == "full":
        out += 4 * arch.hidden_size  # F.linear(hidden.type(torch.float32), ...)
    return out


def routed_layer_bytes(arch: Arch, spec: RunSpec, cb: int, sb: int) -> int:
    """Bytes one MoE layer saves whatever the tokens: grouped_mm's int32 group offsets; the
    eager loop's 16-bit casts of its experts' fp32 weight slices under autocast (the experts
    a rank holds, every one hit)."""
    local = arch.num_experts // expert_parallel(spec)
    impl = implementation(arch, spec)
    if impl == "grouped_mm":
        return 4 * local
    if impl != "eager" or not (spec.precision.mixed and sb > cb):
        return 0
    return cb * local * 3 * arch.intermediate_size * arch.hidden_size


def unrouted_width_per_token(arch: Arch) -> int:
    """The dense and shared MLPs' intermediate width per token, averaged over the layers (the
    part of mlp_width_per_token the ordinary MLP arithmetic keeps)."""
    dense = arch.num_layers - arch.num_moe_layers
    total = arch.num_moe_layers * arch.shared_intermediate_size + dense * \
        arch.dense_intermediate_size
    return round(total / arch.num_layers)


def largest_layer_width(arch: Arch, spec: RunSpec) -> int:
    """The widest MLP intermediate of one layer per token: the pairs' (k', all E for Llama 4)
    plus the shared experts in an MoE layer, or a dense layer's where wider."""
    moe = int(pairs_per_token(arch, spec) * arch.intermediate_size) + \
        arch.shared_intermediate_size
    dense = arch.dense_intermediate_size if arch.num_moe_layers < arch.num_layers else 0
    return max(moe, dense)


def routed_transient(arch: Arch, spec: RunSpec, cb: int, tokens: int) -> int:
    """The largest MoE-only temporary of one layer's forward (see the module)."""
    if not arch.is_moe:
        return 0
    out = 0
    if implementation(arch, spec) == "eager":
        out = tokens * arch.experts_per_token * (arch.num_experts + 1) * INDEX_BYTES
    if expert_parallel(spec) > 1:
        out = max(out, 2 * int(tokens * pairs_per_token(arch, spec)) * arch.hidden_size * cb)
    return out


def expert_fractions(arch: Arch, spec: RunSpec) -> tuple[float, float]:
    """(the share of one rank's weights, the share of its trainable parameters) that are routed
    experts - ``arch`` is the rank's expert-parallel slice (model/arch expert_slice)."""
    from tunepilot.model.arch import lora_targets, param_counts

    counts = param_counts(arch)
    routed = counts.routed_experts / max(counts.total, 1)
    if not spec.method.is_lora:
        return routed, routed
    r = spec.method.lora_rank or 1
    sizes = {lin: f * r * (lin.in_features + lin.out_features) * lin.count_per_layer * lin.layers
             for lin, f in lora_targets(arch, spec.method.lora_targets, vision=True).items()}
    adapters = sum(sizes.values())
    return routed, sum(n for lin, n in sizes.items() if lin.routed) / max(adapters, 1)


def sharded_with_experts(total: int, expert_fraction: float, replicas: int, expert: int) -> int:
    """One rank's share of ``total`` bytes of model states under a sharded strategy with expert
    parallel: the routed experts' part (the rank's num_experts / expert of them) is sharded
    over the replicas / expert ranks holding the same experts, the rest over all the replicas
    (torchtitan's dp_shard_mod_ep mesh, Megatron-core's expert-data-parallel group)."""
    experts = int(total * expert_fraction)
    return (total - experts) // replicas + experts * expert // replicas


def moe_notes(arch: Arch, spec: RunSpec, cb: int, sb: int) -> list[str]:
    """What the plan assumes about the routed experts, in words (none for a dense model)."""
    if not arch.is_moe:
        return [] if spec.moe.is_default else ["moe: no effect - the model has no routed experts"]
    impl = implementation(arch, spec)
    k, e = arch.experts_per_token, arch.num_experts
    pairs = pairs_per_token(arch, spec)
    head = (f"MoE: {arch.num_moe_layers} of {arch.num_layers} layers route each token to {k} of "
            f"{e} experts" + (f" (+ {arch.num_shared_experts} shared)" if
                              arch.num_shared_experts else ""))
    if impl == "all":
        how = (f"transformers' {arch.model_type} runs every expert on every token (router "
               f"scores 0 outside the top-{k}): {e} expert passes per token")
    else:
        how = f"experts as {impl}, {pairs:g} token-expert pairs per token" + (
            " (dropless)" if spec.moe.capacity_factor is None else
            f" (padded to capacity factor {spec.moe.capacity_factor:g})")
    notes = [f"{head}; {how}"]
    if arch.mtp_params:
        notes.append(f"MoE: the checkpoint's multi-token-prediction module ({arch.mtp_params:,} "
                     "parameters) is not built by transformers - not loaded, not planned")
    if compute_bytes(arch, spec, cb, sb) > cb:
        notes.append(f"MoE: {impl} is not an autocast op - the experts compute in their fp32 "
                     "weights' dtype (twice the activation bytes, fp32 GEMMs)")
    if impl == "eager" and routed_layer_bytes(arch, spec, cb, sb):
        notes.append("MoE: the eager loop saves a 16-bit cast of every expert's weights per "
                     "layer under autocast")
    if expert_parallel(spec) > 1 and spec.moe.capacity_factor is None:
        notes.append(f"MoE: dropless under expert parallel - the busiest rank takes "
                     f"{spec.moe.load_factor:g} x the mean token-expert pairs (moe.load_factor; "
                     "1 = balanced routing, assumed)")
    return notes
