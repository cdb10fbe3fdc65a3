"""The restore proof, `verify` and `export` as a person reads them."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.results.export import ExportResult
from tunepilot.results.restore import RestoreResult
from tunepilot.units import fmt_bytes, fmt_rate, fmt_seconds
from tunepilot.views.common import console, notes, table


def render_restore(r: RestoreResult, path: str | None = None) -> None:
    """The verdict: one row per component (per rank), the first divergence, then the costs."""
    verdict = "[green]PASSED[/green]" if r.passed else "[red]FAILED[/red]"
    ck = r.checkpoint
    dev = r.device
    ranks = f" on {r.nproc} ranks" if r.nproc > 1 else ""
    resumed = f", resumed on {r.resume_nproc}" if r.resume_nproc else ""
    console.print(f"[bold]restore proof {verdict}[/bold]  ({r.trainer}{ranks}{resumed}) train "
                  f"{r.steps_before} steps, save, train {r.steps_after}; a fresh process loads "
                  f"step {ck.step if ck else '?'} and trains the same {r.steps_after} steps  "
                  f"({dev.get('kind', '?')} {escape(str(dev.get('name', '')))})")
    per_rank = any(c.rank is not None for c in r.components)
    cols = ["component"] + (["rank"] if per_rank else []) + ["", "detail"]
    t = table("Components (checked before the fresh process trains, then step by step)", cols)
    for c in r.components:
        row = [c.name] + ([("-" if c.rank is None else str(c.rank))] if per_rank else [])
        t.add_row(*row, "[green]pass[/green]" if c.passed else "[red]FAIL[/red]",
                  escape(c.detail))
    console.print(t)
    d = r.first_divergence
    if d:
        o, g = d.get("original") or {}, d.get("restored") or {}
        console.print(f"first divergence at step {d['step']}: {', '.join(d['diverged'])}")
        for label, s in (("original", o), ("restored", g)):
            console.print(f"  {label}: loss {s.get('loss_bits')}  lr {s.get('lr_bits')}  batch "
                          f"{','.join(s.get('fingerprints', []))}")
    det = r.deterministic
    diff = r.loss_max_abs_diff.value
    held = ("not set by tunepilot (the script's own settings)" if not det.requested else
            "held" if det.held else "NOT held: " + ", ".join(det.nondeterministic_ops))
    console.print(f"deterministic algorithms: {held}" +
                  (f"; max |loss diff| {diff:.3g} nats/token" if diff is not None else "")
                  + (f"; tolerance: {r.tolerance}" if r.tolerance else ""))
    b, save, load = r.checkpoint_bytes.value or 0, r.save_s.value, r.load_s.value
    line = f"checkpoint ({ck.kind if ck else '?'}, {ck.files if ck else '?'} files): " \
           f"{fmt_bytes(b)}; save {fmt_seconds(save)}"
    if save:
        line += f" ({fmt_rate(b / save, 'B/s')}, fsync + SHA-256 included)"
    line += f"; load {fmt_seconds(load)}" if load is not None else "; not loaded"
    if load:
        line += f" ({fmt_rate(b / load, 'B/s')}, verification included)"
    console.print(line + "  (measured)")
    notes(r.notes)
    if path:
        console.print(f"wrote {path}")


def render_export(r: ExportResult, path: str | None = None) -> None:
    """What went where, how much, how fast."""
    total, copied = r.bytes.value or 0, r.bytes_copied.value or 0
    console.print(f"[bold]export verified[/bold]: {len(r.files)} files, "
                  f"{fmt_bytes(total, decimal=True)} at {escape(r.dest)} (every SHA-256 read back "
                  "from the destination)")
    console.print(f"copied {r.files_copied} + re-copied {r.files_recopied} files "
                  f"({fmt_bytes(copied, decimal=True)}); skipped {r.files_skipped} already there "
                  f"intact ({fmt_bytes(total - copied, decimal=True)})")
    if r.checkpoint_bytes is not None:
        ck = r.checkpoint_bytes.value or 0
        console.print(f"the export (what the quote's export term and the host plan count): "
                      f"{r.checkpoints} checkpoint(s), {fmt_bytes(ck, decimal=True)}; the stage "
                      f"results and logs beside them {fmt_bytes(total - ck, decimal=True)}")
    rate = r.bytes_per_s
    if rate.value is not None:
        how = " (from the previous export)" if rate.extra("from_previous_export") else ""
        console.print(f"time {fmt_seconds(r.seconds.value)}; throughput "
                      f"{fmt_rate(rate.value, 'B/s')}{how} (measured)")
    else:
        console.print(f"time {fmt_seconds(r.seconds.value)}; throughput not measured: "
                      f"{rate.how}")
    notes(r.notes)
    if path:
        console.print(f"wrote {path}")


def render_verify(report) -> None:
    """`tunepilot verify`: every problem named by file, component and rank."""
    if not report.ok:
        verdict = "[red]PROBLEMS[/red], [yellow]not resumable as is[/yellow]"
    elif report.intact:
        verdict = ("[green]intact[/green] (every file matches the SHA-256 recorded at save "
                   "time), resumable as is")
    else:
        verdict = ("[yellow]not verified[/yellow]: no manifest of SHA-256s to check the bytes "
                   "against; every component loads in a fresh process")
    console.print(f"[bold]{escape(report.path)}[/bold]: {report.kind} checkpoint, {verdict}")
    t = table("What it holds", ["component", "files", "bytes", "status"], ("files", "bytes"))
    for c in report.components:
        t.add_row(c.name, str(c.files), fmt_bytes(c.bytes),
                  "[green]ok[/green]" if c.ok else f"[red]{escape(c.status)}[/red]")
    console.print(t)
    for p in report.problems:
        rank = f" (rank {p.rank})" if p.rank is not None else ""
        console.print(f"[red]problem[/red]: {escape(p.file or '-')} [{p.component}{rank}] "
                      f"{escape(p.problem)}")
    notes(report.notes)
