"""The time model fitted on published runs (cost/runs.py, cost/calibration.py): the held-out
split, every published run projected and the held-out error, the conversions a cell without runs
goes through, scaling efficiency by node count, and a tight fit quoted instead of refused."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import yaml

from tunepilot.catalog import load_catalog
from tunepilot.cost.assumptions import cost_model, efficiency_parts
from tunepilot.cost.calibration import (
    Setting,
    estimate_setting,
    fitted,
    measured_mfu,
    setting_of_run,
)
from tunepilot.cost.compare import compare
from tunepilot.cost.quote import quote
from tunepilot.cost.runs import published_runs
from tunepilot.plan.api import make_plan
from tunepilot.spec import load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LORA_8B = load_spec(EXAMPLES / "llama3-8b-lora.yaml")


def test_every_row_of_a_held_out_publication_is_held_out_and_never_fitted():
    from tunepilot.cost.runs import held_out, held_out_ids, held_out_publication

    runs = published_runs().runs
    held = {r.id for r in runs if held_out(r)}
    by_pub: dict[str, set[bool]] = {}
    for r in runs:
        by_pub.setdefault(r.publication, set()).add(held_out(r))
    assert all(len(v) == 1 for v in by_pub.values())  # a publication is held out whole
    assert {p for p, v in by_pub.items() if True in v} == {
        p for p in by_pub if held_out_publication(p)}
    assert 0.2 < len(held) / len(runs) < 0.5  # the rule holds out a fair share, not a handful
    fitted_ids = {i for c in fitted().cells.values() for i in c.runs}
    assert fitted_ids and not fitted_ids & held  # the fit never saw a held-out run
    assert held <= held_out_ids()
    assert len({r.id for r in runs}) == len(runs)
    assert all(r.source and r.published for r in runs)


def _factor_runs(node, where: str = "") -> list[tuple[str, list[str]]]:
    """Every ``runs:`` list in a data file's tree, with where it sits."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "runs" and isinstance(v, list):
                out.append((where, v))
            elif k == "runs" and isinstance(v, dict):
                out += [(f"{where}.runs.{c}.{n}", ids) for c, col in v.items()
                        for n, ids in col.items()]
            else:
                out += _factor_runs(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _factor_runs(v, f"{where}[{i}]")
    return out


def test_no_factor_rests_on_a_run_of_a_held_out_publication():
    """Each factor read from published runs (the card and compile factors, the node-scaling
    columns) lists them; none may be of a held-out publication, so no held-out row's error
    depends on a factor fitted on it."""
    from tunepilot.cost.runs import held_out_ids
    from tunepilot.resources import COST_MODEL_YAML, THROUGHPUT_MODEL_YAML

    f = published_runs()
    every = {r.id for r in (*f.runs, *f.excluded, *f.pairs)}
    held = held_out_ids()
    found = []
    for path in (THROUGHPUT_MODEL_YAML, COST_MODEL_YAML):
        found += _factor_runs(yaml.safe_load(path.read_text(encoding="utf-8")), path.name)
    assert len(found) >= 11  # card, compile, the eight node-scaling values, a generation
    assert any(".generations[" in where for where, _ in found)
    for where, ids in found:
        assert ids and set(ids) <= every, (where, set(ids) - every)
        assert not set(ids) & held, (where, set(ids) & held)


def test_the_factors_are_the_ratios_of_the_runs_they_list():
    """Not a copy of the data file's number: each factor recomputed from its runs' published
    throughputs."""
    from tunepilot.cost.throughput_model import throughput_model

    tps = {r.id: r.tokens_per_s_per_gpu for r in published_runs().runs}
    tm = throughput_model()
    assert tm.cards["h200"].factor == pytest.approx(tps["ml5"] / tps["ml2"], abs=0.01)
    compile_ = statistics.median([tps["tt2"] / tps["tt1"], tps["tt5"] / tps["tt4"]])
    assert tm.torch_compile.factor == pytest.approx(compile_, abs=0.005)
    peak = {c: load_catalog().get(c).peak_flops("bf16") for c in ("a100-sxm-80gb",
                                                                 "h100-sxm-80gb")}
    for g in tm.generations:  # one-card MFU ratio = tokens/s ratio x the peaks' inverse ratio
        pairs = {p.id: {c.card: c.tokens_per_s_per_gpu for c in p.cards}
                 for p in published_runs().pairs if p.id in g.runs}
        assert len(pairs) == len(g.runs)
        ratios = [t["a100-sxm-80gb"] / t["h100-sxm-80gb"] * peak["h100-sxm-80gb"]
                  / peak["a100-sxm-80gb"] for t in pairs.values()]
        assert (g.to, g.frm) == ("ampere", "hopper")
        assert g.factor == pytest.approx(statistics.median(ratios), abs=0.005)
    by = cost_model()["scaling_efficiency_by_nodes"]
    assert by["latency_bound"][8] == pytest.approx(tps["ml3"] / tps["ml2"], abs=0.002)
    assert by["amortised"][16] == pytest.approx(statistics.median(
        [tps["tt4"] / tps["tt1"], tps["tt5"] / tps["tt2"], tps["tt6"] / tps["tt3"],
         tps["dx13"] / tps["dx12"], tps["dx15"] / tps["dx14"]]), abs=0.002)


def test_every_published_run_is_projected_and_the_held_out_ones_are_scored():
    """Every published run gets a projected MFU (so tokens/s per GPU); the held-out runs of
    both precisions are scored (the benchmark prints their medians)."""
    from tunepilot.cost.runs import held_out

    errors: dict[bool, list[float]] = {False: [], True: []}
    for run in published_runs().runs:
        p = estimate_setting(setting_of_run(run))
        assert 0 < p.mfu < 1, run.id
        if held_out(run):
            errors[run.precision.startswith("fp8")].append(abs(p.mfu / measured_mfu(run) - 1))
    assert len(errors[False]) >= 15 and len(errors[True]) >= 8


def test_a_cell_without_runs_is_reached_through_named_derived_conversions():
    # no published transformers FP8 run: the bf16 cell x the FP8/bf16 ratio of fitted cells
    p = estimate_setting(Setting("transformers", "h100", "lora", "fp8-te"), one_card=True)
    assert p.kind == "derived" and [s.dimension for s in p.route.steps] == ["precision"]
    assert "megatron" in p.route.steps[0].how  # the cells the ratio comes from, named
    bf16 = estimate_setting(Setting("transformers", "h100", "lora", "bf16-mixed"), one_card=True)
    assert bf16.kind == "published" and p.mfu < bf16.mfu  # of a 2x larger peak
    # LitGPT has runs on A100 only: Hopper through the ratio of cells fitted on both
    lit = estimate_setting(Setting("litgpt", "h200", "full", "bf16-mixed"), one_card=True)
    assert [s.dimension for s in lit.route.steps] == ["group"]
    assert lit.factors["card"] == pytest.approx(1.13)  # H200 over H100 at the same peak


def test_a_card_generation_is_the_stacks_own_ratio_before_other_stacks():
    """A group the implementation has no run on: its own cells on both groups first, else its
    published same-script pair (torchtitan's A100 from fms-fsdp's), else every stack's cells."""
    from tunepilot.cost.calibration import generation_step

    tt = estimate_setting(Setting("torchtitan", "a100", "full", "bf16-mixed"), one_card=True)
    hopper = estimate_setting(Setting("torchtitan", "h100", "full", "bf16-mixed"),
                              one_card=True)
    [step] = tt.route.steps
    assert step.dimension == "group" and "fm1" in step.how and "torchtitan's own" in step.how
    assert tt.mfu == pytest.approx(hopper.mfu * 1.44, rel=0.01)
    back = generation_step("torchtitan", "hopper", "ampere")
    assert back is not None and back.factor == pytest.approx(1 / 1.44, rel=0.01)
    assert generation_step("litgpt", "hopper", "ampere") is None
    # transformers has cells on both groups: its own ratios only, never Megatron's
    step = fitted().ratio("group", "ampere", "hopper", "transformers")
    assert "megatron" not in step.how and "transformers x ampere" in step.how
    # LitGPT has neither: every implementation's fitted cells, named
    lit = fitted().ratio("group", "hopper", "ampere", "litgpt")
    assert "megatron" in lit.how and "transformers" in lit.how


def test_the_width_constant_is_its_fit_on_the_runs_not_held_out():
    """width.constant is the argmin of the fitted runs' mean |log error| on its grid, and it
    lists exactly the runs it was fitted on (every run not held out)."""
    from tunepilot.cost.calibration import fit_width_constant
    from tunepilot.cost.runs import fit_runs
    from tunepilot.cost.throughput_model import throughput_model

    w = throughput_model().width
    assert w.kind == "fitted" and w.runs == [r.id for r in fit_runs()]
    assert fit_width_constant(w.constant - 100, w.constant + 100, 10) == w.constant
    wide = estimate_setting(Setting("torchtitan", "h100", "full", "bf16-mixed", width=16384),
                            one_card=True)
    ref = estimate_setting(Setting("torchtitan", "h100", "full", "bf16-mixed", width=4096),
                           one_card=True)
    c = w.constant
    assert wide.mfu / ref.mfu == pytest.approx((1 + c / 4096) / (1 + c / 16384))
    assert ref.mfu == estimate_setting(Setting("torchtitan", "h100", "full", "bf16-mixed"),
                                       one_card=True).mfu  # no width: the reference's


def test_the_pipeline_bubble_and_fp8_attention_are_the_runs_own():
    """A published pipeline's bubble (p - 1) / (v m) and an FP8 run's attention at the BF16
    peak are factors of the run, not of a cell: torchtitan's 405B at 1F1B and interleaved."""
    from tunepilot.cost.runs import PublishedRun

    runs = {r.id: r for r in published_runs().runs}
    assert runs["tt12"].pipeline_bubble == pytest.approx(7 / 8)  # 8 stages, 8 micro-batches
    assert runs["tt13"].pipeline_bubble == pytest.approx(7 / 16)  # 2 stages per rank
    one, inter = (estimate_setting(setting_of_run(runs[i])).mfu for i in ("tt12", "tt13"))
    assert inter / one == pytest.approx((1 + 7 / 8) / (1 + 7 / 16))
    row = runs["tt12"].model_dump()
    with pytest.raises(ValueError, match="tensor x pipeline x context"):
        PublishedRun.model_validate({**row, "pipeline_parallel": 4})
    fp8 = {"implementation": "torchtitan", "family": "h100", "method": "full",
           "precision": "fp8-tensorwise"}
    none = estimate_setting(Setting(**fp8), one_card=True)
    half = estimate_setting(Setting(**fp8, attention_share=0.5), one_card=True)
    assert half.mfu == pytest.approx(none.mfu / 1.5)  # half the FLOPs at half the peak
    bf16 = {**fp8, "precision": "bf16-mixed"}
    assert estimate_setting(Setting(**bf16, attention_share=0.5), one_card=True).mfu == \
        estimate_setting(Setting(**bf16), one_card=True).mfu


def test_scaling_efficiency_by_node_count_from_published_runs():
    by = cost_model()["scaling_efficiency_by_nodes"]
    assert set(by["published"]["amortised"]) == {k for k in by["amortised"]}
    one_node = efficiency_parts("fsdp", 8, None, 8192, 989.4)[0]
    assert one_node == 0.92  # within a node: no node table
    amortised = efficiency_parts("fsdp", 16, None, 16384, 989.4)[0]
    latency = efficiency_parts("fsdp", 16, None, 8192, 989.4)[0]
    assert amortised == pytest.approx(0.92 * by["amortised"][2])
    assert latency == pytest.approx(0.92 * by["latency_bound"][2])
    # an A100 computes the same tokens 3x longer: 8,192 tokens weigh as 26,000 H100 tokens
    assert efficiency_parts("fsdp", 16, None, 8192, 312.0)[0] == amortised
    q8 = quote(LORA_8B, card_id="h100", count=8, term_s=None)
    q16 = quote(LORA_8B, card_id="h100", count=16, term_s=None)
    assert q16.throughput.efficiency.value < q8.throughput.efficiency.value
    assert "2 nodes" in q16.throughput.efficiency.how


def _tight_catalog(tmp_path: Path, spec, card: str, used: float) -> Path:
    """A user catalog whose ``card`` has just enough memory for the spec's device peak to use
    ``used`` of it (a test card, not a datasheet)."""
    peak = make_plan(spec, card_ids=[card]).cards[0].device_peak_bytes
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"cards": [{"id": card, "memory_gb": peak / used / 1e9}]}),
                    encoding="utf-8")
    return path


def test_a_tight_fit_is_quoted_with_why_and_ranked_after_runs_with_room(tmp_path):
    cat = load_catalog(_tight_catalog(tmp_path, LORA_8B, "h100", 0.95))
    q = quote(LORA_8B, card_id="h100", count=1, term_s=None, catalog=cat)  # not refused
    assert q.tight and "10% headroom" in q.tight and "ranked below" in q.tight
    assert q.throughput.total.value > 0 and q.job_cost_usd > 0
    roomy = quote(LORA_8B, card_id="h200", count=1, term_s=None, catalog=cat)
    assert roomy.tight is None
    c = compare(LORA_8B, catalog=cat)
    tight = [i for i, r in enumerate(c.rows) if r.tight]
    assert tight and min(tight) > max(i for i, r in enumerate(c.rows) if not r.tight)
    assert not any(r.card.startswith("h100") for r in c.refused)
    # with no room at all on one card, one card is left out with the reason (FSDP needs more)
    cat = load_catalog(_tight_catalog(tmp_path, LORA_8B, "h100", 1.05))
    c = compare(LORA_8B, catalog=cat)
    assert any(d.startswith("h100-sxm-80gb x 1:") for d in c.dropped)
    assert all(r.count > 1 for r in c.rows if r.card_id == "h100-sxm-80gb")


def test_a_specs_tensor_parallel_narrows_the_rank_but_keeps_the_data_parallel_cell():
    """A spec at tensor parallel 2: a rank half as wide (its MFU x the width model's ratio) on
    the data-parallel cell - the communication is cost/comms.py's term, not a model-parallel
    cell's (whose published runs hold theirs); a published layout takes that cell."""
    from tunepilot.cost.mfu import mfu_for, shape_of
    from tunepilot.spec import spec_from_dict

    card = load_catalog().get("h100")
    d = LORA_8B.model_dump(mode="json", exclude_none=True)
    tp = spec_from_dict({**d, "parallel": {"strategy": "fsdp", "devices": 8, "tensor": 2}})
    from tunepilot.model.arch import resolve_arch

    arch = resolve_arch(LORA_8B)
    assert shape_of(tp, arch)["width"] == arch.hidden_size / 2
    assert not shape_of(tp, arch)["model_parallel"]
    assert shape_of(LORA_8B, arch, layout={"tensor": 2})["model_parallel"]
    c = throughput_model_width()
    ratio = (1 + c / arch.hidden_size) / (1 + c / (arch.hidden_size / 2))
    assert mfu_for(tp, card, arch).value == pytest.approx(
        mfu_for(LORA_8B, card, arch).value * ratio, rel=1e-9)
    assert "data-parallel" in mfu_for(tp, card, arch).how


def throughput_model_width() -> float:
    from tunepilot.cost.throughput_model import throughput_model

    return throughput_model().width.constant
