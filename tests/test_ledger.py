"""The ledger: schema migrations, bookings against inventory, cancellation refunds, invoices in
cents, usage, spend; and hypothesis properties of capacity and money."""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tunepilot import ledger as L
from tunepilot.catalog import Inventory, load_catalog
from tunepilot.cost.terms import parse_options, term_cost
from tunepilot.errors import TunepilotError, UserError
from tunepilot.limits import MAX_CARDS

CAT = load_catalog()
H200 = CAT.get("h200")  # 8 in inventory; full refund >= 72 h ahead, 25% later, 0% after start
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
T0 = int(NOW.timestamp())
H = 3600
PROPS = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _never_the_real_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(L.DB_ENV, str(tmp_path / "default-ledger.sqlite3"))


def small(card, count: int):
    """The card with a smaller inventory, so capacity runs out quickly."""
    return card.model_copy(update={"inventory": Inventory(count=count, source="test")})


def book_at(ledger, card, count, start_h, hours, options=None):
    items = list(term_cost(card, count, hours * H, options).items)
    return ledger.book(card, count, T0 + start_h * H, hours * H, items, quote_id=None,
                       catalog_as_of=CAT.as_of, now=NOW)


@pytest.fixture
def ledger(tmp_path):
    with L.Ledger.open(tmp_path / "ledger.sqlite3") as led:
        yield led


# --- schema --------------------------------------------------------------------------------------

def test_fresh_database_is_at_the_latest_schema(ledger):
    assert ledger.schema_version == L.SCHEMA_VERSION == 2
    applied = ledger.conn.execute("SELECT version FROM schema_migrations ORDER BY version")
    assert [r[0] for r in applied] == [1, 2]
    tables = {r[0] for r in ledger.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"inventory", "quotes", "bookings", "invoices", "line_items", "usage"} <= tables


def test_a_version_1_database_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    L.schema._m1_initial(conn)
    conn.execute("INSERT INTO schema_migrations VALUES (1, 'initial', '2029-01-01T00:00:00Z')")
    conn.execute("PRAGMA user_version = 1")
    conn.execute("COMMIT")
    conn.close()
    with L.Ledger.open(path) as led:
        assert led.schema_version == 2
        booking = book_at(led, H200, 1, 1, 2)
        assert led.record_usage(booking.id, Decimal(1), NOW).utilisation == "0.5000"


def test_a_newer_or_foreign_database_is_refused(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    sqlite3.connect(newer).execute("PRAGMA user_version = 99").connection.commit()
    with pytest.raises(TunepilotError, match="newer than this tunepilot"):
        L.Ledger.open(newer)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(UserError, match="not a tunepilot ledger"):
        L.Ledger.open(junk)


def test_default_path_is_the_env_or_the_user_data_dir(monkeypatch, tmp_path):
    assert L.default_db_path() == tmp_path / "default-ledger.sqlite3"
    monkeypatch.delenv(L.DB_ENV)
    assert L.default_db_path().name == "ledger.sqlite3" and "tunepilot" in str(L.default_db_path())


def test_reading_commands_never_create_the_file(tmp_path):
    db = tmp_path / "none.sqlite3"
    assert L.bookings(db) == [] and L.spend(db) == []
    with pytest.raises(UserError, match="does not exist yet"):
        L.invoice(db, 1)
    assert not db.exists()


# --- time ----------------------------------------------------------------------------------------

def test_start_times_must_be_utc_aware_and_not_past():
    assert L.parse_start("2030-01-02T00:00Z", NOW) == T0 + 24 * H
    assert L.parse_start("2030-01-02T01:00+01:00", NOW) == T0 + 24 * H
    assert L.parse_start("now", NOW) == T0
    with pytest.raises(UserError, match="no UTC offset"):
        L.parse_start("2030-01-02T00:00", NOW)
    with pytest.raises(UserError, match="in the past"):
        L.parse_start("2029-12-31T23:59Z", NOW)
    with pytest.raises(UserError, match="not an ISO 8601"):
        L.parse_start("tomorrow", NOW)


# --- bookings ------------------------------------------------------------------------------------

def test_booking_writes_the_invoice_in_cents(ledger):
    opts = parse_options(H200, ["storage_gb_month=100"])
    b = book_at(ledger, H200, 2, 10, 72, opts)
    inv = ledger.invoice(b.id)
    assert [i.kind for i in inv.items] == ["compute", "option"]
    assert inv.items[0].amount_cents == 2 * 72 * 349
    assert inv.total_cents == sum(i.amount_cents for i in inv.items) == b.total_cents
    assert b.start == "2030-01-01T10:00:00Z" and b.end == "2030-01-04T10:00:00Z"
    snap = ledger.conn.execute("SELECT count FROM inventory WHERE card_id = ?", (H200.id,))
    assert snap.fetchone()[0] == 8


def test_overbooking_is_refused_with_what_is_free_instead(ledger):
    book_at(ledger, H200, 6, 0, 10)
    with pytest.raises(L.CapacityError) as err:
        book_at(ledger, H200, 4, 5, 10)
    e = err.value
    assert e.exit_code == 3 and e.free == 2
    assert e.alternative_start == "2030-01-01T10:00:00Z"  # when the 6 are released
    assert "only 2 of 8" in e.message and "book 2 at that time" in e.hint
    assert e.to_dict()["alternative_start"] == e.alternative_start
    with pytest.raises(L.CapacityError, match="inventory has only 8"):
        book_at(ledger, H200, 9, 100, 1)
    assert len(ledger.bookings()) == 1


def test_back_to_back_bookings_do_not_overlap(ledger):
    book_at(ledger, H200, 8, 0, 10)
    book_at(ledger, H200, 8, 10, 10)  # [0, 10) then [10, 20)
    with pytest.raises(L.CapacityError):
        book_at(ledger, H200, 1, 9, 2)


@pytest.mark.parametrize("cancel_at_h,percent", [(-100, "100"), (-72, "100"), (-10, "25"),
                                                 (0, "0"), (5, "0")])
def test_cancellation_follows_the_policy(ledger, cancel_at_h, percent):
    b = book_at(ledger, H200, 1, 200, 48)
    when = NOW + timedelta(hours=200 + cancel_at_h)
    c = ledger.cancel(b.id, when)
    assert c.refund_percent == percent
    assert c.refund_cents == L.refund_cents(c.paid_cents, Decimal(percent))
    inv = ledger.invoice(b.id)
    assert inv.items[-1].kind == "refund" and inv.items[-1].amount_cents == -c.refund_cents
    assert inv.total_cents == c.paid_cents - c.refund_cents
    assert ledger.booking(b.id).status == "cancelled"
    with pytest.raises(UserError, match="already cancelled"):
        ledger.cancel(b.id, when)


def test_booking_a_saved_quote_uses_its_prices(tmp_path):
    from tunepilot.cost.quote import quote
    from tunepilot.spec import load_spec

    db = tmp_path / "q.sqlite3"
    spec = load_spec("examples/tiny.yaml")
    q = quote(spec, card_id="h200", count=2, term_s=5 * H, options=["support=1"])
    qid = L.save_quote(db, q, NOW)
    b = L.book(CAT, db=db, card_id=None, count=None, start="2030-01-02T00:00Z", quote_id=qid,
               now=NOW)
    assert (b.card_id, b.count, b.hours, b.quote_id) == ("h200-sxm-141gb", 2, "5", qid)
    assert b.total_cents == q.term.total_cents
    with pytest.raises(UserError, match="not count 3"):
        L.book(CAT, db=db, card_id="h200", count=3, start="now", quote_id=qid, now=NOW)
    from tunepilot.ledger.db import Ledger

    with Ledger.open(db) as ledger:  # the ledger stores and loads the typed Quote
        assert ledger.get_quote(qid) == q
    with pytest.raises(UserError, match="no quote 'q-nope'"):
        L.book(CAT, db=db, card_id=None, count=None, start="now", quote_id="q-nope", now=NOW)


def test_usage_gives_utilisation(ledger):
    b = book_at(ledger, H200, 2, 0, 10)
    u = ledger.record_usage(b.id, Decimal("7.5"), NOW)
    assert (u.hours_used, u.hours_booked, u.utilisation) == ("7.5", "10", "0.7500")
    assert ledger.record_usage(b.id, Decimal(10), NOW).utilisation == "1.0000"  # latest wins
    with pytest.raises(UserError, match="more than the 10 h booked"):
        ledger.record_usage(b.id, Decimal(11), NOW)
    with pytest.raises(UserError):
        L.usage(ledger.path, b.id, "-1", NOW)


def test_spend_by_card_and_month(ledger):
    a = book_at(ledger, H200, 1, 0, 10)
    book_at(ledger, H200, 2, 24 * 40, 10)  # February
    book_at(ledger, CAT.get("a100"), 1, 0, 1)
    ledger.cancel(a.id, NOW)  # cancelled at its start: the after-start rate, 0% back
    rows = {(r["card"], r["month"]): r for r in ledger.spend()}
    assert set(rows) == {("h200-sxm-141gb", "2030-01"), ("h200-sxm-141gb", "2030-02"),
                         ("a100-sxm-80gb", "2030-01")}
    jan = rows[("h200-sxm-141gb", "2030-01")]
    assert jan["billed_cents"] == 10 * 349 and jan["refunded_cents"] == 0
    assert jan["card_hours_booked"] == "0"  # cancelled
    assert rows[("h200-sxm-141gb", "2030-02")]["net_cents"] == 2 * 10 * 349


# --- properties ----------------------------------------------------------------------------------

def _brute_peak(intervals, start, end):
    """Most cards in use at any whole hour of [start, end) (every boundary is a whole hour)."""
    return max((sum(n for s, e, n in intervals if s <= t < e) for t in range(start, end)),
               default=0)


ops = st.lists(st.one_of(
    st.tuples(st.just("book"), st.integers(0, 48), st.integers(1, 24), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 30))), max_size=25)


@pytest.mark.slow
@PROPS
@given(ops=ops, inventory=st.integers(1, 5))
def test_at_no_instant_do_bookings_exceed_inventory(ops, inventory):
    card = small(H200, inventory)
    model: dict[int, tuple[int, int, int]] = {}  # booking id -> (start_h, end_h, count)
    with L.Ledger.open(":memory:") as led:
        for op in ops:
            if op[0] == "cancel":
                if model:
                    bid = sorted(model)[op[1] % len(model)]
                    led.cancel(bid, NOW)
                    del model[bid]
                continue
            _, start, hours, count = op
            fits = _brute_peak(model.values(), start, start + hours) + count <= inventory
            try:
                b = book_at(led, card, count, start, hours)
            except L.CapacityError:
                assert not fits
            else:
                assert fits
                model[b.id] = (start, start + hours, count)
        active = [((int(datetime.fromisoformat(b.start[:-1] + "+00:00").timestamp()) - T0) // H,
                   (int(datetime.fromisoformat(b.end[:-1] + "+00:00").timestamp()) - T0) // H,
                   b.count) for b in led.bookings(card.id)]
        assert sorted(active) == sorted(model.values())
        assert _brute_peak(active, 0, 80) <= inventory


@pytest.mark.slow
@PROPS
@given(existing=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 3)),
                         max_size=6),
       start=st.integers(0, 30), hours=st.integers(1, 12), count=st.integers(1, 3))
def test_cancel_then_rebook_restores_capacity(existing, start, hours, count):
    card = small(H200, 4)
    with L.Ledger.open(":memory:") as led:
        for s, h, n in existing:
            with contextlib.suppress(L.CapacityError):
                book_at(led, card, n, s, h)
        window = (T0 + start * H, T0 + (start + hours) * H)
        before = led.free(card, *window)
        assume(before >= count)
        b = book_at(led, card, count, start, hours)
        assert led.free(card, *window) == before - count
        led.cancel(b.id, NOW)
        assert led.free(card, *window) == before
        again = book_at(led, card, count, start, hours)
        assert again.status == "booked" and led.free(card, *window) == before - count


@pytest.mark.slow
@PROPS
@given(bookings=st.lists(st.tuples(
    st.sampled_from([c.id for c in CAT.cards]), st.integers(1, 8), st.integers(1, 24 * 40),
    st.integers(1, 24 * 100), st.decimals(0, 5000, places=2), st.integers(-24 * 5, 24 * 100),
    st.booleans()), min_size=1, max_size=8))
def test_money_never_loses_a_cent(bookings):
    with L.Ledger.open(":memory:") as led:
        for card_id, count, start_h, hours, storage, cancel_h, cancel in bookings:
            card = small(CAT.get(card_id), MAX_CARDS)  # capacity is not what this tests
            b = book_at(led, card, count, start_h, hours, {"storage_gb_month": storage})
            inv = led.invoice(b.id)
            assert inv.total_cents == sum(i.amount_cents for i in inv.items) == b.total_cents
            if cancel:
                c = led.cancel(b.id, NOW + timedelta(hours=max(0, start_h + cancel_h)))
                exact = Decimal(c.paid_cents) * Decimal(c.refund_percent) / 100
                assert 0 <= c.refund_cents <= c.paid_cents
                assert abs(c.refund_cents - exact) <= Decimal("0.5")
                assert led.invoice(b.id).total_cents == c.paid_cents - c.refund_cents
        every = led.bookings(include_cancelled=True)
        spend = led.spend()
        assert sum(r["net_cents"] for r in spend) == sum(b.total_cents for b in every)
        assert sum(r["billed_cents"] - r["refunded_cents"] for r in spend) == sum(
            led.invoice(b.id).total_cents for b in every)


# --- hostile input and damaged files (issue 18) ---------------------------------------------------

def _cli(*args):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("tunepilot")
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,words", [
    (["--hours", "876000000"], "longer than tunepilot quotes or books"),
    (["--days", "1e9"], "longer than tunepilot quotes or books"),
])
def test_an_absurd_term_is_refused_before_the_ledger_is_touched(tmp_path, args, words):
    db = tmp_path / "l.sqlite3"
    proc = _cli("book", "--card", "h100", "--count", "1", "--start", "2030-01-01T00:00Z", *args,
                "--db", db)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
    assert not db.exists()


def test_a_start_beyond_2100_is_refused(tmp_path):
    proc = _cli("book", "--card", "h100", "--count", "1", "--start", "9999-12-10T09:00Z",
                "--hours", "10", "--db", tmp_path / "l.sqlite3")
    assert proc.returncode == 2 and "after 2100" in proc.stderr


def test_rows_out_of_range_from_an_older_version_do_not_crash_the_readers(ledger):
    b = book_at(ledger, H200, 1, 1, 2)
    start = ledger.conn.execute("SELECT start_ts FROM bookings").fetchone()[0]
    ledger.conn.execute("UPDATE bookings SET end_ts = ? WHERE id = ?", (3155396893200, b.id))
    # such a row billed what it held (the invoice check of issue 40 N18 holds it to that)
    hours = Decimal(3155396893200 - start) / 3600
    price = Decimal(ledger.conn.execute("SELECT unit_price_usd FROM line_items").fetchone()[0])
    ledger.conn.execute("UPDATE line_items SET quantity = ?, amount_cents = ?",
                        (str(hours), int(hours * price * 100)))
    rows = ledger.bookings(None, True)
    assert "out of range" in rows[0].end


@pytest.mark.slow
def test_a_zero_byte_ledger_is_refused_not_restarted(tmp_path):
    db = tmp_path / "l.sqlite3"
    db.write_bytes(b"")
    for args in (["bookings"], ["book", "--card", "h100", "--count", "1", "--start",
                                "2030-01-01T00:00Z", "--hours", "1"]):
        proc = _cli(*args, "--db", db)
        assert proc.returncode == 2 and "empty file" in proc.stderr, proc.stderr
    assert db.stat().st_size == 0  # untouched


@pytest.mark.slow
def test_damaged_pages_are_a_message_not_a_traceback(tmp_path):
    db = tmp_path / "l.sqlite3"
    with L.Ledger.open(db) as led:
        book_at(led, H200, 1, 1, 2)
    raw = bytearray(db.read_bytes())
    for i in range(4096, len(raw)):  # every page after the header page
        raw[i] = 0xA5
    db.write_bytes(bytes(raw))
    proc = _cli("bookings", "--db", db)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "ledger" in proc.stderr


def test_a_locked_ledger_says_it_is_locked(tmp_path, monkeypatch):
    db = tmp_path / "l.sqlite3"
    with L.Ledger.open(db):
        pass
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA user_version = 0")  # force a migration, which needs the write lock
    holder.execute("BEGIN EXCLUSIVE")
    try:
        from tunepilot.ledger import db as dbmod

        monkeypatch.setattr(dbmod, "BUSY_TIMEOUT_S", 0.2)
        with pytest.raises(UserError) as e:
            L.Ledger.open(db)
        assert "locked by another process" in str(e.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


# --- hostile input and OS faults (issue 26) --------------------------------------------------


@pytest.mark.parametrize("args,field,words", [
    (["--hours", "10", "--option", "storage_gb_month=1e30"], "option", "at most"),
    (["--hours", "1_000"], "hours", "is not a number"),
    (["--days", "1_0"], "days", "is not a number"),
])
def test_hostile_book_flags_exit_2_and_never_touch_the_ledger(tmp_path, args, field, words):
    db = tmp_path / "l.sqlite3"
    proc = _cli("book", "--card", "h100", "--count", "1", "--start", "2030-01-01T00:00Z", *args,
                "--db", db)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and field in proc.stderr and words in proc.stderr
    assert not db.exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", [["usage", "--hours-used", "1"], ["invoice"], ["cancel"]])
def test_a_21_digit_booking_id_is_a_message(tmp_path, command):
    db = tmp_path / "l.sqlite3"
    with L.Ledger.open(db) as led:
        book_at(led, H200, 1, 1, 2)
    proc = _cli(command[0], "123456789012345678901", *command[1:], "--db", db)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "id" in proc.stderr and "no booking" in proc.stderr


@pytest.mark.slow
def test_a_tiny_term_reserves_what_is_invoiced(tmp_path):
    """--hours 1e-7 is 0.36 ms: h200 bills a whole hour, so the booking holds the cards for
    that hour - never a 1-second reservation with an hour on the invoice."""
    import json

    db = tmp_path / "l.sqlite3"
    proc = _cli("book", "--card", "h200", "--count", "1", "--start", "2030-01-01T00:00Z",
                "--hours", "1e-7", "--db", db, "--json")
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)
    inv = json.loads(_cli("invoice", str(b["id"]), "--db", db, "--json").stdout)
    compute = next(i for i in inv["items"] if i["kind"] == "compute")
    assert Decimal(b["hours"]) == Decimal(compute["quantity"]) == 1
    assert b["end"] == "2030-01-01T01:00:00Z"
    # and the hour is taken: 8 more cards for that hour do not fit the inventory of 8
    again = _cli("book", "--card", "h200", "--count", "8", "--start", "2030-01-01T00:30Z",
                 "--hours", "0.1", "--db", db)
    assert again.returncode == 3, again.stderr


def _race_new_ledger(db, n: int) -> list:
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("tunepilot"))
    procs = [subprocess.Popen([exe, "book", "--card", "h200", "--count", "1", "--start",
                               f"2030-01-0{1 + i % 8}T00:00Z", "--hours", "1", "--db", str(db)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    return [(p.wait(timeout=120), p.stderr.read()) for p in procs]


@pytest.mark.slow
def test_processes_creating_a_new_ledger_at_once_all_book(tmp_path):
    for attempt in range(3):  # the window is small: try a few fresh files
        db = tmp_path / f"new-{attempt}.sqlite3"
        results = _race_new_ledger(db, 6)
        assert all(rc == 0 for rc, _ in results), [e for _, e in results]
        with L.Ledger.open(db) as led:
            assert len(led.bookings()) == 6


def test_a_book_on_a_full_disk_leaves_no_ledger_and_says_the_disk_is_full(tmp_path):
    from tests.support.full_disk import available, run_on_full_disk

    if not available():
        pytest.skip("no private tmpfs here (needs root or CAP_SYS_ADMIN)")
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("tunepilot"))
    mnt = tmp_path / "full"
    db = mnt / "l.sqlite3"
    # fill the 64 KiB disk first, then book: creating the ledger fails
    listing = tmp_path / "listing"
    proc = run_on_full_disk(mnt, 64, ["sh", "-c", f"head -c 1000000 /dev/zero > {mnt}/fill 2>"
                                      f"/dev/null; {exe} book --card h200 --count 1 --start "
                                      f"2030-01-01T00:00Z --hours 1 --db {db}"],
                            after=f"ls -a {mnt} > {listing}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "disk is full" in proc.stderr
    assert sorted(listing.read_text().split()) == [".", "..", "fill"]  # no ledger, no temporary


def test_a_full_disk_under_an_existing_ledger_is_not_called_damage(tmp_path):
    from tests.support.full_disk import available, run_on_full_disk

    if not available():
        pytest.skip("no private tmpfs here (needs root or CAP_SYS_ADMIN)")
    import shutil
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("tunepilot"))
    src = tmp_path / "l.sqlite3"
    with L.Ledger.open(src) as led:
        for i in range(3):
            book_at(led, H200, 1, 10 * i, 2)
    mnt = tmp_path / "full"
    db = mnt / "l.sqlite3"
    out = tmp_path / "after.sqlite3"
    size_kib = src.stat().st_size // 1024 + 8
    script = (f"cp {src} {db} && head -c 10000000 /dev/zero > {mnt}/fill 2>/dev/null; "
              f"for h in 100 200 300 400 500 600; do {exe} book --card h200 --count 1 --start "
              f"2030-02-01T00:00Z --hours $h --option storage_gb_month=$h --db {db} || exit $?; "
              "done")
    proc = run_on_full_disk(mnt, size_kib, ["sh", "-c", script], after=f"cp {db} {out}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "disk is full" in proc.stderr
    assert "damaged" not in proc.stderr and "backup" not in proc.stderr
    shutil.copy(out, tmp_path / "check.sqlite3")
    with L.Ledger.open(tmp_path / "check.sqlite3") as led:  # intact: every earlier booking
        assert led.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert len(led.bookings()) >= 3
