"""compare: every card x count that fits, quoted on its cheapest covering term and ranked by cost
per million useful tokens (runs with room first, tight fits after); offers whose host RAM cannot
hold a node are not ranked; several precisions ranked together, and an RL objective's vLLM
generation both colocated on the training cards and on a server of its own (its cards billed).
Each row is a quote (cost/quote.py build_quote)."""

from __future__ import annotations

from pathlib import Path

from tunepilot.catalog import Catalog, load_catalog
from tunepilot.cost.context import QuoteContext, context
from tunepilot.cost.quote import (
    SpotAsk,
    build_quote,
    does_not_fit_text,
    host_fit_at,
    strategy_at,
)
from tunepilot.cost.rl_quote import colocated_count_refused, generation_layout, layout_variants
from tunepilot.cost.spot import node_rate
from tunepilot.results.quote import Comparison, Quote, Refusal
from tunepilot.spec import RunSpec

COMPARE_COUNTS = (1, 2, 4, 8)


def compare(spec: RunSpec, *, run_dir: Path | str | None = None, catalog: Catalog | None = None,
            base_dir: Path | None = None, spot: SpotAsk | None = None,
            precisions: list[str] | None = None) -> Comparison:
    """Quote every fitting card x count (1, 2, 4, 8 and the fewest FSDP needs) on its cheapest
    covering term and rank by cost per million useful tokens, runs with room first, runs that
    fit only with less headroom than asked after them; a count whose node the offer's host RAM
    cannot hold is not ranked (said, with the binding resource); the spot term beside each row
    where the offer has a spot rate. ``precisions``: rank the spec at each of these precisions
    together (e.g. bf16-mixed against fp8-tensorwise)."""
    catalog = catalog or load_catalog()
    if spot is not None and spot.rate is not None:
        node_rate(catalog.cards[0], spot.rate)  # a bad rate is refused before any work
    rows, refused, dropped, notes, source = [], [], [], [], None
    variants = _precision_variants(spec, precisions)
    layouts = layout_variants(spec)
    for sp in variants:
        for lay in layout_variants(sp):
            own = sp is spec and lay is sp  # the spec itself: the run directory is its own
            if run_dir is not None and not own:
                notes.append(f"{_tag(lay, variants, layouts).strip()}: projected - the run "
                             "directory is of the spec's own precision and layout")
            ctx = context(lay, catalog, run_dir if own else None, None, base_dir)
            if own and ctx.run:
                source = ctx.run.source()
            r, f, d = _compare_cards(ctx, catalog, _tag(lay, variants, layouts), spot)
            rows, refused, dropped = rows + r, refused + f, dropped + d
    rows.sort(key=lambda q: (q.tight is not None, q.cost_per_million_term_usd is None,
                             q.cost_per_million_term_usd or 0, q.job_s.value))
    return Comparison(spec_label=spec.label, spec_hash=spec.spec_hash(), rows=rows,
                      refused=refused, dropped=_dropped_spec_count(spec, rows) + dropped,
                      assumptions=notes, precisions=[v.precision for v in variants],
                      layouts=[generation_layout(v) for v in layouts] if len(layouts) > 1
                      else [], run_dir=source)


def _tag(spec: RunSpec, variants: list, layouts: list) -> str:
    """What tells a variant's rows apart: its precision, its generation layout."""
    parts = ([spec.precision] if len(variants) > 1 else []) + \
        ([generation_layout(spec)] if len(layouts) > 1 else [])
    return f" ({', '.join(parts)})" if parts else ""


def _precision_variants(spec: RunSpec, precisions: list[str] | None) -> list[RunSpec]:
    """The spec at each precision asked (validated as a spec: fp8 with QLoRA is refused)."""
    from tunepilot.spec import spec_from_dict

    if not precisions:
        return [spec]
    out = []
    for p in dict.fromkeys(precisions):
        v = spec_from_dict(dict(spec.model_dump(mode="python"), precision=p),
                           source=f"--precision {p}")
        out.append(spec if v.spec_hash() == spec.spec_hash() else v)
    return out


def _compare_cards(ctx: QuoteContext, catalog: Catalog, tag: str, spot: SpotAsk | None = None
                   ) -> tuple[list[Quote], list[Refusal], list[str]]:
    from tunepilot.spec.fp8 import card_lacks_fp8

    rows, refused, dropped = [], [], []
    for card in catalog.cards:
        why = card_lacks_fp8(ctx.spec, card)
        if why:
            refused.append(Refusal(card=card.id + tag, reason=why))
            continue
        need = ctx.fit[card.id].devices_needed
        least = _least(need)
        if least is None:
            refused.append(Refusal(card=card.id + tag, reason=does_not_fit_text(ctx, card, 1)))
            continue
        counts = sorted({c for c in (*COMPARE_COUNTS, least, 2 * least)
                         if least <= c <= max(COMPARE_COUNTS[-1], 2 * least)})
        dropped += [f"{card.id} x {c}{tag}: the run does not fit fewer than {least} of them"
                    for c in COMPARE_COUNTS if c < least]
        why = {c: colocated_count_refused(ctx.spec, c) for c in counts}
        dropped += [f"{card.id} x {c}{tag}: {w}" for c, w in why.items() if w]
        counts = [c for c in counts if not why[c]]
        if not counts:
            continue
        host = {c: host_fit_at(ctx, card, c, strategy_at(ctx, card, c)[0]) for c in counts}
        if not any(f.fits for f in host.values()):
            refused.append(Refusal(card=card.id + tag, reason=host[counts[0]].reason))
            continue
        dropped += [f"{card.id} x {c}{tag}: {f.reason}" for c, f in host.items() if not f.fits]
        rows += [build_quote(ctx, card, c, None, {}, spot) for c in counts if host[c].fits]
    return rows, refused, dropped


def _least(need) -> int | None:
    """The fewest cards the run fits on, with the headroom asked or, failing that, tight."""
    options = [1 if need.ddp == 1 or need.ddp_tight == 1 else None, need.fsdp, need.fsdp_tight]
    options = [o for o in options if o is not None]
    return min(options) if options else None


def _dropped_spec_count(spec: RunSpec, rows: list[Quote]) -> list[str]:
    """The spec's own card count, when it is not among the ranked rows, with why."""
    n = spec.parallel.world_size
    if n == 1 or any(q.count == n for q in rows):
        return []
    return [f"the spec's parallel.world_size of {n} is not ranked: compare quotes 1, 2, 4, 8 "
            "cards and the fewest each card needs; quote that count with `tunepilot quote "
            f"SPEC --card CARD --count {n}`"]
