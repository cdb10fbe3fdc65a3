"""The quote / compare / ledger commands end to end: bad input exits 2 with one clear paragraph,
no traceback and nothing written to the ledger; a full booking cycle works on a fresh database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunepilot import ledger as L
from tunepilot.cli import main

ROOT = Path(__file__).resolve().parent.parent
LORA = str(ROOT / "examples" / "llama3-8b-lora.yaml")
TINY = str(ROOT / "examples" / "tiny.yaml")
FUTURE = "2099-01-01T00:00Z"
COMMANDS = ("quote", "compare", "book", "bookings", "cancel", "invoice", "usage", "ledger")


@pytest.fixture
def db(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "ledger.sqlite3"
    monkeypatch.setenv(L.DB_ENV, str(path))  # never the user's real data dir
    return path


@pytest.fixture
def cli(capsys, monkeypatch):
    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["tunepilot", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        out = capsys.readouterr()
        return int(exc.value.code or 0), out.out, out.err
    return run


def bookings_in(db: Path) -> int:
    return len(L.bookings(db, include_cancelled=True))


# --- bad input: exit 2, a clear message, no traceback, nothing written -------------------------

BAD = [
    (["quote", LORA, "--card", "h2000", "--hours", "10"], "Did you mean h200"),
    (["book", "--card", "h2000", "--count", "1", "--start", FUTURE, "--hours", "1"],
     "Did you mean h200"),
    (["quote", LORA, "--card", "h200", "--count", "0", "--hours", "10"], "count"),
    (["quote", LORA, "--card", "h200", "--count", "-2", "--hours", "10"], "count"),
    (["book", "--card", "h200", "--count", "0", "--start", FUTURE, "--hours", "1"], "count"),
    (["quote", LORA, "--card", "h200", "--hours", "0"], "positive number of hours"),
    (["quote", LORA, "--card", "h200", "--hours", "-4"], "positive number of hours"),
    (["quote", LORA, "--card", "h200", "--days", "0"], "positive number of days"),
    (["quote", LORA, "--card", "h200", "--hours", "1", "--days", "1"], "exactly one"),
    (["book", "--card", "h200", "--count", "1", "--start", FUTURE, "--hours", "-1"], "positive"),
    (["book", "--card", "h200", "--count", "1", "--start", FUTURE], "exactly one"),
    (["book", "--card", "h200", "--count", "1", "--start", "2020-01-01T00:00Z", "--hours", "1"],
     "in the past"),
    (["book", "--card", "h200", "--count", "1", "--start", "2099-01-01T00:00", "--hours", "1"],
     "no UTC offset"),
    (["book", "--card", "h200", "--count", "1", "--start", "soon", "--hours", "1"], "ISO 8601"),
    (["quote", LORA, "--card", "h200", "--hours", "1", "--option", "nvme=1"], "does not offer"),
    (["book", "--card", "h200", "--count", "1", "--start", FUTURE, "--hours", "1", "--option",
      "storage_gb_mnth=5"], "Did you mean 'storage_gb_month'"),
    (["quote", str(ROOT / "examples" / "llama3-8b-full.yaml"), "--card", "h100", "--count", "1",
      "--hours", "10"], "does not fit 1 x h100-sxm-80gb"),
    (["book", "--quote", "q-nope", "--start", FUTURE], "no quote 'q-nope'"),
    (["cancel", "99"], "no booking 99"),
    (["invoice", "99"], "no booking 99"),
    (["usage", "99", "--hours-used", "-1"], "hours >= 0"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a[:1] + a[3:5]) for a, _ in BAD])
def test_bad_input_exits_2_and_writes_nothing(cli, db, args, expected):
    code, out, err = cli(*args)
    assert code == 2, (out, err)
    assert expected in err and err.startswith("error: ")
    assert "Traceback" not in err + out
    assert not db.exists()


def test_a_run_dir_of_another_spec_is_refused_before_saving(cli, db, tmp_path):
    from tunepilot.spec import load_spec

    run = tmp_path / "run"
    run.mkdir()
    other = load_spec(TINY).with_changes(seed=7)
    (run / "manifest.json").write_text(json.dumps({"spec_hash": other.spec_hash(), "device": {
        "kind": "cpu", "name": "cpu", "card_id": None}}))
    code, out, err = cli("quote", TINY, "--card", "h100", "--hours", "1", "--from", str(run),
                         "--save", "--json")
    assert code == 2 and "another spec" in err
    assert json.loads(out)["field"] == "from"
    assert not db.exists()


@pytest.mark.slow
def test_bad_input_against_an_existing_ledger_changes_nothing(cli, db):
    assert cli("book", "--card", "h200", "--count", "1", "--start", FUTURE, "--hours", "2")[0] == 0
    before = db.read_bytes()
    for args, _ in BAD:
        if args[0] in ("book", "cancel", "usage") and "99" not in args:
            assert cli(*args)[0] == 2
    assert cli("usage", "1", "--hours-used", "3")[0] == 2  # more than booked
    assert db.read_bytes() == before and bookings_in(db) == 1


@pytest.mark.slow
def test_no_traceback_from_a_real_process(db):
    env = {**os.environ, L.DB_ENV: str(db)}
    proc = subprocess.run([sys.executable, "-m", "tunepilot.cli", "book", "--card", "h2000",
                           "--count", "1", "--start", FUTURE, "--hours", "1"],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 2 and "Did you mean h200" in proc.stderr
    assert "Traceback" not in proc.stderr and not db.exists()


# --- working commands ---------------------------------------------------------------------------

def test_help_of_every_command_shows_an_example(cli):
    for command in COMMANDS:
        code, out, _ = cli(command, "--help")
        assert code == 0 and "Example: tunepilot " + command in out and "--json" in out


@pytest.mark.slow
def test_compare_ranks_the_8b_lora_with_projected_figures(cli):
    code, out, _ = cli("compare", LORA)
    assert code == 0 and "projected" in out
    for card in ("h200-sxm-141gb", "mi300x-192gb", "a100-sxm-80gb", "h100-sxm-80gb"):
        assert card in out
    code, out, _ = cli("compare", LORA, "--json")
    data = json.loads(out)
    assert data["refused"] == []
    costs = [float(r["cost_per_million_term_usd"]) for r in data["rows"]]
    assert costs == sorted(costs) and len(costs) == 16


def test_quote_book_invoice_usage_cancel_ledger_on_a_fresh_database(cli, db):
    code, out, _ = cli("quote", LORA, "--card", "h200", "--days", "2", "--option",
                       "storage_gb_month=500", "--save", "--json")
    assert code == 0
    quoted = json.loads(out)
    assert quoted["job_s"]["basis"] == "projected" and quoted["finishes_in_term"]
    qid = quoted["quote_id"]
    code, out, _ = cli("book", "--quote", qid, "--start", FUTURE, "--json")
    assert code == 0
    booking = json.loads(out)
    assert booking["total_cents"] == quoted["term"]["total_cents"] and booking["hours"] == "48"
    code, out, _ = cli("invoice", str(booking["id"]), "--json")
    inv = json.loads(out)
    assert inv["total_cents"] == sum(i["amount_cents"] for i in inv["items"])
    code, out, _ = cli("usage", str(booking["id"]), "--hours-used", "36", "--json")
    assert code == 0 and json.loads(out)["utilisation"] == "0.7500"
    code, out, _ = cli("cancel", str(booking["id"]), "--json")
    cancelled = json.loads(out)
    assert code == 0 and cancelled["refund_cents"] == inv["total_cents"]  # > 72 h ahead: full
    code, out, _ = cli("bookings", "--all", "--json")
    assert [b["status"] for b in json.loads(out)] == ["cancelled"]
    code, out, _ = cli("ledger", "--json")
    (row,) = json.loads(out)
    assert row["net_cents"] == 0 and row["refunded_cents"] == inv["total_cents"]
    for command in (["bookings", "--all"], ["ledger"], ["invoice", str(booking["id"])]):
        code, out, _ = cli(*command)
        assert code == 0 and out


def test_overbooking_exits_3_with_what_is_free(cli, db):
    assert cli("book", "--card", "h200", "--count", "8", "--start", FUTURE, "--hours", "10")[0] == 0
    code, out, err = cli("book", "--card", "h200", "--count", "2", "--start",
                         "2099-01-01T05:00Z", "--hours", "10", "--json")
    assert code == 3 and "only 0 of 8" in err
    refusal = json.loads(out)
    assert refusal["free"] == 0 and refusal["alternative_start"] == "2099-01-01T10:00:00Z"
    assert bookings_in(db) == 1
