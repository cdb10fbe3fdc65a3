"""The dataset profile (`tunepilot data`)."""

from __future__ import annotations

from pathlib import Path

from tunepilot.results.data import DataProfile
from tunepilot.units import fmt_number
from tunepilot.views.common import basis, console, fig, table


def render_profile(p: DataProfile, written: Path | None = None) -> None:
    where = p.path or p.source
    console.print(f"[bold]Dataset[/bold] {where} ({p.format}, train on {p.train_on}"
                  + (f", chat template {p.chat_template}" if p.chat_template else "") + ")")
    t = table("Counted over the whole dataset", ["", "value", "basis"], right=["value"])
    t.add_row("samples", fmt_number(p.samples), basis(p.tokens_total))
    if p.skipped_rows:
        t.add_row("rows skipped (data.skip_bad_rows)", fmt_number(p.skipped_rows), "")
    t.add_row("tokens (all)", fig(p.tokens_total), basis(p.tokens_total))
    t.add_row("tokens trained (supervised)", fig(p.tokens_supervised), basis(p.tokens_supervised))
    L = p.length
    t.add_row("length p50 / p90 / p99 / max", f"{L.p50:,} / {L.p90:,} / {L.p99:,} / {L.max:,} "
              "tokens", "")
    t.add_row(f"truncated at sequence_length {p.sequence_length:,}",
              f"{fmt_number(p.truncated_samples)} samples", "")
    console.print(t)
    b = table(f"One epoch at micro-batch {p.micro_batch_size} x accumulation "
              f"{p.gradient_accumulation_steps} (positions on one device; steps on "
              f"{p.world_size} rank(s), whole micro-batches as the loader draws them)",
              ["batching", "padding", "trained / positions", "positions", "steps per epoch"],
              right=["padding", "trained / positions", "positions", "steps per epoch"])
    for name, row in (("padded", p.padded), ("packed", p.packed)):
        mark = " (the spec's)" if (name == "packed") == p.packing else ""
        b.add_row(name + mark, fig(row.padding_fraction), fig(row.useful_fraction),
                  f"{row.positions:,} tokens", f"{row.steps_per_epoch:,}")
    console.print(b)
    console.print(_histogram(p))
    for n in p.notes:
        console.print(f"note: {n}")
    how = "read from the cache" if p.cached else "tokenized"
    console.print(f"{how} in {fig(p.seconds)}" + (f"; written to {written}" if written else ""))


def _histogram(p: DataProfile) -> str:
    """The length histogram as text bars; '|' marks the bin of the sequence length."""
    hist = p.length.histogram
    top = max((b.count for b in hist), default=0) or 1
    lines = ["Sample lengths (tokens; # = samples)"]
    for b in hist:
        mark = " <- sequence_length" if b.lo <= p.sequence_length < b.hi else ""
        lines.append(f"  {b.lo:>7,}-{b.hi - 1:<7,} {'#' * round(40 * b.count / top):<40} "
                     f"{b.count:,}{mark}")
    return "\n".join(lines)
