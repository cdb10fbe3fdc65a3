"""Projected tokens/s per GPU (the quote's time model) against published training throughputs:
every run of src/tunepilot/resources/throughput_runs.yaml, one line each, and the median |error|
on the runs of held-out publications - bf16 and FP8 apart - beside the error on the runs the
model was fit on.

projected per GPU = MFU (cost/calibration.py estimate_setting: the run's cell, fitted on the runs
of the publications not held out, x its checkpointing, compile, card, scaling, width, pipeline
bubble and FP8-attention factors) x the
card's dense peak at the run's precision / FLOPs per token (model/flops.py) - the functions the
quote uses. Every run is projected (no refusals; a run whose cell has no fitted run goes through
the conversions the quote would use). Held out by publication: every row of a publication whose
name's sha256 is 0 modulo 3 (cost/runs.py held_out_publication), fixed before any fit; no factor
rests on one of their rows (tests/test_time_model.py). --splits also refits with the rule's
other two residues held out (the cells and the width constant) and prints their medians. Published rows the model cannot project
(cards outside the catalog, models that are not presets) are listed after the table with why.
Printed, not asserted.

After the table, the RL step rows (benchmarks/rl_steps.py: published GRPO / PPO step times against
the RL step model) with their own held-out median.

--fit-width refits the width model's constant (throughput_model.yaml width) on the runs not
held out and prints it.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/throughput_accuracy.py [--json] [--splits]
      [--fit-width]
"""

from __future__ import annotations

import argparse
import json
import statistics


def project(run) -> dict:
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.calibration import estimate_setting, setting_of_run
    from tunepilot.cost.runs import held_out, run_spec
    from tunepilot.model.arch import Arch, load_preset
    from tunepilot.model.flops import positions_per_s_at

    spec = run_spec(run)
    arch = Arch.from_config(load_preset(run.model))
    card = load_catalog().get(run.card)
    p = estimate_setting(setting_of_run(run))
    peak = card.peak_flops(spec.precision.peak_key)
    projected = positions_per_s_at(arch, spec, p.mfu, run.sequence_length, peak)
    projected, offload = _with_offload(run, spec, arch, card, projected)
    published = run.tokens_per_s_per_gpu
    return {"id": run.id, "held_out": held_out(run), "publication": run.publication,
            "implementation": run.implementation,
            "model": run.model, "method": run.method, "precision": run.precision,
            "card": card.id, "count": run.count, "published": published,
            "projected": projected, "error": projected / published - 1, "mfu": p.mfu,
            "cell": p.route.cell.label, "conversions": [s.how for s in p.route.steps],
            "kind": p.kind, "offload": offload, "source": run.source}


def _with_offload(run, spec, arch, card, projected: float) -> tuple[float, str | None]:
    """A run with CPU offload steps its optimizer on the host (cost/comms.py offload_s, the
    quote's term): its seconds added to each rank's step."""
    from tunepilot.cost.comms import offload_s
    from tunepilot.model.arch import param_counts

    if not run.cpu_offload:
        return projected, None
    trainable = param_counts(arch).total if run.method == "full" else 0
    extra, how = offload_s(spec, trainable, run.count, card)
    per_rank_step = run.global_batch_size * run.sequence_length / run.count
    return per_rank_step / (per_rank_step / projected + extra), how


def medians(rows: list[dict]) -> dict:
    from tunepilot.spec.precision import Precision

    out = {}
    for held in (True, False):
        for fp8 in (False, True):
            errs = [abs(r["error"]) for r in rows
                    if r["held_out"] == held and Precision(r["precision"]).is_fp8 == fp8]
            key = f"{'held_out' if held else 'fit'}_{'fp8' if fp8 else 'bf16'}"
            out[key] = {"median_abs_error": statistics.median(errs) if errs else None,
                        "runs": len(errs)}
    return out


def all_rows() -> list[dict]:
    from tunepilot.cost.runs import published_runs

    return [project(r) for r in published_runs().runs]


def other_splits() -> dict:
    """The same rule with its other two residues held out, refitted: the cells and the width
    model's constant on each split's runs. The factors of the data files (card, compile, card
    generation, node scaling) stay as they are: under another split some of them rest on rows
    it holds out, so these medians are better than a split refitted in full would score."""
    from tunepilot.cost import calibration, runs

    out, original = {}, runs.HELD_OUT_RESIDUE
    try:
        for residue in range(1, runs.HELD_OUT_MODULUS):
            runs.HELD_OUT_RESIDUE = residue
            calibration.WIDTH_CONSTANT = None
            calibration.refit()
            calibration.WIDTH_CONSTANT = calibration.fit_width_constant()
            calibration.refit()
            m = medians(all_rows())
            out[f"residue {residue}"] = {k: v for k, v in m.items() if k.startswith("held_out")}
            out[f"residue {residue}"]["width_constant"] = calibration.WIDTH_CONSTANT
    finally:
        runs.HELD_OUT_RESIDUE = original
        calibration.WIDTH_CONSTANT = None
        calibration.refit()
    return out


def _print(rows: list[dict], excluded, m: dict, splits: dict | None) -> None:
    print(f"{'id':5} {'':3} {'implementation':12} {'model':14} {'method':6} {'precision':14} "
          f"{'card':15} {'n':>5} {'published':>9} {'projected':>9} {'error':>7}  cell (kind)")
    for r in rows:
        print(f"{r['id']:5} {'HO' if r['held_out'] else '':3} {r['implementation']:12} "
              f"{r['model']:14} {r['method']:6} {r['precision']:14} {r['card']:15} "
              f"{r['count']:>5} {r['published']:>9,.0f} {r['projected']:>9,.0f} "
              f"{r['error']:>+7.1%}  {r['cell']} ({r['kind']})")
    print(f"\nnot projected ({len(excluded)} published rows):")
    for e in excluded:
        print(f"  {e.id}: {e.why}")
    print("\nmedian |error| of tokens/s per GPU, projected vs published (HO = a held-out "
          "publication's run; target <= 10% on held-out runs):")
    for key, v in m.items():
        value = v["median_abs_error"]
        print(f"  {key:14} {'-' if value is None else f'{value:.1%}':>6} over {v['runs']} runs")
    for name, s in (splits or {}).items():
        print(f"  held out {name}: " + ", ".join(
            f"{k.removeprefix('held_out_')} {v['median_abs_error']:.1%} ({v['runs']})"
            for k, v in s.items() if k.startswith("held_out"))
            + f" (width constant refitted: {s['width_constant']:g})")


def main() -> None:
    from tunepilot.cost.runs import published_runs

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--splits", action="store_true",
                    help="also refit with the rule's two other offsets and print their medians")
    ap.add_argument("--fit-width", action="store_true",
                    help="print the width model's constant fitted on the runs not held out "
                         "(throughput_model.yaml width.constant) and exit")
    a = ap.parse_args()
    if a.fit_width:
        from tunepilot.cost.calibration import fit_error, fit_width_constant

        c = fit_width_constant()
        print(json.dumps({"constant": c, "mean_abs_log_error": fit_error(c)}))
        return
    rows = all_rows()
    m = medians(rows)
    splits = other_splits() if a.splits else None
    excluded = published_runs().excluded
    import rl_steps  # the RL step rows: benchmarks/rl_steps.py

    rl, rl_refused = rl_steps.rows()
    if a.json:
        print(json.dumps({"rows": rows, "medians": m, "other_splits": splits,
                          "not_projected": [e.model_dump() for e in excluded],
                          "rl_steps": {"rows": rl, "not_projected": rl_refused,
                                       "medians": rl_steps.medians(rl)}}, indent=1))
        return
    _print(rows, excluded, m, splits)
    print()
    rl_steps.print_rows(rl, rl_refused)


if __name__ == "__main__":
    main()
