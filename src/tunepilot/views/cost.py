"""Quote and compare: every figure with its unit and [measured] or [projected]."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.results.figure import Figure
from tunepilot.results.quote import Comparison, Quote, TermCost
from tunepilot.units import fmt_bytes, fmt_cents, fmt_seconds, fmt_usd, fmt_usd_per_m
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


def _spot_cell(q: Quote) -> str:
    s = q.spot
    if s is None:
        return "- / no spot rate"
    if not s.finishes:
        return f"{usd(s.on_demand_cost_cents)} / does not finish"
    return (f"{usd(s.on_demand_cost_cents)} / {usd(s.expected_cost_cents)} "
            f"({s.overhead_fraction:+.0%} vs naive spot)")


def render_term(term: TermCost, title: str) -> None:
    t = _table(title, ["item", "quantity", "unit price", "amount"], ("quantity", "amount"))
    for i in term.items:
        price = f"${i.unit_price_usd}/{i.unit}" if i.unit_price_usd else ""
        t.add_row(escape(i.description), f"{i.quantity} {i.unit}", price, usd(i.amount_cents))
    t.add_row("[bold]total[/bold]", "", "", f"[bold]{usd(term.total_cents)}[/bold]")
    console.print(t)


def render_run_numbers(q: Quote) -> None:
    """The run in numbers, before the terms (spec/batch.py): a pair's two sequences, the
    positions and useful tokens of a step, the steps, FLOPs per step and the MFU they run at."""
    r = q.run
    pairs = (f" x {r.sequences_per_sample} sequences per sample (chosen, rejected)"
             if r.sequences_per_sample > 1 else "")
    t = _table("The run in numbers", ["figure", "value", "how"], ("value",))
    t.add_row("token positions per micro-batch", f"{r.positions_per_micro_batch:,}",
              f"{q.batch.micro_batch_size if q.batch else '?'} samples{pairs} x sequence length")
    t.add_row("token positions per optimizer step", f"{r.positions_per_step:,}",
              f"{q.batch.global_batch_samples if q.batch else '?'} samples (global batch)"
              f"{pairs} x sequence length, over {q.count} card(s)")
    t.add_row("useful fraction", f"{r.useful_fraction:.3g}", "trained tokens / positions")
    t.add_row("useful tokens per optimizer step", f"{r.useful_tokens_per_step:,.0f}",
              "positions per step x useful fraction")
    epoch = f"; {r.steps_per_epoch:,} per epoch" if r.steps_per_epoch is not None else ""
    t.add_row("optimizer steps", f"{r.optimizer_steps:,}", f"to the target{epoch}")
    t.add_row("FLOPs per optimizer step", f"{r.flops_per_step.value:.4g}",
              f"{escape(r.flops_per_step.how)} {mark(r.flops_per_step.basis)}")
    t.add_row("MFU", f"{r.mfu.value:.3g}", f"{escape(r.mfu.how)} {mark(r.mfu.basis)}")
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
    if q.run is not None:
        render_run_numbers(q)
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
        for part in term.parts:  # an RL step's phases, adding up to the training term
            t.add_row(f"  {part.name}" + (" (dominates)" if part.name == term.dominant else ""),
                      f"{part.times:,}", _value(part.each), _value(part.total),
                      mark(part.total.basis), escape(part.each.how))
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
    if q.host is not None:
        render_host_fit(q)
    if q.spot is not None:
        render_spot(q)
    for note in q.notes:
        console.print(f"note: {escape(note)}")


def render_host_fit(q: Quote) -> None:
    h = q.host
    ram = (f"{fmt_bytes(h.host_usable_bytes_per_node)} usable of "
           f"{fmt_bytes(h.host_ram_bytes_per_node)} ({h.instance or 'the offer'}, "
           f"{h.cards_per_node} card(s)' share)" if h.host_ram_bytes_per_node is not None
           else "not listed by the offer")
    console.print(f"host per node: peak {fmt_bytes(h.host_peak_bytes_per_node)} (projected), "
                  f"host RAM {ram}; local disk need "
                  f"{fmt_bytes(h.disk_bytes_per_node, decimal=True)} of "
                  + (fmt_bytes(h.local_disk_bytes_per_node, decimal=True)
                     if h.local_disk_bytes_per_node is not None else "- (not listed)")
                  + f"; export {fmt_bytes(h.export_bytes, decimal=True)} (the kept checkpoints "
                  "`tunepilot export` copies off); binds: "
                  f"[bold]{h.binds}[/bold] ("
                  + ", ".join(f"{k} {v:.0%}" for k, v in h.utilisation.items()) + " used)")
    for f in (h.measured_rss_bytes_per_process, h.measured_rss_bytes_per_node):
        if f is not None:
            console.print(f"  host RAM measured: {fmt_bytes(f.value)} ({escape(f.how)})")


def render_spot(q: Quote) -> None:
    s = q.spot
    t = _table(f"Spot beside on-demand: {q.count} x {q.card_id} at ${s.spot_usd_per_hour}/card-hour"
               f" ({escape(s.spot_source)})", ["figure", "value", "basis", "how"], ("value",))
    t.add_row("interruptions per node-hour", f"{s.rate_per_node_hour.value:g}",
              mark(s.rate_per_node_hour.basis), escape(s.rate_per_node_hour.how))
    if s.mtbi_s is not None:
        t.add_row(f"mean time between interruptions ({s.nodes} node(s))",
                  duration(s.mtbi_s.value), mark(s.mtbi_s.basis), escape(s.mtbi_s.how))
    t.add_row("checkpoint save (C)", duration(s.save_s.value), mark(s.save_s.basis),
              escape(s.save_s.how))
    t.add_row("restart (R)", duration(s.restart_s.value), mark(s.restart_s.basis),
              escape(" + ".join(f"{k} {duration(f.value)} ({f.basis[0]})"
                                for k, f in s.restart.items())))
    t.add_row("[bold]checkpoint interval (T)[/bold]",
              f"[bold]{duration(s.interval_s.value)} = {s.interval_steps:,} steps[/bold]",
              mark(s.interval_s.basis), escape(s.interval_rule + (
                  f"; Daly (2006): {duration(s.daly_interval_s)}" if s.daly_interval_s else "")))
    t.add_row("checkpoints over the job", f"{s.checkpoints:,}", mark(s.work_s.basis),
              escape(s.work_s.how))
    t.add_row("lost per interruption", duration(s.lost_per_interruption_s.value),
              mark(s.lost_per_interruption_s.basis), escape(s.lost_per_interruption_s.how))
    if s.finishes:
        lo, hi = s.outcome(0.1), s.outcome(0.9)
        t.add_row("expected interruptions", f"{s.expected_interruptions.value:,.1f} "
                  f"(p10 {lo.interruptions}, p90 {hi.interruptions})",
                  mark(s.expected_interruptions.basis), "rate x expected hours; Poisson spread")
        t.add_row("expected run time", f"{duration(s.expected_s.value)} (p10 "
                  f"{lo.hours:,.1f} h, p90 {hi.hours:,.1f} h)", mark(s.expected_s.basis),
                  escape(s.expected_s.how))
    console.print(t)
    line = (f"[bold]on-demand[/bold] job {usd(s.on_demand_cost_cents)} (term as booked "
            f"{usd(q.term.total_cents)})  |  [bold]spot[/bold] naive {usd(s.naive_cost_cents)}")
    if s.finishes:
        lo, hi = s.outcome(0.1), s.outcome(0.9)
        line += (f", expected [bold]{usd(s.expected_cost_cents)}[/bold] (p10 "
                 f"{usd(lo.cost_cents)}, p90 {usd(hi.cost_cents)}), "
                 f"{s.overhead_fraction:+.0%} over naive, "
                 f"{1 - s.expected_cost_cents / s.on_demand_cost_cents:.0%} under on-demand "
                 "(projected)")
        console.print(line)
        console.print(f"a spot run checkpoints every {s.interval_steps:,} optimizer steps "
                      f"(checkpoint.every_steps; `tunepilot launch --spot` writes it into the "
                      "spec it runs)")
    else:
        console.print(line + f"; [red]{escape(s.reason)}[/red]")
    for note in s.notes:
        console.print(f"spot: {escape(note)}")


def render_compare(c: Comparison) -> None:
    several = len(c.precisions) > 1
    layouts = len(c.layouts) > 1
    t = _table(f"{c.spec_label}: every card x count that fits, by cost per million useful tokens "
               "(cheapest term covering the job + safety margin; tight fits last)",
               ["#", "card", "count", "strategy"] + (["precision"] if several else [])
               + (["generation"] if layouts else [])
               + ["useful tokens/s", "time to finish", "term", "term cost", "$/M tokens (term)",
                  "$/M tokens (job)", "job: on-demand / spot expected", "binds",
                  "terms measured"],
               ("#", "count", "useful tokens/s", "term cost", "$/M tokens (term)",
                "$/M tokens (job)", "job: on-demand / spot expected"))
    t.columns[1].no_wrap = True
    for rank, q in enumerate(c.rows, 1):
        f = q.throughput.total
        mfu = q.throughput.per_card.extra("mfu") or {}
        kind = mfu.get("kind") if isinstance(mfu, dict) else None
        mark = f"{f.basis[0]}" + (f", MFU {kind}" if kind and not f.is_measured else "")
        t.add_row(str(rank) + (" tight" if q.tight else ""), q.card_id, str(q.count),
                  q.strategy, *([q.precision or ""] if several else []),
                  *([q.generation_layout or ""] if layouts else []),
                  f"{f.value:,.0f} ({mark})", f"{q.job_s.value / 3600:,.2f} h "
                  f"({q.job_s.basis[0]})", f"{q.term.term_s / 3600:,.2f} h"
                  + (f" ({q.term.discount_term})" if q.term.discount_term else ""),
                  usd(q.term.total_cents), fmt_usd(q.cost_per_million_term_usd),
                  fmt_usd(q.cost_per_million_job_usd), _spot_cell(q),
                  q.host.binds if q.host else "-",
                  f"{sum(t.total.is_measured for t in q.time_terms)}/{len(q.time_terms)}")
    console.print(t)
    console.print("(m) measured on that card, (p) projected (see `tunepilot quote ... ` for the "
                  "rule behind each figure); MFU published / derived / assumed: what the "
                  "projected throughput rests on (resources/throughput_runs.yaml). Prices are "
                  "the catalog's. Job: the job alone at the on-demand rate / on spot with its "
                  "interruptions priced, checkpointing every T (quote shows "
                  "T and the spread); binds: the resource nearest its limit.")
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


