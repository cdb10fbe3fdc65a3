"""The RL step model (cost/rl_step.py, the quote's functions) against published RL step times
(benchmarks/data/rl_steps.yaml: NeMo-RL, verl, TRL): every row projected phase by phase, the
signed error of the step and of each published phase, and the median |error| over the rows of
held-out publications (cost/runs.py held_out_publication, the throughput rows' rule) beside the
rows the step model's constants were fitted on. Imported by throughput_accuracy.py, which prints
it after the throughput table; run alone:

    PYTHONPATH=src .venv/bin/python benchmarks/rl_steps.py [--json] [--fit]

--fit prints the fit of the step model's fitted constants (resources/step_model.yaml decode
engine_step_s / tp_allreduce_s, weight_sync colocated_gb_per_s) from the rows they list - none of
a held-out publication - as tests/test_rl_step.py recomputes them.
Printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import cache
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "data" / "rl_steps.yaml"
# the published phases the model's phases are compared with (verl's gen holds the weight sync)
SYNC_IN_GENERATION = ("verl",)


@cache
def data() -> dict:
    return yaml.safe_load(DATA.read_text(encoding="utf-8"))


def setting(row: dict):
    """(spec, arch, card) of a row."""
    from tunepilot.catalog import load_catalog
    from tunepilot.model.arch import Arch, resolve_arch
    from tunepilot.spec import spec_from_dict

    d = dict(row["spec"])
    if row.get("arch"):
        d["model"] = {**d.get("model", {}), "preset": "tiny"}  # the arch comes from `arch:`
    spec = spec_from_dict(d, source=row["id"])
    arch = (Arch.from_config(data()["arch"][row["arch"]]) if row.get("arch")
            else resolve_arch(spec))
    return spec, arch, load_catalog().get(row["card"])


def project(row: dict) -> dict:
    from tunepilot.cost.rl_step import rl_step
    from tunepilot.cost.runs import held_out_publication

    spec, arch, card = setting(row)
    strategy = spec.parallel.strategy if row["count"] > 1 else "single"
    r = rl_step(spec, arch, card, row["count"], strategy, row.get("training_parallel"))
    step = r.step.value if row["unit"] == "generation-batch" else r.per_optimizer_step_s
    phases = {k: v.value for k, v in r.phases.items()}
    if row["stack"].startswith(SYNC_IN_GENERATION):
        phases = {**phases, "generation": phases["generation"] + phases.pop("weight sync")}
    published = row.get("phases") or {}
    return {"id": row["id"], "publication": row["publication"], "stack": row["stack"],
            "held_out": held_out_publication(row["publication"]), "card": card.id,
            "count": row["count"], "unit": row["unit"], "published_s": row["published_s"],
            "projected_s": step, "error": step / row["published_s"] - 1,
            "phases": phases, "published_phases": published,
            "phase_errors": {k: phases.get(k, 0.0) / v - 1 for k, v in published.items() if v},
            "dominant": r.dominant, "layout": r.layout, "how": r.step.how,
            "source": row["source"]}


def rows() -> tuple[list[dict], list[dict]]:
    """(projected rows, not projected with why)."""
    out, refused = [], list(data().get("excluded", []))
    for row in data()["runs"]:
        try:
            out.append(project(row))
        except Exception as e:  # an architecture the plan refuses, said with its reason
            from tunepilot.errors import UserError

            if not isinstance(e, UserError | ValueError):
                raise
            refused.append({"id": row["id"], "publication": row["publication"],
                            "why": str(e).splitlines()[0][:200], "source": row["source"]})
    return out, refused


def medians(out: list[dict]) -> dict:
    res = {}
    for held in (True, False):
        errs = [abs(r["error"]) for r in out if r["held_out"] == held]
        res["held_out" if held else "fit"] = {
            "median_abs_error": statistics.median(errs) if errs else None, "runs": len(errs),
            "stacks": sorted({r["stack"].split(" ")[0] for r in out if r["held_out"] == held})}
    return res


def fit_rows() -> list[dict]:
    """The rows the fitted constants may rest on: every projectable row of a publication that
    is not held out, with its published generation and weight-sync phases."""
    from tunepilot.cost.runs import held_out_publication

    return [r for r in data()["runs"] if not held_out_publication(r["publication"])
            and "generation" in (r.get("phases") or {})
            and not r["stack"].startswith(SYNC_IN_GENERATION)]


def fit() -> dict:
    """The fitted constants from fit_rows: the engine's seconds per decode step and per
    all-reduce of a tensor-parallel engine (two per layer per step) by least squares on the
    relative error of the generation phase - the decode's fixed work is linear in them: the
    phase = its time without them + decode steps x (engine_step_s + 2 x layers x
    tp_allreduce_s) - and the colocated weight-sync rate as the median of the rows' GB per card
    / published seconds."""
    import numpy as np

    from tunepilot.cost import rollout
    from tunepilot.cost.mfu import mfu_for
    from tunepilot.cost.throughput_model import throughput_model

    a, b, ids, rates, sync_ids = [], [], [], [], []
    for row in fit_rows():
        spec, arch, card = setting(row)
        shape, eng = rollout.completion_shape(spec), rollout.engines(spec, arch, card, row["count"])
        ac = throughput_model().checkpointing.get(spec.activation_checkpointing)
        fwd = mfu_for(spec, card, arch).value / (ac.factor if ac else 1.0)
        g = rollout.generation(spec, arch, eng, shape, fwd)
        base = g.seconds - g.iterations * g.overhead_s
        pub = row["phases"]["generation"]
        tp_term = g.iterations * 2 * arch.num_layers if eng.cards_each > 1 else 0.0
        a.append([g.iterations / pub, tp_term / pub])
        b.append(1 - base / pub)
        ids.append(row["id"])
        if "weight sync" in row["phases"] and eng.backend == "vllm-colocate":
            rates.append(rollout.weight_bytes(arch, spec) / eng.cards_each / 1e9
                         / row["phases"]["weight sync"])
            sync_ids.append(row["id"])
    (step_s, tp_s), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return {"engine_step_s": max(float(step_s), 0.0), "tp_allreduce_s": max(float(tp_s), 0.0),
            "engine_runs": ids, "colocated_gb_per_s": statistics.median(rates),
            "colocated_runs": sync_ids}


def print_rows(out: list[dict], refused: list[dict]) -> None:
    print("RL steps: projected vs published step time (s; published = measured by the source; "
          "HO = held-out publication)")
    for r in out:
        pe = ", ".join(f"{k} {v:+.0%}" for k, v in r["phase_errors"].items())
        print(f"  {r['id']:<46} {'HO' if r['held_out'] else '  '} {r['count']:>3} x "
              f"{r['card']:<14} {r['published_s']:>7.1f} s {r['projected_s']:>7.1f} s "
              f"{r['error']:>+7.1%}  {r['dominant']} dominates" + (f"; phases: {pe}" if pe else ""))
    print(f"  not projected ({len(refused)}):")
    for e in refused:
        print(f"    {e['id']}: {e['why']}")
    m = medians(out)
    for k, v in m.items():
        value = v["median_abs_error"]
        print(f"  median |error| {k:9} {'-' if value is None else f'{value:.1%}':>6} over "
              f"{v['runs']} runs ({', '.join(v['stacks'])})" + (
                  " (target <= 15%)" if k == "held_out" else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fit", action="store_true", help="print the fitted constants' fit")
    a = ap.parse_args()
    if a.fit:
        print(json.dumps(fit(), indent=1))
        return
    out, refused = rows()
    if a.json:
        print(json.dumps({"rows": out, "not_projected": refused, "medians": medians(out)},
                         indent=1))
        return
    print_rows(out, refused)


if __name__ == "__main__":
    main()
