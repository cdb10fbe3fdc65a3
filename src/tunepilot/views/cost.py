"""Quote and compare: every figure with its unit and [measured] or [projected]."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.results.figure import Figure
from tunepilot.results.quote import Comparison, Quote, TermCost
from tunepilot.units import fmt_cents, fmt_seconds, fmt_usd, fmt_usd_per_m
from tunepilot.views.common import basis, console, fig
from tunepilot.views.common import table as _table

usd = fmt_cents
duration = fmt_seconds


def mark(b: str) -> str:
    return basis(Figure(value=0, unit="", basis=b))


def _value(f: Figure) -> str:
    if f.unit == "fraction":
        return f"{f.value:.3g}"
    return fig(f, decimal_bytes=True)


def render_term(term: TermCost, title: str) -> None:
    t = _table(title, ["item", "quantity", "unit price", "amount"], ("quantity", "amount"))
    for i in term.items:
        price = f"${i.unit_price_usd}/{i.unit}" if i.unit_price_usd else ""
        t.add_row(escape(i.description), f"{i.quantity} {i.unit}", price, usd(i.amount_cents))
    t.add_row("[bold]total[/bold]", "", "", f"[bold]{usd(term.total_cents)}[/bold]")
    console.print(t)


def render_quote(q: Quote) -> None:
    console.print(f"[bold]{q.spec_label}[/bold] on {q.count} x {q.card_id} ({q.strategy}"
                  + (f", {q.precision}" if q.precision else "") + "); target "
                  f"{q.target_useful_tokens:,.0f} useful tokens = {q.optimizer_steps:,} optimizer "
                  f"steps of {q.tokens_per_step:,} tokens")
    if q.tight:
        console.print(f"[yellow]{escape(q.tight)}[/yellow]")
    if q.batch is not None:
        b = q.batch
        console.print(f"global batch {b.global_batch_samples:,} samples on every card count "
                      f"(here {q.count} x {b.micro_batch_size} x {b.accumulation_per_rank} "
                      "accumulation); the scaling efficiency is measured under the same rule")
    if q.run_dir:
        console.print(f"run directory {q.run_dir.path} (measured on {q.run_dir.device}"
                      f"{', catalog card ' + q.run_dir.card_id if q.run_dir.card_id else ''})")
    t = _table("Throughput", ["figure", "value", "basis", "how"], ("value",))
    names = {"useful_fraction": "useful (trained) fraction of positions", "per_card": "useful tokens/s, "
             "one card", "efficiency": "scaling efficiency", "total": f"useful tokens/s, {q.count} "
             "card(s)"}
    for key, f in q.throughput.rows():
        t.add_row(names.get(key, key), _value(f), mark(f.basis), escape(f.how))
    console.print(t)
    t = _table("Time the job needs", ["term", "times", "each", "total", "basis", "how"],
               ("times", "each", "total"))
    for term in q.time_terms:
        t.add_row(term.name, f"{term.times:,}", _value(term.each), _value(term.total),
                  mark(term.total.basis), escape(term.each.how))
    t.add_row("[bold]job[/bold]", "", "", f"[bold]{duration(q.job_s.value)}[/bold]",
              mark(q.job_s.basis), "")
    console.print(t)
    render_term(q.term, f"Term: {q.count} x {q.card_id} for {duration(q.term.term_s)} "
                        f"(prices: {escape(q.pricing_source)}, as of {q.pricing_as_of})")
    if q.finishes_in_term:
        console.print(f"finishes inside the term: [green]yes[/green], margin "
                      f"{duration(q.margin_s)} ({q.margin_fraction:.0%} of the job) "
                      f"({q.job_s.basis})")
    else:
        console.print(f"finishes inside the term: [red]no[/red], {duration(-q.margin_s)} short; "
                      f"the term delivers {q.useful_tokens_in_term:,.0f} useful tokens")
    s = q.shortest_term
    console.print(f"shortest covering term (job + {q.safety_margin:.0%} margin): "
                  f"{duration(s.term_s)} = {q.shortest_term_steps:,} billing steps, "
                  f"{usd(s.total_cents)}")
    c = q.cheapest_term
    if c.term_s != s.term_s:
        console.print(f"cheapest covering term: {duration(c.term_s)} ({c.discount_term} term, "
                      f"{c.discount_percent}% off): {usd(c.total_cents)}")
    if q.padding:
        pad = q.padding
        line = (f"padding: {pad['padding_fraction']['value']:.1%} of the token positions "
                f"({pad['trained_on']} micro-batches, dataset profile) = about "
                f"{duration(pad['padding_s']['value'])} of the training time (projected)")
        cut = pad.get("packing_would_cut_positions_by")
        if cut:
            line += f"; packing (data.packing: true) would cut the positions by {cut['value']:.0%}"
        console.print(line)
    per_term = (fmt_usd_per_m(q.cost_per_million_term_usd)
                if q.cost_per_million_term_usd is not None
                else "- (the term delivers no useful tokens)")
    console.print(f"[bold]cost per useful token[/bold]: term as booked {per_term}; job alone "
                  f"{fmt_usd_per_m(q.cost_per_million_job_usd)} (job cost {fmt_usd(q.job_cost_usd)}"
                  f" at the term's rate) ({q.job_s.basis} time, catalog prices)")
    for note in q.notes:
        console.print(f"note: {escape(note)}")


def render_compare(c: Comparison) -> None:
    several = len(c.precisions) > 1
    t = _table(f"{c.spec_label}: every card x count that fits, by cost per million useful tokens "
               "(cheapest term covering the job + safety margin; tight fits last)",
               ["#", "card", "count", "strategy"] + (["precision"] if several else [])
               + ["useful tokens/s", "time to finish", "term", "term cost", "$/M tokens (term)",
                  "$/M tokens (job)", "terms measured"],
               ("#", "count", "useful tokens/s", "term cost", "$/M tokens (term)",
                "$/M tokens (job)"))
    for rank, q in enumerate(c.rows, 1):
        f = q.throughput.total
        mfu = q.throughput.per_card.extra("mfu") or {}
        kind = mfu.get("kind") if isinstance(mfu, dict) else None
        mark = f"{f.basis[0]}" + (f", MFU {kind}" if kind and not f.is_measured else "")
        t.add_row(str(rank) + (" tight" if q.tight else ""), q.card_id, str(q.count),
                  q.strategy, *([q.precision or ""] if several else []),
                  f"{f.value:,.0f} ({mark})", f"{q.job_s.value / 3600:,.2f} h "
                  f"({q.job_s.basis[0]})", f"{q.term.term_s / 3600:,.2f} h"
                  + (f" ({q.term.discount_term})" if q.term.discount_term else ""),
                  usd(q.term.total_cents), fmt_usd(q.cost_per_million_term_usd),
                  fmt_usd(q.cost_per_million_job_usd),
                  f"{sum(t.total.is_measured for t in q.time_terms)}/{len(q.time_terms)}")
    console.print(t)
    console.print("(m) measured on that card, (p) projected (see `tunepilot quote ... ` for the "
                  "rule behind each figure); MFU published / derived / assumed: what the "
                  "projected throughput rests on (resources/throughput_runs.yaml). Prices are "
                  "the catalog's.")
    if any(q.tight for q in c.rows):
        console.print("tight: fits the card with less free memory than the plan's headroom "
                      "(see `tunepilot quote` for why); ranked after every run with room.")
    for r in c.refused:
        console.print(f"[red]not ranked[/red] {r.card}: {escape(r.reason)}")
    for d in c.dropped:
        console.print(f"[yellow]not ranked[/yellow]: {escape(d)}")
    for a in c.assumptions:
        console.print(f"assumption: {escape(a)}")
    if c.run_dir:
        for note in c.run_dir.notes:
            console.print(f"note: {escape(note)}")


