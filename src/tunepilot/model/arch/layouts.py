"""The layout rules: what each decoder ``model_type`` transformers builds is made of, read from its
config by key. One :class:`Recipe` per model_type says the parts that are not in the config
(which projections carry a bias whatever it says, how many norms a layer has, q/k norms, where
the MLP lives); the config gives every size. A model_type with no recipe is refused naming the
key - never counted as another family. Checked against transformers 5.25 built on the meta device
(tests/test_arch.py, tests/test_arch_layouts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunepilot.model.arch.core import Arch, LinearSpec
from tunepilot.model.arch.files import META_KEY, config_hash
from tunepilot.model.arch.reader import ConfigView

Bias = tuple[str | None, bool]  # (config key, default when absent); key None: fixed by the code
_AB: Bias = ("attention_bias", False)
_FIXED_FALSE: Bias = (None, False)
_FIXED_TRUE: Bias = (None, True)


@dataclass(frozen=True)
class Recipe:
    """What a model_type's modeling code fixes that its config does not say."""

    attention: str = "qkvo"  # qkvo | phi | qkv_fused | neox | gpt2 | mla
    qkv_bias: Bias = _FIXED_FALSE
    o_bias: Bias = _FIXED_FALSE
    mlp: str = "gated"  # gated | gated_fused | plain (up/down) | fc | neox | gpt2
    mlp_bias: Bias = _FIXED_FALSE
    norm: str = "rms"  # rms (weight) | layer (weight + bias)
    norms: int = 2  # hidden-sized norms per layer
    qk_norm: str = "none"  # none | head | full | per_head | head_affine (see _qk_norm)
    qk_norm_key: str | None = None  # the config flag that turns q/k norms on; None: always on
    moe: str | None = None  # the MoE rule in model/arch/moe.py
    tied: bool = False  # tie_word_embeddings when the config does not say
    act_params: dict[str, int] = field(default_factory=dict)  # learned scalars per activation
    lm_head_bias: bool = False
    sinks: bool = False  # a learned attention-sink logit per head (gpt-oss)
    mlp_path: str = "mlp"
    defaults: dict[str, Any] = field(default_factory=dict)
    """transformers' class defaults for keys a hub config may leave out"""


_QKVO = dict(qkv_bias=_AB, o_bias=_AB)
# transformers 5.25 configuration classes' defaults (AutoConfig.for_model(type)), for the keys the
# rules read that hub configs omit: Gemma-3 4B+ nest a text_config that names only the sizes that
# differ from Gemma3TextConfig (its vocabulary is then 262,208, not the 1B's 262,144).
_GEMMA3_TEXT = {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 131072, "sliding_window": 4096}
_DEEPSEEK = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128}

RECIPES: dict[str, Recipe] = {
    "llama": Recipe(**_QKVO, mlp_bias=("mlp_bias", False)),
    "granite": Recipe(**_QKVO, mlp_bias=("mlp_bias", False)),
    "mistral": Recipe(),
    "qwen2": Recipe(qkv_bias=_FIXED_TRUE),  # Qwen2Attention: q/k/v bias whatever the config
    "qwen3": Recipe(**_QKVO, qk_norm="head"),
    "gemma": Recipe(**_QKVO, tied=True, defaults={"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": Recipe(**_QKVO, norms=4, tied=True,
                     defaults={"hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3_text": Recipe(**_QKVO, norms=4, qk_norm="head", tied=True, defaults=_GEMMA3_TEXT),
    "olmo2": Recipe(**_QKVO, qk_norm="full"),  # post-norms only: 2 per layer, no pre-norm
    "olmo3": Recipe(**_QKVO, qk_norm="full"),
    # Apertus: up/down MLP with xIELU (2 learned scalars, alpha_p and alpha_n, per layer); its
    # q/k norms are built whatever qk_norm says (transformers 5.25 ApertusAttention)
    "apertus": Recipe(**_QKVO, mlp="plain", qk_norm="head", act_params={"xielu": 2},
                      defaults={"hidden_act": "xielu"}),
    "stablelm": Recipe(qkv_bias=("use_qkv_bias", False), norm="layer", qk_norm="per_head",
                       qk_norm_key="qk_layernorm"),
    "phi": Recipe(attention="phi", qkv_bias=_FIXED_TRUE, o_bias=_FIXED_TRUE, mlp="fc",
                  mlp_bias=_FIXED_TRUE, norm="layer", norms=1, qk_norm="head_affine",
                  qk_norm_key="qk_layernorm", lm_head_bias=True,
                  defaults={"hidden_act": "gelu_new"}),
    "phi3": Recipe(attention="qkv_fused", mlp="gated_fused"),
    "gpt_neox": Recipe(attention="neox", qkv_bias=("attention_bias", True),
                       o_bias=("attention_bias", True), mlp="neox", mlp_bias=_FIXED_TRUE,
                       norm="layer", defaults={"hidden_act": "gelu"}),
    "gpt2": Recipe(attention="gpt2", qkv_bias=_FIXED_TRUE, o_bias=_FIXED_TRUE, mlp="gpt2",
                   mlp_bias=_FIXED_TRUE, norm="layer", tied=True,
                   defaults={"activation_function": "gelu_new"}),
    "mixtral": Recipe(moe="mixtral", defaults={"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2_moe": Recipe(qkv_bias=("qkv_bias", True), moe="qwen2_moe", defaults={
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632}),
    "qwen3_moe": Recipe(**_QKVO, qk_norm="head", moe="qwen3_moe", defaults={
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}),
    "olmoe": Recipe(**_QKVO, qk_norm="full", moe="olmoe",
                    defaults={"num_experts": 64, "num_experts_per_tok": 8}),
    "deepseek_v2": Recipe(attention="mla", mlp_bias=("mlp_bias", False), moe="deepseek",
                          defaults=_DEEPSEEK | {"n_routed_experts": 64, "n_shared_experts": 2,
                                                "moe_intermediate_size": 1407}),
    "deepseek_v3": Recipe(attention="mla", moe="deepseek", defaults=_DEEPSEEK | {
        "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3}),
    "llama4_text": Recipe(**_QKVO, moe="llama4", mlp_path="feed_forward", defaults={
        "num_local_experts": 16, "num_experts_per_tok": 1, "intermediate_size_mlp": 16384,
        "head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192}),
    "gpt_oss": Recipe(qkv_bias=("attention_bias", True), o_bias=("attention_bias", True),
                      sinks=True, moe="gpt_oss", defaults={
                          "num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64}),
}
# Multimodal configs whose text model AutoModelForCausalLM builds from text_config: gemma3 builds
# Gemma3ForConditionalGeneration (the SigLIP tower and projector too: model/arch/vision.py);
# llama4 builds Llama4ForCausalLM, the text model alone.
WRAPPERS = {"gemma3": "gemma3_text", "llama4": "llama4_text"}


def supported_model_types() -> list[str]:
    return sorted(set(RECIPES) | set(WRAPPERS))


@dataclass(frozen=True)
class Dims:
    """The sizes every part is built from (one decoder layer's attention and dense MLP)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim


def _model_type(cfg: dict[str, Any]) -> str:
    from tunepilot.errors import SpecError

    model_type = cfg.get("model_type")
    if not model_type and "n_embd" in cfg:
        return "gpt2"  # the original GPT-2 configs carried no model_type
    if not isinstance(model_type, str) or model_type.lower() not in RECIPES | WRAPPERS:
        shown = repr(model_type)[:40] if model_type else "missing"
        raise SpecError(
            field="model.config",
            message=f"config 'model_type' is {shown}: tunepilot has no layout rule for it, so it "
                    "cannot count its parameters (it would not plan it as another family).",
            hint=f"Layouts tunepilot counts: {', '.join(supported_model_types())}. If the "
                 "model's modeling code builds exactly one of these, copy its config.json and set "
                 "model_type to that one.")
    return model_type.lower()


def _dims(cv: ConfigView, recipe: Recipe) -> Dims:
    hidden = cv.need("hidden_size", "n_embd", "d_model")
    heads = cv.need("num_attention_heads", "n_head")
    if recipe.attention == "gpt2":
        inter = cv.count("n_inner", 4 * hidden)  # GPT2MLP: default 4 * n_embd
    else:
        inter = cv.need("intermediate_size", "ffn_dim")
    if recipe.attention == "mla":  # q/k heads: nope + rope dims; K and V per query head
        head_dim = cv.count("qk_nope_head_dim") + cv.count("qk_rope_head_dim")
        kv_heads = heads
    else:
        head_dim = cv.count("head_dim", max(1, hidden // heads))
        if recipe.attention in ("gpt2", "neox") or recipe.qk_norm == "per_head":
            head_dim = max(1, hidden // heads)  # GPT-2, GPT-NeoX, StableLM read no head_dim
        kv_heads = cv.count("num_key_value_heads", heads)
    return Dims(hidden, cv.need("num_hidden_layers", "n_layer", "num_layers"), heads, kv_heads,
                head_dim, inter, cv.need("vocab_size"))


def _bias(cv: ConfigView, bias: Bias) -> bool:
    key, default = bias
    return default if key is None else cv.flag(key, default)


def _lin(name: str, path: str, fan_in: int, fan_out: int, bias: bool, group: str,
         layers: int, **kw) -> LinearSpec:
    return LinearSpec(name, path, fan_in, fan_out, bias, group=group, layers=layers, **kw)


def attention_parts(cv: ConfigView, r: Recipe, d: Dims) -> tuple[list[LinearSpec], list[int]]:
    """One layer's attention matrices and its other attention parameters but the q/k norms
    and sinks (Arch.attention_vectors: MLA's latent norms)."""
    h, L, hq, hkv = d.hidden, d.layers, d.q_out, d.kv_out
    qb, ob = _bias(cv, r.qkv_bias), _bias(cv, r.o_bias)
    a = "attention"
    if r.attention == "mla":
        from tunepilot.model.arch.moe import mla_parts

        return mla_parts(cv, d)
    if r.attention == "gpt2":  # Conv1D layers; PEFT treats them like nn.Linear
        lins = [_lin("c_attn", "attn.c_attn", h, 3 * h, True, a, L),
                _lin("c_proj", "attn.c_proj", h, h, True, a, L)]
    elif r.attention == "neox":
        lins = [_lin("query_key_value", "attention.query_key_value", h, hq + 2 * hkv, qb, a, L),
                _lin("dense", "attention.dense", hq, h, ob, a, L)]
    elif r.attention == "qkv_fused":  # phi3: one qkv matrix
        lins = [_lin("qkv_proj", "self_attn.qkv_proj", h, hq + 2 * hkv, qb, a, L),
                _lin("o_proj", "self_attn.o_proj", hq, h, ob, a, L)]
    else:
        o = "dense" if r.attention == "phi" else "o_proj"
        lins = [_lin("q_proj", "self_attn.q_proj", h, hq, qb, a, L),
                _lin("k_proj", "self_attn.k_proj", h, hkv, qb, a, L),
                _lin("v_proj", "self_attn.v_proj", h, hkv, qb, a, L),
                _lin(o, f"self_attn.{o}", hq, h, ob, a, L)]
    return lins, []


def _qk_norm(cv: ConfigView, r: Recipe) -> str:
    """The q/k norm kind the layers carry (Arch.qk_norm), where its config flag turns it on."""
    return "none" if r.qk_norm_key and not cv.flag(r.qk_norm_key) else r.qk_norm


def dense_mlp(r: Recipe, d: Dims, inter: int, bias: bool, layers: int,
              path: str | None = None) -> list[LinearSpec]:
    """A dense MLP of width ``inter`` (a dense layer, or a shared expert at ``path``)."""
    h, m = d.hidden, "mlp"
    p = path or r.mlp_path
    if r.mlp == "gpt2":
        return [_lin("c_fc", "mlp.c_fc", h, inter, True, m, layers),
                _lin("c_proj", "mlp.c_proj", inter, h, True, m, layers)]
    if r.mlp == "neox":
        return [_lin("dense_h_to_4h", "mlp.dense_h_to_4h", h, inter, True, m, layers),
                _lin("dense_4h_to_h", "mlp.dense_4h_to_h", inter, h, True, m, layers)]
    if r.mlp == "fc":
        return [_lin("fc1", "mlp.fc1", h, inter, True, m, layers),
                _lin("fc2", "mlp.fc2", inter, h, True, m, layers)]
    if r.mlp == "gated_fused":  # phi3: one gate+up matrix
        return [_lin("gate_up_proj", "mlp.gate_up_proj", h, 2 * inter, bias, m, layers),
                _lin("down_proj", "mlp.down_proj", inter, h, bias, m, layers)]
    up_down = [_lin("up_proj", f"{p}.up_proj", h, inter, bias, m, layers),
               _lin("down_proj", f"{p}.down_proj", inter, h, bias, m, layers)]
    if r.mlp == "plain":
        return up_down
    return [_lin("gate_proj", f"{p}.gate_proj", h, inter, bias, m, layers)] + up_down


def _text_view(cfg: dict[str, Any]) -> tuple[str, ConfigView, ConfigView]:
    """(text model_type, its view, the top-level view) - the text_config of a multimodal one."""
    model_type = _model_type(cfg)
    top = ConfigView(cfg)
    if model_type in WRAPPERS:
        text_type = WRAPPERS[model_type]
        return model_type, top.nested("text_config", RECIPES[text_type].defaults), top
    return model_type, ConfigView(cfg, "", RECIPES[model_type].defaults), top


def _tied(model_type: str, cv: ConfigView, top: ConfigView, recipe: Recipe) -> bool:
    """Gemma 3's wrapper ties by its own top-level flag; Llama 4's text model by text_config's."""
    if model_type == "gemma3":
        return top.flag("tie_word_embeddings", True)
    return cv.flag("tie_word_embeddings", recipe.tied)


def read_arch(cfg: dict[str, Any]) -> Arch:
    """The Arch of a config dict (see Arch.from_config)."""
    from tunepilot.model.arch.moe import linearized_experts, moe_parts, mtp_params
    from tunepilot.model.arch.vision import vision_tower

    model_type, cv, top = _text_view(cfg)
    text_type = WRAPPERS.get(model_type, model_type)
    r = RECIPES[text_type]
    d = _dims(cv, r)
    attn, attn_vectors = attention_parts(cv, r, d)
    mlp_bias = _bias(cv, r.mlp_bias)
    moe = moe_parts(cv, r, d, text_type, mlp_bias) if r.moe else None
    mlp = moe.linears if moe else dense_mlp(r, d, d.inter, mlp_bias, d.layers)
    if moe and (cfg.get(META_KEY) or {}).get("experts_layout") == "per_expert":
        mlp = linearized_experts(mlp, text_type)
    norms = r.norms
    if text_type == "stablelm" and cv.flag("use_parallel_residual"):
        norms = 1  # one input_layernorm feeds attention and MLP
    norm_size = d.hidden * (2 if r.norm == "layer" else 1)
    act = _activation(cv)
    layer_vectors = [norm_size] * norms + attn_vectors + [1] * r.act_params.get(act, 0)
    model_vectors = [norm_size]  # the final norm
    window, sliding = _sliding(cv, text_type, d.layers)
    meta = cfg.get(META_KEY) or {}
    max_pos = cv.optional("max_position_embeddings", minimum=2) or \
        cv.optional("n_positions", minimum=2)  # a context of one position is no model
    k = moe.experts_per_token if moe else 1
    return Arch(
        model_type=model_type, family="mla" if r.attention == "mla" else {
            "qkvo": "llama", "qkv_fused": "phi3", "neox": "gpt_neox"}.get(r.attention,
                                                                          r.attention),
        hidden_size=d.hidden, num_layers=d.layers, num_heads=d.heads, num_kv_heads=d.kv_heads,
        head_dim=d.head_dim, intermediate_size=moe.expert_inter if moe else d.inter,
        vocab_size=d.vocab, tied_embeddings=_tied(model_type, cv, top, r),
        num_experts=moe.num_experts if moe else 1, experts_per_token=k,
        mlp_kind="plain" if r.mlp in ("plain", "fc", "neox", "gpt2") else "gated",
        norm_kind=r.norm, norms_per_layer=norms,
        attention_bias=_bias(cv, r.qkv_bias), o_proj_bias=_bias(cv, r.o_bias),
        mlp_bias=mlp_bias, lm_head_bias=r.lm_head_bias,
        num_position_embeddings=cv.count("n_positions", 1024) if r.attention == "gpt2" else 0,
        max_position_embeddings=max_pos, known_layout=True, hf_id=meta.get("hf_id"),
        config_hash=config_hash(cfg), hidden_act=act, decoder=tuple(attn + mlp),
        layer_vectors=tuple(layer_vectors), model_vectors=tuple(model_vectors),
        qk_norm=_qk_norm(cv, r), attention_sinks=r.sinks,
        num_moe_layers=moe.num_layers if moe else 0,
        num_shared_experts=moe.num_shared if moe else 0,
        shared_intermediate_size=moe.shared_inter if moe else 0,
        dense_intermediate_size=moe.dense_inter if moe else d.inter,
        router=moe.router if moe else "", router_norm=moe.router_norm if moe else False,
        router_groups=moe.router_groups if moe else 1,
        sliding_window=window, num_sliding_layers=sliding,
        vision=vision_tower(top, d) if model_type == "gemma3" else None,
        mtp_params=mtp_params(cv, d, attn, layer_vectors, moe),
        context_length=_context_length(cv.cfg, max_pos),
    )


def _context_length(cfg: dict[str, Any], max_pos: int | None) -> int | None:
    """max_position_embeddings, or the config's own RoPE scaling where it names the context it
    stretches (Qwen2.5's YaRN: original 32768 x factor 4 over max_position_embeddings 32768)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(rope, dict):
        original, factor = rope.get("original_max_position_embeddings"), rope.get("factor")
        if isinstance(original, int | float) and isinstance(factor, int | float) and \
                not isinstance(original, bool) and 0 < original * factor < 2**40:
            return max(max_pos or 0, int(original * factor))
    return max_pos


def _activation(cv: ConfigView) -> str:
    for key in ("hidden_act", "activation_function", "hidden_activation"):
        if cv.text(key):
            return cv.text(key)
    return "silu"


def _sliding(cv: ConfigView, text_type: str, layers: int) -> tuple[int | None, int]:
    """(window in tokens, layers that attend within it): from layer_types where the config
    lists them, else by the model's own rule (Gemma 2 every other layer, Gemma 3 five in six,
    Llama 4's chunked attention on its RoPE layers, Qwen's layers past max_window_layers)."""
    window = cv.optional("sliding_window", minimum=0) or None
    types = cv.strings("layer_types")
    if text_type == "llama4_text":
        window = cv.optional("attention_chunk_size", minimum=0) or None
        step = cv.count("no_rope_layer_interval", 4)
        n = sum(1 for i in range(layers) if (i + 1) % step) if window else 0
    elif types:
        n = sum(t in ("sliding_attention", "chunked_attention") for t in types)
    elif text_type == "gemma2":
        n = (layers + 1) // 2
    elif text_type == "gemma3_text":
        pattern = cv.count("sliding_window_pattern", 6)
        n = sum(1 for i in range(layers) if (i + 1) % pattern)
    elif text_type.startswith("qwen"):
        n = layers - min(cv.count("max_window_layers", layers, minimum=0), layers) \
            if cv.flag("use_sliding_window") else 0
    elif text_type in ("mistral", "mixtral"):
        n = layers if window else 0
    else:
        n = 0
    return (window if n else None), n
