"""The ledger's SQLite file: what SQLite's errors mean for the person, creating a ledger whole
in one step, the versioned schema and its ordered migrations, and the integrity check every open
makes (a ledger SQLite calls damaged is never read as data or written to)."""

from __future__ import annotations

import errno
import os
import secrets
import sqlite3
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from tunepilot.errors import UserError

BUSY_TIMEOUT_S = 30.0  # how long a writer waits for another process's transaction


# --- what SQLite said -------------------------------------------------------------------------

# SQLite's primary result codes (https://www.sqlite.org/rescode.html); the extended code of an
# exception (sqlite_errorcode, Python >= 3.11) carries the primary one in its low byte.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY, _SQLITE_IOERR = 5, 6, 8, 10
_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 11, 13, 14, 26


def db_error(exc: sqlite3.Error, path: Path | str | None, outcome: str = "was not changed"
             ) -> UserError:
    """What a SQLite error means for the person, as one UserError: a full disk, a lock, a file
    that cannot be written, an I/O error, or (only when SQLite says so) a damaged database."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(exc)
    where = f"the ledger {str(path)!r}" if path is not None else "the ledger database"
    if primary == _SQLITE_FULL or "disk is full" in text:
        intact = "" if "created" in outcome else " and is intact"
        return UserError("db", f"the disk is full (no space left on device) where {where} is; "
                         f"the ledger {outcome}{intact}.",
                         "Free disk space there, or pass another --db, then run it again.")
    if primary in (_SQLITE_BUSY, _SQLITE_LOCKED) or "locked" in text:
        return UserError("db", f"{where} is locked by another process (waited "
                         f"{BUSY_TIMEOUT_S:g} s); it {outcome}.",
                         "Try again when it has finished, or close it.")
    if primary in (_SQLITE_READONLY, _SQLITE_CANTOPEN) or "readonly" in text:
        return UserError("db", f"{where} cannot be written ({text}); it {outcome}.",
                         "Check the file's and its directory's permissions, or pass another "
                         "--db.")
    if primary == _SQLITE_IOERR or "disk I/O error" in text:
        return UserError("db", f"the disk refused a read or write of {where} ({text}); it "
                         f"{outcome}.", "Check the disk (dmesg), then run it again.")
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in text or \
            "not a database" in text:
        return UserError("db", f"{where} is damaged or not a tunepilot ledger ({text}); it "
                         f"{outcome}.", "Restore the file from a backup, or pass another --db.")
    return UserError("db", f"{where} refused the change: {text}; it {outcome}.",
                     "Check the file's permissions and free disk.")


def create_ledger(cls, path: Path) -> None:
    """A new ledger at ``path``: built and migrated in a temporary file beside it, then
    hard-linked into place (fails if the path exists: a process that created it first wins and
    its ledger is used). Nothing is left behind on failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _os_user_error(exc, path) from None
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
        except sqlite3.Error as exc:
            raise db_error(exc, path, "was not created") from None
        try:
            cls(conn, path)._migrate(outcome="was not created")
        finally:
            conn.close()
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its ledger is the ledger
        except OSError as exc:  # a filesystem without hard links
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise _os_user_error(exc, path) from None
            if not path.exists():
                os.rename(tmp, path)
    except OSError as exc:
        raise _os_user_error(exc, path) from None
    finally:
        for p in (tmp, tmp.with_name(tmp.name + "-journal")):
            with suppress(OSError):
                p.unlink()


def _os_user_error(exc: OSError, path: Path) -> UserError:
    from tunepilot.errors import os_error_kind

    kind, words = os_error_kind(exc)
    return UserError("db", f"cannot create the ledger {str(path)!r}: {words}; nothing was "
                     "written.", "Free disk space there, or pass another --db." if kind == "full"
                     else "Pass a writable file path with --db.")


# --- schema ------------------------------------------------------------------------------------


def _run(db: sqlite3.Connection, script: str) -> None:
    """Statements one by one: executescript would COMMIT the migration's transaction first."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _m1_initial(db: sqlite3.Connection) -> None:
    _run(db, """
        CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL,
                                        applied_at TEXT NOT NULL);
        CREATE TABLE inventory (card_id TEXT PRIMARY KEY, count INTEGER NOT NULL CHECK (count >= 0),
                                source TEXT NOT NULL, catalog_as_of TEXT, recorded_at TEXT NOT NULL);
        CREATE TABLE quotes (id TEXT PRIMARY KEY, created_at TEXT NOT NULL, spec_hash TEXT NOT NULL,
                             card_id TEXT NOT NULL, count INTEGER NOT NULL, term_s INTEGER NOT NULL,
                             total_cents INTEGER NOT NULL, body TEXT NOT NULL);
        CREATE TABLE bookings (
            id INTEGER PRIMARY KEY AUTOINCREMENT, card_id TEXT NOT NULL,
            count INTEGER NOT NULL CHECK (count > 0),
            start_ts INTEGER NOT NULL, end_ts INTEGER NOT NULL CHECK (end_ts > start_ts),
            quote_id TEXT REFERENCES quotes(id),
            status TEXT NOT NULL CHECK (status IN ('booked', 'cancelled')),
            cancellation_policy TEXT NOT NULL, created_at TEXT NOT NULL, cancelled_at TEXT);
        CREATE INDEX bookings_by_card ON bookings (card_id, status, end_ts);
        CREATE TABLE invoices (id INTEGER PRIMARY KEY AUTOINCREMENT,
                               booking_id INTEGER NOT NULL UNIQUE REFERENCES bookings(id),
                               issued_at TEXT NOT NULL, currency TEXT NOT NULL DEFAULT 'USD');
        CREATE TABLE line_items (id INTEGER PRIMARY KEY AUTOINCREMENT,
                                 invoice_id INTEGER NOT NULL REFERENCES invoices(id),
                                 kind TEXT NOT NULL, description TEXT NOT NULL, quantity TEXT NOT NULL,
                                 unit TEXT NOT NULL, unit_price_usd TEXT NOT NULL,
                                 amount_cents INTEGER NOT NULL);
    """)


def _m2_usage(db: sqlite3.Connection) -> None:
    _run(db, """
        CREATE TABLE usage (booking_id INTEGER PRIMARY KEY REFERENCES bookings(id),
                            hours_used TEXT NOT NULL, recorded_at TEXT NOT NULL);
    """)


Migration = Callable[[sqlite3.Connection], None]
MIGRATIONS: list[tuple[int, str, Migration]] = [
    (1, "inventory, quotes, bookings, invoices, line items", _m1_initial),
    (2, "usage per booking", _m2_usage),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def integrity_problem(conn: sqlite3.Connection) -> str | None:
    """SQLite's quick_check of the whole file (every page, record and CHECK constraint: a few
    milliseconds for a ledger's size); None when it is sound, else what SQLite found."""
    try:
        rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise  # another process holds it: db_error says so, it is not damage
        return str(exc)
    except sqlite3.DatabaseError as exc:
        return str(exc)
    found = "; ".join(str(r[0]) for r in rows)
    return None if found == "ok" else " ".join(found.split())[:300]
