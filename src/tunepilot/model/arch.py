"""Model architecture facts read from a Hugging Face ``config.json``, with no torch import.

This module sits on the fast ``plan`` path, so it only reads JSON and does arithmetic. It turns a
config dict into an :class:`Arch` (the numbers the memory model needs), lists the linear layers of
one decoder layer as PEFT would see them, and counts parameters exactly: ``param_counts(arch).total``
equals ``sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())``, which counts
tied weights once (tests/test_arch.py checks every preset against transformers on the meta device).

Presets live in ``resources/presets/<name>.json``: each is the model's hub ``config.json`` plus a
``_tunepilot`` block (``hf_id``, ``source``, ``params_published``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from tunepilot.errors import SpecError, did_you_mean
from tunepilot.resources import PRESETS_DIR

META_KEY = "_tunepilot"  # our block inside a preset; never part of the HF config or its hash
ALL_LINEAR = "all-linear"  # PEFT's shorthand (peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND)

MoeLayout = Literal["fused", "per_expert"]

# model_type -> layer layout. Types not listed fall back to the llama layout (or gpt2 for
# n_embd-style configs) and are flagged ``known_layout=False``: the count is then an estimate.
_FAMILY = {t: "llama" for t in ("llama", "mistral", "qwen2", "gemma2", "stablelm")}
_FAMILY |= {t: t for t in ("mixtral", "phi3", "gpt_neox", "phi", "gpt2")}
_TIED_BY_DEFAULT = {"gemma2", "gpt2"}  # transformers' default when tie_word_embeddings is absent
# LayerNorm (weight + bias), not RMSNorm (weight only)
_LAYER_NORM_TYPES = {"stablelm", "gpt_neox", "phi", "gpt2"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


# --------------------------------------------------------------------------- presets and files


def _norm_name(name: str) -> str:
    """'Llama-3.1_8B' -> 'llama318b': case, '-', '_', '.', '/' and spaces do not matter."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def list_presets() -> list[str]:
    """Names of the bundled model presets, e.g. ['gemma-2-27b', ..., 'tiny', 'tinyllama-1.1b']."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


@lru_cache(maxsize=1)
def _preset_index() -> dict[str, str]:
    """Normalised preset name and hub id (e.g. 'metallamametallama38b') -> preset file stem."""
    index: dict[str, str] = {}
    for name in list_presets():
        index[_norm_name(name)] = name
        meta = _read_json(PRESETS_DIR / f"{name}.json", "model.preset").get(META_KEY, {})
        hf_id = meta.get("hf_id")
        if hf_id:
            index.setdefault(_norm_name(hf_id), name)
    return index


def load_preset(name: str) -> dict[str, Any]:
    """The preset's config dict (a fresh copy, including ``_tunepilot``); also accepts its hub id."""
    stem = _preset_index().get(_norm_name(name))
    if stem is None:
        raise SpecError(
            field="model.preset",
            message=f"unknown model preset {name!r}.",
            hint=did_you_mean(name.lower(), list_presets())
            + " Or point model.config at a config.json to plan any other model.",
        )
    return _read_json(PRESETS_DIR / f"{stem}.json", "model.preset")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json``, given the file or the model directory that holds it."""
    path = Path(path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SpecError(
            field="model.config",
            message=f"no config.json at {str(file)!r}.",
            hint="Pass a model directory containing config.json, or the config.json file itself.",
        )
    return _read_json(file, "model.config")


def _read_json(file: Path, field: str) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SpecError(
            field=field,
            message=f"{str(file)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).",
            hint="A Hugging Face config.json is one JSON object.",
        ) from exc
    except OSError as exc:
        raise SpecError(field=field, message=f"cannot read {str(file)!r}: {exc.strerror}.") from exc
    except UnicodeDecodeError:
        raise SpecError(field=field, message=f"{str(file)!r} is not UTF-8 text.",
                        hint="A Hugging Face config.json is UTF-8 JSON.") from None
    except RecursionError:
        raise SpecError(field=field, message=f"{str(file)!r} is nested too deeply.") from None
    if not isinstance(data, dict):
        raise SpecError(
            field=field, message=f"{str(file)!r} holds a JSON {type(data).__name__}, not an object."
        )
    return data


def config_hash(cfg: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the config without our ``_tunepilot`` block."""
    body = {k: v for k, v in cfg.items() if k != META_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- the architecture


@dataclass(frozen=True)
class Arch:
    """The normalised facts the memory and LoRA arithmetic need, read from one config."""

    model_type: str
    family: str  # layer layout: llama | mixtral | phi3 | gpt_neox | phi | gpt2
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert for MoE
    vocab_size: int
    tied_embeddings: bool
    num_experts: int  # 1 for dense models
    experts_per_token: int  # 1 for dense models
    mlp_kind: str  # "gated" (SwiGLU / GeGLU: 3 matrices) or "plain" (GELU MLP: 2 matrices)
    norm_kind: str  # "rms" (weight only) or "layer" (weight + bias)
    norms_per_layer: int  # 2 pre-norms; 4 for gemma2 (pre+post); 1 for parallel-residual blocks
    attention_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool  # attention output projection carries a bias
    mlp_bias: bool
    lm_head_bias: bool
    num_position_embeddings: int  # learned absolute positions (gpt2); 0 for rotary models
    max_position_embeddings: int | None
    known_layout: bool  # False: model_type not in _FAMILY, counts are a llama-style estimate
    hf_id: str | None
    config_hash: str
    hidden_act: str = "silu"  # the config's activation (hidden_act / activation_function)
    # positions the config is made for: max_position_embeddings, or its rope_scaling's
    # original_max_position_embeddings x factor where larger (model/context.py); None: unnamed
    context_length: int | None = None

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Arch:
        """Build from a HF config dict (a preset or a user's config.json)."""
        model_type = str(cfg.get("model_type") or "").lower()
        family = _FAMILY.get(model_type)
        if family is None and any(cfg.get(k) for k in _MOE_KEYS):
            raise SpecError(
                field="model.config",
                message=f"mixture-of-experts model_type {model_type or '(missing)'!r} is not supported yet.",
                hint="Supported MoE: mixtral. A dense estimate would undercount the experts.",
            )
        if family is None:
            family = "gpt2" if "n_embd" in cfg else "llama"
        hidden = _need(cfg, "hidden_size", "n_embd", "d_model")
        layers = _need(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _need(cfg, "num_attention_heads", "n_head")
        vocab = _need(cfg, "vocab_size")
        if family == "gpt2":
            inter = _optional_count(cfg, "n_inner", 4 * hidden)  # GPT2MLP: default 4 * n_embd
        else:
            inter = _need(cfg, "intermediate_size", "ffn_dim")
        kv_heads = _optional_count(cfg, "num_key_value_heads", heads)
        head_dim = _optional_count(cfg, "head_dim", max(1, hidden // heads))
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias, mlp_bias, lm_bias = bias, bias, bool(cfg.get("mlp_bias", False)), False
        norms = 2
        known = model_type in _FAMILY
        if model_type in ("mistral", "mixtral", "phi3"):
            qkv_bias = o_bias = mlp_bias = False
        elif model_type == "qwen2":  # Qwen2Attention: bias on q/k/v only, whatever the config says
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "gemma2":
            norms, mlp_bias = 4, False
        elif model_type == "stablelm":
            qkv_bias, o_bias, mlp_bias = bool(cfg.get("use_qkv_bias", False)), False, False
            norms = 1 if cfg.get("use_parallel_residual") else 2
            known = not cfg.get("qk_layernorm")  # per-head q/k LayerNorms are not counted
        elif family == "gpt_neox":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", True))
            mlp_bias = True
        elif family == "phi":
            qkv_bias = o_bias = mlp_bias = lm_bias = True
            norms = 1  # one input_layernorm feeds attention and MLP in parallel
            known = not cfg.get("qk_layernorm")
        elif family == "gpt2":
            qkv_bias = o_bias = mlp_bias = True
        experts = _optional_count(cfg, "num_local_experts", 1) if family == "mixtral" else 1
        tied = cfg.get("tie_word_embeddings")
        meta = cfg.get(META_KEY) or {}
        max_pos = cfg.get("max_position_embeddings", cfg.get("n_positions"))
        return cls(
            model_type=model_type or family,
            family=family,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            tied_embeddings=bool(
                model_type in _TIED_BY_DEFAULT or family == "gpt2" if tied is None else tied
            ),
            num_experts=experts,
            experts_per_token=_optional_count(cfg, "num_experts_per_tok", 1) if experts > 1 else 1,
            mlp_kind="plain" if family in ("gpt_neox", "phi", "gpt2") else "gated",
            norm_kind="layer" if model_type in _LAYER_NORM_TYPES or family == "gpt2" else "rms",
            norms_per_layer=norms,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            lm_head_bias=lm_bias,
            num_position_embeddings=_optional_count(cfg, "n_positions", 1024) if family == "gpt2" else 0,
            max_position_embeddings=int(max_pos) if max_pos else None,
            known_layout=known,
            hf_id=meta.get("hf_id"),
            config_hash=config_hash(cfg),
            hidden_act=_activation(cfg),
            context_length=_context_length(cfg, int(max_pos) if max_pos else None),
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


def _activation(cfg: dict[str, Any]) -> str:
    for key in ("hidden_act", "activation_function", "hidden_activation"):
        value = cfg.get(key)
        if isinstance(value, str) and value:
            return value.lower()[:64]
    return "silu"


def _need(cfg: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return _count(cfg, key)
    alts = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
    raise SpecError(
        field="model.config",
        message=f"config has no {keys[0]!r}{alts}, which the memory plan needs.",
        hint="Use the model's own config.json from the Hugging Face hub, unedited.",
    )


def _count(cfg: dict[str, Any], key: str, *, minimum: int = 1) -> int:
    """A dimension of the config: a whole number >= ``minimum`` (and below 2^40), else a
    SpecError naming the key - never a ValueError or a plan of a negative model."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) \
            or not minimum <= value < 2**40:
        shown = repr(value)[:40]
        raise SpecError(field="model.config", message=f"config {key!r} is {shown}, not a whole "
                        f"number of at least {minimum}.", hint="Use the model's own "
                        "config.json from the Hugging Face hub, unedited.")
    return int(value)


def _optional_count(cfg: dict[str, Any], key: str, default: int) -> int:
    return default if cfg.get(key) is None else _count(cfg, key)


# --------------------------------------------------------------------------- linear layers


@dataclass(frozen=True)
class LinearSpec:
    """One weight matrix of a decoder layer (or the LM head), as PEFT would target it."""

    name: str  # PEFT target name, e.g. "q_proj"
    path: str  # path inside one decoder layer, e.g. "self_attn.q_proj"; PEFT matches its suffix
    in_features: int
    out_features: int
    has_bias: bool
    count_per_layer: int = 1  # num_experts for MoE experts stored as one (experts, out, in) tensor
    group: str = "attention"  # attention | mlp | router | head
    # "module": an nn.Linear / Conv1D that PEFT's target_modules and all-linear wrap;
    # "parameter": a raw nn.Parameter (fused MoE experts, router) reached via target_parameters
    peft_kind: str = "module"

    @property
    def numel(self) -> int:
        """Parameters in this entry for one layer: weight (+ bias) times count_per_layer."""
        return (
            self.in_features * self.out_features + self.has_bias * self.out_features
        ) * self.count_per_layer


@lru_cache(maxsize=1)  # package metadata is slow to read, and the fit search asks often
def installed_moe_layout() -> MoeLayout:
    """How the installed transformers stores MoE experts; read from package metadata, no import.

    transformers >= 5 fuses each layer's experts into 3-D parameters (``experts.gate_up_proj``,
    ``experts.down_proj``) and makes the router a plain parameter; 4.x kept one nn.Linear per
    expert (``experts.N.w1/w2/w3``) and an nn.Linear router ``gate``.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return "fused"
    return "fused" if major >= 5 else "per_expert"


def linear_modules(arch: Arch, moe_layout: MoeLayout | None = None) -> list[LinearSpec]:
    """The weight matrices of one decoder layer, named as transformers/PEFT name them."""
    h, i, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q_out, kv_out = arch.num_heads * hd, arch.kv_dim
    qb, ob, mb = arch.attention_bias, arch.o_proj_bias, arch.mlp_bias

    def lin(name, path, fan_in, fan_out, bias, group, count=1, kind="module"):
        return LinearSpec(name, path, fan_in, fan_out, bias, count, group, kind)

    if arch.family == "gpt2":  # Conv1D layers; PEFT treats them like nn.Linear
        return [
            lin("c_attn", "attn.c_attn", h, 3 * h, True, "attention"),
            lin("c_proj", "attn.c_proj", h, h, True, "attention"),
            lin("c_fc", "mlp.c_fc", h, i, True, "mlp"),
            lin("c_proj", "mlp.c_proj", i, h, True, "mlp"),
        ]
    if arch.family == "gpt_neox":
        return [
            lin(
                "query_key_value",
                "attention.query_key_value",
                h,
                q_out + 2 * kv_out,
                qb,
                "attention",
            ),
            lin("dense", "attention.dense", q_out, h, ob, "attention"),
            lin("dense_h_to_4h", "mlp.dense_h_to_4h", h, i, True, "mlp"),
            lin("dense_4h_to_h", "mlp.dense_4h_to_h", i, h, True, "mlp"),
        ]
    if arch.family == "phi3":  # fused projections: one qkv matrix, one gate+up matrix
        return [
            lin("qkv_proj", "self_attn.qkv_proj", h, q_out + 2 * kv_out, False, "attention"),
            lin("o_proj", "self_attn.o_proj", q_out, h, False, "attention"),
            lin("gate_up_proj", "mlp.gate_up_proj", h, 2 * i, False, "mlp"),
            lin("down_proj", "mlp.down_proj", i, h, False, "mlp"),
        ]
    attention = [
        lin("q_proj", "self_attn.q_proj", h, q_out, qb, "attention"),
        lin("k_proj", "self_attn.k_proj", h, kv_out, qb, "attention"),
        lin("v_proj", "self_attn.v_proj", h, kv_out, qb, "attention"),
        lin(
            "dense" if arch.family == "phi" else "o_proj",
            "self_attn.dense" if arch.family == "phi" else "self_attn.o_proj",
            q_out,
            h,
            ob,
            "attention",
        ),
    ]
    if arch.family == "phi":
        return attention + [
            lin("fc1", "mlp.fc1", h, i, True, "mlp"),
            lin("fc2", "mlp.fc2", i, h, True, "mlp"),
        ]
    if arch.family == "mixtral":
        e = arch.num_experts
        if (moe_layout or installed_moe_layout()) == "per_expert":  # transformers 4.x
            return attention + [
                lin("gate", "block_sparse_moe.gate", h, e, False, "router"),
                lin("w1", "block_sparse_moe.experts.w1", h, i, False, "mlp", e),
                lin("w2", "block_sparse_moe.experts.w2", i, h, False, "mlp", e),
                lin("w3", "block_sparse_moe.experts.w3", h, i, False, "mlp", e),
            ]
        return attention + [  # transformers >= 5: MixtralTopKRouter.weight, MixtralExperts params
            lin("gate", "mlp.gate", h, e, False, "router", kind="parameter"),
            lin("gate_up_proj", "mlp.experts.gate_up_proj", h, 2 * i, False, "mlp", e, "parameter"),
            lin("down_proj", "mlp.experts.down_proj", i, h, False, "mlp", e, "parameter"),
        ]
    return attention + [
        lin("gate_proj", "mlp.gate_proj", h, i, mb, "mlp"),
        lin("up_proj", "mlp.up_proj", h, i, mb, "mlp"),
        lin("down_proj", "mlp.down_proj", i, h, mb, "mlp"),
    ]


def lm_head_spec(arch: Arch) -> LinearSpec:
    """The output projection (hidden -> vocab). With tied embeddings it shares the embedding weight."""
    return LinearSpec(
        "lm_head", "lm_head", arch.hidden_size, arch.vocab_size, arch.lm_head_bias, 1, "head"
    )


# --------------------------------------------------------------------------- parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts; ``total`` counts a tied embedding/LM-head weight once."""

    total: int
    embedding: int  # token embedding (+ learned position embedding)
    lm_head: int  # 0 when tied to the embedding (a bias, if any, still counts)
    per_layer: int  # one decoder layer: linears + its norms
    attention_per_layer: int
    mlp_per_layer: int  # includes the MoE router and every expert
    norms: int  # every norm in the model, final norm included
    active_per_token: int  # parameters one token passes through (MoE: top-k experts only)


def param_counts(arch: Arch, moe_layout: MoeLayout | None = None) -> ParamCounts:
    """Count every parameter of ``AutoModelForCausalLM.from_config(cfg)`` without building it."""
    specs = linear_modules(arch, moe_layout)
    norm = arch.hidden_size * (2 if arch.norm_kind == "layer" else 1)  # weight (+ bias), (hidden,)
    attention = sum(s.numel for s in specs if s.group == "attention")
    mlp = sum(s.numel for s in specs if s.group in ("mlp", "router"))
    per_layer = attention + mlp + arch.norms_per_layer * norm
    embedding = (arch.vocab_size + arch.num_position_embeddings) * arch.hidden_size
    head = lm_head_spec(arch)
    lm_head = 0 if arch.tied_embeddings else head.in_features * head.out_features
    lm_head += head.out_features if head.has_bias else 0
    norms = arch.num_layers * arch.norms_per_layer * norm + norm  # + the final norm
    total = embedding + lm_head + arch.num_layers * per_layer + norm
    idle_experts = arch.num_experts - arch.experts_per_token  # experts a token skips, per layer
    expert_numel = sum(s.numel for s in specs if s.group == "mlp" and s.count_per_layer > 1)
    idle = arch.num_layers * expert_numel * idle_experts // arch.num_experts if idle_experts else 0
    return ParamCounts(total, embedding, lm_head, per_layer, attention, mlp, norms, total - idle)


# transformers 4.x Mixtral names -> the fused >= 5 parameters PEFT maps them to
# (peft.utils.transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING / _MOE_FUSED_TARGETS).
_V4_EXPERT_ALIASES = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def _fused_moe(arch: Arch, moe_layout: MoeLayout | None) -> bool:
    return arch.family == "mixtral" and (moe_layout or installed_moe_layout()) == "fused"


def lora_target_names(arch: Arch, moe_layout: MoeLayout | None = None) -> list[str]:
    """Target names lora_param_count accepts for this model (short names, plus 'lm_head')."""
    names = {s.name for s in linear_modules(arch, moe_layout)} | {"lm_head"}
    if _fused_moe(arch, moe_layout):
        names |= set(_V4_EXPERT_ALIASES)
    return sorted(names)


def lora_targets(
    arch: Arch, targets: list[str] | str, moe_layout: MoeLayout | None = None
) -> dict[LinearSpec, int]:
    """The matrices LoRA wraps, each with its rank multiple (2 for fused w1+w3, else 1).

    ``targets`` is ``"all-linear"`` or a list of names matched like PEFT's ``target_modules`` (a
    layer path equal to the name or ending in ``.name``). PEFT's all-linear wraps every nn.Linear /
    Conv1D except the output embedding (peft.tuners.tuners_utils._maybe_include_all_linear_layers),
    so on transformers 4.x Mixtral it takes the router ``gate`` and every expert's w1/w2/w3. On
    transformers >= 5 those are raw parameters; PEFT (0.18+) then translates the 4.x names to
    ``target_parameters``: gate -> gate.weight, w2 -> experts.down_proj, and w1 + w3 (both or
    neither) -> experts.gate_up_proj at rank 2r, keeping the 4.x capacity. all-linear includes them.
    """
    specs = linear_modules(arch, moe_layout)
    fused = _fused_moe(arch, moe_layout)
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        names = [s.name for s in specs if s.peft_kind == "module"]
        names += ["gate", *_V4_EXPERT_ALIASES] if fused else []
    else:
        names = [targets] if isinstance(targets, str) else list(targets)
    if fused and ("w1" in names) != ("w3" in names):
        raise SpecError(
            field="method.lora_targets",
            message="w1 and w3 are fused into one experts.gate_up_proj in transformers >= 5.",
            hint="Target both w1 and w3, or neither (or target gate_up_proj directly).",
        )
    chosen: dict[LinearSpec, int] = {}
    for name in names:
        factor = 2 if fused and name in ("w1", "w3") else 1
        name = _V4_EXPERT_ALIASES.get(name, name) if fused else name
        hits = [
            s for s in specs + [lm_head_spec(arch)] if s.path == name or s.path.endswith("." + name)
        ]
        if not hits:
            valid = lora_target_names(arch, moe_layout)
            close = did_you_mean(name, valid)
            if not close.startswith("Valid"):
                close += f" Valid values: {', '.join(valid)}."
            raise SpecError(
                field="method.lora_targets",
                message=f"{name!r} is not a linear layer of {arch.model_type}.",
                hint=f"{close} Or use {ALL_LINEAR!r}.",
            )
        for s in hits:
            chosen[s] = max(chosen.get(s, 0), factor)
    return chosen


def lora_param_count(
    arch: Arch, targets: list[str] | str, rank: int, moe_layout: MoeLayout | None = None
) -> int:
    """Trainable LoRA parameters: rank * (in + out) per wrapped matrix, per expert, per layer.

    Equals PEFT's trainable count for ``LoraConfig(r=rank, target_modules=targets)`` (see
    :func:`lora_targets` for which matrices that is).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise SpecError(
            field="method.lora_rank", message=f"LoRA rank must be a positive integer, got {rank!r}."
        )
    total = 0
    for s, factor in lora_targets(arch, targets, moe_layout).items():
        per_matrix = factor * rank * (s.in_features + s.out_features)  # A: (r, in), B: (out, r)
        layers = 1 if s.group == "head" else arch.num_layers
        total += per_matrix * s.count_per_layer * layers
    return total


# --------------------------------------------------------------------------- the spec's model


def resolve_model_config(spec, base_dir: Path | None = None) -> dict[str, Any]:
    """The model's Hugging Face config dict, from the preset or the local config path (relative
    paths are tried as given, then against ``base_dir``: the spec file's directory)."""
    if spec.model.preset is not None:
        return load_preset(spec.model.preset)
    path = Path(spec.model.config or "")
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return load_config_file(path)


def resolve_arch(spec, base_dir: Path | None = None) -> Arch:
    return Arch.from_config(resolve_model_config(spec, base_dir))
