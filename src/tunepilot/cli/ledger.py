"""The ledger: book, bookings, cancel, invoice, usage, ledger (spend)."""

from __future__ import annotations

from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import (
    CatalogOpt,
    DaysOpt,
    DbOpt,
    HoursOpt,
    JsonOpt,
    OptionOpt,
    show,
    show_committed,
    view,
)

BookingArg = Annotated[int, typer.Argument(help="The booking id (see `tunepilot bookings`).")]


@app.command()
def book(
    start: Annotated[str, typer.Option("--start", help="UTC start, e.g. 2026-12-01T09:00Z, or "
                                       "now.")],
    card: Annotated[str | None, typer.Option("--card", help="The card, e.g. h200.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="How many cards.")] = None,
    hours: HoursOpt = None,
    days: DaysOpt = None,
    quote_id: Annotated[str | None, typer.Option("--quote", help="A QUOTE_ID from quote "
                                                 "--save.")] = None,
    option: OptionOpt = None,
    catalog: CatalogOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Allocate cards from the inventory for [start, start + hours); refused (exit 3) with what
    is free instead when any overlapping interval would exceed the inventory.

    Example: tunepilot book --card h200 --count 1 --start 2026-12-01T09:00Z --hours 72
    """
    from tunepilot import ledger
    from tunepilot.catalog import load_catalog

    result = ledger.book(load_catalog(catalog), db=db, card_id=card, count=count, start=start,
                         hours=hours, days=days, quote_id=quote_id, options=option)
    show_committed(result, as_json, view("ledger.render_booking"), f"booked: booking {result.id}")


@app.command()
def bookings(
    card: Annotated[str | None, typer.Option("--card", help="Only this card.")] = None,
    include_all: Annotated[bool, typer.Option("--all", help="Include cancelled bookings.")
                           ] = False,
    catalog: CatalogOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the ledger's bookings (active ones; --all adds the cancelled).

    Example: tunepilot bookings --card h200 --all
    """
    from tunepilot import ledger
    from tunepilot.catalog import load_catalog

    card_id = load_catalog(catalog).get(card).id if card else None
    show(ledger.bookings(db, card_id, include_all), as_json, view("ledger.render_bookings"))


@app.command()
def cancel(booking_id: BookingArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Cancel a booking per its card's cancellation policy; the refund (in cents) is added to its
    invoice and the cards are free again.

    Example: tunepilot cancel 3
    """
    from tunepilot import ledger

    show_committed(ledger.cancel(db, booking_id), as_json, view("ledger.render_cancellation"),
                   f"cancelled: booking {booking_id}")


@app.command()
def invoice(booking_id: BookingArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """A booking's invoice: line items and total in cents.

    Example: tunepilot invoice 3 --json
    """
    from tunepilot import ledger

    show(ledger.invoice(db, booking_id), as_json, view("ledger.render_invoice"))


@app.command()
def usage(
    booking_id: BookingArg,
    hours_used: Annotated[str, typer.Option("--hours-used", help="Hours the cards were used.")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Record the hours a booking was actually used: utilisation = used / booked.

    Example: tunepilot usage 3 --hours-used 61.5
    """
    from tunepilot import ledger

    show_committed(ledger.usage(db, booking_id, hours_used), as_json,
                   view("ledger.render_usage"),
                   f"usage recorded: booking {booking_id}")


@app.command("ledger")
def ledger_summary(db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Spend by card and month (billed, refunded, net, in cents).

    Example: tunepilot ledger --db ./team-ledger.sqlite3
    """
    from tunepilot import ledger

    show(ledger.spend(db), as_json, view("ledger.render_spend"))
