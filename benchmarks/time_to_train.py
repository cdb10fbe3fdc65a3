"""Time to train: the hours `tunepilot quote` promises against published end-to-end training times
(benchmarks/data/end_to_end.yaml: MLPerf Training llama2_70b_lora time-to-train on H100, H200 and
MI300X, the HF + DeepSpeed reference implementation, answer.ai's FSDP + QLoRA wall time).

Each run is quoted as tunepilot would quote it (cost/quote.py quote: the plan's fit, the time
model's throughput, the scaling efficiency, validation passes), and the published time is
compared with the sum of the quote's time terms the publication covers (`terms` in the data
file: MLPerf counts training and its evaluations, not set-up or model load). No pilot: every
figure is projected. Printed, not asserted.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/time_to_train.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "data" / "end_to_end.yaml"


def project(row: dict) -> dict:
    from tunepilot.cost.quote import quote
    from tunepilot.spec import spec_from_dict

    spec = spec_from_dict(row["spec"], source=row["id"])
    q = quote(spec, card_id=row["card"], count=row["count"], term_s=None)
    terms = {t.name: t.total.value for t in q.time_terms}
    hours = sum(terms[name] for name in row["terms"]) / 3600
    published = row["published_hours"]
    return {"id": row["id"], "card": q.card_id, "count": row["count"],
            "precision": spec.precision, "implementation": spec.model.implementation,
            "published_hours": published, "projected_hours": hours,
            "error": hours / published - 1, "terms": row["terms"],
            "job_hours": q.job_s.value / 3600, "tokens_per_s": q.throughput.total.value,
            "tight": q.tight, "source": row["source"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    data = yaml.safe_load(DATA.read_text(encoding="utf-8"))
    from tunepilot.errors import UserError

    rows, refused = [], []
    for r in data["runs"]:
        try:
            rows.append(project(r))
        except UserError as exc:  # said, not hidden: the quote refused the published run
            refused.append({"id": r["id"], "why": str(exc)})
    med = statistics.median(abs(r["error"]) for r in rows)
    if a.json:
        print(json.dumps({"rows": rows, "median_abs_error": med, "refused": refused,
                          "not_projected": data["excluded"]}, indent=1))
        return
    print(f"{'id':4} {'card':15} {'n':>2} {'precision':10} {'implementation':12} "
          f"{'published':>9} {'projected':>9} {'error':>7}  terms compared (whole job)")
    for r in rows:
        print(f"{r['id']:4} {r['card']:15} {r['count']:>2} {r['precision']:10} "
              f"{r['implementation']:12} {r['published_hours']:>8.3f}h "
              f"{r['projected_hours']:>8.3f}h {r['error']:>+7.1%}  {' + '.join(r['terms'])} "
              f"({r['job_hours']:.2f} h with provisioning, set-up, load, saves, export)")
    for e in refused:
        print(f"{e['id']:4} refused by the quote: {e['why']}")
    print(f"\nnot projected ({len(data['excluded'])} published times):")
    for e in data["excluded"]:
        print(f"  {e['id']}: {e['why']}")
    print(f"\nmedian |error| of the hours, projected vs published: {med:.1%} over {len(rows)} "
          "runs (every figure projected: no pilot)")


if __name__ == "__main__":
    main()
