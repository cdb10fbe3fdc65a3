"""Which matrices a LoRA config wraps, and its trainable parameters, as PEFT would count them -
MoE experts included: transformers >= 5 stores them as raw parameters that PEFT reaches through
``target_parameters``, and PEFT renames transformers 4.x target names to them (moe.py)."""

from __future__ import annotations

from functools import lru_cache

from tunepilot.errors import SpecError, did_you_mean
from tunepilot.model.arch.core import Arch, LinearSpec, MoeLayout
from tunepilot.model.arch.counts import linear_modules, lm_head_spec
from tunepilot.model.arch.moe import PEFT_FUSED_PAIR, PEFT_MOE_ALIASES, PEFT_MOE_PATTERN

ALL_LINEAR = "all-linear"  # PEFT's shorthand (peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND)


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


def _aliases(arch: Arch, moe_layout: MoeLayout | None) -> tuple[dict[str, str], tuple]:
    """(PEFT's 4.x-name -> fused-parameter aliases for this model, the pair fused into one)."""
    if not arch.is_moe or (moe_layout or installed_moe_layout()) != "fused":
        return {}, ()
    pattern = PEFT_MOE_PATTERN.get(arch.model_type, "")
    return PEFT_MOE_ALIASES.get(pattern, {}), PEFT_FUSED_PAIR.get(pattern, ())


def lora_target_names(arch: Arch, moe_layout: MoeLayout | None = None) -> list[str]:
    """Target names lora_param_count accepts for this model (short names, plus 'lm_head')."""
    names = {s.name for s in linear_modules(arch, moe_layout, vision=True)} | {"lm_head"}
    return sorted(names | set(_aliases(arch, moe_layout)[0]))


def lora_targets(arch: Arch, targets: list[str] | str, moe_layout: MoeLayout | None = None,
                 *, vision: bool = False) -> dict[LinearSpec, int]:
    """The matrices LoRA wraps, each with its rank multiple (2 for a fused pair, else 1).

    ``targets`` is ``"all-linear"`` or a list of names matched like PEFT's ``target_modules`` (a
    layer path equal to the name or ending in ``.name``). PEFT's all-linear wraps every nn.Linear /
    Conv1D except the output embedding (peft.tuners.tuners_utils._maybe_include_all_linear_layers)
    - a vision tower's too, and Llama 4's nn.Linear router. On transformers >= 5 the experts of
    the MoE types PEFT converts (Mixtral; Qwen3-MoE, OLMoE, DeepSeek) are raw parameters; PEFT
    translates the 4.x names to ``target_parameters``: gate -> gate.weight, w2 / down_proj ->
    experts.down_proj, and w1 + w3 / gate_proj + up_proj (both or neither) ->
    experts.gate_up_proj at rank 2r, keeping the 4.x capacity; those names then reach no dense or
    shared MLP. all-linear includes them. A vision tower's matrices are left out unless
    ``vision`` (they hold adapters but never run on text).
    """
    specs = linear_modules(arch, moe_layout, vision=True)
    aliases, pair = _aliases(arch, moe_layout)
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        names = [s.name for s in specs if s.peft_kind == "module"] + list(aliases)
    else:
        names = [targets] if isinstance(targets, str) else list(targets)
    if pair and (pair[0] in names) != (pair[1] in names):
        raise SpecError(
            field="method.lora_targets",
            message=f"{pair[0]} and {pair[1]} are fused into one experts.gate_up_proj in "
                    "transformers >= 5.",
            hint=f"Target both {pair[0]} and {pair[1]}, or neither (or target gate_up_proj "
                 "directly).",
        )
    chosen: dict[LinearSpec, int] = {}
    for name in dict.fromkeys(names):
        factor = 2 if name in pair else 1
        if name in aliases:  # the routed experts' parameter (or the router), nothing else
            hits = [s for s in specs if (s.routed or s.group == "router")
                    and s.path.endswith("." + aliases[name])]
        else:  # a module of that name if there is one (PEFT's target_modules), else a raw
            # parameter (target_parameters: model/build.py expert_parameters decides the same)
            found = [s for s in specs + [lm_head_spec(arch)]
                     if s.path == name or s.path.endswith("." + name)]
            hits = [s for s in found if s.peft_kind == "module"] or found
        if not hits:
            _unknown_target(arch, name, moe_layout)
        for s in hits:
            chosen[s] = max(chosen.get(s, 0), factor)
    return chosen if vision else {s: f for s, f in chosen.items() if s.runs_per_token}


def _unknown_target(arch: Arch, name: str, moe_layout: MoeLayout | None) -> None:
    valid = lora_target_names(arch, moe_layout)
    close = did_you_mean(name, valid)
    if not close.startswith("Valid"):
        close += f" Valid values: {', '.join(valid)}."
    raise SpecError(
        field="method.lora_targets",
        message=f"{name!r} is not a linear layer of {arch.model_type}.",
        hint=f"{close} Or use {ALL_LINEAR!r}.",
    )


def lora_param_count(
    arch: Arch, targets: list[str] | str, rank: int, moe_layout: MoeLayout | None = None
) -> int:
    """Trainable LoRA parameters: rank * (in + out) per wrapped matrix, per expert, per layer -
    a vision tower's adapters included.

    Equals PEFT's trainable count for ``LoraConfig(r=rank, target_modules=targets)`` (see
    :func:`lora_targets` for which matrices that is).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise SpecError(
            field="method.lora_rank", message=f"LoRA rank must be a positive integer, got {rank!r}."
        )
    total = 0
    for s, factor in lora_targets(arch, targets, moe_layout, vision=True).items():
        per_matrix = factor * rank * (s.in_features + s.out_features)  # A: (r, in), B: (out, r)
        total += per_matrix * s.count_per_layer * s.layers
    return total
