"""The local allocation and billing ledger: an embedded SQLite database of bookings and invoices.

Cards are allocated from the catalog's ``inventory.count`` over half-open UTC intervals
[start, end). A booking is refused (``CapacityError``, exit code 3) when, at any instant of its
interval, the cards already booked plus the ones asked for would exceed the inventory; the refusal
says what is free instead. Check and insert run inside one ``BEGIN IMMEDIATE`` transaction, so two
processes racing for the last cards are serialised by SQLite: exactly one wins.

Money is integer cents. A booking's invoice holds the line items of its term (from the saved quote
when ``--quote`` names one, else priced from the catalog at booking time); a cancellation adds a
refund line (negative) computed from the cancellation policy in force when the booking was made,
by the time of cancelling relative to the start. An invoice's total is always the sum of its lines.

The database lives in platformdirs' user data dir (``tunepilot/ledger.sqlite3``) unless ``--db``
(or ``TUNEPILOT_DB``) names another. The schema is versioned with ``PRAGMA user_version`` and the
ordered ``MIGRATIONS`` (ledger/schema.py); each applied migration is also recorded in
``schema_migrations``. Commands that only read never create the file. Every open runs SQLite's
quick_check first: a damaged file is refused (exit 2) before it is read or written.

The inventory a ledger allocates from is the ledger's own: the count recorded at its first
booking of a card, not whatever catalog a later command names (a second catalog saying 100 does
not let 16 cards be booked from 8). A saved quote is booked at most once while that booking
stands. Rows are checked when read: an invoice line whose quantity or amount does not follow
from its booking is named as damage, never shown as data.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from tunepilot.catalog import Card
from tunepilot.errors import UserError
from tunepilot.ledger.records import (
    BOOKED,
    CANCELLED,
    Booking,
    Cancellation,
    Invoice,
    Usage,
    cancellation_rule,
    line_problem,
    peak_use,
    refund_cents,
)
from tunepilot.ledger.schema import (
    BUSY_TIMEOUT_S,
    MIGRATIONS,
    SCHEMA_VERSION,
    create_ledger,
    db_error,
    integrity_problem,
)
from tunepilot.results.quote import LineItem, Quote
from tunepilot.units import cents_to_usd, utc_now

DB_FILENAME = "ledger.sqlite3"
DB_ENV = "TUNEPILOT_DB"


class CapacityError(UserError):
    """Not enough cards free over the interval; says what is free instead. Exit code 3."""

    exit_code = 3

    def __init__(self, message: str, hint: str | None, *, free: int, alternative: str | None):
        self.free = free
        self.alternative_start = alternative
        super().__init__("count", message, hint)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "free": self.free, "alternative_start": self.alternative_start}


def default_db_path() -> Path:
    """``$TUNEPILOT_DB``, else ledger.sqlite3 in the user's data directory."""
    import os

    import platformdirs

    env = os.environ.get(DB_ENV)
    return Path(env) if env else Path(platformdirs.user_data_dir("tunepilot")) / DB_FILENAME


# --- time --------------------------------------------------------------------------------------


LATEST_START_YEAR = 2100  # a booking starts before this year ends


def _iso(ts: int) -> str:
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError, OSError):  # a row written before the bounds existed
        return f"(out of range: {ts} s)"


def parse_start(text: str, now: datetime) -> int:
    """``--start``: an ISO 8601 time with a UTC offset (``2026-12-01T09:00Z``) or ``now``, not in
    the past; whole seconds since the epoch."""
    _check_aware(now)
    raw = text.strip()
    if raw.lower() == "now":
        return _ts(now)
    fixed = raw[:-1] + "+00:00" if raw[-1:] in ("Z", "z") else raw
    try:
        when = datetime.fromisoformat(fixed)
    except ValueError:
        raise UserError("start", f"{text!r} is not an ISO 8601 time.",
                        "E.g. --start 2026-12-01T09:00Z (UTC) or --start now.") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise UserError("start", f"{text!r} has no UTC offset; times are UTC and must say so.",
                        f"Write {raw}Z (UTC) or add an offset such as +01:00.")
    try:  # year 1 at +14:00 is in year 0 in UTC: outside what datetime holds
        utc = when.astimezone(timezone.utc)
    except OverflowError:
        utc = None
    if (utc.year if utc is not None else when.year) > LATEST_START_YEAR:
        raise UserError("start", f"{text[:40]!r} is after {LATEST_START_YEAR}.",
                        "Give a start in this century (UTC), e.g. 2026-12-01T09:00Z.")
    if utc is None or utc.year < 1970:
        raise UserError("start", f"{text[:40]!r} is in the past (before 1970 in UTC).",
                        "Give a start from now on, e.g. 2026-12-01T09:00Z or --start now.")
    ts = int(utc.timestamp())
    if ts < _ts(now):
        raise UserError("start", f"{_iso(ts)} is in the past (now is {_iso(_ts(now))}).",
                        "Give a start from now on, or --start now.")
    return ts


def _ts(now: datetime) -> int:
    """Whole UTC seconds of an aware clock reading."""
    _check_aware(now)
    return int(now.timestamp())


def _check_aware(now: datetime) -> None:
    if now.tzinfo is None:  # a library caller's bug, not user input: never read it as local time
        raise ValueError("ledger clocks must be timezone-aware (UTC)")




# --- the ledger --------------------------------------------------------------------------------


class Ledger:
    """One open ledger database. Use as a context manager; every write is one transaction."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    @classmethod
    def open(cls, path: Path | str | None = None) -> Ledger:
        """Open (creating it and its directory when missing) and migrate to SCHEMA_VERSION. A
        new ledger is built complete beside its path and linked into place in one step, so no
        process ever sees a half-made ledger (another process creating it at the same moment,
        or a full disk, leaves either a whole ledger or none)."""
        path = Path(path) if path is not None else default_db_path()
        in_memory = str(path) == ":memory:"  # SQLite's own name for a private in-memory ledger
        if not in_memory and not path.exists():
            create_ledger(cls, path)
        elif path.is_file() and path.stat().st_size == 0:
            raise UserError("db", f"{str(path)!r} is an empty file, not a tunepilot ledger: "
                            "tunepilot creates a ledger whole, in one step, so something else "
                            "made this file (or a tunepilot before 0.1 failed to create it).",
                            "If no booking was ever made in it, remove the empty file and a "
                            "new ledger is created; otherwise pass the ledger's real file with "
                            "--db.")
        try:
            conn = sqlite3.connect(":memory:" if in_memory else path, timeout=BUSY_TIMEOUT_S,
                                   isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise UserError("db", f"cannot open the ledger {str(path)!r}: {exc}.",
                            "Pass a writable file path with --db.") from None
        ledger = cls(conn, path)
        try:
            problem = integrity_problem(conn)
            if problem is not None:
                raise UserError("db", f"the ledger {str(path)!r} is damaged or not a tunepilot "
                                f"ledger (SQLite's integrity check: {problem}); it was not read "
                                "or changed.",
                                "Restore the file from a backup, or pass another --db.")
            conn.execute("PRAGMA foreign_keys = ON")
            ledger._migrate()
        except sqlite3.Error as exc:
            conn.close()
            raise db_error(exc, path) from None
        except BaseException:
            conn.close()
            raise
        return ledger

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self, outcome: str = "was not changed") -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE: take the write lock first, so check-then-insert cannot interleave.
        Any SQLite error - at BEGIN, in the body or at COMMIT - rolls back and becomes one
        UserError that says what happened (a full disk is not damage)."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise db_error(exc, self.path, outcome) from None
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise db_error(exc, self.path, outcome) from None
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        """Roll back what is open (SQLite has already rolled back after some errors)."""
        if self.conn.in_transaction:
            with suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")

    @property
    def schema_version(self) -> int:
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self, outcome: str = "was not changed") -> None:
        try:
            if self.schema_version == SCHEMA_VERSION:
                return
            with self._tx(outcome) as db:  # another process may be migrating: re-read under the lock
                version = int(db.execute("PRAGMA user_version").fetchone()[0])
                if version > SCHEMA_VERSION:
                    raise UserError("db", f"the ledger {self.path} has schema version "
                                    f"{version}, newer than this tunepilot's {SCHEMA_VERSION}; "
                                    "it was not changed.", "Upgrade tunepilot to use it, or "
                                    "pass another --db.")
                for number, description, migrate in MIGRATIONS:
                    if number > version:
                        migrate(db)
                        db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)",
                                   (number, description, _iso(int(utc_now().timestamp()))))
                        db.execute(f"PRAGMA user_version = {number}")
        except sqlite3.DatabaseError as exc:
            raise db_error(exc, self.path, outcome) from None

    # -- quotes -----------------------------------------------------------------------------

    def save_quote(self, quote: Quote, now: datetime) -> str:
        """Store a Quote (its JSON, validated again when read); its new id."""
        quote_id = "q-" + secrets.token_hex(6)
        with self._tx() as db:
            db.execute("INSERT INTO quotes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (quote_id, _iso(_ts(now)), quote.spec_hash, quote.card_id, quote.count,
                        quote.term.term_s, quote.term.total_cents, quote.model_dump_json()))
        return quote_id

    def get_quote(self, quote_id: str) -> Quote:
        row = self.conn.execute("SELECT body FROM quotes WHERE id = ?", (quote_id,)).fetchone()
        if row is None:
            raise UserError("quote", f"no quote {quote_id!r} in the ledger {self.path}.",
                            "Save one with `tunepilot quote SPEC ... --save`.")
        try:
            return Quote.model_validate_json(row[0])
        except ValueError as exc:
            raise UserError("quote", f"quote {quote_id!r} was saved by another version of "
                            f"tunepilot and cannot be read ({str(exc).splitlines()[0]}).",
                            "Quote again with --save and book the new quote.") from None

    # -- bookings ---------------------------------------------------------------------------

    def book(self, card: Card, count: int, start_ts: int, term_s: int, items: list[LineItem],
             *, quote_id: str | None, catalog_as_of: str | None, now: datetime) -> Booking:
        """Allocate ``count`` x ``card`` for [start, start + billed) or raise CapacityError:
        the cards are held for the time the invoice bills (``term_s`` rounded up to the
        billing increment and at least the minimum charge), never less."""
        from tunepilot.cost.terms import billed_seconds

        end_ts = start_ts + billed_seconds(card, term_s)
        stamp = _iso(_ts(now))
        with self._tx() as db:
            inventory = self._inventory(db, card, catalog_as_of)
            if quote_id is not None:
                self._quote_not_booked(db, quote_id)
            rows = db.execute("SELECT start_ts, end_ts, count FROM bookings WHERE card_id = ? AND "
                              "status = ? AND end_ts > ?", (card.id, BOOKED, start_ts)).fetchall()
            used, at = peak_use(rows, start_ts, end_ts)
            if used + count > inventory:
                raise _refusal(card, inventory, count, start_ts, term_s, rows, used, at)
            db.execute("INSERT INTO inventory VALUES (?, ?, ?, ?, ?) ON CONFLICT (card_id) DO "
                       "UPDATE SET count = excluded.count, source = excluded.source, "
                       "catalog_as_of = excluded.catalog_as_of, recorded_at = excluded.recorded_at",
                       (card.id, inventory, card.inventory.source, catalog_as_of, stamp))
            policy = json.dumps(card.pricing.cancellation.model_dump(mode="json"))
            cur = db.execute("INSERT INTO bookings (card_id, count, start_ts, end_ts, quote_id, "
                             "status, cancellation_policy, created_at) VALUES (?,?,?,?,?,?,?,?)",
                             (card.id, count, start_ts, end_ts, quote_id, BOOKED, policy, stamp))
            booking_id = int(cur.lastrowid)
            inv = db.execute("INSERT INTO invoices (booking_id, issued_at) VALUES (?, ?)",
                             (booking_id, stamp)).lastrowid
            db.executemany("INSERT INTO line_items (invoice_id, kind, description, quantity, unit, "
                           "unit_price_usd, amount_cents) VALUES (?,?,?,?,?,?,?)",
                           [(inv, i.kind, i.description, i.quantity, i.unit, i.unit_price_usd,
                             i.amount_cents) for i in items])
        return self.booking(booking_id)

    def _inventory(self, db: sqlite3.Connection, card: Card, catalog_as_of: str | None) -> int:
        """The count this ledger allocates ``card`` from: recorded at the card's first booking,
        then the ledger's own. A catalog that now says another count is refused, not obeyed:
        a command naming a second catalog must not conjure (or lose) cards."""
        row = db.execute("SELECT count, source, catalog_as_of, recorded_at FROM inventory WHERE "
                         "card_id = ?", (card.id,)).fetchone()
        if row is None:
            return card.inventory.count
        if row[0] != card.inventory.count:
            raise UserError("catalog", f"this ledger allocates {card.id} from an inventory of "
                            f"{row[0]} (recorded {row[3]} from {row[1]}, catalog as of "
                            f"{row[2] or 'unknown'}); the catalog given now says "
                            f"{card.inventory.count}. One ledger holds one inventory; nothing "
                            "was booked.", "Book with the catalog this ledger was made with, or "
                            "pass another --db for another inventory.")
        return row[0]

    def _quote_not_booked(self, db: sqlite3.Connection, quote_id: str) -> None:
        """A saved quote is booked once (until that booking is cancelled): a retried command
        must not hold the cards twice."""
        row = db.execute("SELECT id FROM bookings WHERE quote_id = ? AND status = ?",
                         (quote_id, BOOKED)).fetchone()
        if row is not None:
            raise UserError("quote", f"quote {quote_id} is already booked as booking {row[0]}; "
                            "nothing was booked.", f"See `tunepilot invoice {row[0]}`; cancel "
                            "it first to book the quote again, or quote again.")

    def booking(self, booking_id: int) -> Booking:
        rows = self._bookings("WHERE b.id = ?", (booking_id,))
        if not rows:
            raise UserError("id", f"no booking {booking_id} in the ledger {self.path}.",
                            "List them with `tunepilot bookings`.")
        return rows[0]

    def bookings(self, card_id: str | None = None, include_cancelled: bool = False) -> list[Booking]:
        where, args = [], []
        if card_id:
            where.append("b.card_id = ?")
            args.append(card_id)
        if not include_cancelled:
            where.append("b.status = 'booked'")
        return self._bookings(("WHERE " + " AND ".join(where)) if where else "", tuple(args))

    def _bookings(self, where: str, args: tuple) -> list[Booking]:
        sql = ("SELECT b.id, b.card_id, b.count, b.start_ts, b.end_ts, b.status, b.quote_id, "
               "b.created_at, b.cancelled_at, COALESCE(SUM(li.amount_cents), 0) FROM bookings b "
               "LEFT JOIN invoices i ON i.booking_id = b.id "
               f"LEFT JOIN line_items li ON li.invoice_id = i.id {where} "
               "GROUP BY b.id ORDER BY b.start_ts, b.id")
        out = []
        for r in self.conn.execute(sql, args).fetchall():
            self._lines(r[0], r[2], r[3], r[4], r[6])  # the total is of lines that hold
            out.append(Booking(r[0], r[1], r[2], _iso(r[3]), _iso(r[4]), hours_text(r[4] - r[3]),
                               r[5], r[6], r[7], r[8], int(r[9])))
        return out

    def _lines(self, booking_id: int, count: int, start_ts: int, end_ts: int,
               quote_id: str | None) -> tuple[int, str, list[LineItem]]:
        """(invoice id, issued at, its line items) of a booking, each line checked against
        the booking and its own arithmetic (records.line_problem): a row edited or damaged is
        a UserError naming it, never a figure shown as data."""
        inv = self.conn.execute("SELECT id, issued_at FROM invoices WHERE booking_id = ?",
                                (booking_id,)).fetchone()
        if inv is None:
            raise _damaged(self.path, f"booking {booking_id} has no invoice row")
        rows = self.conn.execute("SELECT id, kind, description, quantity, unit, unit_price_usd, "
                                 "amount_cents FROM line_items WHERE invoice_id = ? ORDER BY id",
                                 (inv[0],)).fetchall()
        fields = ("kind", "description", "quantity", "unit", "unit_price_usd", "amount_cents")
        items = []
        held_hours = None if quote_id else Decimal(end_ts - start_ts) / 3600
        for row in rows:
            try:
                item = LineItem(**dict(zip(fields, row[1:], strict=True)))
            except ValueError as exc:
                raise _damaged(self.path, f"line_items row {row[0]} (booking {booking_id}) is "
                               f"not a line item ({str(exc).splitlines()[0]})") from None
            problem = line_problem(item, items, count, held_hours)
            if problem:
                raise _damaged(self.path, f"line_items row {row[0]} (booking {booking_id}): "
                               f"{problem}")
            items.append(item)
        return inv[0], inv[1], items

    def free(self, card: Card, start_ts: int, end_ts: int) -> int:
        """Cards of ``card`` free at every instant of [start, end) (of the ledger's inventory)."""
        inventory = self._inventory(self.conn, card, None)
        rows = self.conn.execute("SELECT start_ts, end_ts, count FROM bookings WHERE card_id = ? "
                                 "AND status = ? AND end_ts > ?", (card.id, BOOKED, start_ts))
        return inventory - peak_use(rows.fetchall(), start_ts, end_ts)[0]

    def cancel(self, booking_id: int, now: datetime) -> Cancellation:
        """Cancel per the booking's policy; the refund is a negative line on its invoice."""
        now_ts = _ts(now)
        with self._tx() as db:
            row = db.execute("SELECT status, start_ts, cancellation_policy, count, end_ts, "
                             "quote_id FROM bookings WHERE id = ?", (booking_id,)).fetchone()
            if row is None:
                raise UserError("id", f"no booking {booking_id} in the ledger {self.path}.",
                                "List them with `tunepilot bookings`.")
            if row[0] == CANCELLED:
                raise UserError("id", f"booking {booking_id} is already cancelled.", None)
            try:
                rule, pct = cancellation_rule(json.loads(row[2]), row[1], now_ts)
            except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError):
                raise _damaged(self.path, f"booking {booking_id}'s cancellation policy is not "
                               "one tunepilot wrote") from None
            inv, _, items = self._lines(booking_id, row[3], row[1], row[4], row[5])
            paid = sum(i.amount_cents for i in items)
            refund = refund_cents(int(paid), pct)
            db.execute("INSERT INTO line_items (invoice_id, kind, description, quantity, unit, "
                       "unit_price_usd, amount_cents) VALUES (?, 'refund', ?, ?, 'percent', '', ?)",
                       (inv, f"refund: {rule}", str(pct), -refund))
            db.execute("UPDATE bookings SET status = ?, cancelled_at = ? WHERE id = ?",
                       (CANCELLED, _iso(now_ts), booking_id))
        return Cancellation(self.booking(booking_id), rule, str(pct), int(paid), refund)

    def invoice(self, booking_id: int) -> Invoice:
        booking = self.booking(booking_id)
        row = self.conn.execute("SELECT count, start_ts, end_ts, quote_id FROM bookings WHERE "
                                "id = ?", (booking_id,)).fetchone()
        _, issued, items = self._lines(booking_id, *row)
        return Invoice(booking, issued, tuple(items))

    def record_usage(self, booking_id: int, hours_used: Decimal, now: datetime) -> Usage:
        booking = self.booking(booking_id)
        booked = Decimal(booking.hours)
        if hours_used > booked:
            raise UserError("hours_used", f"{hours_used} h is more than the {booked} h booked.",
                            "Give the hours the cards were actually used.")
        with self._tx() as db:
            db.execute("INSERT INTO usage VALUES (?, ?, ?) ON CONFLICT (booking_id) DO UPDATE SET "
                       "hours_used = excluded.hours_used, recorded_at = excluded.recorded_at",
                       (booking_id, str(hours_used), _iso(_ts(now))))
        return self.usage(booking_id)

    def usage(self, booking_id: int) -> Usage:
        booking = self.booking(booking_id)
        row = self.conn.execute("SELECT hours_used FROM usage WHERE booking_id = ?",
                                (booking_id,)).fetchone()
        if row is None:
            raise UserError("hours_used", f"no usage recorded for booking {booking_id}.",
                            f"Record it with `tunepilot usage {booking_id} --hours-used H`.")
        used, booked = Decimal(row[0]), Decimal(booking.hours)
        per_hour = (Decimal(booking.total_cents) / 100 / used).quantize(Decimal("0.0001"),
                                                                        ROUND_HALF_UP) if used else None
        return Usage(booking, str(used), str(booked),
                     str((used / booked).quantize(Decimal("0.0001"), ROUND_HALF_UP)),
                     None if per_hour is None else str(per_hour))

    def spend(self) -> list[dict]:
        """Spend by card and UTC month of the booking's start: billed, refunded, net (cents)."""
        sql = ("SELECT b.card_id, strftime('%Y-%m', b.start_ts, 'unixepoch') AS month, "
               "COUNT(DISTINCT b.id), "
               "COALESCE(SUM(CASE WHEN li.kind != 'refund' THEN li.amount_cents END), 0), "
               "COALESCE(SUM(CASE WHEN li.kind = 'refund' THEN -li.amount_cents END), 0) "
               "FROM bookings b JOIN invoices i ON i.booking_id = b.id "
               "JOIN line_items li ON li.invoice_id = i.id GROUP BY b.card_id, month "
               "ORDER BY month, b.card_id")
        hours = {(r[0], r[1]): r[2] for r in self.conn.execute(
            "SELECT card_id, strftime('%Y-%m', start_ts, 'unixepoch'), SUM(count * (end_ts - "
            "start_ts)) FROM bookings WHERE status = 'booked' GROUP BY 1, 2")}
        return [{"card": card, "month": month, "bookings": n,
                 "card_hours_booked": hours_text(hours.get((card, month), 0)),
                 "billed_cents": billed, "refunded_cents": refunded,
                 "net_cents": billed - refunded, "net_usd": str(cents_to_usd(billed - refunded))}
                for card, month, n, billed, refunded in self.conn.execute(sql)]


def hours_text(seconds: int) -> str:
    return f"{(Decimal(seconds) / 3600).normalize():f}"


def _damaged(path: Path, what: str) -> UserError:
    return UserError("db", f"the ledger {str(path)!r} holds a row tunepilot did not write: "
                     f"{what} (damaged or edited by hand); nothing was shown or changed.",
                     "Restore the file from a backup, or pass another --db.")


def _refusal(card: Card, inventory: int, count: int, start: int, term_s: int, rows: list,
             used: int, at: int) -> CapacityError:
    free = max(inventory - used, 0)
    if count > inventory:
        return CapacityError(f"{count} x {card.id} asked for, but the inventory has only "
                             f"{inventory}.", f"Book at most {inventory}, or another card.",
                             free=free, alternative=None)
    alternative = None
    for t in sorted({start} | {e for _, e, _ in rows if e > start}):
        if peak_use(rows, t, t + term_s)[0] + count <= inventory:
            alternative = _iso(t)
            break
    instead = f"{count} x {card.id} are free for {hours_text(term_s)} h from {alternative}"
    return CapacityError(
        f"only {free} of {inventory} x {card.id} are free for the whole of {_iso(start)} .. "
        f"{_iso(start + term_s)} ({used} booked at {_iso(at)}); {count} asked for.",
        f"Instead: {f'book {free} at that time, or ' if free else ''}{instead}.", free=free,
        alternative=alternative)


