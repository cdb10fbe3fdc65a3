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
from tunepilot.model.context import search_cap
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


class Probes:
    """The specs a fit tries (one field changed) and their plans, made once for every card of a
    plan: the cards of one software stack ask many of the same questions."""

    def __init__(self, spec: RunSpec, arch: Arch, planner: Planner) -> None:
        self.spec, self.arch, self.planner = spec, arch, planner
        self._specs: dict[tuple[str, str], RunSpec | None] = {}
        self._plans: dict[tuple[int, str], MemoryPlan] = {}

    def changed(self, field: str, value: object) -> RunSpec | None:
        key = (field, repr(value))
        if key not in self._specs:
            self._specs[key] = _changed(self.spec, field, value)
        return self._specs[key]

    def plan(self, s: RunSpec, stack: str) -> MemoryPlan:
        key = (id(s), stack)  # s is held in _specs (or is the spec itself): its id is stable
        if key not in self._plans:
            self._plans[key] = self.planner(s, self.arch, stack)
        return self._plans[key]


def fit_card(spec: RunSpec, arch: Arch, card: Card, planner: Planner,
             headroom: float = DEFAULT_HEADROOM, plan: MemoryPlan | None = None,
             probes: Probes | None = None) -> CardFit:
    """One row of the fit table for `card`. A colocated vLLM's reserve is a share of this card
    (objective_phases.card_device_peak), so the row's device peak is the card's own. Counts
    that fit only with less free memory than ``headroom`` are the *_tight counts. ``probes``:
    the specs and plans already tried for another card of the same plan."""
    probes = probes or Probes(spec, arch, planner)
    stack = card.software_stack
    plan = plan if plan is not None and plan.stack == stack else probes.plan(spec, stack)
    cap = card.capacity_bytes
    peak, phase = card_device_peak(plan, spec, cap)
    fitting = fits(peak, cap, headroom)

    def ok(s: RunSpec | None, room: float = headroom) -> bool:
        return s is not None and fits(card_device_peak(probes.plan(s, stack), s, cap)[0],
                                      cap, room)

    def tight(s: RunSpec | None) -> bool:  # fits the card, with less free than the headroom asked
        return ok(s, 0.0)

    def largest(field: str, upper: int) -> int:
        """The largest value of ``field`` that fits, searched upward from the smallest valid one
        (micro-batches in _batch_step steps; a sequence past a pair's or a generation's prompt),
        starting from the spec's own value where it is on the way."""
        step = _batch_step(spec) if field == "micro_batch_size" else _sequence_step(spec)
        first = step if field == "micro_batch_size" else _shortest_valid_sequence(spec, probes)
        if first > upper:
            return 0
        own = getattr(spec, field)
        at = (own - first) // step + 1 if own >= first and (own - first) % step == 0 else None
        if field == "sequence_length" and spec.objective.generative:
            at = None  # its own length may hold a shorter completion than the search's
        hint = {} if at is None or own > upper else \
            {"known_ok": at} if fitting else {"known_bad": at}
        best = largest_passing(lambda x: ok(probes.changed(field, first + (x - 1) * step)),
                               (upper - first) // step + 1, **hint)[0]
        return first + (best - 1) * step if best else 0

    ddp, fsdp = _ddp_devices(probes, ok), _fsdp_devices(probes, ok)
    ddp_tight = _ddp_devices(probes, tight) if ddp is None else None
    fsdp_tight = _fsdp_devices(probes, tight, below=fsdp)
    return CardFit(
        card=card.id, capacity_bytes=cap, device_peak_bytes=peak,
        fits=fitting, headroom_fraction=1.0 - peak / cap,
        devices_needed=DevicesNeeded(ddp=ddp, fsdp=fsdp, ddp_tight=ddp_tight,
                                     fsdp_tight=fsdp_tight),
        max_micro_batch=largest("micro_batch_size", MAX_SEARCH_MICRO_BATCH),
        max_sequence_length=largest("sequence_length", search_cap(arch, spec, MAX_SEARCH_SEQ)[0]),
        peak_phase=phase, generation_reserve_bytes=vllm_reserve_bytes(spec, cap),
        headroom_asked=headroom)


def note_context(plan: MemoryPlan, spec: RunSpec, arch: Arch) -> None:
    """The plan's words on the model's context: a warning when sequence_length runs past it, and
    where the max seq len column stops (model/context.py)."""
    from tunepilot.model.context import context_warning

    warning = context_warning(arch, spec)
    if warning:
        plan.warnings.append(warning)
    cap_note = search_cap(arch, spec, MAX_SEARCH_SEQ)[1]
    if cap_note:
        plan.assumptions.append(cap_note)


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


def _sequence_step(spec: RunSpec) -> int:
    """Sequence lengths in steps the context- (and sequence-) parallel ranks divide evenly."""
    par = spec.parallel
    return par.context * (par.tensor if par.sequence_parallel else 1)


def _shortest_valid_sequence(spec: RunSpec, probes: Probes | None = None) -> int:
    """The shortest sequence_length at which the spec is valid: 1 for SFT; past the prompt for a
    pair (a DPO spec with max_prompt_length 1024 starts at 1025) or a generation. Bisection
    between 1 and the spec's own length, which is valid."""
    split = _sequence_step(spec)

    def changed(value: int) -> RunSpec | None:
        return probes.changed("sequence_length", value) if probes else \
            _changed(spec, "sequence_length", value)

    if changed(split) is not None:
        return split
    bad, good = 1, spec.sequence_length
    while good - bad > 1:
        mid = (bad + good) // 2
        if changed(mid) is None:
            bad = mid
        else:
            good = mid
    return good


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


def _ddp_devices(probes: Probes, ok: Callable[[RunSpec | None], bool]) -> int | None:
    """DDP replicates the model and does not pool memory: it needs one card's worth of memory per
    rank (plus gradient buckets), so the answer is 1 when a single device fits, else None (never)."""
    par = dict(probes.spec.parallel.model_dump(), strategy="single", devices=1, nodes=1)
    return 1 if ok(probes.changed("parallel", par)) else None


def _fsdp_devices(probes: Probes, ok: Callable[[RunSpec | None], bool],
                  below: int | None = None) -> int | None:
    """The fewest ranks whose FSDP shards fit (activations are per rank and do not shrink),
    fewer than ``below`` when given."""
    for n in FSDP_COUNTS:
        if below is not None and n >= below:
            return None
        par = dict(probes.spec.parallel.model_dump(), strategy="fsdp" if n > 1 else "single",
                   devices=min(n, 8), nodes=max(1, n // 8))
        if ok(probes.changed("parallel", par)):
            return n
    return None
