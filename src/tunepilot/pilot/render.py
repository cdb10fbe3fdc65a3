"""Terminal output of the pilot: a progress bar on stderr while it runs, a summary at the end.

Only the CLI calls these; the pilot itself reports progress through a callback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from tunepilot.figures import value_of
from tunepilot.render import console, gib

GB = 10**9


@contextlib.contextmanager
def pilot_progress() -> Iterator:
    """A progress callback(phase, done, total) drawing on stderr (never on stdout)."""
    err = Console(stderr=True, highlight=False)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        current = {"phase": None, "task": None}

        def update(phase: str, done: int, total: int | None) -> None:
            if phase != current["phase"]:  # a new phase: a new bar (its own total, or none)
                if current["task"] is not None:
                    bar.remove_task(current["task"])
                current["phase"], current["task"] = phase, bar.add_task(phase, total=total)
            bar.update(current["task"], completed=done)

        yield update


def _s(f) -> str:
    v = value_of(f)
    if v is None:
        return "-"
    return f"{v * 1e3:,.1f} ms" if v < 1 else f"{v:,.2f} s"


def _n(f, fmt: str = "{:,.0f}", unit: str = "") -> str:
    v = value_of(f)
    return "-" if v is None else fmt.format(v) + unit


def _b(f) -> str:
    """Bytes in the binary unit that reads best (KiB, MiB, GiB = 2^10, 2^20, 2^30)."""
    v = value_of(f)
    if v is None:
        return "-"
    if abs(v) >= 2**30:
        return gib(v)
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:,.2f} {unit}"
    return f"{v:,.0f} B"


def _why(f) -> str:
    return f.get("unavailable", "") if isinstance(f, dict) else ""


def render_pilot(d: dict, path: str) -> None:
    """The summary of a pilot.json document."""
    dev = d["device"]
    colour = "green" if d["fits"] else "red"
    console.print(f"[bold]{d['run']['label']}[/bold] on {dev['kind'].upper()} {dev['name']!r}"
                  f"{' (' + dev['card_id'] + ')' if dev.get('card_id') else ''}: "
                  f"[{colour}]{d['verdict']}[/{colour}]   (every figure measured on this "
                  "device; GiB = 2^30 bytes)")
    if not d["fits"]:
        dnf = d["does_not_fit"]
        console.print(f"  out of memory in {dnf['phase']}"
                      f"{' (simulated by --memory-limit)' if dnf['simulated'] else ''}: "
                      f"{dnf['error']}")
    steps = d["steps"]
    st = d["step_time"]
    if value_of(steps["measured"]):
        t = Table(title=f"Step time: {value_of(steps['measured'])} measured steps "
                  f"({steps['stopped_because']}; 95% CI +/- "
                  f"{_n(steps['ci95_relative'], '{:.1%}')}), {value_of(steps['warmup'])} "
                  "warm-up steps on the longest batch", title_justify="left")
        for c in ("p50", "p90", "p99", "mean", "CV", "data wait", "forward", "backward",
                  "optimizer", "stalls"):
            t.add_column(c, justify="right")
        sp, dw = d["split"], d["data_wait"]
        t.add_row(_s(st["p50_s"]), _s(st["p90_s"]), _s(st["p99_s"]), _s(st["mean_s"]),
                  _n(st["cv"], "{:.1%}"), _s(dw["mean_s"]), _s(sp["forward_s"]),
                  _s(sp["backward_s"]), _s(sp["optimizer_s"]), _n(dw["num_stalls"]))
        console.print(t)
        tp = d["throughput"]
        mfu = d["mfu"]
        console.print(f"throughput: [bold]{_n(tp['useful_tokens_per_s'])} useful tokens/s[/bold]"
                      f", {_n(tp['padded_tokens_per_s'])} padded tokens/s (useful fraction "
                      f"{_n(tp['useful_fraction'], '{:.1%}')});  MFU "
                      + (_n(mfu, "{:.1%}") + f" of the {mfu['card_id']} dense "
                         f"{mfu['peak_precision']} peak" if value_of(mfu) is not None
                         else f"- ({_why(mfu)})"))
    _render_memory(d)
    tm = d["timings"]
    ckb = value_of(tm["checkpoint_bytes"])
    console.print(f"timings: model load {_s(tm['model_load_s'])}, set-up {_s(tm['setup_s'])}, "
                  f"warm-up {_s(tm['warmup_s'])}, validation pass "
                  f"({d['validation'].get('num_batches') or '-'} batches) "
                  f"{_s(tm['validation_pass_s'])}, checkpoint write {_s(tm['checkpoint_write_s'])}"
                  + (f" ({ckb / 2**20:,.1f} MiB at {value_of(tm['checkpoint_bytes_per_s']) / 1e6:,.1f}"
                     " MB/s)" if ckb else f" ({_why(tm['checkpoint_write_s'])})"))
    s = d.get("find_max_batch")
    if s:
        cap = " (the search cap)" if s["reached_search_cap"] else ""
        console.print(f"largest micro-batch that completes full steps: [bold]"
                      f"{value_of(s['max_micro_batch'])}[/bold]{cap} at seq "
                      f"{s['max_micro_batch'].get('at_sequence_length')}, limit: {s['limit']}")
    for n in d.get("notes", []):
        console.print(f"note: {n}")
    console.print(f"wrote {path}")


def _render_memory(d: dict) -> None:
    pvm = d["plan_vs_measured"]
    t = Table(title=f"Memory: plan ({pvm['plan_fidelity']}, {pvm['stack']}) vs measured "
              "(memory-probe step = warm-up step 2)", title_justify="left")
    for c in ("component", "planned", "measured", "residual", "measured / planned", "what"):
        t.add_column(c, justify="left" if c in ("component", "what") else "right")
    for name, row in pvm["components"].items():
        t.add_row(name, _b(row["planned"]), _b(row["measured"]),
                  _b(row.get("residual_bytes")), _n(row.get("ratio"), "{:.3f}"), row["what"])
    console.print(t)
    m = d["memory"]
    if d["device"]["kind"] == "cpu":
        p = m["process"]
        console.print(f"process RSS: peak {_b(p.get('peak_rss_bytes'))}, growth "
                      f"{_b(p.get('rss_growth_bytes'))} over the baseline "
                      f"{_b(p.get('baseline_rss_bytes'))}; tracked tensor peak "
                      f"{_b(m['tracked']['peak_bytes'])} (allocator and device-wide figures: "
                      f"{_why(m['allocator']['peak_allocated_bytes'])})")
    else:
        a, dv = m["allocator"], m["device"]
        console.print(f"allocator: peak allocated {_b(a['peak_allocated_bytes'])}, reserved "
                      f"{_b(a['peak_reserved_bytes'])}, alloc retries "
                      f"{_n(a['num_alloc_retries'])}, OOMs {_n(a['num_ooms'])};  device-wide "
                      f"peak - baseline {_b(dv['peak_minus_baseline_bytes'])} (gap over reserved "
                      f"{_b(dv['gap_bytes'])})")
    if m.get("memory_limit_bytes"):
        console.print(f"simulated memory limit: {_b(m['memory_limit_bytes'])}")
