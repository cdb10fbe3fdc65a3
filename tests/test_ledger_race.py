"""Two real processes race for the last cards: exactly one wins, the other is refused cleanly.

Each round, 6 of the 8 H200s are already booked over the round's interval; both processes wait at
a barrier and then ask for the last 2. BEGIN IMMEDIATE makes the check-then-insert one critical
section: the loser must see the winner's booking and get a CapacityError, never a double booking
and never a "database is locked" error.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import datetime, timezone

import pytest

from tunepilot import ledger as L
from tunepilot.catalog import load_catalog
from tunepilot.cost.terms import term_cost

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
T0 = int(NOW.timestamp())
H = 3600
ROUNDS = 15
ROUND_SPACING_S = 100 * H
TERM_S = 10 * H


def _race_worker(db: str, barrier, results, name: str) -> None:
    card = load_catalog().get("h200")
    items = list(term_cost(card, 2, TERM_S).items)
    with L.Ledger.open(db) as ledger:
        for r in range(ROUNDS):
            barrier.wait(timeout=60)
            try:
                b = ledger.book(card, 2, T0 + r * ROUND_SPACING_S, TERM_S, items, quote_id=None,
                                catalog_as_of=None, now=NOW)
                results.put((r, name, "won", b.id))
            except L.CapacityError as exc:
                results.put((r, name, "refused", exc.free))
            except Exception as exc:  # anything else is a failure of the serialisation
                results.put((r, name, "error", repr(exc)))


@pytest.mark.slow
def test_two_processes_racing_for_the_last_cards_exactly_one_wins(tmp_path):
    db = tmp_path / "race.sqlite3"
    card = load_catalog().get("h200")
    assert card.inventory.count == 8
    with L.Ledger.open(db) as ledger:
        for r in range(ROUNDS):
            ledger.book(card, 6, T0 + r * ROUND_SPACING_S, TERM_S,
                        list(term_cost(card, 6, TERM_S).items), quote_id=None,
                        catalog_as_of=None, now=NOW)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(db), barrier, results, name))
             for name in ("a", "b")]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(2 * ROUNDS)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not [o for o in outcomes if o[2] == "error"], outcomes
    for r in range(ROUNDS):
        this = sorted(o[2] for o in outcomes if o[0] == r)
        assert this == ["refused", "won"], (r, this)
    assert {o[3] for o in outcomes if o[2] == "refused"} == {0}  # the loser saw no card free
    with L.Ledger.open(db) as ledger:
        for r in range(ROUNDS):
            start = T0 + r * ROUND_SPACING_S
            assert ledger.free(card, start, start + TERM_S) == 0
        assert len(ledger.bookings(card.id)) == 2 * ROUNDS
