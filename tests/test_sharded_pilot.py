"""The sharded pilot (pilot/ranks.py): a spec whose single-device plan exceeds --memory-limit but
whose per-rank FSDP plan fits is piloted on its 4 ranks under torchrun (gloo on the CPU), every
rank measured against the per-rank plan; `tunepilot run` of it goes through the pilot, the
restore proof at the pilot's ranks (sharded DCP) and the scaling test, and the report shows
every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunepilot.errors import UserError
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult, PlanVsMeasured, Residual
from tunepilot.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "llama-mini-fsdp4.yaml"
LIMIT = 96 * 2**20  # the example's --memory-limit (96MiB)
EXE = Path(sys.executable).with_name("tunepilot")
PLAN_TOLERANCE = 0.10  # each rank's measured peak within +-10% of the per-rank plan


def _doc(peak: int, planned: int, p50: float, wall: list[float], useful: list[int],
         fits: bool = True) -> PilotResult:
    d = PilotResult(fits=fits, verdict="fits at micro_batch=1, seq=128")
    d.plan_vs_measured = PlanVsMeasured(
        plan_fidelity="analytic", stack="cpu", peak_phase="backward", note="", components={
            "allocated_peak": Residual(planned=Figure.projected(planned, "bytes", "plan"),
                                       measured=Figure.measured(peak, "bytes"),
                                       what="tracked tensor peak",
                                       ratio=Figure.measured(peak / planned, "ratio"))})
    d.step_time.p50_s = Figure.measured(p50, "s")
    d.per_step.wall_s = Figure.measured(wall, "s")
    d.per_step.useful_tokens = Figure.measured(useful, "tokens")
    d.per_step.padded_tokens = Figure.measured(useful, "tokens")
    return d


def test_the_slowest_rank_sets_the_time_the_largest_the_memory_and_every_rank_is_listed():
    from tunepilot.pilot.ranks import merge_ranks

    docs = {0: _doc(100, 100, 1.0, [1.0, 1.0], [10, 10]),
            1: _doc(120, 100, 1.5, [1.5, 1.5], [10, 10])}
    docs[0].notes, docs[1].notes = ["rank 0 note"], ["rank 1 note"]
    out = merge_ranks(docs, 2)
    assert out.world_size == 2 and [r.rank for r in out.ranks] == [0, 1]
    assert [r.allocated_peak_bytes.value for r in out.ranks] == [100, 120]
    assert out.ranks[1].plan_ratio.value == pytest.approx(1.2)
    assert out.step_time.p50_s.value == 1.5  # rank 1 is the slowest
    assert "rank 1 note" in out.notes  # and the largest: its memory figures
    # 40 useful tokens over the slowest rank's 3 s, per device of 2
    assert out.throughput.useful_tokens_per_s.value == pytest.approx(40 / 3.0 / 2)
    assert "on each of 2 FSDP ranks" in out.verdict


def test_a_rank_out_of_memory_makes_the_pilot_not_fit_and_names_the_stopped_ranks():
    from tunepilot.pilot.ranks import merge_ranks
    from tunepilot.results.pilot import DoesNotFit

    bad = _doc(100, 100, 1.0, [], [], fits=False)
    bad.does_not_fit = DoesNotFit(micro_batch_size=1, sequence_length=128, phase="warm-up step "
                                  "1", simulated=True, error="simulated", message="does not fit")
    out = merge_ranks({1: bad}, 3)
    assert not out.fits and "rank 1 of 3" in out.verdict
    assert [r.fits for r in out.ranks] == [False, False, False]
    assert "stopped" in out.ranks[0].error and "ranks [0, 2] were stopped" in out.notes[-1]


def test_an_fsdp_spec_pilots_its_ranks_and_a_single_one_device():
    from tunepilot.pilot.runner import pilot_ranks
    from tunepilot.pilot.session import PilotOptions

    fsdp = load_spec(SPEC)
    cpu = PilotOptions(device="cpu")
    assert pilot_ranks(fsdp, cpu) == 4
    assert pilot_ranks(fsdp.with_changes(parallel={"strategy": "single"}), cpu) == 1
    ddp = spec_from_dict({"model": {"preset": "tiny"}, "parallel": {"strategy": "ddp",
                                                                    "devices": 2}})
    assert pilot_ranks(ddp, cpu) == 1  # DDP replicates: one device's step is the measure
    with pytest.raises(UserError) as err:
        pilot_ranks(fsdp, PilotOptions(device="cpu", find_max_batch=True))
    assert err.value.field == "--find-max-batch"


def _plans() -> dict[int, int]:
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan

    spec = load_spec(SPEC)
    arch = resolve_arch(spec, SPEC.parent)
    one = spec.with_changes(parallel={"strategy": "single", "devices": 1})
    return {n: analytic_plan(s, arch, "cpu").per_device.allocated_peak_bytes
            for n, s in ((1, one), (4, spec))}


@pytest.mark.slow
def test_four_cpu_ranks_each_under_the_limit_and_within_ten_percent_of_the_plan(tmp_path):
    plans = _plans()
    assert plans[1] > LIMIT > plans[4]  # one device's plan does not fit, one rank's does
    proc = subprocess.run([str(EXE), "pilot", str(SPEC), "--memory-limit", "96MiB", "--steps",
                           "3", "--out", str(tmp_path / "run"), "--json"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout)
    assert d["fits"] and d["world_size"] == 4 and [r["rank"] for r in d["ranks"]] == [0, 1, 2, 3]
    for r in d["ranks"]:
        peak, planned = r["allocated_peak_bytes"]["value"], r["planned_allocated_peak_bytes"]
        assert r["allocated_peak_bytes"]["basis"] == "measured" and planned["basis"] == "projected"
        assert peak < LIMIT and r["tracked_peak_bytes"]["value"] <= LIMIT
        assert abs(peak / planned["value"] - 1) <= PLAN_TOLERANCE, r
        assert planned["value"] == plans[4]
        assert r["step_time_median_s"]["value"] > 0
    assert not (tmp_path / "run" / "checkpoints" / ".pilot-probe-sharded").exists()


@pytest.mark.slow
def test_run_goes_through_pilot_sharded_restore_and_scale_and_reports_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([str(EXE), "run", str(SPEC), "--memory-limit", "96MiB", "--no-trace",
                           "--pilot-max-steps", "3", "--scale-steps", "2", "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gates = {g["stage"]: g for g in json.loads(proc.stdout)["gates"]}
    assert {"pilot", "restore", "scale"} <= gates.keys()
    assert gates["restore"]["status"] == "passed" and gates["scale"]["status"] != "skipped"
    assert "4 FSDP ranks" in gates["pilot"]["summary"]
    restore = json.loads((out / "restore.json").read_text())
    assert restore["passed"] and restore["nproc"] == 4 and restore["checkpoint"]["world_size"] == 4
    scale = json.loads((out / "scale.json").read_text())
    assert scale["global_batch"]["baseline_world_size"] > 1  # one device's plan does not fit
    assert scale["strategies"]["ddp"]["status"] == "does_not_fit"
    for stage in ("pilot", "restore", "scale"):  # each stage in a process of its own
        assert (out / "logs" / f"{stage}-stage.log").exists(), stage
    html = (out / "report.html").read_text()
    assert "Every rank of the sharded pilot (4 FSDP ranks)" in html
    md = (out / "report.md").read_text()
    assert all(f"rank {r}: allocated peak" in md for r in range(4))
