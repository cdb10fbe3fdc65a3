"""The ledger: bookings, invoices, cancellations, usage, spend (money in cents, times UTC)."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.ledger.records import Booking, Cancellation, Invoice, Usage
from tunepilot.units import fmt_cents as usd
from tunepilot.views.common import console
from tunepilot.views.common import table as _table


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
