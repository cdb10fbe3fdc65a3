"""Mixture-of-experts and multi-head latent attention layouts, by rule from the config.

Which layers route (every layer; Qwen's decoder_sparse_step and mlp_only_layers; DeepSeek's
first_k_dense_replace; Llama 4's moe_layers / interleave_moe_layer_step), the router, the routed
experts - fused by transformers >= 5 into two 3-D parameters per layer (``experts.gate_up_proj``
and ``experts.down_proj``; gpt-oss and Llama 4 store them (experts, in, out) and gpt-oss adds
biases) - and the shared experts every token passes through (DeepSeek, Qwen2-MoE with its
sigmoid gate, Llama 4). DeepSeek's MLA: low-rank query (q_lora_rank) and key/value
(kv_lora_rank) projections with their norms. Its multi-token-prediction module the checkpoint
ships but transformers does not build is counted apart (``mtp_params``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.model.arch.core import Arch, LinearSpec, MoeLayout
from tunepilot.model.arch.reader import ConfigView

# How PEFT (0.21, utils/transformers_weight_conversion.py _MOE_TARGET_MODULE_MAPPING) renames
# transformers 4.x target names of MoE models to the fused >= 5 parameters, for the model types
# transformers (5.25, conversion_mapping._MODEL_TO_CONVERSION_PATTERN) converts: a target that
# names one of these aliases reaches only the routed experts' parameter (at rank 2r where the
# pair fused into gate_up_proj is both named), never a dense or shared MLP of the same name.
PEFT_MOE_ALIASES = {
    "mixtral": {"gate": "gate", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "gate", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"},
}
PEFT_FUSED_PAIR = {"mixtral": ("w1", "w3"), "qwen2_moe": ("gate_proj", "up_proj")}
# transformers' Llama4TextMoe runs every token through every expert (routed_in =
# hidden.repeat(num_experts), scaled by a router score that is 0 outside the top-k): the card
# computes and saves all of them, not the top-k (transformers 5.25 modeling_llama4.py)
ROUTES_EVERY_EXPERT = {"llama4", "llama4_text"}
PEFT_MOE_PATTERN = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "olmoe": "qwen2_moe",
                    "deepseek_v2": "qwen2_moe", "deepseek_v3": "qwen2_moe"}


@dataclass(frozen=True)
class MoeParts:
    """The MLP side of an MoE model: every MLP matrix (dense layers' too) and the sizes."""

    linears: list[LinearSpec]
    num_experts: int
    experts_per_token: int
    expert_inter: int
    num_layers: int  # MoE layers
    num_shared: int
    shared_inter: int
    dense_inter: int
    router: str = ""
    router_norm: bool = False
    router_groups: int = 1


def _router(cv: ConfigView, rule: str) -> tuple[str, bool, int]:
    """(the router's kind, whether it renormalises the top-k weights, its expert groups)."""
    if rule == "gpt_oss":
        return "topk_softmax", False, 1
    if rule == "llama4":
        return "topk_sigmoid", False, 1
    if rule == "mixtral":
        return "softmax", True, 1  # MixtralTopKRouter always renormalises
    if rule == "deepseek" and (cv.cfg.get("model_type") == "deepseek_v3"
                               or cv.text("topk_method") == "noaux_tc"):
        return "sigmoid_grouped", cv.flag("norm_topk_prob", True), cv.count("n_group", 1)
    grouped = cv.text("topk_method") == "group_limited_greedy"
    return ("softmax_grouped" if grouped else "softmax"), cv.flag("norm_topk_prob"), \
        cv.count("n_group", 1)


def _moe_layers(cv: ConfigView, rule: str, layers: int, experts: int) -> list[int]:
    if rule in ("qwen2_moe", "qwen3_moe"):
        only = set(cv.indices("mlp_only_layers") or [])
        step = cv.count("decoder_sparse_step", 1)
        return [i for i in range(layers) if i not in only and experts > 0 and (i + 1) % step == 0]
    if rule == "deepseek":
        return list(range(min(cv.count("first_k_dense_replace", 0, minimum=0), layers), layers))
    if rule == "llama4":
        listed = cv.indices("moe_layers")
        if listed is not None:
            return sorted({i for i in listed if i < layers})
        step = cv.count("interleave_moe_layer_step", 1)
        return list(range(step - 1, layers, step))
    return list(range(layers))  # mixtral, olmoe, gpt_oss: every layer routes


def _sizes(cv: ConfigView, rule: str, inter: int) -> tuple[int, int, int]:
    """(routed experts, experts per token, one expert's width)."""
    if rule in ("qwen2_moe", "qwen3_moe"):
        return (cv.count("num_experts", minimum=0), cv.count("num_experts_per_tok"),
                cv.count("moe_intermediate_size"))
    if rule == "deepseek":
        return (cv.count("n_routed_experts"), cv.count("num_experts_per_tok"),
                cv.count("moe_intermediate_size"))
    if rule == "olmoe":
        return cv.count("num_experts"), cv.count("num_experts_per_tok"), inter
    k = cv.count("num_experts_per_tok", cv.optional("experts_per_token"))
    return cv.count("num_local_experts"), k, inter


def moe_parts(cv: ConfigView, r, d, rule_type: str, mlp_bias: bool) -> MoeParts:
    """The MLP matrices of an MoE model (``r``: its Recipe, ``d``: its Dims)."""
    from tunepilot.model.arch.layouts import dense_mlp

    rule = r.moe
    experts, k, inter = _sizes(cv, rule, d.inter)
    moe_idx = _moe_layers(cv, rule, d.layers, experts)
    dense_inter = cv.count("intermediate_size_mlp") if rule == "llama4" else d.inter
    n_moe, n_dense = len(moe_idx), d.layers - len(moe_idx)
    out = [_with(s, layer_kind="dense") for s in dense_mlp(r, d, dense_inter, mlp_bias, n_dense)]
    out = [s for s in out if s.layers]
    if not n_moe:
        return MoeParts(out, 1, 1, d.inter, 0, 0, 0, dense_inter)
    p, h = r.mlp_path, d.hidden
    gpt_oss, llama4 = rule == "gpt_oss", rule == "llama4"
    router = "router" if gpt_oss or llama4 else "gate"
    out.append(LinearSpec(router, f"{p}.{router}", h, experts, gpt_oss, group="router",
                          peft_kind="module" if llama4 else "parameter", layers=n_moe,
                          layer_kind="moe"))
    for name, fan_in, fan_out in (("gate_up_proj", h, 2 * inter), ("down_proj", inter, h)):
        out.append(LinearSpec(name, f"{p}.experts.{name}", fan_in, fan_out, gpt_oss, experts,
                              "mlp", "parameter", n_moe, routed=True,
                              transposed=gpt_oss or llama4, layer_kind="moe"))
    shared, shared_inter, shared_path = 0, 0, f"{p}.shared_expert"
    if rule == "deepseek" and cv.optional("n_shared_experts", minimum=0):
        shared = cv.count("n_shared_experts")
        shared_inter, shared_path = shared * inter, f"{p}.shared_experts"
    elif rule == "qwen2_moe":
        shared, shared_inter = 1, cv.count("shared_expert_intermediate_size")
    elif llama4:
        shared, shared_inter = 1, inter
    if shared:
        out += [_with(s, layer_kind="moe") for s in
                dense_mlp(r, d, shared_inter, mlp_bias, n_moe, path=shared_path)]
    if rule == "qwen2_moe":  # the shared expert's sigmoid gate: nn.Linear(hidden, 1)
        out.append(LinearSpec("shared_expert_gate", f"{p}.shared_expert_gate", h, 1, False,
                              group="router", layers=n_moe, layer_kind="moe"))
    return MoeParts(out, experts, k, inter, n_moe, shared, shared_inter, dense_inter,
                    *_router(cv, rule))


def _with(spec: LinearSpec, **changes) -> LinearSpec:
    from dataclasses import replace

    return replace(spec, **changes)


def mla_parts(cv: ConfigView, d) -> tuple[list[LinearSpec], list[int]]:
    """DeepSeek's multi-head latent attention: a low-rank query (q_a_proj, its norm, q_b_proj;
    or one q_proj when q_lora_rank is null) and a shared key/value latent (kv_a_proj_with_mqa
    also yields the RoPE key; kv_a_layernorm; kv_b_proj back to per-head keys and values)."""
    h, L, heads = d.hidden, d.layers, d.heads
    nope, rope = cv.count("qk_nope_head_dim"), cv.count("qk_rope_head_dim")
    v, kv_rank = cv.count("v_head_dim"), cv.count("kv_lora_rank")
    q_rank = cv.optional("q_lora_rank")
    ab = cv.flag("attention_bias")

    def lin(name, fan_in, fan_out, bias):
        return LinearSpec(name, f"self_attn.{name}", fan_in, fan_out, bias, layers=L)

    if q_rank:
        q = [lin("q_a_proj", h, q_rank, ab), lin("q_b_proj", q_rank, heads * (nope + rope), False)]
    else:
        q = [lin("q_proj", h, heads * (nope + rope), False)]
    kv = [lin("kv_a_proj_with_mqa", h, kv_rank + rope, ab),
          lin("kv_b_proj", kv_rank, heads * (nope + v), False),
          lin("o_proj", heads * v, h, ab)]
    return q + kv, ([q_rank] if q_rank else []) + [kv_rank]


def mtp_params(cv: ConfigView, d, attn: list[LinearSpec], layer_vectors: list[int],
               moe: MoeParts | None) -> int:
    """DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers), which the hub
    checkpoint ships and transformers' DeepseekV3ForCausalLM does not build: each is one MoE
    decoder layer plus enorm and hnorm, eh_proj (2h -> h) and shared_head.norm (its embedding
    and head are the model's). 0 for every other model."""
    n = cv.optional("num_nextn_predict_layers", minimum=0) if cv.cfg.get("model_type") == \
        "deepseek_v3" else None
    if not n or moe is None or not moe.num_layers:
        return 0
    h = d.hidden
    layer = sum(s.numel for s in attn) + sum(layer_vectors) + sum(
        s.numel for s in moe.linears if s.layer_kind == "moe")
    return n * (layer + 3 * h + 2 * h * h)


def per_expert_layout(arch: Arch, specs: list[LinearSpec]) -> list[LinearSpec]:
    """transformers 4.x's MoE layout: one nn.Linear per expert and an nn.Linear router, for the
    model types whose experts transformers 5 fused (Mixtral's w1/w3/w2 under
    block_sparse_moe; gate_proj/up_proj/down_proj under mlp.experts for the Qwen-MoE style)."""
    pattern = PEFT_MOE_PATTERN.get(arch.model_type, arch.model_type)
    if pattern not in ("mixtral", "qwen2_moe"):
        return specs
    h, i = arch.hidden_size, arch.intermediate_size
    e = next(s.count_per_layer for s in specs if s.routed)  # an expert-parallel slice's share
    n = arch.num_moe_layers
    mixtral = pattern == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    router_kind = "parameter" if arch.model_type.startswith("deepseek") else "module"
    out = [s for s in specs if not s.routed and not (s.group == "router" and s.name == "gate")]
    out.append(LinearSpec("gate", f"{block}.gate", h, arch.num_experts, False, group="router",
                          peft_kind=router_kind, layers=n, layer_kind="moe"))
    return out + _expert_linears(f"{block}.experts", names, h, i, e, n)


def _expert_linears(prefix: str, names: tuple[str, str, str], h: int, i: int, e: int,
                    n: int) -> list[LinearSpec]:
    """Every expert's gate, up and down projection (``names``) as nn.Linear modules, e per
    layer in n MoE layers: the per-expert layouts' routed experts."""
    return [LinearSpec(name, f"{prefix}.{name}", fan_in, fan_out, False, e, "mlp", layers=n,
                       routed=True, layer_kind="moe")
            for name, fan_in, fan_out in zip(names, (h, h, i), (i, i, h), strict=True)]


def layout_specs(arch: Arch, moe_layout: MoeLayout) -> list[LinearSpec]:
    """The decoder's matrices in the given MoE storage layout."""
    specs = list(arch.decoder)
    return per_expert_layout(arch, specs) if moe_layout == "per_expert" and arch.is_moe \
        else specs


# axolotl's linearized Llama 4 (monkeypatch/models/llama4/modeling.py, the checkpoints of
# axolotl-quants/Llama-4-*-Linearized-*): each expert's gate, up and down an nn.Linear
LINEARIZED_TYPES = {"llama4", "llama4_text"}


def linearized_experts(specs: list[LinearSpec], model_type: str) -> list[LinearSpec]:
    """The routed experts as one nn.Linear per expert and projection (moe.experts_layout
    per_expert), the same parameters: bitsandbytes quantizes them, PEFT targets them by name
    (``experts.gate_projs.N``; a target ``gate_proj`` reaches only the shared expert's)."""
    if model_type not in LINEARIZED_TYPES:
        from tunepilot.errors import SpecError

        raise SpecError("moe.experts_layout", f"per_expert is the layout of axolotl's "
                        f"linearized Llama 4 checkpoints; transformers builds {model_type}'s "
                        "routed experts fused.", "Drop moe.experts_layout (fused is the default).")
    fused = next(s for s in specs if s.routed and s.name == "gate_up_proj")
    return [s for s in specs if not s.routed] + _expert_linears(
        fused.path.rsplit(".", 1)[0], ("gate_projs", "up_projs", "down_projs"),
        fused.in_features, fused.out_features // 2, fused.count_per_layer, fused.layers)
