"""Exact parameter counts of an :class:`Arch`: ``param_counts(arch).total`` equals
``sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())``, which counts tied
weights once (tests/test_arch*.py build each layout on the meta device to check it)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tunepilot.model.arch.core import Arch, LinearSpec, MoeLayout


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts; ``total`` counts a tied embedding/LM-head weight once."""

    total: int
    embedding: int  # token embedding (+ learned position embedding)
    lm_head: int  # 0 when tied to the embedding (a bias, if any, still counts)
    per_layer: int  # the largest decoder layer: linears + its other parameters
    attention_per_layer: int
    mlp_per_layer: int  # the largest layer's MLP: router, every expert, shared experts
    norms: int  # every norm and other small vector in the decoder, final norm included
    active_per_token: int  # parameters one token passes through (MoE: top-k experts only)
    routed_experts: int = 0  # every routed expert's parameters, all layers
    vision: int = 0  # a vision tower and projector (loaded, never run on text)
    mtp: int = 0  # multi-token-prediction modules the checkpoint ships; not in total


def linear_modules(arch: Arch, moe_layout: MoeLayout | None = None, *,
                   vision: bool = False) -> list[LinearSpec]:
    """The weight matrices of the decoder layers, named as transformers/PEFT name them, each
    with the number of layers that hold it (``layers``); a vision tower's too with vision."""
    from tunepilot.model.arch.lora import installed_moe_layout
    from tunepilot.model.arch.moe import layout_specs

    # only an MoE model's matrices depend on the installed transformers (its metadata is slow)
    specs = layout_specs(arch, moe_layout or (installed_moe_layout() if arch.is_moe else "fused"))
    if vision and arch.vision is not None:
        specs += list(arch.vision.linears)
    return specs


def lm_head_spec(arch: Arch) -> LinearSpec:
    """The output projection (hidden -> vocab). With tied embeddings it shares the embedding weight."""
    return LinearSpec(
        "lm_head", "lm_head", arch.hidden_size, arch.vocab_size, arch.lm_head_bias, 1, "head"
    )


def _largest_layer(arch: Arch, specs: list[LinearSpec]) -> tuple[int, int]:
    """(attention, largest MLP) parameters of one decoder layer."""
    attention = sum(s.numel for s in specs if s.group == "attention")
    mlp = {kind: sum(s.numel for s in specs if s.group in ("mlp", "router")
                     and s.layer_kind in ("all", kind)) for kind in ("dense", "moe")}
    if not arch.is_moe:
        return attention, mlp["dense"]
    if arch.num_moe_layers == arch.num_layers:
        return attention, mlp["moe"]
    return attention, max(mlp.values())


@lru_cache(maxsize=256)
def param_counts(arch: Arch, moe_layout: MoeLayout | None = None) -> ParamCounts:
    """Count every parameter of ``AutoModelForCausalLM.from_config(cfg)`` without building it.
    Cached: an Arch is frozen, and a plan's fit asks for the same counts hundreds of times."""
    specs = linear_modules(arch, moe_layout)
    layer_vectors = sum(arch.vectors_per_layer)
    attention, mlp = _largest_layer(arch, specs)
    embedding = (arch.vocab_size + arch.num_position_embeddings) * arch.hidden_size
    head = lm_head_spec(arch)
    lm_head = 0 if arch.tied_embeddings else head.in_features * head.out_features
    lm_head += head.out_features if head.has_bias else 0
    norms = arch.num_layers * layer_vectors + sum(arch.model_vectors)
    vision = arch.vision.params if arch.vision is not None else 0
    total = (embedding + lm_head + sum(s.total_numel for s in specs) + norms + vision)
    routed = sum(s.total_numel for s in specs if s.routed)
    idle = routed * (arch.num_experts - arch.experts_per_token) // arch.num_experts \
        if routed else 0  # the experts a token skips
    return ParamCounts(total, embedding, lm_head, attention + mlp + layer_vectors, attention,
                       mlp, norms, total - idle - vision, routed, vision, arch.mtp_params)


def parameter_shapes(arch: Arch, moe_layout: MoeLayout | None = None) -> list[tuple[int, ...]]:
    """The shape of every parameter tensor (tied weights once): what a per-tensor optimizer
    rule (Adafactor's factored moments, the for-loop step's largest temporary) iterates."""
    shapes: list[tuple[int, ...]] = [(arch.vocab_size, arch.hidden_size)]
    if arch.num_position_embeddings:
        shapes.append((arch.num_position_embeddings, arch.hidden_size))
    if not arch.tied_embeddings:
        shapes.append((arch.vocab_size, arch.hidden_size))
    if arch.lm_head_bias:
        shapes.append((arch.vocab_size,))
    for lin in linear_modules(arch, moe_layout, vision=True):
        matrix = (lin.out_features, lin.in_features)
        if lin.count_per_layer > 1 and lin.peft_kind == "parameter":  # one 3-D tensor
            shapes += [(lin.count_per_layer, *matrix)] * lin.layers
            if lin.has_bias:
                shapes += [(lin.count_per_layer, lin.out_features)] * lin.layers
            continue
        shapes += [matrix] * (lin.count_per_layer * lin.layers)
        if lin.has_bias:
            shapes += [(lin.out_features,)] * (lin.count_per_layer * lin.layers)
    shapes += [(n,) for n in arch.vectors_per_layer] * arch.num_layers
    shapes += [(n,) for n in arch.model_vectors]
    if arch.vision is not None:
        shapes += [(n,) for n in arch.vision.vectors] + list(arch.vision.shapes)
    return shapes
