"""Human-readable rendering (rich tables). Functions here print; library functions never do."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

GIB = 2**30
GB = 10**9

console = Console(highlight=False)
if not console.is_terminal:  # piped or captured: don't squeeze tables into 80 columns
    console = Console(highlight=False, width=160)


def gib(n: float | int | None) -> str:
    """Bytes as GiB (2^30) with the unit, e.g. '14.96 GiB'."""
    if n is None:
        return "-"
    return f"{n / GIB:,.2f} GiB"


def table(title: str, columns: list[str], rows: Iterable[dict]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[_cell(r.get(c)) for c in columns])
    console.print(t)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def render_plan(spec, plan, catalog, headroom: float) -> None:
    """The plan as a worked example: the arithmetic, the timeline, the peaks, the fit table."""
    p = plan.params
    d = plan.per_device
    kind = "projected" if plan.fidelity == "analytic" else f"projected ({plan.fidelity})"
    console.print(f"[bold]{spec.label}[/bold]  ({plan.fidelity} plan; every figure is {kind} "
                  f"for a {plan.stack.upper()} device; GiB = 2^30 bytes)")
    console.print(
        f"params: total {p.total:,}  trainable {p.trainable:,}  frozen {p.frozen:,}   "
        f"method {spec.method.kind}, {spec.precision}, optimizer {spec.optimizer.name} "
        f"(state {spec.optimizer_state_dtype})")
    console.print(
        f"tokens: micro-batch {spec.micro_batch_size} x seq {spec.sequence_length} = "
        f"{plan.tokens_per_micro_batch:,} tokens; x {spec.gradient_accumulation_steps} accumulation"
        f" x {plan.world_size} rank(s) = {plan.tokens_per_optimizer_step:,} tokens per optimizer "
        f"step ({plan.strategy})")
    b = plan.bytes_per_param
    t = Table(title="Per device, by component", title_justify="left")
    for c in ("component", "bytes / param", "size"):
        t.add_column(c, justify="right" if c != "component" else "left")
    t.add_row("weights", f"{b['weights_per_param']:.3g} per param", gib(d["weights_bytes"]))
    t.add_row("master weights", f"{b['master_weights_per_trainable_param']:.3g} per trainable",
              gib(d["master_weights_bytes"]))
    t.add_row("gradients", f"{b['gradients_per_trainable_param']:.3g} per trainable",
              gib(d["gradients_bytes"]))
    t.add_row("optimizer state", f"{b['optimizer_per_trainable_param']:.3g} per trainable",
              gib(d["optimizer_bytes"]))
    t.add_row("activations (saved)", f"{d['activations_bytes'] / max(plan.tokens_per_micro_batch, 1):,.0f} B per token",
              gib(d["activations_bytes"]))
    t.add_row("temporaries", "", gib(d["temporary_bytes"]))
    if d.get("collective_buffers_bytes"):
        t.add_row("collective buffers", "", gib(d["collective_buffers_bytes"]))
    t.add_row("model states", f"{b['model_states_per_param']:.3g} per param", "")
    console.print(t)

    t = Table(title="Timeline of one step (live bytes; the peak is the largest phase, not a sum)",
              title_justify="left")
    for c in ("phase", "weights+master", "grads", "optimizer", "activations", "temporaries",
              "total"):
        t.add_column(c, justify="right" if c != "phase" else "left")
    for ph in plan.phases:
        mark = " <- peak" if ph.name == plan.peak_phase else ""
        t.add_row(ph.name + mark, gib(ph.weights_bytes + ph.master_weights_bytes),
                  gib(ph.gradients_bytes), gib(ph.optimizer_bytes), gib(ph.activations_bytes),
                  gib(ph.temporary_bytes + ph.collective_buffers_bytes), gib(ph.total_bytes))
    console.print(t)
    console.print(
        f"allocated peak {gib(d['allocated_peak_bytes'])}  ->  reserved peak "
        f"{gib(d['reserved_peak_bytes'])} (caching allocator)  +  runtime "
        f"{gib(d['runtime_overhead_bytes'])} (context, workspaces, collectives)  =  "
        f"[bold]device peak {gib(d['device_peak_bytes'])}[/bold]  ({kind})")
    if plan.peak_phase == "model-load":
        console.print(f"model load peak {gib(d['load_peak_bytes'])} sets the peak")

    t = Table(title=f"Fit per card (headroom {headroom:.0%}; capacity as the device reports it)",
              title_justify="left")
    for c in ("card", "capacity", "device peak", "fits", "free", "DDP cards", "FSDP cards",
              "max micro-batch", "max seq len"):
        t.add_column(c, justify="left" if c == "card" else "right", no_wrap=c == "card")
    for row in plan.cards:
        t.add_row(row["card"], f"{row['capacity_bytes'] / GB:,.1f} GB", gib(row["device_peak_bytes"]),
                  "yes" if row["fits"] else "[red]no[/red]", f"{row['headroom_fraction']:.0%}",
                  _cell(row["devices_needed"]["ddp"]) if row["devices_needed"]["ddp"] else "never",
                  _cell(row["devices_needed"]["fsdp"]) if row["devices_needed"]["fsdp"] else ">1024",
                  _cell(row["max_micro_batch"]), _cell(row["max_sequence_length"]))
    console.print(t)
    if plan.assumptions:
        console.print("assumes: " + "; ".join(plan.assumptions))


def render_decision(result, report_path) -> None:
    """The gates and the decision paragraph at the end of `run` / `demo`."""
    t = Table(title=f"Staged pilot: {result.spec_label} ({result.run_dir})", title_justify="left")
    for c in ("stage", "verdict", "summary"):
        t.add_column(c)
    style = {"passed": "green", "failed": "red", "skipped": "dim"}
    for g in result.gates:
        verdict = f"[{style.get(g.status, '')}]{g.status}[/]" + (" (reused)" if g.reused else "")
        t.add_row(g.stage, verdict, g.summary)
    console.print(t)
    console.print(("[bold green]" if result.ready else "[bold red]") + result.decision + "[/]")
    console.print(f"report: {report_path}")
