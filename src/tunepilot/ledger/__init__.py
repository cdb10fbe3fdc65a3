"""The local allocation-and-billing ledger (SQLite).

    records  bookings, invoices, cancellations, usage; refunds and interval arithmetic
    db       the database: schema migrations, BEGIN IMMEDIATE transactions, the Ledger class
    api      what the CLI calls: input checked before the file is touched
"""

from tunepilot.ledger.api import (
    book,
    bookings,
    cancel,
    existing,
    invoice,
    save_quote,
    spend,
    usage,
)
from tunepilot.ledger.db import (
    DB_ENV,
    SCHEMA_VERSION,
    CapacityError,
    Ledger,
    default_db_path,
    parse_start,
)
from tunepilot.ledger.records import cancellation_rule, peak_use, refund_cents

__all__ = ["DB_ENV", "SCHEMA_VERSION", "CapacityError", "Ledger", "book", "bookings", "cancel", "cancellation_rule",
           "default_db_path", "existing", "invoice", "parse_start", "peak_use", "refund_cents",
           "save_quote", "spend", "usage"]
