"""`tunepilot report RUN_DIR`: one self-contained HTML file (inline CSS and SVG, nothing fetched at
view time, no scripts) and a short Markdown summary, both from the run directory's JSON files.

Sections: the decision and every gate; memory per card (plan vs measured); step time and data
wait; the restore components; scaling; cost per useful token and the term's itemised cost; the
provenance manifest. A stage that did not run is shown as such, never invented.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from tunepilot.catalog import cents_to_usd
from tunepilot.figures import value_of
from tunepilot.memory.fit import DEFAULT_HEADROOM
from tunepilot.render import GIB, gib
from tunepilot.report import svg

STALL_FRACTION = 0.05  # as tunepilot.pilot.results.STALL_FRACTION (not imported: it pulls torch)
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1000px;
color:#222;line-height:1.4}
h1{font-size:1.6rem;margin-bottom:.2rem} h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;
margin-top:2rem} table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}
td,th{border:1px solid #ccc;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#f4f4f4} .num{text-align:right;font-variant-numeric:tabular-nums}
.decision{font-size:1.15rem;padding:.8rem 1rem;border-radius:6px;margin:1rem 0}
.ready{background:#e6f4ea;border:1px solid #34a853} .notready{background:#fce8e6;
border:1px solid #d93025} .passed{color:#188038;font-weight:bold} .failed{color:#d93025;
font-weight:bold} .skipped,.missing{color:#777} .reused{color:#555;font-style:italic}
.m{color:#188038} .p{color:#b06000} small{color:#555} code{background:#f4f4f4;padding:0 .2rem}
"""


def _load(run: Path, name: str) -> dict | None:
    """A stage's JSON, or None when it is missing, unreadable or not a JSON object (a report of
    a partial or damaged run directory shows that stage as missing, never a traceback)."""
    from tunepilot.errors import UserError
    from tunepilot.store import read_json

    p = run / f"{name}.json"
    if not p.exists():
        return None
    try:
        data = read_json(p)
    except UserError:
        return None
    return data if isinstance(data, dict) else None


_v = value_of


def _kind(fig) -> str:
    if isinstance(fig, dict) and fig.get("measured"):
        return '<span class="m">measured</span>'
    return '<span class="p">projected</span>'


def _table(headers: list[str], rows: list[list], num_cols: set[int] | None = None) -> str:
    num_cols = num_cols or set()
    h = "".join(f"<th>{escape(str(x))}</th>" for x in headers)
    body = ""
    for r in rows:
        cells = "".join(f'<td class="num">{c}</td>' if i in num_cols else f"<td>{c}</td>"
                        for i, c in enumerate(r))
        body += f"<tr>{cells}</tr>"
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _gib(n) -> str:
    return gib(n)


# --- sections ----------------------------------------------------------------------------------


def _decision(run: Path, dec: dict | None, manifest: dict) -> str:
    if dec is None:
        stages = ", ".join(sorted(manifest.get("stages", {}))) or "none"
        return (f'<div class="decision notready" id="decision">No decision yet: `tunepilot run` '
                f"has not finished in this directory (stages present: {escape(stages)}).</div>")
    cls = "ready" if dec.get("ready") else "notready"
    gates = _table(["stage", "verdict", "summary"], [
        [escape(g["stage"]), f'<span class="{escape(g["status"])}">{escape(g["status"])}</span>'
         + (' <span class="reused">(reused)</span>' if g.get("reused") else ""),
         escape(g["summary"])] for g in dec.get("gates", [])])
    return (f'<div class="decision {cls}" id="decision">{escape(str(dec.get("decision", "")))}'
            '</div>'
            f'<div id="gates">{gates}</div>')


def _memory(plan: dict | None, pilot: dict | None) -> str:
    if plan is None or not {"per_device", "phases", "cards"} <= set(plan):
        return '<p class="missing">No plan in this run directory.</p>'
    d = plan["per_device"]
    comps = ["weights", "master weights", "gradients", "optimizer", "activations",
             "temporaries", "allocator + runtime"]
    peak_phase = next((p for p in plan["phases"] if p["name"] == plan["peak_phase"]), None)
    at_peak = peak_phase or {}
    values = {
        "weights": at_peak.get("weights_bytes", d["weights_bytes"]) / GIB,
        "master weights": at_peak.get("master_weights_bytes", 0) / GIB,
        "gradients": at_peak.get("gradients_bytes", 0) / GIB,
        "optimizer": at_peak.get("optimizer_bytes", 0) / GIB,
        "activations": at_peak.get("activations_bytes", 0) / GIB,
        "temporaries": (at_peak.get("temporary_bytes", 0)
                        + at_peak.get("collective_buffers_bytes", 0)) / GIB,
        "allocator + runtime": (d["device_peak_bytes"] - d["allocated_peak_bytes"]) / GIB,
    }
    bars = []
    for c in plan.get("cards", []):
        cap = c["capacity_bytes"] / GIB
        bars.append({"label": f"{c['card']} ({'fits' if c['fits'] else 'does not fit'})",
                     "values": values, "projected": True,
                     "markers": [{"label": "capacity", "value": cap, "color": "#000"},
                                 {"label": "capacity less headroom", "value": cap * (1 - DEFAULT_HEADROOM),
                                  "color": "#d93025", "dash": "4 3"}]})
    chart = svg.stacked_bars(f"Device peak per card at the {plan['peak_phase']} phase "
                             f"({plan['fidelity']} plan, projected)", bars, comps)
    fit = _table(["card", "capacity", "device peak", "fits", "free", "FSDP cards",
                  "max micro-batch", "max seq len"],
                 [[escape(c["card"]), f"{c['capacity_bytes'] / 1e9:,.1f} GB",
                   _gib(c["device_peak_bytes"]), "yes" if c["fits"] else "no",
                   f"{c['headroom_fraction']:.0%}", c["devices_needed"].get("fsdp") or "-",
                   c["max_micro_batch"], c["max_sequence_length"]] for c in plan["cards"]],
                 {1, 2, 4, 5, 6, 7})
    side = ""
    if pilot and pilot.get("plan_vs_measured"):
        pvm = pilot["plan_vs_measured"]
        rows = []
        for name, c in pvm.get("components", {}).items():
            planned, meas = _v(c.get("planned")), _v(c.get("measured"))
            ratio = c.get("ratio")
            rows.append([escape(name), _gib(planned) + " " + _kind(c.get("planned")),
                         _gib(meas) + " " + _kind(c.get("measured")),
                         "-" if ratio is None else f"{_v(ratio, 0):.2f}",
                         escape(str(c.get("what", "")))])
        side = (f"<h3>Plan vs measured on this device (pilot, {escape(pvm.get('stack', ''))})"
                f"</h3>" + _table(["component", "plan", "measured", "measured / plan", "what"],
                                  rows, {1, 2, 3}))
    return chart + fit + side


def _steps(pilot: dict | None) -> str:
    if pilot is None:
        return '<p class="missing">The pilot did not run.</p>'
    per = pilot.get("per_step", {})
    wall = [x * 1000 for x in _v(per.get("wall_s"), [])]
    wait = [x * 1000 for x in _v(per.get("data_wait_s"), [])]
    st = pilot.get("step_time", {})
    marks = {k: _v(st.get(f"{k}_s")) * 1000 for k in ("p50", "p90", "p99")
             if _v(st.get(f"{k}_s")) is not None}
    hist = svg.histogram("Measured step wall time (ms, measured)", wall, marks, "ms")
    dw = pilot.get("data_wait", {})
    stalls = [i for i, (a, b) in enumerate(zip(wait, wall, strict=False))
              if b and a > STALL_FRACTION * b]
    line = svg.series("Data wait per step (ms, measured; red = stall)", wait, stalls, "ms")
    tp = pilot.get("throughput", {})
    def num(fig, fmt: str, unit: str = "") -> str:
        v = _v(fig)
        return "-" if v is None else format(v, fmt) + unit

    rows = [["step time p50 / p90 / p99",
             " / ".join(f"{v:.1f} ms" for v in marks.values()) or "-", _kind(st.get("p50_s"))],
            ["CV", num(st.get("cv"), ".3f"), _kind(st.get("cv"))],
            ["useful tokens/s", num(tp.get("useful_tokens_per_s"), ",.0f"),
             _kind(tp.get("useful_tokens_per_s"))],
            ["padded tokens/s", num(tp.get("padded_tokens_per_s"), ",.0f"),
             _kind(tp.get("padded_tokens_per_s"))],
            ["data-loader stalls", str(_v(dw.get("num_stalls"), 0)), _kind(dw.get("num_stalls"))],
            ["MFU", "-" if _v(pilot.get("mfu")) is None else f"{_v(pilot.get('mfu')):.1%}",
             escape((pilot.get("mfu") or {}).get("unavailable", "")) or _kind(pilot.get("mfu"))]]
    t = pilot.get("timings", {})
    for k in ("model_load_s", "validation_pass_s", "checkpoint_write_s"):
        if k in t:
            rows.append([k.removesuffix("_s").replace("_", " "),
                         "-" if _v(t[k]) is None else f"{_v(t[k]):.3g} s", _kind(t[k])])
    return hist + line + _table(["figure", "value", "kind"], rows, {1})


def _restore(rest: dict | None) -> str:
    if rest is None:
        return '<p class="missing">The restore proof did not run.</p>'
    rows = [[escape(c["name"]), f'<span class="{"passed" if c["passed"] else "failed"}">'
             f'{"pass" if c["passed"] else "FAIL"}</span>', escape(c.get("detail", ""))]
            for c in rest.get("components", [])]
    def fig(key: str, scale: float, fmt: str, unit: str) -> str:
        v = _v(rest.get(key))
        return "-" if v is None else f"{format(v / scale, fmt)} {unit}"

    extra = (f"<p>save {fig('save_s', 1, '.3g', 's')}, load {fig('load_s', 1, '.3g', 's')}, "
             f"checkpoint {fig('checkpoint_bytes', 2**20, ',.1f', 'MiB')} (measured)</p>")
    if rest.get("first_divergence"):
        extra += f"<p class=failed>first divergence: {escape(json.dumps(rest['first_divergence']))}</p>"
    return _table(["component", "verdict", "detail"], rows) + extra


def _scale(sc: dict | None) -> str:
    if sc is None:
        return ('<p class="missing">Scaling was not tested (one device here and no --nproc); '
                "multi-card figures in the quote are projected.</p>")
    base = sc.get("baseline", {})
    items = [{"label": "1 rank (baseline)", "value": base.get("useful_tokens_per_s") or 0}]
    rows = []
    for name, s in sc.get("strategies", {}).items():
        if not isinstance(s, dict):
            continue
        n = s.get("world_size") or s.get("nproc")
        items.append({"label": f"{name} x{n}", "value": s.get("useful_tokens_per_s") or 0})
        eff = s.get("efficiency")
        rows.append([escape(name), n, f"{s.get('useful_tokens_per_s') or 0:,.0f}",
                     "-" if eff is None else f"{eff:.2f}",
                     _gib(s.get("peak_memory_bytes_per_rank")),
                     f"{s.get('loss_max_abs_diff', '-')}", "yes" if s.get("data_order_same")
                     else "no", escape(str(s.get("status", "ok")))])
    rec = sc.get("recommendation", {})
    return (svg.bars("Useful tokens/s by strategy (measured)", items, "tokens/s")
            + _table(["strategy", "ranks", "useful tokens/s", "efficiency T_N/(N T_1)",
                      "peak memory / rank", "loss max |diff|", "same data order", "status"],
                     rows, {1, 2, 3, 4})
            + f"<p>Recommendation: <b>{escape(str(rec.get('strategy')))}</b> - "
              f"{escape(str(rec.get('reason', '')))}</p>")


def _cost(cmp: dict | None, quote: dict | None) -> str:
    if cmp is None and quote is None:
        return '<p class="missing">No quote in this run directory.</p>'
    out = ""
    if cmp:
        items = []
        for r in cmp.get("rows", [])[:16]:
            v = r.get("cost_per_million_term_usd") or r.get("cost_per_million_job_usd")
            items.append({"label": f"{r['card_id']} x{r['count']}",
                          "value": float(v or 0),  # bar length only; the text is the Decimal
                          "text": f"${v}" if v is not None else "-",
                          "projected": r.get("cost_basis") != "measured"})
        out += svg.bars("Cost per million useful tokens, cheapest covering term (USD)", items,
                        "USD/M tokens")
    if quote:
        term = quote["term"]
        rows = [[escape(i["kind"]), escape(i["description"]), escape(str(i["quantity"])),
                 escape(i["unit"]), f"${i['unit_price_usd']}", f"${cents_to_usd(i['amount_cents']):,}"]
                for i in term.get("items", [])]
        rows.append(["<b>total</b>", "", "", "", "", f"<b>${cents_to_usd(term['total_cents']):,}</b>"])
        times = [[escape(t["name"]), f"{_v(t['total'], 0) / 3600:,.3g} h", _kind(t["total"])]
                 for t in quote.get("time_terms", [])]
        out += (f"<h3>Term: {escape(quote['card_id'])} x {quote['count']} for "
                f"{term['term_s'] / 3600:,.4g} h</h3>"
                + _table(["kind", "item", "quantity", "unit", "unit price", "amount"], rows,
                         {2, 4, 5})
                + "<h3>Time the job needs</h3>" + _table(["term", "time", "kind"], times, {1}))
    return out


def _flatten(d, prefix="") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list) and len(d) > 8:
        out.append((prefix, f"[{len(d)} items]"))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _flatten(v, f"{prefix}[{i}]")
    else:
        out.append((prefix, "null" if d is None else str(d)))
    return out


def _provenance(manifest: dict) -> str:
    prov = manifest.get("provenance") or {k: v for k, v in manifest.items() if k != "spec"}
    rows = [[f"<code>{escape(k)}</code>", escape(v[:300])] for k, v in _flatten(prov)]
    return _table(["key", "value"], rows)


# --- the document ------------------------------------------------------------------------------


def build_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write RUN_DIR/report.html and RUN_DIR/report.md; return their paths."""
    from tunepilot.errors import UserError

    run = Path(run_dir)
    if not run.is_dir():
        raise UserError("RUN_DIR", f"{str(run)!r} is not a run directory.",
                        "Give the --out directory of `tunepilot run`, `pilot` or `demo`.")
    manifest = _load(run, "manifest") or {}
    dec = _load(run, "decision")
    plan, pilot, rest = _load(run, "plan"), _load(run, "pilot"), _load(run, "restore")
    sc, cmp, quote = _load(run, "scale"), _load(run, "compare"), _load(run, "quote")
    if not any((manifest, plan, pilot, rest, sc, cmp, quote)):
        raise UserError("RUN_DIR", f"{str(run)!r} holds no tunepilot results.",
                        "Run `tunepilot run SPEC --out DIR` first.")
    label = manifest.get("label") or (manifest.get("spec") or {}).get("name") or run.name
    sections = [
        ("summary", "Decision and gates", _decision(run, dec, manifest)),
        ("memory", "Memory", _memory(plan, pilot)),
        ("steps", "Step time and data loading", _steps(pilot)),
        ("restore", "Restore proof", _restore(rest)),
        ("scaling", "Scaling", _scale(sc)),
        ("cost", "Cost", _cost(cmp, quote)),
        ("provenance", "Provenance", _provenance(manifest)),
    ]
    body = "".join(f'<section id="{sid}"><h2>{escape(title)}</h2>{html}</section>'
                   for sid, title, html in sections)
    doc = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tunepilot report: '
           f"{escape(label)}</title><style>{CSS}</style></head><body><h1>tunepilot report: "
           f"{escape(label)}</h1><small>spec hash {escape(str(manifest.get('spec_hash', '?')))}; "
           f"every figure says measured (on this machine) or projected (carried by a stated rule)"
           f"; GiB = 2^30 bytes, GB = 10^9 bytes; prices are the catalog's.</small>{body}"
           "</body></html>")
    html_path = run / "report.html"
    md_path = run / "report.md"
    from tunepilot.store import atomic_write_bytes

    atomic_write_bytes(html_path, doc.encode())
    atomic_write_bytes(md_path, _markdown(label, manifest, dec, pilot, rest, sc, quote).encode())
    return html_path, md_path


def _markdown(label, manifest, dec, pilot, rest, sc, quote) -> str:
    lines = [f"## tunepilot: {label}", ""]
    if dec:
        lines += [f"**{dec['decision']}**", "", "| stage | verdict | summary |", "|---|---|---|"]
        lines += [f"| {g['stage']} | {g['status']} | {g['summary']} |" for g in dec["gates"]]
    if pilot:
        tp = _v(pilot.get("throughput", {}).get("useful_tokens_per_s"), 0)
        p50 = _v(pilot.get("step_time", {}).get("p50_s"), 0)
        lines += ["", f"- pilot on {pilot.get('device', {}).get('name', '?')}: {tp:,.0f} useful "
                  f"tokens/s, step p50 {p50 * 1000:.1f} ms (measured)"]
    if rest:
        lines.append(f"- restore: {'passed' if rest.get('passed') else 'FAILED'} "
                     f"({len(rest.get('components', []))} components)")
    if sc:
        rec = sc.get("recommendation", {})
        lines.append(f"- scale: use {rec.get('strategy')} - {rec.get('reason', '')}")
    if quote:
        lines.append(f"- term: {quote['card_id']} x {quote['count']}, "
                     f"${quote['term']['total_usd']} ({quote.get('cost_basis', 'projected')} time)")
    lines += ["", f"spec hash `{manifest.get('spec_hash', '?')}`; full report: report.html", ""]
    return "\n".join(lines)
