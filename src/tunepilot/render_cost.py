"""Rich tables for quote, compare and the ledger (bookings, invoice, cancel, usage, spend).

Every figure is printed with its unit and, where it could be either, [measured] or [projected].
Library functions return the rows; only this module prints.
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from tunepilot.catalog import cents_to_usd
from tunepilot.cost import MEASURED, Comparison, Figure, Quote
from tunepilot.ledger import Booking, Cancellation, Invoice, Usage
from tunepilot.pricing import TermCost
from tunepilot.render import console


def usd(cents: int) -> str:
    amount = cents_to_usd(cents)
    return f"-${-amount:,.2f}" if amount < 0 else f"${amount:,.2f}"


def duration(seconds: float) -> str:
    """'34.41 h (123,882 s)', days as well past two days; under an hour '16.1 s' or '9.5 min'."""
    if abs(seconds) < 120:
        return f"{seconds:,.3g} s"
    if abs(seconds) < 3600:
        return f"{seconds / 60:,.1f} min ({seconds:,.0f} s)"
    hours = seconds / 3600
    days = f", {hours / 24:,.2f} d" if hours >= 48 else ""
    return f"{hours:,.2f} h ({seconds:,.0f} s{days})"


def mark(basis: str) -> str:
    return "[green]measured[/green]" if basis == MEASURED else "[yellow]projected[/yellow]"


def _value(f: Figure) -> str:
    if f.unit == "s":
        return duration(f.value)
    if f.unit == "fraction":
        return f"{f.value:.3g}"
    if f.unit == "bytes":
        return f"{f.value / 1e9:,.3g} GB"
    return f"{f.value:,.0f} {f.unit}"


def _table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    return t


def render_term(term: TermCost, title: str) -> None:
    t = _table(title, ["item", "quantity", "unit price", "amount"], ("quantity", "amount"))
    for i in term.items:
        price = f"${i.unit_price_usd}/{i.unit}" if i.unit_price_usd else ""
        t.add_row(escape(i.description), f"{i.quantity} {i.unit}", price, usd(i.amount_cents))
    t.add_row("[bold]total[/bold]", "", "", f"[bold]{usd(term.total_cents)}[/bold]")
    console.print(t)


def render_quote(q: Quote) -> None:
    console.print(f"[bold]{q.spec_label}[/bold] on {q.count} x {q.card_id} ({q.strategy}); target "
                  f"{q.target_useful_tokens:,.0f} useful tokens = {q.optimizer_steps:,} optimizer "
                  f"steps of {q.tokens_per_step:,} tokens")
    if q.run_dir:
        console.print(f"run directory {q.run_dir['path']} (measured on {q.run_dir['device']}"
                      f"{', catalog card ' + q.run_dir['card_id'] if q.run_dir['card_id'] else ''})")
    t = _table("Throughput", ["figure", "value", "basis", "how"], ("value",))
    names = {"useful_fraction": "useful (non-padding) fraction", "per_card": "useful tokens/s, "
             "one card", "efficiency": "scaling efficiency", "total": f"useful tokens/s, {q.count} "
             "card(s)"}
    for key, f in q.throughput.items():
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
    per_term = (f"${q.cost_per_million_term_usd}" if q.cost_per_million_term_usd is not None
                else "- (the term delivers no useful tokens)")
    console.print(f"[bold]cost per million useful tokens[/bold]: term as booked {per_term}; job "
                  f"alone ${q.cost_per_million_job_usd} (job cost ${q.job_cost_usd} at the term's "
                  f"rate) ({q.job_s.basis} time, catalog prices)")
    for note in q.notes:
        console.print(f"note: {escape(note)}")


def render_compare(c: Comparison) -> None:
    t = _table(f"{c.spec_label}: every card x count that fits, by cost per million useful tokens "
               "(cheapest term covering the job + safety margin)",
               ["#", "card", "count", "strategy", "useful tokens/s", "time to finish", "term",
                "term cost", "$/M tokens (term)", "$/M tokens (job)", "terms measured"],
               ("#", "count", "useful tokens/s", "term cost", "$/M tokens (term)",
                "$/M tokens (job)"))
    for rank, q in enumerate(c.rows, 1):
        f = q.throughput["total"]
        t.add_row(str(rank), q.card_id, str(q.count), q.strategy,
                  f"{f.value:,.0f} ({f.basis[0]})", f"{q.job_s.value / 3600:,.2f} h "
                  f"({q.job_s.basis[0]})", f"{q.term.term_s / 3600:,.2f} h"
                  + (f" ({q.term.discount_term})" if q.term.discount_term else ""),
                  usd(q.term.total_cents), f"${q.cost_per_million_term_usd}",
                  f"${q.cost_per_million_job_usd}",
                  f"{sum(t.total.basis == MEASURED for t in q.time_terms)}/{len(q.time_terms)}")
    console.print(t)
    console.print("(m) measured on that card, (p) projected (see `tunepilot quote ... ` for the "
                  "rule behind each figure). Prices are the catalog's.")
    for r in c.refused:
        console.print(f"[red]not ranked[/red] {r['card']}: {escape(r['reason'])}")
    if c.run_dir:
        for note in c.run_dir["notes"]:
            console.print(f"note: {escape(note)}")


def render_bookings(rows: list[Booking], title: str = "Bookings") -> None:
    t = _table(title, ["id", "card", "count", "start (UTC)", "end (UTC)", "hours", "status",
                       "quote", "net"], ("id", "count", "hours", "net"))
    for b in rows:
        t.add_row(str(b.id), b.card_id, str(b.count), b.start, b.end, b.hours, b.status,
                  b.quote_id or "-", usd(b.total_cents))
    console.print(t)
    if not rows:
        console.print("no bookings")


def render_invoice(inv: Invoice) -> None:
    b = inv.booking
    t = _table(f"Invoice for booking {b.id}: {b.count} x {b.card_id}, {b.start} .. {b.end} "
               f"({b.status}; issued {inv.issued_at})", ["kind", "item", "quantity", "unit price",
                                                        "amount"], ("quantity", "amount"))
    for i in inv.items:
        price = f"${i.unit_price_usd}/{i.unit}" if i.unit_price_usd else ""
        t.add_row(i.kind, escape(i.description), f"{i.quantity} {i.unit}", price, usd(i.amount_cents))
    t.add_row("", "[bold]total[/bold]", "", "", f"[bold]{usd(inv.total_cents)}[/bold]")
    console.print(t)


def render_cancellation(c: Cancellation) -> None:
    console.print(f"cancelled booking {c.booking.id} ({c.booking.count} x {c.booking.card_id}, "
                  f"{c.booking.start}): {escape(c.rule)}")
    console.print(f"paid {usd(c.paid_cents)}, refund {usd(c.refund_cents)}, kept "
                  f"{usd(c.paid_cents - c.refund_cents)}")


def render_booking(b: Booking) -> None:
    render_bookings([b], title=f"Booked: #{b.id}")
    console.print(f"invoice: tunepilot invoice {b.id}; cancel: tunepilot cancel {b.id}")


def render_usage(u: Usage) -> None:
    b = u.booking
    per = f", ${u.cost_per_used_hour_usd} per used hour of the term" if u.cost_per_used_hour_usd \
        else ""
    console.print(f"booking {b.id} ({b.count} x {b.card_id}): used {u.hours_used} h of "
                  f"{u.hours_booked} h booked = utilisation {float(u.utilisation):.1%}{per} "
                  f"(net {usd(b.total_cents)})")


def render_spend(rows: list[dict]) -> None:
    t = _table("Spend by card and month (UTC month of the booking's start)",
               ["month", "card", "bookings", "card-hours booked", "billed", "refunded", "net"],
               ("bookings", "card-hours booked", "billed", "refunded", "net"))
    for r in rows:
        t.add_row(r["month"], r["card"], str(r["bookings"]), r["card_hours_booked"],
                  usd(r["billed_cents"]), usd(r["refunded_cents"]), usd(r["net_cents"]))
    if rows:
        t.add_row("[bold]total[/bold]", "", str(sum(r["bookings"] for r in rows)), "",
                  usd(sum(r["billed_cents"] for r in rows)),
                  usd(sum(r["refunded_cents"] for r in rows)),
                  f"[bold]{usd(sum(r['net_cents'] for r in rows))}[/bold]")
    console.print(t)
