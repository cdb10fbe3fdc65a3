"""Projected tokens/s per GPU (the quote's throughput model) against published training
throughputs: shared/reference/published_throughput.csv, one line per row and the median error.

projected per GPU = MFU(implementation, card, method, checkpointing, compile) x dense peak /
FLOPs per token x scaling efficiency at the row's GPU count (the quote's own functions:
cost/mfu.py, model/flops.py, cost_model.yaml). Rows the model was built from are marked
"in-sample" (their error only checks the arithmetic). p8 is torchtune's padded baseline: its
tokens/s counts the real tokens of padded Alpaca batches, and without the dataset the model
assumes no padding (with `data:` in the spec the quote applies the profile's useful fraction).
Printed, not asserted.
Run:  .venv/bin/python benchmarks/throughput_accuracy.py [--json]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = next(p for p in (HERE.parent / "shared" / "reference",
                             HERE.parent.parent / "shared" / "reference",
                             HERE.parents[2] / "shared" / "reference") if p.exists())
AC = {"none": "none", "full": "full", "selective": "selective", "selective-op": "selective-op",
      "selective-layer": "selective"}  # the spec's closest setting (the model keeps the row's)


def project(row: dict) -> dict:
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.mfu import _scaling, estimate, throughput_model
    from tunepilot.model.arch import Arch, load_preset
    from tunepilot.model.flops import flops_per_token, peak_precision
    from tunepilot.spec import spec_from_dict

    card = load_catalog().get(row["card"])
    spec = spec_from_dict({
        "model": {"preset": row["model_preset"], "implementation": row["implementation"]},
        "method": {"kind": row["method"]}, "precision": row["precision"],
        "sequence_length": int(row["sequence_length"]),
        "micro_batch_size": int(row["micro_batch_size"]),
        "activation_checkpointing": AC[row["activation_checkpointing"]],
        "torch_compile": row["torch_compile"] == "true"})
    arch = Arch.from_config(load_preset(row["model_preset"]))
    e = estimate(row["implementation"], card.id, row["method"], row["activation_checkpointing"],
                 row["torch_compile"] == "true")
    peak = card.peak_flops(peak_precision(spec))
    fpt = flops_per_token(arch, spec).train
    count = int(row["count"])
    eff = _scaling(row["strategy"], count)
    projected = e.mfu * peak / fpt * eff
    published = float(row["published_tokens_per_s_per_gpu"])
    import re

    text = throughput_model().model_dump_json()  # every source the model cites
    in_sample = re.search(rf"\b{row['id']}\b", text) is not None
    return {"id": row["id"], "implementation": row["implementation"],
            "model": row["model_preset"], "card": card.id, "count": count,
            "ac": row["activation_checkpointing"], "compile": row["torch_compile"],
            "published": published, "projected": projected,
            "error": projected / published - 1, "mfu": e.mfu, "kind": e.basis_kind,
            "in_sample": in_sample}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with open(REFERENCE / "published_throughput.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = [project(r) for r in rows]
    from objectives_reference import print_steps, step_rows

    steps = step_rows()  # GRPO step times: benchmarks/objectives_reference.py
    if a.json:
        print(json.dumps({"rows": out, "objectives": steps}, indent=1))
        return
    print(f"{'id':4} {'implementation':12} {'model':14} {'card':14} {'n':>3} {'ac':15} "
          f"{'cmp':5} {'published':>10} {'projected':>10} {'error':>7}  basis")
    for r in out:
        print(f"{r['id']:4} {r['implementation']:12} {r['model']:14} {r['card']:14} "
              f"{r['count']:>3} {r['ac']:15} {r['compile']:5} {r['published']:>10,.0f} "
              f"{r['projected']:>10,.0f} {r['error']:>+7.1%}  {r['kind']}"
              + (" (in-sample)" if r["in_sample"] else ""))
    errs = [abs(r["error"]) for r in out]
    oos = [abs(r["error"]) for r in out if not r["in_sample"]]
    print(f"median |error|: {statistics.median(errs):.1%} over {len(errs)} rows; "
          f"{statistics.median(oos):.1%} over the {len(oos)} rows the model was not built from "
          "(target <= 15% on rows not seen); tokens/s per GPU, projected vs published")
    print_steps(steps)


if __name__ == "__main__":
    main()
