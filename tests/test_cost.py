"""Quotes: term pricing in cents, the job's time terms, measured vs projected, compare's ranking.

The run directories here are FIXTURES written by hand in the schema cost.py documents (numbers
chosen for easy arithmetic), not measurements: the pilot / restore / scale / export stages that
write real ones are tested in their own modules.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunepilot.catalog import load_catalog
from tunepilot.cost.assumptions import cost_model
from tunepilot.cost.compare import compare
from tunepilot.cost.measurements import read_run_dir
from tunepilot.cost.quote import MEASURED, PROJECTED, quote
from tunepilot.cost.terms import billed_seconds, parse_duration, parse_options, term_cost
from tunepilot.errors import UserError
from tunepilot.results.export import ExportResult
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import DeviceBlock, PilotResult, Throughput, Timings
from tunepilot.results.scale import (
    BatchPlan,
    Distribution,
    LaunchSummary,
    NodeFacts,
    PreflightResult,
    Recommendation,
    ScalingResult,
    StrategyResult,
    TopologyFacts,
)
from tunepilot.spec import load_spec
from tunepilot.store import RunDir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CAT = load_catalog()
TINY = load_spec(EXAMPLES / "tiny.yaml")
LORA_8B = load_spec(EXAMPLES / "llama3-8b-lora.yaml")
H = 3600


def write_run_dir(path: Path, spec, card_id: str | None, *, pilot: PilotResult | None = None,
                  scale: dict | None = None, export: dict | None = None) -> Path:
    """A hand-made run directory of typed results (a fixture, not a measurement): the pilot's
    throughput and timings, optionally a scaling strategy and an export."""
    run = RunDir(path)
    device = {"kind": "cuda" if card_id else "cpu", "name": card_id or "cpu", "card_id": card_id}
    timings = {"setup_s": 120.0, "model_load_s": 2.0, "validation_pass_s": 0.05,
               "checkpoint_write_s": 0.1, "checkpoint_bytes": 1_896_192}
    if pilot is None:
        pilot = PilotResult(
            throughput=Throughput(useful_tokens_per_s=Figure.measured(50_000.0, "tokens/s")),
            timings=Timings(**{k: Figure.measured(v, "s" if k.endswith("_s") else "bytes")
                               for k, v in timings.items()}),
            device=DeviceBlock(**device))
    run.write(pilot, spec.spec_hash())
    run.update_manifest(device=device)
    if scale is not None:
        run.write(_scaling(spec, scale), spec.spec_hash())
    if export is not None:
        run.write(ExportResult(dest="file:///x", source=str(path), files=[], files_copied=0,
                               files_recopied=0, files_skipped=0, bytes_copied=_b(0),
                               bytes_skipped=_b(0), bytes=_b(export["bytes"]),
                               seconds=Figure.measured(export["seconds"], "s"),
                               bytes_per_s=Figure.measured(export["bytes_per_s"], "B/s")),
                  spec.spec_hash())
    return path


def _b(n):
    return Figure.measured(n, "bytes")


def _scaling(spec, strategies: dict) -> ScalingResult:
    dist = Distribution(median=1.0, mean=1.0, min=1.0, max=1.0, values=[1.0])
    base = LaunchSummary(world_size=1, strategy="single", backend="nccl", micro_batch_size=1,
                         accumulation=1, measured_steps=1, useful_tokens=1,
                         useful_tokens_per_s=1.0, step_time_s=dist, peak_memory_bytes_per_rank=1,
                         losses=[1.0], loss_spread_between_ranks=0.0, ranks_reported=[0],
                         per_rank=[])
    return ScalingResult(
        label=spec.label, nproc=2, nnodes=1, world_size=2, device="cuda", steps=1,
        warmup_steps=0, global_batch=BatchPlan(global_batch_samples=4, world_size=2,
                                               micro_batch_size=1, accumulation=2,
                                               baseline_accumulation=4, sequence_length=128),
        preflight=PreflightResult(nproc=2, nnodes=1, node=NodeFacts(kind="cuda", device_count=2),
                                  topology=TopologyFacts(source="none"), ranks=[]),
        baseline=base, recommendation=Recommendation(strategy="ddp", reason="-"),
        strategies={k: StrategyResult(status="ok", **{"world_size": v["nproc"], **v})
                    for k, v in strategies["strategies"].items()})


def term(q, name):
    return next(t for t in q.time_terms if t.name == name)


# --- pricing -----------------------------------------------------------------------------------

def test_billing_rounds_up_to_the_increment_and_the_minimum_charge():
    h200, a100, mi300x = CAT.get("h200"), CAT.get("a100"), CAT.get("mi300x")
    assert billed_seconds(h200, int(1.5 * H)) == 2 * H  # whole hours
    assert billed_seconds(h200, 10) == H  # minimum charge 3600 s
    assert billed_seconds(a100, 61) == 120  # per minute
    assert billed_seconds(mi300x, 61) == 61  # per second
    assert billed_seconds(mi300x, 5) == 60  # minimum 60 s
    cost = term_cost(h200, 2, int(1.5 * H))
    assert cost.items[0].amount_cents == 2 * 2 * 349  # 2 cards x 2 h x $3.49


def test_term_discount_applies_from_the_term_length_on():
    h100 = CAT.get("h100")
    assert term_cost(h100, 1, 167 * H).discount_term is None
    week = term_cost(h100, 1, 168 * H)
    assert week.discount_term == "week"
    gross = 168 * 249
    assert [i.amount_cents for i in week.items] == [gross, -round(gross * 0.10)]
    assert term_cost(h100, 1, 720 * H).discount_term == "month"


def test_options_are_prorated_by_their_unit():
    h100 = CAT.get("h100")
    opts = parse_options(h100, ["storage_gb_month=730", "support=1", "egress_gb=100"])
    cost = term_cost(h100, 1, 73 * H, opts)
    by_name = {i.description.split(":")[0]: i.amount_cents for i in cost.items if i.kind == "option"}
    # 730 GB for 73 h = 73 GB-month at $0.10; support $0.25/h x 73 h; egress $0.00/GB
    assert by_name == {"storage_gb_month": 730, "support": 1825, "egress_gb": 0}


def test_unknown_option_says_what_the_card_offers():
    with pytest.raises(UserError, match="does not offer 'nvme'") as err:
        parse_options(CAT.get("h100"), ["nvme=1"])
    assert "local_nvme_tb_month" in err.value.render()
    for bad in (["storage_gb_month"], ["storage_gb_month=-1"], ["storage_gb_month=x"],
                ["support=1", "support=2"]):
        with pytest.raises(UserError):
            parse_options(CAT.get("h100"), bad)


@pytest.mark.parametrize("hours,days", [("0", None), ("-3", None), (None, "0"), ("x", None),
                                        ("1", "1"), (None, None), ("nan", None), ("inf", None)])
def test_bad_durations_are_user_errors(hours, days):
    with pytest.raises(UserError):
        parse_duration(hours, days)


def test_durations_are_whole_seconds_rounded_up():
    assert parse_duration("72", None) == 72 * H
    assert parse_duration(None, "1.5") == 36 * H
    assert parse_duration("0.0001", None) == 1


@settings(max_examples=200, deadline=None)
@given(card=st.sampled_from([c.id for c in CAT.cards]), count=st.integers(1, 64),
       term_s=st.integers(1, 200 * 24 * H), storage=st.decimals(0, 10**5, places=3),
       support=st.integers(0, 4))
def test_term_total_is_the_sum_of_its_lines_within_half_a_cent_each(card, count, term_s, storage,
                                                                     support):
    c = CAT.get(card)
    cost = term_cost(c, count, term_s, {"storage_gb_month": storage, "support": Decimal(support)})
    assert cost.total_cents == sum(i.amount_cents for i in cost.items)
    assert all(isinstance(i.amount_cents, int) for i in cost.items)
    p = c.pricing
    gross = count * Decimal(cost.billed_s) / H * p.on_demand_usd_per_hour
    disc = Decimal(cost.discount_percent) / 100
    months = Decimal(term_s) / H / 730
    exact = (gross * (1 - disc) + storage * months * p.options["storage_gb_month"].usd
             + support * Decimal(term_s) / H * p.options["support"].usd) * 100
    assert abs(Decimal(cost.total_cents) - exact) <= Decimal("0.5") * len(cost.items)


# --- the projection from FLOPs -----------------------------------------------------------------

def test_flops_per_token_follow_palm_appendix_b():
    q = quote(LORA_8B, card_id="h200", count=1, term_s=72 * H)
    trainable, frozen = 6_815_744, 8_030_261_248 - 525_336_576  # the input embedding is a lookup
    flops = 6 * trainable + 4 * frozen + 12 * 32 * 32 * 128 * 4096
    from tunepilot.cost.mfu import estimate

    mfu = estimate("transformers", "h200-sxm-141gb", "lora", "none", False).mfu
    one = q.throughput.per_card
    assert one.basis == PROJECTED and "MFU" in one.how and "PaLM" in one.how
    assert one.value == pytest.approx(mfu * 989.4e12 / flops, rel=1e-9)
    assert term(q, "training").total.value == pytest.approx(1e9 / one.value)


def test_time_terms_follow_the_schedules():
    q = quote(LORA_8B, card_id="h200", count=1, term_s=72 * H)
    steps = math.ceil(1e9 / (2 * 4096 * 8))
    assert q.optimizer_steps == steps
    assert term(q, "validation").times == steps // 500
    assert term(q, "checkpoint writes").times == steps // 1000
    assert term(q, "provisioning").each.value == cost_model()["provisioning_s"]["value"]
    assert term(q, "set-up").each.value == cost_model()["process_setup_s"]["value"]
    assert q.job_s.value == pytest.approx(sum(t.total.value for t in q.time_terms))
    assert all(t.total.basis == PROJECTED and t.total.unit == "s" for t in q.time_terms)


def test_quote_margins_and_cost_per_million_tokens():
    q = quote(LORA_8B, card_id="h200", count=1, term_s=72 * H)
    assert q.finishes_in_term and q.margin_s == pytest.approx(72 * H - q.job_s.value)
    assert q.cost_per_million_term_usd == (Decimal(q.term.total_cents) / 100 / 1000).quantize(
        Decimal("1e-10"))
    # the shortest covering term: job x (1 + margin) rounded up to whole billed hours
    need = q.job_s.value * (1 + cost_model()["safety_margin"]["value"])
    assert q.shortest_term.term_s == math.ceil(need / H) * H
    assert q.cost_per_million_job_usd < q.cost_per_million_term_usd


def test_a_term_too_short_says_how_much_it_delivers():
    q = quote(LORA_8B, card_id="h200", count=1, term_s=10 * H)
    assert not q.finishes_in_term and q.margin_s < 0
    assert 0 < q.useful_tokens_in_term < 1e9
    assert any("short" in n for n in q.notes)


def test_cheapest_covering_term_can_be_a_discounted_longer_one():
    spec = TINY.with_changes(target={"tokens": 5e12})  # long enough to approach a week
    q = quote(spec, card_id="h100", count=1, term_s=None)
    assert q.cheapest_term.total_cents <= q.shortest_term.total_cents
    assert q.term == q.cheapest_term


def test_a_card_the_run_does_not_fit_is_refused_with_the_reason():
    full_8b = load_spec(EXAMPLES / "llama3-8b-full.yaml")  # 16 B/param of model states
    with pytest.raises(UserError, match="does not fit 1 x h100-sxm-80gb") as err:
        quote(full_8b, card_id="h100", count=1, term_s=H)
    assert "GiB" in err.value.message


def test_unknown_card_says_did_you_mean():
    with pytest.raises(UserError, match="Did you mean h200"):
        quote(LORA_8B, card_id="h2000", count=1, term_s=H)


# --- compare -----------------------------------------------------------------------------------

def test_compare_8b_lora_ranks_every_fitting_card_and_names_the_others():
    c = compare(LORA_8B)
    seen = {q.card_id for q in c.rows} | {r.card for r in c.refused}
    assert seen == {card.id for card in CAT.cards}  # all four cards appear
    assert c.refused == []  # with full checkpointing the 8B LoRA fits every card
    costs = [q.cost_per_million_term_usd for q in c.rows]
    assert costs == sorted(costs)
    assert {(q.card_id, q.count) for q in c.rows} >= {(card.id, n) for card in CAT.cards
                                                      for n in (1, 2, 4, 8)}
    assert all(q.job_s.basis == PROJECTED for q in c.rows)
    assert all(f["basis"] == PROJECTED for q in c.to_dict()["rows"]
               for f in q["throughput"].values())


def test_compare_counts_start_at_the_fewest_fsdp_needs():
    c = compare(load_spec(EXAMPLES / "llama3-8b-full.yaml"))
    h100 = {q.count: q for q in c.rows if q.card_id == "h100-sxm-80gb"}
    assert all(q.strategy == "fsdp" for q in c.rows if q.card_id.startswith("h1"))
    # FSDP needs 4 cards with the headroom asked; 2 fit tight (ranked after every run with room)
    roomy = sorted(n for n, q in h100.items() if q.tight is None)
    assert roomy == [4, 8] and all(h100[n].tight for n in h100 if n < 4)
    assert all("a rank's device peak" in h100[n].tight for n in h100 if n < 4)


# --- run directories ---------------------------------------------------------------------------

def test_measured_figures_apply_on_the_card_they_were_measured_on(tmp_path):
    run = write_run_dir(tmp_path / "run", TINY, "h100-sxm-80gb",
                        export={"bytes": 4e8, "seconds": 2.0, "bytes_per_s": 2e8})
    q = quote(TINY, card_id="h100", count=1, term_s=H, run_dir=run)
    assert q.throughput.per_card.basis == MEASURED
    assert q.throughput.per_card.value == 50_000
    assert term(q, "training").total.value == pytest.approx(1e7 / 50_000)
    assert term(q, "set-up").each.value == 120 and term(q, "set-up").each.basis == MEASURED
    assert term(q, "validation").each.value == 0.05
    # the export is the run directory's kept checkpoints (host.checkpoints_kept, default 2)
    assert term(q, "export").each.value == pytest.approx(2 * 1_896_192 / 2e8)
    assert "random weights" in term(q, "model load").each.how
    # everything but provisioning (on the rented cluster, before any stage runs) is measured
    assert [t.name for t in q.time_terms if t.total.basis == PROJECTED] == ["provisioning"]
    assert q.job_s.basis == PROJECTED


def test_a_pilot_measured_in_bf16_is_quoted_with_the_fp8_recipe_speedup(tmp_path):
    """The pilot runs an FP8 spec's bf16 stand-in (FP8 is not measured): the quote carries its
    measured throughput with the recipe's speed-up from the time model, said."""
    fp8 = LORA_8B.with_changes(precision="fp8-tensorwise")
    run = write_run_dir(tmp_path / "run", fp8, "h100-sxm-80gb")
    one = quote(fp8, card_id="h100", count=1, term_s=H, run_dir=run).throughput.per_card
    assert one.basis == PROJECTED and "fp8-tensorwise over bf16" in one.how
    assert 1.0 < one.value / 50_000 < 2.0


def test_another_card_is_projected_by_the_flops_and_bandwidth_ratios(tmp_path):
    run = write_run_dir(tmp_path / "run", TINY, "h100-sxm-80gb")
    q = quote(TINY, card_id="a100", count=1, term_s=H, run_dir=run)
    f = cost_model()["compute_bound_fraction"]["value"]
    # step time on the A100 / on the H100; the tiny spec trains in fp32 (non-tensor peaks)
    ratio = f * 67 / 19.5 + (1 - f) * 3.35 / 2.039
    one = q.throughput.per_card
    assert one.basis == PROJECTED and one.value == pytest.approx(50_000 / ratio)
    setup = term(q, "set-up").each
    assert setup.basis == PROJECTED and setup.value == 120 and "carried over" in setup.how
    assert term(q, "validation").each.value == pytest.approx(0.05 * ratio)
    assert q.job_s.basis == PROJECTED


@pytest.mark.slow
def test_scale_json_gives_measured_multi_card_throughput(tmp_path):
    run = write_run_dir(tmp_path / "run", TINY, "h100-sxm-80gb", scale={"strategies": {
        "ddp": {"nproc": 2, "efficiency": 0.9, "useful_tokens_per_s": 90_000.0}}})
    two = quote(TINY, card_id="h100", count=2, term_s=H, run_dir=run)
    assert two.throughput.total.basis == MEASURED and two.throughput.total.value == 90_000
    four = quote(TINY, card_id="h100", count=4, term_s=H, run_dir=run)
    assert four.throughput.efficiency.basis == PROJECTED
    assert four.throughput.total.value == pytest.approx(4 * 0.9 * 50_000)
    eight = quote(TINY, card_id="h200", count=8, term_s=H)  # nothing measured: assumed
    assumed = cost_model()["scaling_efficiency_assumed"]["ddp"][8]
    assert eight.throughput.efficiency.value == assumed


def test_a_cpu_pilot_carries_its_machine_timings_but_not_its_throughput(tmp_path):
    """Disk-bound timings carry over from a CPU pilot; its throughput does not (no catalog peak
    to scale by), nor its set-up: imports and tokenising on a shared, often loaded, CPU say
    nothing of a rented card's host (issue 26: 120 s of a loaded CPU were carried over)."""
    run = write_run_dir(tmp_path / "run", TINY, None)
    q = quote(TINY, card_id="h100", count=1, term_s=H, run_dir=run)
    assert q.throughput.per_card.basis == PROJECTED and "MFU" in q.throughput.per_card.how
    setup = term(q, "set-up").each
    assert setup.value == cost_model()["process_setup_s"]["value"] and setup.basis == PROJECTED
    assert "not carried" in setup.how
    assert term(q, "model load").each.value == 2
    assert "forward only" in term(q, "validation").each.how  # compute-bound: not carried from a CPU
    assert term(q, "checkpoint writes").each.value == 0.1
    export = term(q, "export").each  # no export.json: the measured size at the assumed bandwidth
    assert export.basis == PROJECTED and "0.0019 GB (measured)" in export.how
    assert any("not a catalog card" in n for n in q.notes)


def test_missing_files_and_keys_fall_back_to_projections(tmp_path):
    run = tmp_path / "run"
    write_run_dir(run, TINY, "h100-sxm-80gb")
    (run / "pilot.json").write_text(json.dumps({"spec_hash": TINY.spec_hash(), "schema_version": 2,
                                                "throughput": {"useful_tokens_per_s": "fast"}}))
    q = quote(TINY, card_id="h100", count=1, term_s=H, run_dir=run)
    assert q.job_s.basis == PROJECTED
    assert any("no restore.json" in n for n in q.notes)


def test_a_run_directory_of_another_spec_is_refused(tmp_path):
    run = write_run_dir(tmp_path / "run", TINY.with_changes(seed=1), "h100-sxm-80gb")
    with pytest.raises(UserError, match="another spec"):
        read_run_dir(run, TINY, CAT)
    with pytest.raises(UserError, match="does not exist"):
        read_run_dir(tmp_path / "nope", TINY, CAT)


def test_quote_json_marks_every_figure(tmp_path):
    d = quote(TINY, card_id="h100", count=2, term_s=H,
              run_dir=write_run_dir(tmp_path / "run", TINY, "h100-sxm-80gb")).to_dict()
    json.dumps(d)  # serialisable
    figures = [*d["throughput"].values(), d["job_s"]] + [
        f for t in d["time_terms"] for f in (t["each"], t["total"])]
    assert all(f["basis"] in (MEASURED, PROJECTED) and f["unit"] and f["how"] for f in figures)
    assert isinstance(d["term"]["total_cents"], int) and d["term"]["total_usd"].count(".") == 1


def test_the_throughput_model_is_per_implementation_card_and_setting_with_sources():
    from tunepilot.cost.mfu import estimate
    from tunepilot.cost.runs import published_runs

    assert all(r.source and r.published for r in published_runs().runs)
    h100 = estimate("transformers", "h100-sxm-80gb", "full", "none", False)
    mi300x = estimate("transformers", "mi300x-192gb", "full", "none", False)
    assert mi300x.mfu < h100.mfu and mi300x.basis_kind == "derived"  # not one MFU for all
    titan = estimate("torchtitan", "h100-sxm-80gb", "full", "none", False)
    assert titan.basis_kind == "published" and titan.mfu > h100.mfu
    assert estimate("torchtitan", "h100-sxm-80gb", "full", "full", False).mfu == \
        pytest.approx(titan.mfu * 0.75)  # recompute is HFU, not MFU
    assert estimate("torchtitan", "h100-sxm-80gb", "full", "none", True).mfu > titan.mfu
    assert estimate("torchtitan", "h100-sxm-80gb", "lora", "none", False).basis_kind == "derived"
    # torchtitan's A100 runs are of a held-out publication: its A100 cell is derived
    assert estimate("torchtitan", "a100-sxm-80gb", "full", "none", False).basis_kind == "derived"
    q = quote(LORA_8B.with_changes(model={"preset": "llama-3-8b", "implementation": "megatron"}),
              card_id="h100", count=1, term_s=72 * H)
    how = q.throughput.per_card.how
    assert "megatron x hopper x lora" in how and "published runs" in how


def test_an_hourly_option_line_says_what_it_charges():
    card = load_catalog().get("h100")
    cost = term_cost(card, 1, 2 * H, {"support": Decimal(1)})
    line = next(i for i in cost.items if i.description.startswith("support"))
    assert "2 hours charged" in line.description and "1 x 2 h" not in line.description
    assert line.amount_cents == 50


@pytest.mark.slow
def test_every_shipped_example_fits_the_count_it_names_on_some_card():
    from pathlib import Path

    from tunepilot.plan.api import make_plan
    from tunepilot.spec import load_spec

    for path in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")):
        spec = load_spec(path)
        plan = make_plan(spec, base_dir=path.parent)
        assert any(c.fits for c in plan.cards), path.name


def test_cost_per_million_is_rounded_once_for_display():
    """$6.544999 per million was shown as $6.55 (rounded to 1/100 cent, then to cents)."""
    from tunepilot.cost.quote import _cost_per_million
    from tunepilot.units import fmt_usd

    exact = _cost_per_million(6544999, 1e10)  # $65,449.99 for 10 billion useful tokens
    assert exact == Decimal("6.544999")
    assert fmt_usd(exact) == "$6.54"
