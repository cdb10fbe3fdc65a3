"""The pilot's summary: step times, throughput, memory plan vs measured, timings."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.results.pilot import PilotResult
from tunepilot.units import fmt_bytes, fmt_number, fmt_rate
from tunepilot.views.common import console, fig, notes, table, why


def render_pilot(d: PilotResult, path: str | None = None) -> None:
    """The summary of a pilot result."""
    dev = d.device
    colour = "green" if d.fits else "red"
    card = f" ({dev.card_id})" if dev.card_id else ""
    console.print(f"[bold]{escape(d.run.label)}[/bold] on {dev.kind.upper()} "
                  f"{escape(repr(dev.name))}{card}: [{colour}]{escape(d.verdict)}[/{colour}]   "
                  f"(source: {d.source}; every figure measured on this device)")
    if d.does_not_fit is not None:
        dnf = d.does_not_fit
        console.print(f"  out of memory on {escape(dnf.device or 'the local device')} in "
                      f"{escape(dnf.phase)}{' (simulated by --memory-limit)' if dnf.simulated else ''}"
                      f": {escape(dnf.error)}")
    if d.steps.measured.value:
        _steps(d)
    if d.ranks:
        _ranks(d)
    _memory(d)
    _timings(d)
    s = d.find_max_batch
    if s is not None:
        cap = " (the search cap)" if s.reached_search_cap else ""
        console.print(f"largest micro-batch that completes full steps: [bold]"
                      f"{s.max_micro_batch.value}[/bold]{cap} at seq "
                      f"{s.max_micro_batch.extra('at_sequence_length')}, limit: {s.limit}")
    if d.steps.confidence and not d.steps.confidence.startswith("converged"):
        console.print(f"[yellow]confidence[/yellow]: {escape(d.steps.confidence)}")
    notes(n for n in d.notes if n != d.steps.confidence)
    if path:
        console.print(f"wrote {path}")


def _steps(d: PilotResult) -> None:
    steps, st, sp, dw = d.steps, d.step_time, d.split, d.data_wait
    ci = steps.ci95_relative.value
    cols = ["p50", "p90", "p99", "mean", "CV", "data wait", "forward", "backward", "optimizer",
            "stalls"]
    t = table(f"Step time: {steps.measured.value} measured steps ({steps.stopped_because}; 95% "
              f"CI +/- {'-' if ci is None else f'{ci:.1%}'}), {steps.warmup.value} warm-up steps "
              "on the longest batch", cols, cols)
    t.add_row(fig(st.p50_s), fig(st.p90_s), fig(st.p99_s), fig(st.mean_s), fig(st.cv),
              fig(dw.mean_s), fig(sp.forward_s), fig(sp.backward_s), fig(sp.optimizer_s),
              "-" if dw.num_stalls.value is None else fmt_number(dw.num_stalls.value))
    console.print(t)
    tp, mfu = d.throughput, d.mfu
    mfu_text = (f"{mfu.value:.1%} of the {mfu.extra('card_id')} dense "
                f"{mfu.extra('peak_precision')} peak" if mfu.value is not None
                else f"- ({why(mfu)})")
    console.print(f"throughput: [bold]{fmt_rate(tp.useful_tokens_per_s.value, 'tokens/s')} "
                  f"useful[/bold], {fmt_rate(tp.padded_tokens_per_s.value, 'tokens/s')} padded "
                  f"(useful fraction {fig(tp.useful_fraction)});  MFU {mfu_text}")
    g = d.generation
    if g is not None:
        console.print(f"generation ({g.backend}): {fig(g.seconds_per_step)} per step "
                      f"({fig(g.fraction_of_step_time)} of it), "
                      f"{fmt_rate(g.generated_tokens_per_s.value, 'tokens/s')} generated; "
                      f"tracked peak while generating {fig(g.peak_bytes)}")


def _ranks(d: PilotResult) -> None:
    """A sharded pilot: every rank's peaks, step time and plan (measured; the plan projected)."""
    cols = ["rank", "allocated peak", "planned", "measured / planned", "reserved peak",
            "device peak", "median step", "status"]
    t = table(f"Ranks: {d.world_size} FSDP ranks, each measured (allocated peak: the "
              "steady-state peak; plan: the per-rank plan, projected)", cols, cols[1:7])
    for r in d.ranks:
        ratio = r.plan_ratio.value
        t.add_row(str(r.rank), fig(r.allocated_peak_bytes), fig(r.planned_allocated_peak_bytes),
                  "-" if ratio is None else f"{ratio:.3f}", fig(r.reserved_peak_bytes),
                  fig(r.device_peak_bytes), fig(r.step_time_median_s),
                  "fits" if r.fits else escape(r.error or "does not fit"))
    console.print(t)


def _memory(d: PilotResult) -> None:
    pvm = d.plan_vs_measured
    if pvm is not None:
        cols = ["component", "planned", "measured", "residual", "measured / planned", "what"]
        t = table(f"Memory: plan ({pvm.plan_fidelity}, {pvm.stack}) vs measured (memory-probe "
                  "step = warm-up step 2)", cols, cols[1:5])
        for name, row in pvm.components.items():
            ratio = row.ratio.value if row.ratio is not None else None
            t.add_row(name, fig(row.planned), fig(row.measured), fig(row.residual_bytes),
                      "-" if ratio is None else f"{ratio:.3f}", row.what)
        console.print(t)
    m = d.memory
    if d.device.kind == "cpu":
        p = m.process
        console.print(f"process RSS: peak {fig(p.peak_rss_bytes)}, growth "
                      f"{fig(p.rss_growth_bytes)} over the baseline {fig(p.baseline_rss_bytes)};"
                      f" tracked tensor peak {fig(m.tracked.peak_bytes)} (allocator and "
                      f"device-wide figures: {why(m.allocator.peak_allocated_bytes)})")
    else:
        a, dv = m.allocator, m.device
        console.print(f"allocator: peak allocated {fig(a.peak_allocated_bytes)}, reserved "
                      f"{fig(a.peak_reserved_bytes)}, alloc retries {fig(a.num_alloc_retries)}, "
                      f"OOMs {fig(a.num_ooms)};  device-wide peak - baseline "
                      f"{fig(dv.peak_minus_baseline_bytes)} (gap over reserved "
                      f"{fig(dv.gap_bytes)})")
    if m.memory_limit_bytes is not None:
        console.print(f"simulated memory limit: {fig(m.memory_limit_bytes)}")


def _timings(d: PilotResult) -> None:
    tm = d.timings
    ckb = tm.checkpoint_bytes.value
    rate = tm.checkpoint_bytes_per_s.value
    ck = (f" ({fmt_bytes(ckb)} at {fmt_rate(rate, 'B/s')})" if ckb and rate
          else f" ({why(tm.checkpoint_write_s)})")
    console.print(f"timings: model load {fig(tm.model_load_s)}, set-up {fig(tm.setup_s)}, "
                  f"warm-up {fig(tm.warmup_s)}, validation pass "
                  f"({d.validation.num_batches or '-'} batches) {fig(tm.validation_pass_s)}, "
                  f"checkpoint write {fig(tm.checkpoint_write_s)}{ck}")
