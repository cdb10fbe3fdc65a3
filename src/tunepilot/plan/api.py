"""`plan`: the memory one device needs for a spec, how it fits each card of the catalog, and
the host RAM and disk each node needs (plan/host.py) against each card's offer."""

from __future__ import annotations

from pathlib import Path

from tunepilot.catalog import Catalog, load_catalog
from tunepilot.model.arch import Arch, resolve_arch
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.plan.fit import DEFAULT_HEADROOM, fit_card, note_context
from tunepilot.plan.host import attach_host
from tunepilot.results.plan import MemoryPlan
from tunepilot.spec import RunSpec


def make_plan(spec: RunSpec, *, catalog: Catalog | None = None, card_ids: list[str] | None = None,
              headroom: float = DEFAULT_HEADROOM, arch: Arch | None = None,
              base_dir: Path | None = None) -> MemoryPlan:
    """The analytic plan of `spec`, fitted against `card_ids` (default: every catalog card)."""
    catalog = catalog or load_catalog()
    arch = arch or resolve_arch(spec, base_dir)
    from tunepilot.spec.fp8 import cards_for

    cards, left_out = cards_for(spec, catalog, card_ids)
    stack = cards[0].software_stack if cards else "cuda"
    plan = analytic_plan(spec, arch, stack)
    plan.cards = [fit_card(spec, arch, card, analytic_plan, headroom, plan) for card in cards]
    plan.assumptions += left_out
    note_context(plan, spec, arch)
    attach_host(plan, spec, arch, cards, headroom)
    plan.spec_hash = spec.spec_hash()
    if card_ids:  # cards the user chose: a colocated vLLM that leaves no room is bad input
        from tunepilot.plan.analytic.phases import check_generation_room

        check_generation_room(spec, plan, headroom)
    return plan
