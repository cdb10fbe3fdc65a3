"""The plan as a worked example: the arithmetic, the timeline, the peaks, the fit table; the
presets and cards lists."""

from __future__ import annotations

from rich.markup import escape

from tunepilot.model.flops import EXPORT_RULE, optimizer_state_label
from tunepilot.results.plan import MemoryPlan
from tunepilot.units import fmt_bytes, fmt_number
from tunepilot.views.common import cell, console, table


def render_plan(plan: MemoryPlan, spec, headroom: float) -> None:
    p, d = plan.params, plan.per_device
    kind = "projected" if plan.fidelity == "analytic" else f"projected ({plan.fidelity})"
    console.print(f"[bold]{escape(spec.label)}[/bold]  ({plan.fidelity} plan; every figure is "
                  f"{kind} for a {plan.stack.upper()} device; KiB/MiB/GiB = 2^10/2^20/2^30 bytes, "
                  "cards are sold in GB = 10^9 bytes)")
    console.print(f"params: total {p.total:,}  trainable {p.trainable:,}  frozen {p.frozen:,}   "
                  f"method {spec.method.kind}, {spec.precision}, optimizer {spec.optimizer.name} "
                  f"({optimizer_state_label(spec)})")
    rows = spec.objective.sequences_per_sample
    pairs = f" pairs x {rows} (chosen, rejected)" if rows > 1 else ""
    console.print(f"tokens: micro-batch {spec.micro_batch_size}{pairs} x seq "
                  f"{spec.sequence_length} = "
                  f"{plan.tokens_per_micro_batch:,} tokens; x {spec.gradient_accumulation_steps} "
                  f"accumulation x {plan.world_size} rank(s) = {plan.tokens_per_optimizer_step:,} "
                  f"tokens per optimizer step ({plan.strategy})")
    _objective(spec)
    _components(plan)
    _timeline(plan)
    console.print(
        f"allocated peak {fmt_bytes(d.allocated_peak_bytes)}  ->  reserved peak "
        f"{fmt_bytes(d.reserved_peak_bytes)} (caching allocator)  +  runtime "
        f"{fmt_bytes(d.runtime_overhead_bytes)} (context, workspaces, collectives)  =  "
        f"[bold]device peak {fmt_bytes(d.device_peak_bytes)}[/bold]  ({kind})")
    if plan.peak_phase == "model-load":
        console.print(f"model load peak {fmt_bytes(d.load_peak_bytes)} sets the peak")
    if d.load_stranded_bytes:
        console.print(f"the model load leaves {fmt_bytes(d.load_stranded_bytes)} cached in blocks "
                      "the step cannot reuse (in the reserved peak; expandable segments would "
                      "reuse them)")
    _fit(plan, headroom)
    if plan.host is not None:
        _host(plan)
    for diff in plan.differences:
        console.print(f"[yellow]traced vs analytic[/yellow]: {diff['component']} "
                      f"{fmt_bytes(diff['traced_bytes'])} traced, "
                      f"{fmt_bytes(diff['analytic_bytes'])} analytic - {escape(diff['why'])}")
    if plan.assumptions:
        console.print("assumes: " + escape("; ".join(plan.assumptions)))
    for w in plan.warnings:
        console.print("[yellow]warning[/yellow]: " + escape(w))


def _objective(spec) -> None:
    """The objective's arithmetic, when it is not SFT: lengths, reference, generation."""
    from tunepilot.spec.objective import generation_batch, lengths, useful_unit

    o = spec.objective
    if o.kind == "sft":
        return
    ln, unit = lengths(spec), useful_unit(spec)
    ref = o.reference_kind(spec.method.kind)
    parts = [f"objective {o.kind} (loss {o.effective_loss_type}, beta "
             f"{fmt_number(o.effective_beta)})", f"prompt {ln.prompt:,} + completion "
             f"{ln.completion:,} tokens", f"reference: {ref}"]
    if o.generative:
        g = o.generation
        backend = g.backend + (f" at {g.gpu_memory_utilization:g} of the card"
                               + (", sleep mode" if g.sleep_mode else "")
                               if g.backend == "vllm-colocate" else "")
        parts.append(f"{o.generations} completions per prompt, {generation_batch(spec):,} "
                     f"generated at once per device ({backend})")
    parts.append(f"useful unit: {unit.how}")
    console.print("; ".join(parts))


def _components(plan: MemoryPlan) -> None:
    b, d = plan.bytes_per_param, plan.per_device
    t = table("Per device, by component", ["component", "bytes / param", "size"],
              ("bytes / param", "size"))
    t.add_row("weights", f"{fmt_number(b['weights_per_param'])} per param",
              fmt_bytes(d.weights_bytes))
    t.add_row("master weights",
              f"{fmt_number(b['master_weights_per_trainable_param'])} per trainable",
              fmt_bytes(d.master_weights_bytes))
    t.add_row("gradients", f"{fmt_number(b['gradients_per_trainable_param'])} per trainable",
              fmt_bytes(d.gradients_bytes))
    t.add_row("optimizer state",
              f"{fmt_number(b['optimizer_per_trainable_param'])} per trainable",
              fmt_bytes(d.optimizer_bytes))
    per_token = d.activations_bytes / max(plan.tokens_per_micro_batch, 1)
    t.add_row("activations (saved)", f"{per_token:,.0f} B per token",
              fmt_bytes(d.activations_bytes))
    t.add_row("temporaries", "", fmt_bytes(d.temporary_bytes))
    if d.collective_buffers_bytes:
        t.add_row("collective buffers", "", fmt_bytes(d.collective_buffers_bytes))
    t.add_row("model states", f"{fmt_number(b['model_states_per_param'])} per param", "")
    console.print(t)


def _timeline(plan: MemoryPlan) -> None:
    cols = ["phase", "weights+master", "grads", "optimizer", "activations", "temporaries",
            "total"]
    t = table("Timeline of one step (live bytes; the peak is the largest phase, not a sum)",
              cols, cols[1:])
    for ph in plan.phases:
        mark = " <- peak" if ph.name == plan.peak_phase else ""
        t.add_row(ph.name + mark, fmt_bytes(ph.weights_bytes + ph.master_weights_bytes),
                  fmt_bytes(ph.gradients_bytes), fmt_bytes(ph.optimizer_bytes),
                  fmt_bytes(ph.activations_bytes),
                  fmt_bytes(ph.temporary_bytes + ph.collective_buffers_bytes),
                  fmt_bytes(ph.total_bytes))
    console.print(t)


def _fit(plan: MemoryPlan, headroom: float) -> None:
    cols = ["card", "capacity", "device peak", "fits", "free", "DDP cards", "FSDP cards",
            "max micro-batch", "max seq len"]
    t = table(f"Fit per card (headroom {headroom:.0%}; capacity as the device reports it, sold "
              "in GB = 10^9 bytes)", cols, cols[1:])
    reserved = [r for r in plan.cards if r.generation_reserve_bytes]
    for row in plan.cards:
        need = row.devices_needed
        t.add_row(row.card, fmt_bytes(row.capacity_bytes, decimal=True),
                  fmt_bytes(row.device_peak_bytes), "yes" if row.fits else "[red]no[/red]",
                  f"{row.headroom_fraction:.0%}", cell(need.ddp) if need.ddp else "never",
                  cell(need.fsdp) if need.fsdp else ">1024", cell(row.max_micro_batch),
                  cell(row.max_sequence_length))
    console.print(t)
    for row in reserved:
        console.print(f"{row.card}: device peak {fmt_bytes(row.device_peak_bytes)} = "
                      f"{escape(row.peak_phase or '')} - vLLM reserves "
                      f"{fmt_bytes(row.generation_reserve_bytes)} of this card (COMPUTED: "
                      "vLLM's allocator does not run on a CPU)")


def _host(plan: MemoryPlan) -> None:
    h = plan.host
    t = table(f"Host RAM per node ({h.ranks_per_node} rank(s) per node, {h.nodes} node(s); "
              f"weights loaded {h.load}; projected)",
              ["component", "per process", "processes", "per node", "phases", "how"],
              ("per process", "processes", "per node"))
    for c in h.components:
        t.add_row(c.name + (" (pinned)" if c.pinned else ""), fmt_bytes(c.bytes_per_rank),
                  cell(c.holders), fmt_bytes(c.bytes_per_node), ", ".join(c.phases),
                  escape(c.how))
    console.print(t)
    phases = "  ".join(f"{p.name} {fmt_bytes(p.bytes_per_node)}"
                       + (" <- peak" if p.name == h.peak_phase else "") for p in h.phases)
    console.print(f"host phases per node: {phases}")
    disk = ", ".join(f"{d.name} {fmt_bytes(d.bytes_per_node, decimal=True)}" for d in h.disk)
    console.print(f"local disk per node: {fmt_bytes(h.disk_bytes_per_node, decimal=True)} "
                  f"({disk}); the export: {fmt_bytes(h.export_bytes, decimal=True)} "
                  f"({EXPORT_RULE})")
    cols = ["card", "offer", "host RAM usable", "host peak", "host fits", "local disk",
            "disk need", "binds"]
    t = table("Host fit per offer (the node's share of the instance; host RAM at "
              "runtime.yaml host.usable_fraction)", cols, cols[2:4] + cols[5:7])
    for row in plan.cards:
        f = row.host
        if f is None:
            continue
        ok = {True: "yes", False: "[red]no[/red]", None: "[yellow]not listed[/yellow]"}
        t.add_row(row.card, escape(f.instance or ("listed" if f.source else "-")),
                  fmt_bytes(f.host_usable_bytes_per_node), fmt_bytes(f.host_peak_bytes_per_node),
                  ok[f.host_fits], fmt_bytes(f.local_disk_bytes_per_node, decimal=True),
                  fmt_bytes(f.disk_bytes_per_node, decimal=True), f.binds)
    console.print(t)
    for row in plan.cards:
        if row.host is not None and row.host.reason:
            console.print(f"[red]{row.card}[/red]: {escape(row.host.reason)}")
        if row.host is not None and row.host.warning:
            console.print(f"[yellow]{row.card}[/yellow]: {escape(row.host.warning)}")
    for note in h.notes:
        console.print(f"host: {escape(note)}")


def render_rows(title: str, columns: list[str], rows: list[dict]) -> None:
    """A list of plain rows (presets, cards)."""
    t = table(title, columns)
    for r in rows:
        t.add_row(*[cell(r.get(c)) for c in columns])
    console.print(t)
