"""Fit a memory plan against cards: headroom, devices needed, and the inverse queries.

A card fits when the device-level peak (allocator reserve + runtime context + workspaces +
collective buffers) leaves at least `headroom` of the card's memory free. A run whose peak fits
the card but leaves less free than that is "tight": the fit says at how many cards
(DevicesNeeded.ddp_tight / fsdp_tight), and the quote prices it, ranked below runs with room.
"""

from __future__ import annotations

from collections.abc import Callable

from tunepilot.catalog import Card
from tunepilot.model.arch import Arch
from tunepilot.plan.analytic.phases import card_device_peak, vllm_reserve_bytes
from tunepilot.plan.search import largest_passing
from tunepilot.results.plan import CardFit, DevicesNeeded, MemoryPlan
from tunepilot.spec import RunSpec

DEFAULT_HEADROOM = 0.10
# Device counts tried for FSDP: one node's worth, then whole 8-GPU nodes.
FSDP_COUNTS = [1, 2, 4, 8] + [8 * n for n in range(2, 129)]
MAX_SEARCH_SEQ = 1 << 21  # 2M tokens: beyond any shipped model's context
MAX_SEARCH_MICRO_BATCH = 1 << 14

Planner = Callable[[RunSpec, Arch, str], MemoryPlan]


def fits(device_peak_bytes: int, capacity_bytes: int, headroom: float) -> bool:
    return device_peak_bytes <= capacity_bytes * (1.0 - headroom)


def fit_card(spec: RunSpec, arch: Arch, card: Card, planner: Planner,
             headroom: float = DEFAULT_HEADROOM, plan: MemoryPlan | None = None) -> CardFit:
    """One row of the fit table for `card`. A colocated vLLM's reserve is a share of this card
    (objective_phases.card_device_peak), so the row's device peak is the card's own. Counts
    that fit only with less free memory than ``headroom`` are the *_tight counts."""
    stack = card.software_stack
    plan = plan if plan is not None and plan.stack == stack else planner(spec, arch, stack)
    cap = card.capacity_bytes
    peak, phase = card_device_peak(plan, spec, cap)

    def ok(s: RunSpec | None, room: float = headroom) -> bool:
        return s is not None and fits(card_device_peak(planner(s, arch, stack), s, cap)[0],
                                      cap, room)

    def tight(s: RunSpec | None) -> bool:  # fits the card, with less free than the headroom asked
        return ok(s, 0.0)

    def largest(field: str, upper: int) -> int:
        """The largest value of ``field`` that fits: micro-batches in _batch_step steps; a
        generative sequence as its prompt + the largest completion."""
        step = _batch_step(spec) if field == "micro_batch_size" else 1
        base = 0
        if field == "sequence_length" and spec.objective.generative:
            from tunepilot.spec.objective import lengths

            base = lengths(spec).prompt
        best = largest_passing(lambda v: ok(_changed(spec, field, base + v * step)),
                               (upper - base) // step)[0]
        return base + best * step if best else 0

    ddp, fsdp = _ddp_devices(spec, ok), _fsdp_devices(spec, ok)
    ddp_tight = _ddp_devices(spec, tight) if ddp is None else None
    fsdp_tight = _fsdp_devices(spec, tight, below=fsdp)
    return CardFit(
        card=card.id, capacity_bytes=cap, device_peak_bytes=peak,
        fits=fits(peak, cap, headroom), headroom_fraction=1.0 - peak / cap,
        devices_needed=DevicesNeeded(ddp=ddp, fsdp=fsdp, ddp_tight=ddp_tight,
                                     fsdp_tight=fsdp_tight),
        max_micro_batch=largest("micro_batch_size", MAX_SEARCH_MICRO_BATCH),
        max_sequence_length=largest("sequence_length", MAX_SEARCH_SEQ),
        peak_phase=phase, generation_reserve_bytes=vllm_reserve_bytes(spec, cap),
        headroom_asked=headroom)


def _batch_step(spec: RunSpec) -> int:
    """GRPO/RLOO: micro-batches in steps that keep every prompt's completions in one
    generation batch (num_generations divides micro x steps_per_generation x ranks)."""
    import math

    o = spec.objective
    if not o.generative or o.generations < 2:
        return 1
    per = (o.steps_per_generation or spec.gradient_accumulation_steps) * \
        spec.parallel.world_size
    return o.generations // math.gcd(o.generations, per)


def _changed(spec: RunSpec, field: str, value: int) -> RunSpec | None:
    """The spec with ``field`` at ``value`` (None where that spec is not valid). A generative
    run's sequence grows by its completion: the prompt keeps its length."""
    from tunepilot.errors import SpecError
    from tunepilot.spec import spec_from_dict
    from tunepilot.spec.objective import lengths

    data = spec.model_dump(mode="python")
    data[field] = value
    o = spec.objective
    if field == "sequence_length" and o.generative:
        p = lengths(spec).prompt
        if value <= p:
            return None
        data["objective"] = dict(data["objective"], max_completion_length=value - p)
    try:
        return spec_from_dict(data)
    except SpecError:
        return None


def _ddp_devices(spec: RunSpec, ok: Callable[[RunSpec | None], bool]) -> int | None:
    """DDP replicates the model and does not pool memory: it needs one card's worth of memory per
    rank (plus gradient buckets), so the answer is 1 when a single device fits, else None (never)."""
    par = dict(spec.parallel.model_dump(), strategy="single", devices=1, nodes=1)
    return 1 if ok(_changed(spec, "parallel", par)) else None


def _fsdp_devices(spec: RunSpec, ok: Callable[[RunSpec | None], bool], below: int | None = None
                  ) -> int | None:
    """The fewest ranks whose FSDP shards fit (activations are per rank and do not shrink),
    fewer than ``below`` when given."""
    for n in FSDP_COUNTS:
        if below is not None and n >= below:
            return None
        par = dict(spec.parallel.model_dump(), strategy="fsdp" if n > 1 else "single",
                   devices=min(n, 8), nodes=max(1, n // 8))
        if ok(_changed(spec, "parallel", par)):
            return n
    return None
