"""Published DPO / GRPO memory figures (benchmarks/data/objectives.yaml, each row with its source)
and the plan's error on each. Imported by plan_accuracy.py; run on its own it prints them:
  .venv/bin/python benchmarks/objectives_reference.py [--json]
(The GRPO / PPO step times are benchmarks/rl_steps.py's, printed by throughput_accuracy.py.)

What a row can and cannot say is in its note; rows whose settings were inferred, or that measure
another implementation, are marked and left out of the like-for-like median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import cache
from pathlib import Path

import yaml

MIB, GIB = 2**20, 2**30
DATA = Path(__file__).resolve().parent / "data" / "objectives.yaml"


@cache
def _data() -> dict:
    return yaml.safe_load(DATA.read_text(encoding="utf-8"))


def _rows(kind: str) -> list[dict]:
    return _data()[kind]


def _spec(row: dict):
    from tunepilot.model.arch import Arch, resolve_arch
    from tunepilot.spec import spec_from_dict

    d = dict(row["spec"])
    if row.get("arch"):
        d.setdefault("model", {"preset": "tiny"})  # placeholder; the arch comes from data arch:
    spec = spec_from_dict(d)
    arch = (Arch.from_config(_data()["arch"][row["arch"]]) if row.get("arch")
            else resolve_arch(spec))
    return spec, arch


def _component(row: dict) -> int:
    """The loss head alone as the plan counts it: lm_head (4096 x 128256, bf16) and its
    gradient, the hidden states and theirs, the log-prob terms at bf16 (activations.py)."""
    from tunepilot.model.arch import Arch, load_preset
    from tunepilot.plan.analytic.activations import logprob_bytes
    from tunepilot.spec import spec_from_dict

    arch = Arch.from_config(load_preset("llama-3-8b"))
    t = row["tokens"]
    if row["component"] == "grpo":
        obj = {"kind": "grpo", "num_generations": 2, "max_prompt_length": 1,
               "max_completion_length": t - 1}
        mb = row["rows"]
    else:
        obj, mb = {"kind": "orpo"}, row["rows"] // 2
    spec = spec_from_dict({"model": {"preset": "llama-3-8b"}, "precision": "bf16-true",
                           "method": {"kind": "full"}, "sequence_length": t,
                           "micro_batch_size": mb, "objective": obj})
    lp = logprob_bytes(arch, spec, 2, row["rows"])
    head = 2 * 2 * arch.hidden_size * arch.vocab_size
    hidden = 2 * 2 * row["rows"] * t * arch.hidden_size
    return head + hidden + lp["kept"] + max(lp["forward"], lp["backward"])


def memory_rows() -> list[dict]:
    from tunepilot.plan.analytic.core import analytic_plan

    out = []
    for row in _rows("memory"):
        if row.get("component"):
            planned = _component(row)
        else:
            spec, arch = _spec(row)
            plan = analytic_plan(spec, arch, "cuda")
            planned = getattr(plan.per_device, f"{row['compare']}_peak_bytes")
        out.append({"id": row["id"], "compare": row["compare"], "measured_kind":
                    row["measured_kind"], "measured_bytes": row["measured_mib"] * MIB,
                    "analytic_bytes": planned, "error": planned / (row["measured_mib"] * MIB) - 1,
                    "inferred": row.get("inferred", False), "note": row["note"],
                    "source": row["source"]})
    return out


def fit_rows() -> list[dict]:
    from tunepilot.catalog import load_catalog
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.plan.fit import fit_card

    out = []
    for row in _rows("fit"):
        spec, arch = _spec(row)
        card = load_catalog().get(row["card"])
        fit = fit_card(spec, arch, card, analytic_plan)
        out.append({"id": row["id"], "card": card.id, "published": row["published"],
                    "plan_fits": fit.fits, "device_peak_gib": fit.device_peak_bytes / GIB,
                    "max_micro_batch": fit.max_micro_batch, "note": row["note"],
                    "source": row["source"]})
    return out


def print_memory(rows: list[dict]) -> None:
    print("objectives: plan vs published peaks (GiB = 2^30 B; measured = published)")
    for r in rows:
        print(f"  {r['id']:<40} {r['compare']:<9} {r['measured_bytes'] / GIB:>7.2f} GiB "
              f"{r['analytic_bytes'] / GIB:>7.2f} GiB {r['error']:>+7.1%}"
              + ("   (inferred / another implementation)" if r["inferred"] else ""))
    like = [abs(r["error"]) for r in rows if not r["inferred"]]
    print("  median |error| like-for-like: " + (f"{statistics.median(like):.1%}" if like else
          "none: every published DPO/GRPO peak found has inferred settings or measures a "
          "component of another implementation (see each note)"))
    for r in fit_rows():
        print(f"  {r['id']:<40} {r['card']}: published {r['published']}; the plan "
              f"{'fits' if r['plan_fits'] else 'does NOT fit'} at {r['device_peak_gib']:.1f} GiB"
              f" (max micro-batch {r['max_micro_batch']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    mem = memory_rows()
    if a.json:
        print(json.dumps({"memory": mem, "fit": fit_rows()}, indent=1))
        return
    print_memory(mem)


if __name__ == "__main__":
    main()
