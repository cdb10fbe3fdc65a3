"""Rendering of the restore proof and the export (prints; the library functions never do)."""

from __future__ import annotations

from rich.table import Table

from tunepilot.figures import value_of
from tunepilot.render import console

MB = 10**6


def render_restore(r: dict, path: str | None = None) -> None:
    """The verdict: one row per component, then the first divergence, then the costs."""
    verdict = "[green]PASSED[/green]" if r["passed"] else "[red]FAILED[/red]"
    ck = r["checkpoint"]
    dev = r.get("device", {})
    console.print(f"[bold]restore proof {verdict}[/bold]  train {r['steps_before']} steps, save, "
                  f"train {r['steps_after']}; a fresh process loads step {ck['step']} and trains "
                  f"the same {r['steps_after']} steps  ({dev.get('kind', '?')} "
                  f"{dev.get('name', '')})")
    t = Table(title_justify="left", title="Components (checked before the fresh process trains, "
              "then step by step)")
    for c in ("component", "", "detail"):
        t.add_column(c)
    for c in r["components"]:
        t.add_row(c["name"], "[green]pass[/green]" if c["passed"] else "[red]FAIL[/red]",
                  c["detail"])
    console.print(t)
    d = r.get("first_divergence")
    if d:
        o, g = d.get("original") or {}, d.get("restored") or {}
        console.print(f"first divergence at step {d['step']}: {', '.join(d['diverged'])}")
        console.print(f"  original: loss {o.get('loss_bits')}  lr {o.get('lr_bits')}  batch "
                      f"{','.join(o.get('fingerprints', []))}")
        console.print(f"  restored: loss {g.get('loss_bits')}  lr {g.get('lr_bits')}  batch "
                      f"{','.join(g.get('fingerprints', []))}")
    det = r.get("deterministic", {})
    diff = value_of(r.get("loss_max_abs_diff"))
    console.print(f"deterministic algorithms: {'held' if det.get('held') else 'NOT held: ' + ', '.join(det.get('nondeterministic_ops', []))}"
                  + (f"; max |loss diff| {diff:.3g}" if diff is not None else ""))
    b = value_of(r["checkpoint_bytes"], 0)
    save, load = value_of(r["save_s"]), value_of(r["load_s"])
    line = f"checkpoint ({ck['kind']}, {ck['files']} files): {b / MB:,.2f} MB; save {save:.3f} s"
    if save:
        line += f" ({b / save / MB:,.1f} MB/s, fsync + SHA-256 included)"
    line += f"; load {load:.3f} s" if load is not None else "; not loaded"
    if load:
        line += f" ({b / load / MB:,.1f} MB/s, verification included)"
    console.print(line + "  (measured; MB = 10^6 bytes)")
    if path:
        console.print(f"wrote {path}")


def render_export(r: dict, path: str | None = None) -> None:
    """What went where, how much, how fast."""
    total = value_of(r["bytes"], 0)
    copied = value_of(r["bytes_copied"], 0)
    secs = value_of(r["seconds"], 0.0)
    rate = r["bytes_per_s"]
    console.print(f"[bold]export verified[/bold]: {len(r['files'])} files, {total / MB:,.2f} MB "
                  f"at {r['dest']} (every SHA-256 read back from the destination)")
    console.print(f"copied {r['files_copied']} + re-copied {r['files_recopied']} files "
                  f"({copied / MB:,.2f} MB); skipped {r['files_skipped']} already there intact "
                  f"({(total - copied) / MB:,.2f} MB)")
    if rate.get("value") is not None:
        how = " (from the previous export)" if rate.get("from_previous_export") else ""
        console.print(f"time {secs:.3f} s; throughput {rate['value'] / MB:,.1f} MB/s{how} "
                      "(measured; MB = 10^6 bytes)")
    else:
        console.print(f"time {secs:.3f} s; throughput not measured: {rate.get('unavailable')}")
    if path:
        console.print(f"wrote {path}")
