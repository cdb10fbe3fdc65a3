"""What the CLI calls: check the input first, then open the database (a read never creates
it). Every write is one transaction: all or nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from tunepilot.catalog import Catalog
from tunepilot.cost.terms import (
    check_count,
    parse_decimal,
    parse_duration,
    parse_options,
    term_cost,
)
from tunepilot.errors import UserError
from tunepilot.ledger.db import Ledger, default_db_path, hours_text, parse_start, utc_now
from tunepilot.ledger.records import Booking, Cancellation, Invoice, Usage
from tunepilot.results.quote import Quote


def book(catalog: Catalog, *, db: Path | str | None, card_id: str | None, count: int | None,
         start: str, hours: str | None = None, days: str | None = None,
         quote_id: str | None = None, options: list[str] | None = None,
         now: datetime | None = None) -> Booking:
    """Book cards from the inventory; with ``quote_id`` the saved quote sets card, count, term and
    prices (flags given as well must agree with it). Bad input raises before the file is touched."""
    now = now or utc_now()
    start_ts = parse_start(start, now)
    if quote_id is None:
        if card_id is None or count is None:
            raise UserError("card", "give --card and --count (or --quote QUOTE_ID).",
                            "E.g. tunepilot book --card h200 --count 1 --start now --hours 72.")
        card = catalog.get(card_id)
        check_count(count)
        term_s = parse_duration(hours, days)
        opts = parse_options(card, options)
        with Ledger.open(db) as ledger:
            items = list(term_cost(card, count, term_s, opts).items)
            return ledger.book(card, count, start_ts, term_s, items, quote_id=None,
                               catalog_as_of=catalog.as_of, now=now)
    path = Path(db) if db is not None else default_db_path()
    if not path.exists():
        raise UserError("quote", f"no quote {quote_id!r}: the ledger {path} does not exist yet.",
                        "Save a quote first with `tunepilot quote SPEC ... --save`.")
    if options:
        raise UserError("option", "a quoted booking takes its options from the quote.",
                        "Quote again with the --option flags, then book that quote.")
    with Ledger.open(path) as ledger:
        q = ledger.get_quote(quote_id)
        card = catalog.get(q.card_id)
        given = {"card": card_id and catalog.get(card_id).id, "count": count,
                 "term_s": parse_duration(hours, days, required=False)}
        quoted = {"card": card.id, "count": q.count, "term_s": q.term.term_s}
        for key, value in given.items():
            if value is not None and value != quoted[key]:
                raise UserError(key if key != "term_s" else "hours",
                                f"quote {quote_id} is for {quoted['count']} x {quoted['card']} "
                                f"for {hours_text(quoted['term_s'])} h, not {key} {value}.",
                                "Leave the flag out to book the quote as quoted.")
        return ledger.book(card, quoted["count"], start_ts, quoted["term_s"], q.term.items,
                           quote_id=quote_id, catalog_as_of=catalog.as_of, now=now)


@contextmanager
def existing(db: Path | str | None) -> Iterator[Ledger | None]:
    """The ledger at ``db`` when the file exists, else None (reading never creates it)."""
    path = Path(db) if db is not None else default_db_path()
    if not path.exists():
        yield None
        return
    with Ledger.open(path) as ledger:
        yield ledger


MAX_BOOKING_ID = 2**63 - 1  # SQLite's INTEGER PRIMARY KEY


def _check_id(booking_id: int) -> int:
    """A booking id the database can hold; anything else names no booking (before the file is
    opened: a 21-digit id is not a SQLite overflow)."""
    if isinstance(booking_id, bool) or not isinstance(booking_id, int) or \
            not 1 <= booking_id <= MAX_BOOKING_ID:
        raise UserError("id", f"no booking {str(booking_id)[:30]}: booking ids are whole "
                        f"numbers from 1 to {MAX_BOOKING_ID:,}.",
                        "List them with `tunepilot bookings`.")
    return booking_id


def _need(ledger: Ledger | None, db: Path | str | None, booking_id: int) -> Ledger:
    if ledger is None:
        path = Path(db) if db is not None else default_db_path()
        raise UserError("id", f"no booking {booking_id}: the ledger {path} does not exist yet.",
                        "Book something first with `tunepilot book`.")
    return ledger


def cancel(db: Path | str | None, booking_id: int, now: datetime | None = None) -> Cancellation:
    _check_id(booking_id)
    with existing(db) as ledger:
        return _need(ledger, db, booking_id).cancel(booking_id, now or utc_now())


def invoice(db: Path | str | None, booking_id: int) -> Invoice:
    _check_id(booking_id)
    with existing(db) as ledger:
        return _need(ledger, db, booking_id).invoice(booking_id)


def usage(db: Path | str | None, booking_id: int, hours_used: str,
          now: datetime | None = None) -> Usage:
    _check_id(booking_id)
    used = parse_decimal(hours_used)
    if used is None or used < 0:
        raise UserError("hours_used", f"must be a number of hours >= 0, got {hours_used!r}.",
                        "E.g. --hours-used 61.5.")
    with existing(db) as ledger:
        return _need(ledger, db, booking_id).record_usage(booking_id, used, now or utc_now())


def bookings(db: Path | str | None, card_id: str | None = None,
             include_cancelled: bool = False) -> list[Booking]:
    with existing(db) as ledger:
        return ledger.bookings(card_id, include_cancelled) if ledger else []


def spend(db: Path | str | None) -> list[dict]:
    with existing(db) as ledger:
        return ledger.spend() if ledger else []


def save_quote(db: Path | str | None, quote: Quote, now: datetime | None = None) -> str:
    """Store the quote (the whole typed Quote) in the ledger; its id."""
    with Ledger.open(db) as ledger:
        return ledger.save_quote(quote, now or utc_now())
