"""The ledger against what a script or an adversary does to it (issue 40 item 12, N14-N18): one
place where a booking commits, after which an output failure neither undoes nor doubles it;
the inventory is the ledger's, not the catalog a command names; a damaged file is refused
before it is read or written; rows that do not add up are named, not shown."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "trust4"
BOOK = ["book", "--card", "h200", "--count", "1", "--hours", "24"]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunepilot", *map(str, args)],
                          capture_output=kw.pop("capture", True), text=True, timeout=120, **kw)


def _ids(db: Path) -> list[int]:
    code, out, err = run_cli("bookings", "--all", "--db", db, "--json")
    assert code == 0, err
    return [b["id"] for b in json.loads(out)]


def test_a_start_in_year_1_is_refused_and_nothing_is_created(tmp_path):
    db = tmp_path / "l.db"
    code, _, err = run_cli(*BOOK, "--start", "0001-01-01T00:00+14:00", "--db", db)
    assert code == 2 and "start" in err and not db.exists()


def test_a_closed_stdout_after_the_commit_exits_0_with_the_id_on_stderr(tmp_path):
    """`book ... >&-` committed, then exited 1: a script that retries on failure booked
    twice."""
    db = tmp_path / "l.db"
    proc = subprocess.run([sys.executable, "-m", "tunepilot", *BOOK, "--start",
                           "2030-01-01T00:00Z", "--db", str(db)], stderr=subprocess.PIPE,
                          text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0, proc.stderr
    assert "booked: booking 1" in proc.stderr and "Traceback" not in proc.stderr
    assert _ids(db) == [1]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_broken_pipe_after_the_commit_exits_0_with_the_id_on_stderr(tmp_path, as_json):
    db = tmp_path / "l.db"
    proc = subprocess.Popen([sys.executable, "-m", "tunepilot", *BOOK, "--start",
                             "2030-01-01T00:00Z", "--db", str(db)] + (["--json"] if as_json
                                                                      else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader went away (`| head -0`)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "booked: booking 1" in err and "Traceback" not in err
    assert _ids(db) == [1]


def test_a_second_catalog_does_not_add_cards_to_the_ledger(tmp_path):
    db = tmp_path / "l.db"
    first = ["book", "--card", "h200", "--count", "8", "--hours", "1", "--start",
             "2030-01-01T00:00Z", "--db", db]
    assert run_cli(*first)[0] == 0
    code, _, err = run_cli(*first, "--catalog", DATA / "bigcat.yaml")
    assert code == 2 and "inventory of 8" in err and "100" in err
    assert _ids(db) == [1]
    code, _, err = run_cli(*first)  # the ledger's own inventory is full at that time
    assert code == 3


def test_a_damaged_ledger_is_refused_before_it_is_read_or_written(tmp_path):
    db = tmp_path / "damaged.db"
    shutil.copy(DATA / "ledger_damaged_index.sqlite3", db)
    before = db.read_bytes()
    for args in (["invoice", "1"], ["cancel", "1"], ["bookings"], ["usage", "1",
                                                                    "--hours-used", "1"],
                 [*BOOK, "--start", "2031-01-01T00:00Z"]):
        code, _, err = run_cli(*args, "--db", db)
        assert code == 2 and "damaged" in err, (args, err)
    assert db.read_bytes() == before


def test_a_newer_ledger_is_bad_input_not_a_failure(tmp_path):
    db = tmp_path / "l.db"
    assert run_cli(*BOOK, "--start", "2030-01-01T00:00Z", "--db", db)[0] == 0
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA user_version = 9")
    code, _, err = run_cli("bookings", "--db", db)
    assert code == 2 and "schema version 9" in err


@pytest.mark.parametrize("edit,words", [
    ("UPDATE line_items SET quantity = '64'", "64 card-hour"),
    ("UPDATE line_items SET quantity = '64', amount_cents = 22336", "booking holds 1 card"),
    ("UPDATE line_items SET amount_cents = -5", "bills -5 cents"),
    ("UPDATE line_items SET kind = 'gift'", "kind 'gift'"),
    ("DELETE FROM invoices", "has no invoice"),
])
def test_rows_that_do_not_add_up_are_named_not_shown(tmp_path, edit, words):
    db = tmp_path / "l.db"
    assert run_cli(*BOOK, "--start", "2030-01-01T00:00Z", "--db", db)[0] == 0
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA foreign_keys = OFF")
        c.execute(edit)
    for args in (["invoice", "1"], ["bookings"], ["cancel", "1"]):
        code, out, err = run_cli(*args, "--db", db)
        assert code == 2 and words in err and "did not write" in err, (args, err)
        assert out == ""


def test_a_saved_quote_is_booked_once_until_that_booking_is_cancelled(tmp_path):
    db = tmp_path / "l.db"
    code, out, err = run_cli("quote", ROOT / "examples" / "tiny.yaml", "--card", "h200",
                             "--hours", "2", "--save", "--db", db, "--json")
    assert code == 0, err
    qid = json.loads(out)["quote_id"]
    book = ["book", "--quote", qid, "--start", "2030-01-01T00:00Z", "--db", db]
    assert run_cli(*book)[0] == 0
    code, _, err = run_cli(*book)
    assert code == 2 and "already booked as booking 1" in err
    assert run_cli("cancel", "1", "--db", db)[0] == 0
    assert run_cli(*book)[0] == 0 and _ids(db) == [1, 2]
