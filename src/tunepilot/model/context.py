"""The model's context: how many positions a run can train at, and what to say past it.

The config names its context (max_position_embeddings, or the original length x factor of its
own rope_scaling: model/arch.py ``context_length``). A spec's ``model.rope_scaling`` is a linear
RoPE factor (position interpolation, Chen et al. 2023, arXiv:2306.15595; HF rope_type "linear",
applied by model/build.py) that stretches it: the run's context is the config's x the factor.
Past it a rotary model still runs, but attends at positions it never trained on; a model with
learned absolute positions (GPT-2's wpe) cannot index them at all. So `plan` and `quote` warn
past the context, and the plan's inverse query (max seq len) stops at it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Context:
    """The positions a run can train at: ``tokens`` None when the config names none."""

    tokens: int | None
    how: str
    learned_positions: bool  # learned absolute positions: no RoPE to scale
    config_tokens: int | None = None  # the config's own, before the spec's rope scaling


def run_context(arch: Any, spec: Any) -> Context:
    """The config's context, times the spec's rope scaling factor where it sets one."""
    base = arch.context_length or arch.max_position_embeddings
    learned = arch.num_position_embeddings > 0
    if base is None:
        return Context(None, "the config names no max_position_embeddings", learned, None)
    factor = spec.model.rope_scaling
    how = "config max_position_embeddings" + (
        "" if base == arch.max_position_embeddings else " with its own rope_scaling")
    if factor and not learned:
        return Context(int(base * factor), f"{base:,} from the {how} x model.rope_scaling "
                       f"{factor:g}", learned, base)
    return Context(base, how, learned, base)


def context_warning(arch: Any, spec: Any) -> str | None:
    """A warning when sequence_length runs past the run's context, naming the way to go longer
    (or when the spec scales RoPE on a model that has none)."""
    ctx = run_context(arch, spec)
    s = spec.sequence_length
    if ctx.learned_positions and spec.model.rope_scaling:
        return ("model.rope_scaling has no effect: the model has learned absolute positions, "
                "not RoPE; remove it")
    if ctx.tokens is None or s <= ctx.tokens:
        return None
    if ctx.learned_positions:
        return (f"sequence_length {s:,} is past the model's {ctx.tokens:,} learned absolute "
                f"positions ({ctx.how}): it cannot embed the positions beyond them (an index "
                f"error in training); set sequence_length <= {ctx.tokens:,}")
    factor = max(2, math.ceil(s / ctx.config_tokens))
    return (f"sequence_length {s:,} is past the model's context, {ctx.tokens:,} tokens "
            f"({ctx.how}): the positions beyond it were never trained, and quality falls "
            f"there; to train longer, scale RoPE (model.rope_scaling: {factor} covers it), or "
            f"set sequence_length <= {ctx.tokens:,}")


def search_cap(arch: Any, spec: Any, upper: int) -> tuple[int, str | None]:
    """The inverse query's upper bound for sequence_length: the run's context (the config's, or
    the config's x the spec's rope scaling), and the words that say so; ``upper`` when the
    config names none."""
    ctx = run_context(arch, spec)
    if ctx.tokens is None or ctx.tokens >= upper:
        return upper, None
    return ctx.tokens, f"max seq len stops at the model's context, {ctx.tokens:,} tokens " \
        f"({ctx.how})" + (
        "" if ctx.learned_positions else "; model.rope_scaling stretches it")
