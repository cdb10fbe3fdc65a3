"""`tunepilot report RUN_DIR`: one self-contained HTML file (inline CSS and SVG, nothing fetched at
view time, no scripts) and a short Markdown summary, both from the run directory's results.

Sections: the decision and every gate; memory per card (plan vs measured); step time and data
wait; the dataset profile (when `tunepilot data` ran); the restore components; scaling; cost per
useful token and the term's itemised cost; the provenance manifest (folded). A stage that did not
run is shown as such, never invented. The page comes from Jinja templates with autoescape
(report/templates); the charts' geometry from report/charts.py.
"""

from __future__ import annotations

from pathlib import Path

from markupsafe import Markup, escape

from tunepilot.report import charts
from tunepilot.results.data import DataProfile
from tunepilot.results.decision import Decision
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult
from tunepilot.results.plan import MemoryPlan
from tunepilot.results.quote import Comparison, Quote
from tunepilot.results.restore import RestoreResult
from tunepilot.results.scale import ScalingResult
from tunepilot.store import RunDir
from tunepilot.units import GIB, MIB, fmt_bytes, fmt_cents, fmt_number, fmt_seconds, fmt_usd

STALL_FRACTION = 0.05  # as tunepilot.pilot.assemble.STALL_FRACTION (not imported: it pulls torch)
TEMPLATES = Path(__file__).resolve().parent / "templates"


def _basis(f: Figure | None) -> Markup:
    if f is None or f.basis == "not measured":
        return Markup('<span class="missing">not measured</span>')
    cls = "m" if f.basis == "measured" else "p"
    return Markup(f'<span class="{cls}">{escape(f.basis)}</span>')


def _fig(f: Figure | None) -> str:
    from tunepilot.views.common import fig

    return fig(f)


# --- sections ----------------------------------------------------------------------------------


def _gates(dec: Decision) -> list[list]:
    return [[g.stage, Markup(f'<span class="{escape(g.status)}">{escape(g.status)}</span>')
             + (Markup(' <span class="reused">(reused)</span>') if g.reused else ""), g.summary]
            for g in dec.gates]


def _memory(plan: MemoryPlan | None, pilot: PilotResult | None) -> dict | None:
    measured = _measured_memory(pilot)
    if plan is None:
        return {"charts": [], "fit_rows": [], "pvm_rows": [], "measured_rows": measured,
                "note": "What the run measured (this directory holds no plan: `tunepilot "
                        "plan SPEC` projects one)."} \
            if measured else None
    d = plan.per_device
    state = _state_at_peak(plan)
    peaks = {c.card: c.device_peak_bytes for c in plan.cards} or {"plan": d.device_peak_bytes}
    unit, scale = ("GiB", GIB) if max(peaks.values()) >= GIB else ("MiB", MIB)
    # one figure, one source: each bar is its card's device peak as the fit table states it;
    # the training state is the plan's, the rest is that card's allocator reserve and runtime
    bars = [{"label": f"{c.card} ({'fits' if c.fits else 'does not fit'})",
             "values": {**state, RUNTIME: max(c.device_peak_bytes - sum(state.values()), 0)},
             "total_text": fmt_bytes(c.device_peak_bytes), "projected": True, "markers": [
                 {"label": "capacity", "value": c.capacity_bytes, "color": "#000"},
                 {"label": f"capacity less {c.headroom_asked:.0%} headroom",
                  "value": c.capacity_bytes * (1 - c.headroom_asked), "color": "#d93025",
                  "dash": "4 3"}]} for c in plan.cards]
    chart = charts.stacked_bars(f"Device peak per card at the {plan.peak_phase} phase "
                                f"({plan.fidelity} plan, projected; the fit table's figures; "
                                "ticks: capacity solid, less headroom dashed)", bars,
                                [*state, RUNTIME], unit, scale)
    out = {"charts": [chart, *_state_chart(state, d.device_peak_bytes)],
           "measured_rows": measured, "note": None,
           "fit_headers": ["card", "capacity", "device peak", "fits", "free", "FSDP cards",
                           "max micro-batch", "max seq len"],
           "fit_rows": [[c.card, fmt_bytes(c.capacity_bytes, decimal=True),
                         fmt_bytes(c.device_peak_bytes), "yes" if c.fits else "no",
                         f"{c.headroom_fraction:.0%}", c.devices_needed.fsdp or "-",
                         fmt_number(c.max_micro_batch), fmt_number(c.max_sequence_length)]
                        for c in plan.cards], "fit_num": (1, 2, 4, 5, 6, 7),
           "fit_explain": "capacity: what the device reports (sold in GB = 10^9 bytes); device "
                          "peak: allocator reserve + runtime context, workspaces and collective "
                          "buffers (projected); free: capacity not used at the peak; FSDP cards: "
                          "the fewest ranks whose shards fit; max micro-batch / seq len: the "
                          "largest that fit with the headroom.",
           "pvm_rows": [], "pvm_stack": ""}
    if pilot and pilot.plan_vs_measured:
        pvm = pilot.plan_vs_measured
        out["pvm_stack"] = pvm.stack
        out["pvm_rows"] = [[name, Markup(f"{escape(_fig(c.planned))} ") + _basis(c.planned),
                            Markup(f"{escape(_fig(c.measured))} ") + _basis(c.measured),
                            "-" if c.ratio is None or c.ratio.value is None
                            else f"{c.ratio.value:.2f}", c.what]
                           for name, c in pvm.components.items()]
    return out


RUNTIME_DOMINATES = 0.5  # allocator + runtime above this share of the peak: chart the rest too
RUNTIME = "allocator + runtime"
WORKSPACES = "workspaces (cuBLAS)"


def _state_at_peak(plan: MemoryPlan) -> dict[str, int]:
    """What the step holds at its peak phase, by component, summing to the allocated peak: the
    library workspaces (cuBLAS's, in allocated, in no component) are a part of their own."""
    d = plan.per_device
    if plan.peak_phase == "model-load":
        return {"model load": d.load_peak_bytes}
    at = plan.phase(plan.peak_phase) or plan.phases[0]
    state = {"weights": at.weights_bytes, "master weights": at.master_weights_bytes,
             "gradients": at.gradients_bytes, "optimizer": at.optimizer_bytes,
             "activations": at.activations_bytes,
             "temporaries": at.temporary_bytes + at.collective_buffers_bytes}
    state[WORKSPACES] = max(d.allocated_peak_bytes - sum(state.values()), 0)
    return state


def _state_chart(state: dict[str, int], peak: int) -> list:
    """A small model's peak is mostly the runtime (CUDA context, workspaces): its training state
    is then charted again on its own scale, so what the run itself holds can be read."""
    state = {k: v for k, v in state.items() if k != WORKSPACES}
    total = sum(state.values())
    runtime = peak - total
    if not peak or runtime <= RUNTIME_DOMINATES * peak or total <= 0:
        return []
    unit, scale = next(((u, n) for u, n in (("GiB", GIB), ("MiB", MIB)) if total >= n),
                       ("KiB", 1024))
    return [charts.stacked_bars(
        f"The training state alone ({fmt_bytes(total)} of the {fmt_bytes(peak)} peak; "
        f"workspaces, allocator and runtime are the other {runtime / peak:.0%}), projected",
        [{"label": "training state", "values": state, "projected": True, "markers": [],
          "total_text": fmt_bytes(total)}], list(state), unit, scale)]


def _ranks(pilot: PilotResult | None) -> dict | None:
    """A sharded pilot: every rank's measured peaks and step time beside its plan."""
    if pilot is None or not pilot.ranks:
        return None
    rows = []
    for r in pilot.ranks:
        ratio = r.plan_ratio.value
        rows.append([r.rank, Markup(f"{escape(_fig(r.allocated_peak_bytes))} ")
                     + _basis(r.allocated_peak_bytes),
                     Markup(f"{escape(_fig(r.planned_allocated_peak_bytes))} ")
                     + _basis(r.planned_allocated_peak_bytes),
                     "-" if ratio is None else f"{ratio:.3f}", _fig(r.reserved_peak_bytes),
                     _fig(r.device_peak_bytes), _fig(r.step_time_median_s),
                     "fits" if r.fits else (r.error or "does not fit")])
    return {"world_size": pilot.world_size, "rows": rows}


def _measured_memory(pilot: PilotResult | None) -> list[list]:
    """Every memory figure the pilot (or a callback, or watch) measured, with its basis."""
    if pilot is None:
        return []
    m = pilot.memory
    rows = [("device peak (NVML/amdsmi, device-wide)", m.device.peak_bytes),
            ("device baseline before the run", m.device.baseline_bytes),
            ("allocator peak allocated", m.allocator.peak_allocated_bytes),
            ("allocator peak reserved", m.allocator.peak_reserved_bytes),
            ("process peak RSS (host memory)", m.process.peak_rss_bytes),
            ("RSS growth over the run", m.process.rss_growth_bytes),
            ("device memory (capacity)", pilot.device.memory)]
    return [[name, fmt_bytes(f.value), _basis(f), f.how or ""] for name, f in rows
            if f is not None and f.value is not None]


def _steps(pilot: PilotResult | None) -> dict | None:
    if pilot is None:
        return None
    wall = [x * 1000 for x in pilot.per_step.wall_s.value or []]
    wait = [x * 1000 for x in pilot.per_step.data_wait_s.value or []]
    st, tp, dw = pilot.step_time, pilot.throughput, pilot.data_wait
    marks = {k: getattr(st, f"{k}_s").value * 1000 for k in ("p50", "p90", "p99")
             if getattr(st, f"{k}_s").value is not None}
    stalls = [i for i, (a, b) in enumerate(zip(wait, wall, strict=False))
              if b and a > STALL_FRACTION * b]
    rows = [["step time p50 / p90 / p99",
             " / ".join(fmt_seconds(v / 1000) for v in marks.values()) or "-",
             _basis(st.p50_s)],
            ["CV (std / mean)", "-" if st.cv.value is None else f"{st.cv.value:.1%}",
             _basis(st.cv)],
            ["useful tokens/s", _fig(tp.useful_tokens_per_s), _basis(tp.useful_tokens_per_s)],
            ["padded tokens/s", _fig(tp.padded_tokens_per_s), _basis(tp.padded_tokens_per_s)],
            ["data-loader stalls", _fig(dw.num_stalls), _basis(dw.num_stalls)],
            ["MFU", "-" if pilot.mfu.value is None else f"{pilot.mfu.value:.1%}",
             Markup(escape(pilot.mfu.how or "")) if pilot.mfu.value is None
             else _basis(pilot.mfu)]]
    t = pilot.timings
    for name, f in (("model load", t.model_load_s), ("validation pass", t.validation_pass_s),
                    ("checkpoint write", t.checkpoint_write_s)):
        rows.append([name, _fig(f), _basis(f)])
    if pilot.steps.confidence:
        rows.append(["confidence", pilot.steps.confidence, _basis(pilot.steps.ci95_relative)])
    return {"histogram": charts.histogram("Measured step wall time (ms, measured)", wall, marks,
                                          "ms", "wall time of one optimizer step (ms)"),
            "waits": charts.series("Data wait per step (ms, measured; red = stall)", wait,
                                   stalls, "ms", "data wait"),
            "rows": rows}


def _data(profile: DataProfile | None) -> dict | None:
    if profile is None:
        return None
    hist = [(b.lo, b.hi, b.count) for b in profile.length.histogram]
    chart = charts.binned(f"Sample lengths ({profile.samples:,} samples, tokens; the line is "
                          "the spec's sequence length)", hist,
                          {"sequence_length": profile.sequence_length}, "tokens",
                          "tokens per sample (chat template applied)", "samples")
    L = profile.length
    rows = [["samples", fmt_number(profile.samples)],
            ["tokens in all / supervised", f"{_fig(profile.tokens_total)} / "
                                           f"{_fig(profile.tokens_supervised)}"],
            ["length p50 / p90 / p99 / max", f"{L.p50} / {L.p90} / {L.p99} / {L.max} tokens"],
            ["truncated at the sequence length", fmt_number(profile.truncated_samples)],
            ["padding (padded batches / packed)",
             f"{_fig(profile.padded.padding_fraction)} / {_fig(profile.packed.padding_fraction)}"],
            ["steps per epoch (padded / packed)",
             f"{profile.padded.steps_per_epoch:,} / {profile.packed.steps_per_epoch:,}"]]
    return {"chart": chart, "rows": rows}


def _restore(rest: RestoreResult | None) -> dict | None:
    if rest is None:
        return None
    per_rank = any(c.rank is not None for c in rest.components)
    headers = ["component"] + (["rank"] if per_rank else []) + ["verdict", "detail"]
    rows = [[c.name] + (["-" if c.rank is None else c.rank] if per_rank else [])
            + [Markup(f'<span class="{"passed" if c.passed else "failed"}">'
                      f'{"pass" if c.passed else "FAIL"}</span>'), c.detail]
            for c in rest.components]
    summary = (f"save {_fig(rest.save_s)}, load {_fig(rest.load_s)}, checkpoint "
               f"{_fig(rest.checkpoint_bytes)} (measured)")
    return {"headers": headers, "rows": rows, "summary": summary,
            "divergence": rest.first_divergence and
            f"step {rest.first_divergence['step']}: {', '.join(rest.first_divergence['diverged'])}"}


def _scaling(sc: ScalingResult | None) -> dict | None:
    if sc is None:
        return None
    items = [{"label": "1 rank (baseline)", "value": sc.baseline.useful_tokens_per_s}]
    rows = []
    for name, s in sc.strategies.items():
        items.append({"label": f"{name} x{s.world_size}", "value": s.useful_tokens_per_s or 0})
        rows.append([name, s.world_size, fmt_number(s.useful_tokens_per_s),
                     "-" if s.efficiency is None else f"{s.efficiency:.2f}",
                     fmt_bytes(s.peak_memory_bytes_per_rank), fmt_number(s.loss_max_abs_diff),
                     "yes" if s.data_order_same else "no", s.status])
    return {"chart": charts.bars("Useful tokens/s by strategy (measured)", items, "tokens/s",
                                 "useful tokens per second, all ranks"),
            "rows": rows, "strategy": sc.recommendation.strategy,
            "reason": sc.recommendation.reason}


def _cost(cmp: Comparison | None, quote: Quote | None) -> dict | None:
    if cmp is None and quote is None:
        return None
    out: dict = {"chart": None, "term_rows": None, "run_rows": None}
    if cmp is not None:
        items = [{"label": f"{r.card_id} x{r.count}",
                  "value": float(r.cost_per_million_term_usd or r.cost_per_million_job_usd or 0),
                  "text": fmt_usd(r.cost_per_million_term_usd or r.cost_per_million_job_usd),
                  "projected": r.cost_basis != "measured"} for r in cmp.rows[:16]]
        out["chart"] = charts.bars("Cost per million useful tokens, cheapest covering term "
                                   "(USD)", items, "USD/M tokens",
                                   "USD per million useful tokens")
    if quote is not None:
        term = quote.term
        out["term_title"] = (f"Term: {quote.card_id} x {quote.count} for "
                             f"{fmt_seconds(term.term_s)}")
        out["term_rows"] = [[i.kind, i.description, i.quantity, i.unit,
                             f"${i.unit_price_usd}" if i.unit_price_usd else "",
                             fmt_cents(i.amount_cents)] for i in term.items]
        out["term_rows"].append([Markup("<b>total</b>"), "", "", "", "",
                                 Markup(f"<b>{escape(fmt_cents(term.total_cents))}</b>")])
        out["time_rows"] = [[t.name, fmt_seconds(t.total.value), _basis(t.total), t.each.how]
                            for t in quote.time_terms]
        out["run_rows"] = _run_numbers(quote)
    return out


def _run_numbers(quote: Quote) -> list[list] | None:
    """The quote's run in numbers (spec/batch.py), as the quote view prints it."""
    r = quote.run
    if r is None:
        return None
    return [["sequences per sample", r.sequences_per_sample],
            ["token positions per optimizer step", f"{r.positions_per_step:,}"],
            ["useful fraction", f"{r.useful_fraction:.3g}"],
            ["useful tokens per optimizer step", f"{r.useful_tokens_per_step:,.0f}"],
            ["optimizer steps", f"{r.optimizer_steps:,}"],
            ["steps per epoch", "-" if r.steps_per_epoch is None else f"{r.steps_per_epoch:,}"],
            ["FLOPs per optimizer step", f"{r.flops_per_step.value:.4g}"],
            ["MFU", f"{r.mfu.value:.3g}"]]


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


# --- the document ------------------------------------------------------------------------------


def build_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write RUN_DIR/report.html and RUN_DIR/report.md; return their paths."""
    import jinja2

    from tunepilot.errors import UserError
    from tunepilot.store import atomic_write_bytes

    run = _run_dir(run_dir)
    manifest = run.manifest()
    got = {cls.STAGE: run.read_if(cls) for cls in (Decision, MemoryPlan, PilotResult,
                                                   RestoreResult, ScalingResult, Comparison,
                                                   Quote, DataProfile)}
    if not manifest.spec_hash and not any(got.values()):
        raise UserError("RUN_DIR", f"{str(run.path)!r} holds no tunepilot results.",
                        "Run `tunepilot run SPEC --out DIR` first.")
    label = manifest.label or (manifest.spec or {}).get("name") or run.path.name
    dec = got["decision"]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    prov = manifest.provenance or {k: v for k, v in manifest.model_dump().items() if k != "spec"}
    html = env.get_template("report.html.j2").render(
        label=label, spec_hash=manifest.spec_hash or "?", decision=dec,
        pending=_pending(run.path, manifest, got["pilot"]) if dec is None else "",
        gates=_gates(dec) if dec else [],
        memory=_memory(got["plan"], got["pilot"]), ranks=_ranks(got["pilot"]),
        steps=_steps(got["pilot"]),
        data=_data(got["data"]), restore=_restore(got["restore"]),
        scaling=_scaling(got["scale"]), cost=_cost(got["compare"], got["quote"]),
        provenance=[[Markup(f"<code>{escape(k)}</code>"), v[:300]] for k, v in _flatten(prov)])
    html_path, md_path = run.path / "report.html", run.path / "report.md"
    atomic_write_bytes(html_path, html.encode())
    atomic_write_bytes(md_path, _markdown(label, manifest, got).encode())
    return html_path, md_path


_OWN_RUN = {"hf-callback": "TunepilotCallback in your own HF Trainer run",
            "lightning-callback": "TunepilotCallback in your own Lightning run",
            "watch": "`tunepilot watch` around your own command"}


def _pending(path: Path, manifest, pilot: PilotResult | None) -> str:
    """Why there is no decision, and what would make one - a run measured in the user's own
    loop is not a run that failed."""
    stages = ", ".join(sorted(manifest.stages)) or "none"
    by = _OWN_RUN.get(pilot.source) if pilot is not None else None
    if by:
        return (f"Measured by {by} (pilot.json): a measurement, not a decision. For one, quote "
                f"it on a card: tunepilot quote {path}/spec.yaml --from {path} --card CARD "
                "--hours H")
    return (f"No decision in this directory: a decision is what `tunepilot run` ends with "
            f"(stages present: {stages}).")


def _run_dir(run_dir: str | Path) -> RunDir:
    """A run directory to report on: never a checkpoint directory or another tool's folder."""
    from tunepilot.errors import UserError

    path = Path(run_dir)
    if not path.is_dir():
        raise UserError("RUN_DIR", f"{str(path)!r} is not a run directory.",
                        "Give the --out directory of `tunepilot run`, `pilot` or `demo`.")
    if (path / "manifest.json").exists() and (path / "model").is_dir():
        raise UserError("RUN_DIR", f"{str(path)!r} is a checkpoint directory, not a run "
                        "directory; nothing was written into it.",
                        "Give the run directory that holds it (its parent's parent), or check "
                        "it with `tunepilot verify`.")
    return RunDir(path)


def _markdown(label: str, manifest, got: dict) -> str:
    lines = [f"## tunepilot: {label}", ""]
    dec, pilot, rest, sc, quote = (got[k] for k in ("decision", "pilot", "restore", "scale",
                                                     "quote"))
    if dec:
        lines += [f"**{dec.decision}**", "", "| stage | verdict | summary |", "|---|---|---|"]
        lines += [f"| {g.stage} | {g.status} | {g.summary} |" for g in dec.gates]
        lines += [f"- warning: {w}" for w in dec.warnings]
    if pilot:
        tps = pilot.throughput.useful_tokens_per_s
        lines += ["", f"- pilot on {pilot.device.name}: {_fig(tps)} useful ({tps.basis}), step "
                      f"p50 {_fig(pilot.step_time.p50_s)}"]
        lines += [f"  - rank {r.rank}: allocated peak {_fig(r.allocated_peak_bytes)} (measured) "
                  f"vs {_fig(r.planned_allocated_peak_bytes)} planned per rank, median step "
                  f"{_fig(r.step_time_median_s)}, {'fits' if r.fits else 'does not fit'}"
                  for r in pilot.ranks]
    if rest:
        lines.append(f"- restore: {'passed' if rest.passed else 'FAILED'} "
                     f"({len(rest.components)} components)")
    if sc:
        lines.append(f"- scale: use {sc.recommendation.strategy} - {sc.recommendation.reason}")
    if quote:
        lines.append(f"- term: {quote.card_id} x {quote.count}, {fmt_usd(quote.term.total_usd)} "
                     f"({quote.cost_basis} time)")
    lines += ["", f"spec hash `{manifest.spec_hash or '?'}`; full report: report.html", ""]
    return "\n".join(lines)
