"""`plan`: the memory one device needs for a spec, how it fits each card of the catalog, and
the host RAM and disk each node needs (plan/host.py) against each card's offer.

One entry point, ``make_plan(spec, method=...)``, and one finishing tail; each way of planning is
a room that only makes the plan of the spec itself and the planner the fit table's inverse
queries use (max micro-batch, max sequence length, device counts):

    analytic    plan/analytic/ - arithmetic over the architecture, no torch
    traced      plan/trace/ - the real step on fake tensors in a child process (falls back to
                the analytic plan, saying why)
    calibrated  plan/calibrate.py - the analytic plan with a pilot's measured ratios (run_dir)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from tunepilot.catalog import Card, Catalog, load_catalog
from tunepilot.errors import UserError
from tunepilot.model.arch import Arch, resolve_arch
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.plan.fit import DEFAULT_HEADROOM, Planner, Probes, fit_card, note_context
from tunepilot.plan.host import attach_host
from tunepilot.results.plan import MemoryPlan
from tunepilot.spec import RunSpec

Method = Literal["analytic", "traced", "calibrated"]
METHODS: tuple[str, ...] = ("analytic", "traced", "calibrated")


def make_plan(spec: RunSpec, method: Method = "analytic", *, catalog: Catalog | None = None,
              card_ids: list[str] | None = None, headroom: float = DEFAULT_HEADROOM,
              arch: Arch | None = None, base_dir: Path | None = None,
              run_dir: Path | str | None = None, timeout_s: float | None = None) -> MemoryPlan:
    """The plan of `spec` by ``method``, fitted against `card_ids` (default: every catalog card
    that can run it). ``run_dir``: the pilot a calibrated plan reads; ``timeout_s``: the trace's
    child process."""
    from tunepilot.spec.fp8 import cards_for

    if method not in METHODS:
        raise UserError("method", f"{method!r} is not a way of planning.",
                        f"Use one of {', '.join(METHODS)}.")
    catalog = catalog or load_catalog()
    cards, left_out = cards_for(spec, catalog, card_ids)
    stack = cards[0].software_stack if cards else "cuda"
    if method == "traced":
        from tunepilot.plan.trace.core import traced_plan

        plan, arch, planner = traced_plan(spec, stack, base_dir, timeout_s)
    else:
        arch = arch or resolve_arch(spec, base_dir)
        planner = _calibrated(run_dir) if method == "calibrated" else analytic_plan
        plan = planner(spec, arch, stack)
    return _finish(plan, spec, arch, cards, planner, headroom, left_out,
                   chosen=bool(card_ids))


def _calibrated(run_dir: Path | str | None) -> Planner:
    from tunepilot.plan.calibrate import calibrated_planner, load_calibration

    if run_dir is None:
        raise UserError("--calibrate", "a calibrated plan needs the run directory of a pilot.",
                        "Pass the pilot's RUN_DIR.")
    return calibrated_planner(load_calibration(run_dir))


def _finish(plan: MemoryPlan, spec: RunSpec, arch: Arch, cards: list[Card], planner: Planner,
            headroom: float, left_out: list[str], *, chosen: bool) -> MemoryPlan:
    """The tail every way of planning shares: each card's fit (its inverse queries by
    ``planner``), the cards left out, the host plan, the spec's hash, and - for cards the user
    chose - a colocated vLLM that leaves no room refused as bad input."""
    probes = Probes(spec, arch, planner)
    plan.cards = [fit_card(spec, arch, card, planner, headroom, plan, probes) for card in cards]
    plan.assumptions += left_out
    note_context(plan, spec, arch)
    attach_host(plan, spec, arch, cards, headroom)
    plan.spec_hash = spec.spec_hash()
    if chosen:
        from tunepilot.plan.analytic.phases import check_generation_room

        check_generation_room(spec, plan, headroom)
    return plan
