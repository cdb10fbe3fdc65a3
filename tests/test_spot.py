"""The interruption-aware spot quote (cost/spot.py): recomputed here by hand from the quote's own
time terms, the measured save/load time of a restore proof used, bad input refused naming the
field, on-demand and spot side by side in compare, the interval written into the launched spec.

The run directories and catalogs here are FIXTURES (numbers chosen for easy arithmetic)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import yaml

from tunepilot.catalog import load_catalog
from tunepilot.cost.compare import compare
from tunepilot.cost.quote import SpotAsk, quote
from tunepilot.cost.spot import daly_interval_s, poisson_quantile, young_interval_s
from tunepilot.errors import UserError
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    DeviceBlock,
    MemoryBlock,
    PilotResult,
    ProcessMemory,
    Throughput,
    Timings,
)
from tunepilot.results.restore import ComponentCheck, RestoreResult
from tunepilot.spec import load_spec
from tunepilot.store import RunDir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXE = Path(sys.executable).with_name("tunepilot")
FSDP_70B = load_spec(EXAMPLES / "llama3.1-70b-fsdp8.yaml")
TINY = load_spec(EXAMPLES / "tiny.yaml")
DAY = 86400


def _term(q, name):
    return next(t for t in q.time_terms if t.name == name)


def _cents(count, seconds, increment, usd):
    billed = math.ceil(seconds / increment) * increment
    return int((count * Decimal(billed) / 3600 * Decimal(usd) * 100).to_integral_value(
        rounding=ROUND_HALF_UP))


def test_a_multi_day_spot_quote_recomputed_by_hand():
    q = quote(FSDP_70B, card_id="h200", count=8, term_s=4 * DAY)
    s = q.spot
    assert q.job_s.value > 2 * DAY  # a multi-day term
    # by hand, from the quote's own terms: C, M, T (Young), B, R, L, H, N
    c = _term(q, "checkpoint writes").each.value
    m = 3600 / 0.44  # cost_model.yaml spot_interruptions_per_node_hour, one node
    t = math.sqrt(2 * c * m)
    work = _term(q, "training").total.value + _term(q, "validation").total.value
    once = sum(_term(q, n).total.value for n in ("provisioning", "set-up", "model load",
                                                  "export"))
    b = once + work + (work // t) * c
    r = 600 + 60 + _term(q, "model load").each.value + c + 60  # checkpoint load = a save; skip
    lost = t / 2 + r
    h = b / (1 - lost / m)
    n = h / m
    assert s.interval_s.value == pytest.approx(t)
    assert s.mtbi_s.value == pytest.approx(m)
    assert s.checkpoints == work // t
    assert s.work_s.value == pytest.approx(b)
    assert s.restart_s.value == pytest.approx(r)
    assert s.lost_per_interruption_s.value == pytest.approx(lost)
    assert s.expected_s.value == pytest.approx(h)
    assert s.expected_interruptions.value == pytest.approx(n)
    assert s.interval_steps == round(t / (_term(q, "training").total.value / q.optimizer_steps))
    # money: 8 cards x hours billed in whole hours (the H200 example) x $1.01, cents once
    assert s.expected_cost_cents == _cents(8, h, 3600, "1.01")
    assert s.naive_cost_cents == _cents(8, b, 3600, "1.01")  # the same schedule, no interruption
    assert s.on_demand_cost_cents == _cents(8, q.job_s.value, 3600, "3.49")
    assert s.expected_cost_cents > s.naive_cost_cents  # interruptions cost something
    assert s.expected_cost_cents < s.on_demand_cost_cents
    assert s.overhead_fraction == pytest.approx(s.expected_cost_cents / s.naive_cost_cents - 1)
    # the spread: Poisson quantiles of the interruptions, each priced as B + k x L
    lo, mid, hi = (s.outcome(x) for x in (0.1, 0.5, 0.9))
    assert lo.interruptions < mid.interruptions < hi.interruptions
    assert lo.cost_cents <= s.expected_cost_cents <= hi.cost_cents
    assert hi.hours == pytest.approx((b + hi.interruptions * lost) / 3600)
    assert s.daly_interval_s < s.interval_s.value
    assert isinstance(s.expected_cost_cents, int) and isinstance(s.spot_usd_per_hour, Decimal)


def test_the_overhead_is_never_negative_when_the_spec_saves_more_often_than_the_optimum():
    """N20: the naive cost was the on-demand job (the spec's checkpoint schedule) at the spot
    rate, the expected cost the spot schedule: a spec saving every step showed -5%."""
    often = FSDP_70B.with_changes(checkpoint=FSDP_70B.checkpoint.model_copy(
        update={"every_steps": 1}))
    s = quote(often, card_id="h200", count=8, term_s=8 * DAY).spot
    assert s.expected_cost_cents >= s.naive_cost_cents and s.overhead_fraction >= 0


def test_young_and_daly_match_the_worked_examples():
    # NOTES (Young 1974; Daly 2006 eq. 37): C = 5 min, M = 2 h -> 34.6 / 31.4 min
    assert young_interval_s(300, 7200) / 60 == pytest.approx(34.64, abs=0.01)
    assert daly_interval_s(300, 7200) / 60 == pytest.approx(31.4, abs=0.05)
    assert daly_interval_s(10, 4) == 4  # C >= 2M: checkpoint every M


def test_poisson_quantiles_by_hand():
    # P(X=0) = e^-2 = 0.135 >= 0.1; P(X<=2) = 0.677 >= 0.5; P(X<=3) = 0.857, P(X<=4) = 0.947
    assert [poisson_quantile(2.0, q) for q in (0.1, 0.5, 0.9)] == [0, 2, 4]
    assert poisson_quantile(0, 0.9) == 0
    assert poisson_quantile(10_000, 0.5) == pytest.approx(10_000, abs=2)  # normal branch


def _run_dir(path: Path, spec, card_id: str, *, save_s: float, load_s: float,
             data_ok: bool) -> Path:
    """A hand-made run directory (a fixture, not a measurement): a pilot and a restore proof on
    ``card_id`` with the save and load seconds given."""
    run = RunDir(path)
    device = {"kind": "cuda", "name": card_id, "card_id": card_id}
    run.write(PilotResult(
        throughput=Throughput(useful_tokens_per_s=Figure.measured(50_000.0, "tokens/s")),
        timings=Timings(setup_s=Figure.measured(30.0, "s"), model_load_s=Figure.measured(5.0, "s"),
                        checkpoint_bytes=Figure.measured(2_000_000, "bytes")),
        memory=MemoryBlock(process=ProcessMemory(
            peak_rss_bytes=Figure.measured(3 * 2**30, "bytes"))),
        device=DeviceBlock(**device)), spec.spec_hash())
    run.write(RestoreResult(
        passed=data_ok, steps_before=2, steps_after=2,
        components=[ComponentCheck(name="model", passed=True, detail="equal"),
                    ComponentCheck(name="data_position", passed=data_ok, detail="-")],
        save_s=Figure.measured(save_s, "s"), load_s=Figure.measured(load_s, "s")),
        spec.spec_hash())
    run.update_manifest(device=device)
    return path


def test_the_measured_save_and_load_times_price_the_spot_term(tmp_path):
    run = _run_dir(tmp_path / "run", TINY, "h100-sxm-80gb", save_s=4.0, load_s=3.0,
                   data_ok=True)
    q = quote(TINY, card_id="h100", count=1, term_s=DAY, run_dir=run,
              spot=SpotAsk(rate="0.05"))
    s = q.spot
    assert s.save_s.value == 4.0 and s.save_s.is_measured
    assert s.restart["checkpoint load"].value == 3.0 and s.restart["checkpoint load"].is_measured
    assert s.restart["data skip"].value == 0 and s.restart["data skip"].is_measured
    assert s.rate_per_node_hour.value == 0.05 and "--spot-rate" in s.rate_per_node_hour.how
    # the pilot's measured process RSS shown beside the host plan
    assert q.host.measured_rss_bytes_per_process.value == 3 * 2**30
    work = _term(q, "training").total.value + _term(q, "validation").total.value
    assert s.interval_s.value == pytest.approx(min(math.sqrt(2 * 4.0 * 3600 / 0.05), work))
    # a proof whose data position was not restored pays the assumed skip
    bad = _run_dir(tmp_path / "bad", TINY, "h100-sxm-80gb", save_s=4.0, load_s=3.0,
                   data_ok=False)
    s2 = quote(TINY, card_id="h100", count=1, term_s=DAY, run_dir=bad).spot
    assert s2.restart["data skip"].value == 60 and "NOT restored" in s2.restart["data skip"].how


def test_the_catalogs_rate_is_used_with_its_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cards": [{"id": "h200", "pricing": {
        "spot_interruptions_per_hour": 0.02, "spot_interruption_source": "my logs, 2026-11"}}]}))
    s = quote(FSDP_70B, card_id="h200", count=16, term_s=None,
              catalog=load_catalog(path)).spot
    assert s.rate_per_node_hour.value == 0.02 and "my logs" in s.rate_per_node_hour.how
    assert s.nodes == 2 and s.rate_per_job_hour.value == pytest.approx(0.04)  # any node stops it
    for bad in (1.5, -0.1, "x"):
        path.write_text(yaml.safe_dump({"cards": [{"id": "h200", "pricing": {
            "spot_interruptions_per_hour": bad, "spot_interruption_source": "s"}}]}))
        with pytest.raises(UserError) as err:
            load_catalog(path)
        assert err.value.field == "catalog.cards[0].pricing.spot_interruptions_per_hour"
    path.write_text(yaml.safe_dump({"cards": [{"id": "h200", "pricing": {
        "spot_interruptions_per_hour": 0.1}}]}))
    with pytest.raises(UserError, match="needs spot_interruption_source"):
        load_catalog(path)


def test_no_interruptions_and_no_spot_price():
    s = quote(FSDP_70B, card_id="h200", count=8, term_s=None, spot=SpotAsk(rate="0")).spot
    assert s.expected_interruptions.value == 0 and s.mtbi_s is None
    assert s.expected_s.value == s.work_s.value
    assert quote(FSDP_70B, card_id="mi300x", count=8, term_s=None).spot is None
    with pytest.raises(UserError) as err:
        quote(FSDP_70B, card_id="mi300x", count=8, term_s=None, spot=SpotAsk(rate="0.1"))
    assert err.value.field == "spot-rate" and "no spot price" in err.value.message


def test_a_job_interrupted_faster_than_it_recovers_does_not_finish():
    s = quote(FSDP_70B, card_id="h200", count=16, term_s=None, spot=SpotAsk(rate="0.99")).spot
    assert not s.finishes and s.expected_cost_cents is None and "does not finish" in s.reason


@pytest.mark.parametrize("args,field,words", [
    (["--spot-rate", "1.5"], "spot-rate", "outside [0, 1)"),
    (["--spot-rate", "-0.01"], "spot-rate", "outside [0, 1)"),
    (["--spot-rate", "nan"], "spot-rate", "outside [0, 1)"),
    (["--checkpoint-minutes", "3"], "checkpoint-minutes", "not longer than one checkpoint save"),
    (["--checkpoint-minutes", "-5"], "checkpoint-minutes", "positive"),
])
def test_bad_spot_input_exits_2_naming_the_field(args, field, words):
    proc = subprocess.run([str(EXE), "quote", str(EXAMPLES / "llama3.1-70b-fsdp8.yaml"),
                           "--card", "h200", "--count", "8", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-300:]
    assert f"{field}:" in proc.stderr and words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_given_interval_is_priced_and_costs_more_than_the_optimum():
    best = quote(FSDP_70B, card_id="h200", count=8, term_s=None).spot
    given = quote(FSDP_70B, card_id="h200", count=8, term_s=None,
                  spot=SpotAsk(interval_s=90 * 60)).spot
    assert given.interval_s.value == 90 * 60 and "given" in given.interval_rule
    assert given.expected_s.value > best.expected_s.value
    # four hours between checkpoints on a node reclaimed every 2.3 h: it never finishes
    assert not quote(FSDP_70B, card_id="h200", count=8, term_s=None,
                     spot=SpotAsk(interval_s=4 * 3600)).spot.finishes


def test_compare_shows_on_demand_and_spot_side_by_side():
    c = compare(FSDP_70B)
    with_spot = [q for q in c.rows if q.spot is not None]
    assert with_spot and all(q.spot.on_demand_cost_cents > 0 for q in with_spot)
    assert {q.card_id for q in c.rows if q.spot is None} == {"mi300x-192gb"}
    assert all(q.host is not None and q.host.binds for q in c.rows)
    with pytest.raises(UserError) as err:
        compare(FSDP_70B, spot=SpotAsk(rate="2"))
    assert err.value.field == "spot-rate"


@pytest.mark.slow
def test_launch_spot_writes_the_interval_into_the_spec_it_runs(tmp_path):
    spec = tmp_path / "llama3.1-70b-fsdp8.yaml"
    spec.write_text((EXAMPLES / "llama3.1-70b-fsdp8.yaml").read_text())
    out = tmp_path / "t.sky.yaml"
    proc = subprocess.run([str(EXE), "launch", str(spec), "--card", "h200", "--count", "8",
                           "--via", "skypilot", "--out", str(out), "--spot", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    every = quote(FSDP_70B, card_id="h200", count=8, term_s=None).spot.interval_steps
    assert plan["spot"]["checkpoint_every_steps"] == every != FSDP_70B.checkpoint.every_steps
    written = load_spec(tmp_path / "llama3.1-70b-fsdp8.spot.yaml")
    assert written.checkpoint.every_steps == every
    assert written.with_changes(checkpoint=FSDP_70B.checkpoint.model_dump()).spec_hash() == \
        FSDP_70B.spec_hash()  # nothing else changed
    task = yaml.safe_load(out.read_text())
    assert task["resources"]["use_spot"] is True
    assert "tunepilot run llama3.1-70b-fsdp8.spot.yaml" in task["run"]
    slurm = tmp_path / "t.sbatch"
    proc = subprocess.run([str(EXE), "launch", str(spec), "--card", "h200", "--count", "8",
                           "--via", "slurm", "--out", str(slurm), "--spot"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --requeue" in slurm.read_text() and ".spot.yaml" in slurm.read_text()
    bad = subprocess.run([str(EXE), "launch", str(spec), "--card", "mi300x", "--count", "8",
                          "--via", "slurm", "--out", str(slurm), "--spot"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--spot:" in bad.stderr and "no spot price" in bad.stderr
