"""The traced memory plan: the spec's real training step, run on fake tensors on a CPU.

`traced_plan` (plan/api.py make_plan(spec, "traced")) builds the user's run (transformers +
PEFT, as the pilot builds it, with tunepilot.training.build.build_run) on the meta device, turns
every parameter and buffer into a fake CPU tensor (FakeTensorMode: shapes, dtypes and aliasing,
no data) and runs two optimizer steps of
tunepilot.training.step's step - forward_loss, backward, update (clip, step, zero_grad, schedule) -
under `StorageTracker` (plan/trace/tracker.py). The peak of step 2 counts: optimizer state exists
from step 1. Gradient accumulation: step 2 runs min(accumulation, 3) micro-batches; micro-batches
after the second repeat its allocations exactly (same shapes), and the third shows it.

The trace runs in a child process (plan/trace/step.py, through tunepilot.proc.child): an abort
inside PyTorch (e.g. fake CUDA tensors reaching a kernel without a device guard) becomes a
fallback to the analytic plan with the reason, never a crash of the CLI. The parent never imports
torch.

What the trace maps to the target card rather than traces (each says so in `assumptions`):
  attention  fake *CPU* tensors take the CPU flash-attention kernel, which saves the output and
             the logsumexp, as CUDA flash / memory-efficient attention do (the meta device would
             take the math path with an s x s matrix per head; fake CUDA tensors abort).
  QLoRA      bitsandbytes is CUDA-only: the frozen base is traced as bf16 linears whose storage is
             counted as bitsandbytes lays out NF4 (packed codes + absmax, tracker.nf4_parts),
             each matmul dequantising a bf16 weight-sized temporary in forward and again in
             backward, as bnb's MatMul4Bit does.
  8-bit and paged optimizers (bitsandbytes): a stand-in with the same state (uint8 + absmax).
  DDP        gradient buckets added to every phase (a second copy of the gradients).
  FSDP       traced per rank (plan/trace/fsdp.py): rank 0 of a fake process group of the
             spec's world size, sharded as the scaling worker shards it; CPU offload moves the
             traced rank's sharded states to the host by their role.
  reserve    the traced allocations replayed through the CUDA caching allocator's rules
             (plan/reserve/allocator.py), plus the varied-shapes term (plan/reserve/core.py).
  runtime    context, workspaces and collective buffers from analytic.runtime_constants, as the
             analytic plan does, so both share one schema.
The inverse queries of the fit table (max micro-batch, max sequence length, device counts) use
the analytic planner scaled by the traced/analytic ratio of model states and of the rest.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tunepilot.model.arch import Arch, resolve_model_config
from tunepilot.plan.analytic.core import (
    LIGER_VALIDATION_NOTE,
    analytic_plan,
    checkpoint_note,
    lever_notes,
    offload_note,
    per_device_figures,
)
from tunepilot.plan.analytic.parallel import grads_kept
from tunepilot.plan.analytic.variants import (
    in_use,
    kernel_notes,
    offloads_activations,
    validation_spec,
    without_offload,
)
from tunepilot.plan.fit import Planner
from tunepilot.plan.reserve.core import (
    expandable_segments,
    held_bytes,
    reserve,
    reserve_note,
    varied_shapes,
)
from tunepilot.plan.trace.messages import TracedPhase, TraceJob, TraceResult
from tunepilot.proc.child import ChildFailed, run_child
from tunepilot.results.plan import TRACED_COMPONENTS, MemoryPlan, ParamSplit, PerDevice, Phase
from tunepilot.spec import RunSpec

# Environment knob (tests and benchmarks; not a user flag).
ENV_TIMEOUT = "TUNEPILOT_TRACE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900


class TraceFailed(Exception):
    """The trace could not run; the message is the reason shown with the analytic fallback."""


# ============================================================================ the parent side


def traced_plan(spec: RunSpec, stack: str, base_dir: Path | None = None,
                timeout_s: float | None = None) -> tuple[MemoryPlan, Arch, Planner]:
    """(the traced plan of `spec` on ``stack``, its architecture, the planner of the fit
    table's inverse queries: the analytic one scaled by the trace). Falls back to the analytic
    plan (fidelity "analytic", the reason first in `assumptions` and in
    `trace["fallback_reason"]`) when the trace fails for any reason."""
    config = resolve_model_config(spec, base_dir)
    arch = Arch.from_config(config)
    analytic = analytic_plan(spec, arch, stack)
    t0 = time.perf_counter()
    try:
        plan = traced_plan_from(spec, trace_in_child(spec, config, stack, timeout_s=timeout_s),
                                analytic, stack, arch)
    except TraceFailed as exc:
        return _fallback(analytic, str(exc)), arch, analytic_plan
    plan.trace["wall_s"] = round(time.perf_counter() - t0, 2)
    return plan, arch, scaled_planner(plan, analytic)


def trace_in_child(spec: RunSpec, config: dict, stack: str, *,
                   timeout_s: float | None = None) -> TraceResult:
    """Run `trace_step` in a fresh Python process; its result, or TraceFailed with the reason
    (also when the result is not one this version can read)."""
    from tunepilot.plan.trace.parallel import trace_target
    from tunepilot.spec.fp8 import bf16_stand_in

    timeout = float(timeout_s or os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S)
    target, config = trace_target(spec, config, Arch.from_config(config))
    job = TraceJob(spec=bf16_stand_in(target).model_dump(mode="json"), config=config,
                   stack=stack, rank_step=spec.parallel.strategy == "deepspeed")
    try:
        return run_child("tunepilot.plan.trace.step", job, TraceResult, timeout_s=timeout,
                         what="the trace process")
    except ChildFailed as exc:
        reason = exc.reason
        if "took longer" in reason:
            reason += f" (set {ENV_TIMEOUT} to allow more)"
        elif exc.error:
            reason = f"tracing failed: {reason}"
        raise TraceFailed(reason) from None


def _fallback(analytic: MemoryPlan, reason: str) -> MemoryPlan:
    plan = analytic.model_copy(deep=True)
    plan.trace = {"status": "fallback", "fallback_reason": reason}
    plan.assumptions = [f"trace failed, so this is the analytic plan: {reason}"] + list(
        analytic.assumptions)
    return plan


# ---------------------------------------------------------------------------- building the plan


def _phase_bytes(p: TracedPhase) -> dict:
    return {c: getattr(p, f"{c}_bytes") for c in TRACED_COMPONENTS}


def grads_made_and_gone(spec: RunSpec) -> str:
    """Why the run's gradients do not pile up as the traced single-device step's do (empty when
    they do): ZeRO-2/3 reduce each into its partition as it is made, a kept buffer holds them
    all from the start, the optimizer in the backward steps and frees each at once."""
    if spec.parallel.strategy == "deepspeed" and spec.parallel.deepspeed.stage >= 2:
        return (f"ZeRO-{spec.parallel.deepspeed.stage} reduces each gradient into the rank's "
                "partition as it is made, so the backward's peak is where the traced step held "
                "the most besides its gradients (the start of the backward, every checkpoint "
                "alive), with the partition added - not the traced instant that held them all")
    if grads_kept(spec):
        return ("the gradients live in one buffer allocated before the step and kept (Megatron's "
                "main grads, DeepSpeed's fp32 buffer), so the backward's peak is where the traced "
                "step held the most besides its gradients, with the whole buffer added")
    if spec.optimizer_in_backward:
        return ("optimizer_in_backward steps and frees each gradient as it is made: each "
                "phase's peak is the larger of the traced instant (its gradients cut to the "
                "largest) and the instant that held the most besides gradients")
    return ""


def _larger_of_twins(phases: list[dict]) -> list[dict]:
    """Each phase, or its twin (the same phase at its instant of most non-gradient bytes, as
    the strategy holds it) where that holds more; the twins dropped."""
    def total(p: dict) -> int:
        return sum(v for k, v in p.items() if k in TRACED_COMPONENTS or k == "collective_buffers")

    twin = {p["name"]: p for p in phases if p.get("twin")}
    out = []
    for p in (q for q in phases if not q.get("twin")):
        t = twin.get(p["name"])
        q = dict(t if t is not None and total(t) > total(p) else p)
        q.pop("twin", None)
        out.append(q)
    return out


def _modelled_on_trace(spec: RunSpec, arch: Arch | None, raw: TraceResult, stack: str,
                       phases_in: list[dict], notes: list[str]) -> list[dict]:
    """What the CPU trace cannot run, modelled on its phases: activation offloading and the
    optimizer in the backward, torch.compile's fusion, FP8 over its bf16 stand-in."""
    if offloads_activations(spec) or spec.optimizer_in_backward:
        phases_in = _levers_on_trace(spec, arch, raw, phases_in)
        notes += lever_notes(spec)
    if spec.torch_compile:  # the trace runs eager: compile's fusion is modelled on top of it
        from tunepilot.plan.analytic.activations import COMPILE_SAVED_FRACTION

        if arch is None:
            raise ValueError("a compiled spec on a traced plan needs the architecture")
        phases_in = _difference_on_trace(spec, spec.with_changes(torch_compile=False), arch,
                                         stack, phases_in)
        notes.append(f"torch_compile: traced eager; compile's difference from the analytic "
                     f"plan (a layer's pointwise outputs x {COMPILE_SAVED_FRACTION:g}, recomputed "
                     "by Inductor: every layer's without checkpointing, the recomputed layer's "
                     "with it - checkpointed tensors are kept as they are) (MODELLED, not "
                     "traced)")
    if spec.precision.is_fp8:  # the trace ran the bf16 stand-in: FP8 is modelled on top
        from tunepilot.spec.fp8 import bf16_stand_in

        if arch is None:
            raise ValueError("an FP8 spec on a traced plan needs the architecture")
        phases_in = _difference_on_trace(spec, bf16_stand_in(spec), arch, stack, phases_in)
        notes.append(f"{spec.precision}: traced as bf16-mixed (FP8 kernels do not run on a "
                     "CPU); FP8's difference in each phase - weight casts, saved inputs, the "
                     "FP8 working set, the FP8 all-gather - from the analytic model "
                     "(plan/analytic/fp8.py), MODELLED, not traced")
    return phases_in


def _strategy_on_trace(spec: RunSpec, arch: Arch | None, raw: TraceResult,
                       phases_in: list[dict], notes: list[str]) -> tuple[list[dict], int]:
    """The traced rank under its strategy: (its phases, the collective buffers) - FSDP's shard
    (and CPU offload), tensor/context parallel, DeepSpeed ZeRO, DDP's gradient buckets."""
    strategy = spec.parallel.strategy
    buckets = 0
    dp = spec.parallel.replicas
    sharded = strategy == "fsdp" and dp > 1
    if sharded and (raw.fsdp_version is None or raw.world_size != dp):
        raise TraceFailed(f"the trace is of {raw.world_size} device(s) without FSDP, the spec "
                          f"shards over {dp} ranks; trace the spec itself (plan --trace)")
    if spec.parallel.model_parallel:  # sequence parallel's split, the ring's buffers
        from tunepilot.plan.trace.parallel import parallel_on_trace

        phases_in = parallel_on_trace(spec, arch, phases_in)
    if sharded and spec.parallel.cpu_offload:
        phases_in, host = _offloaded(phases_in, raw.model.buffer_bytes)
        notes.append(offload_note(host) + " (the traced rank's sharded states moved to the "
                     "host by their tracked role; the unsharded layers, buffers and "
                     "activations stay as traced)")
    elif strategy == "deepspeed":
        from tunepilot.plan.trace.parallel import zero_on_trace

        phases_in, buckets, _host, zero_notes = zero_on_trace(spec, arch, raw, phases_in)
        notes += zero_notes
    elif strategy == "ddp" and dp > 1:
        buckets = raw.model.trainable_bytes
        notes.append("DDP: gradient buckets (a second copy of the gradients, PyTorch's default "
                     "gradient_as_bucket_view=False) added to every phase")
    if strategy != "deepspeed" and grads_kept(spec):  # Megatron's main-grad buffer
        kept = max(p["gradients"] for p in phases_in)
        phases_in = [dict(p, gradients=kept) for p in phases_in]
    return phases_in, buckets


def traced_plan_from(spec: RunSpec, raw: TraceResult, analytic: MemoryPlan, stack: str,
                     arch: Arch | None = None) -> MemoryPlan:
    """Turn the child's trace (single device) into the plan of `spec` on one of its ranks
    (``arch`` for what is modelled on top of the trace: activation offloading)."""
    N, strategy = spec.parallel.world_size, spec.parallel.strategy
    notes = list(raw.notes)
    if arch is None and (spec.parallel.model_parallel or strategy == "deepspeed"):
        raise ValueError("a tensor/context-parallel or DeepSpeed spec's traced plan needs the "
                         "architecture")
    from tunepilot.plan.trace.parallel import target_notes

    notes += target_notes(spec)
    if arch is not None and in_use(spec):  # what the kernels and adapter variants change
        notes += kernel_notes(arch, spec)
    if arch is not None:
        from tunepilot.plan.analytic.phases import objective_notes

        notes += objective_notes(spec, arch)
    phases_in = [dict(_phase_bytes(p), name=p.name) for p in raw.phases]
    twins = grads_made_and_gone(spec)
    if twins:  # each phase's instant with the most non-gradient bytes, carried alongside
        phases_in += [dict(p.sans_grad_bytes, name=p.name, twin=True) for p in raw.phases
                      if p.sans_grad_bytes]
    phases_in = _modelled_on_trace(spec, arch, raw, stack, phases_in, notes)
    phases_in, buckets = _strategy_on_trace(spec, arch, raw, phases_in, notes)
    if twins:
        phases_in = _larger_of_twins(phases_in)
        notes.append(twins)
    dp = spec.parallel.replicas
    sharded = strategy == "fsdp" and dp > 1
    phases = [Phase.of(p["name"], dict(p, collective_buffers=buckets)) for p in phases_in]
    phases += _checkpoint_on_trace(phases, analytic, buckets, notes)
    peak = max(phases, key=lambda p: p.total_bytes)
    load_peak = analytic.per_device.load_peak_bytes
    expandable = expandable_segments(spec, stack)
    slack, a = replay_slack(spec, raw, expandable)

    def figures(ph: list[Phase], slack_bytes: int | None) -> PerDevice:
        return per_device_figures(ph, buckets, stack, N, load_peak,
                                  replay_slack_bytes=slack_bytes, varied=varied_shapes(spec),
                                  expandable=expandable,
                                  stranded_bytes=analytic.per_device.load_stranded_bytes)

    per_device = figures(phases, slack)
    if peak.name == "checkpoint-save":  # not traced: its reserve by the analytic rule, or the
        per_device = figures(phases, None)  # traced step's replayed one where that is larger
        step = figures([p for p in phases if p is not peak], slack)
        if step.reserved_peak_bytes > per_device.reserved_peak_bytes:
            per_device = per_device.model_copy(update={
                k: getattr(step, k) for k in ("reserved_peak_bytes", "device_peak_bytes")})
    if load_peak > peak.total_bytes:
        notes.append("loading the model sets the peak, not the training step (load peak from "
                     "the analytic plan; loading is not traced)")
    elif peak.name == "validation" and validation_spec(spec) is not spec:
        notes.append(LIGER_VALIDATION_NOTE)
    notes.append(reserve_note(varied_shapes(spec), replayed=a is not None,
                              expandable=expandable,
                              asked_unsupported=stack if spec.allocator.expandable_segments
                              and not expandable else None))
    m = raw.model
    params = ParamSplit(total=m.total_params, trainable=m.trainable_params,
                        frozen=m.total_params - m.trainable_params)
    shard = dp if strategy == "fsdp" else 1
    trace = raw.facts()
    trace.update(status="traced", peak_phase=peak.name,
                 fsdp=_fsdp_facts(raw, peak.name) if sharded else None)
    plan = MemoryPlan(
        fidelity="trace", params=params, per_device=per_device, phases=phases,
        peak_phase=peak.name if load_peak <= peak.total_bytes else "model-load",
        bytes_per_param=_bytes_per_param(params, per_device, shard),
        tokens_per_micro_batch=spec.batch.positions_per_micro_batch,
        tokens_per_optimizer_step=spec.batch.positions_per_step, world_size=N,
        strategy=strategy, stack=stack, assumptions=notes, trace=trace)
    plan.differences = differences(plan, analytic)
    verdict = trusted(plan, analytic)
    if verdict is not None:
        plan.trace["trusted"] = verdict
        plan.assumptions.append(verdict["text"])
    return plan


def _checkpoint_on_trace(phases: list[Phase], analytic: MemoryPlan, buckets: int,
                         notes: list[str]) -> list[Phase]:
    """FSDP1's sharded checkpoint save (not traced): the analytic plan's clones and unsharded
    units beside the traced states between steps."""
    ck = next((p for p in analytic.phases if p.name == "checkpoint-save"), None)
    if ck is None:
        return []
    st = next((p for p in phases if p.is_optimizer), phases[-1])
    notes.append(checkpoint_note(ck.temporary_bytes, False) + " (MODELLED, not traced: the "
                 "analytic plan's clones beside the traced states)")
    return [Phase.make("checkpoint-save", st.weights_bytes, st.master_weights_bytes, 0,
                       st.optimizer_bytes, 0, ck.temporary_bytes, buckets)]


def replay_slack(spec: RunSpec, raw: TraceResult, expandable: bool) -> tuple[int | None, object]:
    """The replay's reserved peak over its allocated peak (None: nothing replayed), and the
    allocator figures. A DeepSpeed rank steps its own partition, not the single device's whole
    model: its slack is the replay's without the traced optimizer steps (plan/trace/replay.py
    rank_step_events)."""
    a = raw.allocator
    if a is None:
        return None, None
    r = a.rank_step if spec.parallel.strategy == "deepspeed" and a.rank_step else {
        "reserved_peak_bytes": a.reserved_peak_bytes,
        "allocated_peak_bytes": a.allocated_peak_bytes,
        "expandable_reserved_peak_bytes": a.expandable_reserved_peak_bytes}
    reserved = r["expandable_reserved_peak_bytes"] if expandable else r["reserved_peak_bytes"]
    return reserved - r["allocated_peak_bytes"], a


TRUST_FRACTION = 0.10  # a traced and an analytic peak this far apart: the plan says which it uses


def trusted(traced: MemoryPlan, analytic: MemoryPlan) -> dict | None:
    """Where the traced and the analytic allocated peaks differ by more than TRUST_FRACTION,
    which one the plan uses and why: the trace, which ran the step's real operations (the
    implementation's kernels, casts, views and temporaries) where the analytic plan derives them
    per token - naming the components that differ and what the trace modelled rather than ran
    (plan.assumptions' MODELLED notes), which both share."""
    t = traced.per_device.allocated_peak_bytes
    a = analytic.per_device.allocated_peak_bytes
    gap = t / a - 1 if a else 0.0
    if abs(gap) <= TRUST_FRACTION:
        return None
    parts = [f"{d['component']} ({d['why']})" for d in traced.differences] or \
        ["the peak phase's mix of components"]
    modelled = [n.split(":")[0] for n in traced.assumptions if "MODELLED" in n]
    text = (f"traced and analytic allocated peaks differ by {gap:+.0%} "
            f"({t / 2**30:.2f} vs {a / 2**30:.2f} GiB): the plan uses the trace, which ran the "
            "step's own operations where the analytic plan derives them per token; they "
            f"differ in {'; '.join(parts)}"
            + (f" (modelled alike in both: {', '.join(modelled)})" if modelled else ""))
    return {"uses": "trace", "difference_fraction": round(gap, 4), "text": text}


def _bytes_per_param(params: ParamSplit, d, shard: int) -> dict:
    tr, total = max(params.trainable, 1), max(params.total, 1)
    w, mw, g, o = (d.weights_bytes, d.master_weights_bytes, d.gradients_bytes, d.optimizer_bytes)
    return {"weights_per_param": w * shard / total,
            "master_weights_per_trainable_param": mw * shard / tr,
            "gradients_per_trainable_param": g * shard / tr,
            "optimizer_per_trainable_param": o * shard / tr,
            "model_states_per_param": (w + mw + g + o) * shard / total}


DIFFERENCE_FRACTION = 0.05  # plan prints a component where traced and analytic differ by more
_WHY = {
    "weights": "parameter storage as built (buffers, tied weights, NF4 layout) vs the counted "
               "parameters",
    "master_weights": "trainable fp32 parameters as built vs counted",
    "gradients": "gradient storage as autograd allocates it vs one per trainable parameter",
    "optimizer": "the optimizer's state tensors as it creates them (small tensors, step "
                 "counters) vs the bytes-per-parameter table",
    "activations": "what autograd saved in the real ops (the implementation's kernels, casts "
                   "and views) vs the per-token derivation",
    "temporary": "the transient buffers of the real ops (loss backward, casts, optimizer "
                 "temporaries) vs the derivation's largest one",
}


def differences(traced: MemoryPlan, analytic: MemoryPlan) -> list[dict]:
    """Components whose traced and analytic figures differ by more than DIFFERENCE_FRACTION of
    the analytic device peak or of themselves, with the reason the two can differ."""
    out = []
    a_peak = max(analytic.per_device.allocated_peak_bytes, 1)
    for comp in _WHY:
        t = getattr(traced.per_device, f"{comp}_bytes")
        a = getattr(analytic.per_device, f"{comp}_bytes")
        if abs(t - a) > DIFFERENCE_FRACTION * max(a, 1) and abs(t - a) > 0.01 * a_peak:
            out.append({"component": comp, "traced_bytes": t, "analytic_bytes": a,
                        "difference_fraction": (t - a) / a if a else None, "why": _WHY[comp]})
    return out


def _fsdp_facts(raw: TraceResult, peak_name: str) -> dict:
    """What FSDP held at the traced peak, by label: the unsharded parameters, the all-gather
    and reduce-scatter buffers (bytes on the traced rank)."""
    ph = next((p for p in raw.phases if p.name == peak_name), None)
    held = ph.labelled_bytes if ph is not None else {}
    return {"version": raw.fsdp_version, "world_size": raw.world_size, "how": "traced per rank",
            "unsharded_params_bytes": held.get("unsharded", 0),
            "all_gather_bytes": held.get("all-gather", 0),
            "reduce_scatter_bytes": held.get("reduce-scatter", 0)}


def _offloaded(phases: list[dict], buffer_bytes: int = 0) -> tuple[list[dict], int]:
    """FSDP CPU offload: the sharded states leave the device (buffers, which FSDP does not shard
    or offload, stay: QLoRA's absmax); the optimizer steps on the host (its temporaries with it).
    The host bytes: the largest sharded states of any phase."""
    host = max(p["weights"] + p["master_weights"] + p["gradients"] + p["optimizer"]
               for p in phases) - buffer_bytes
    out = []
    for p in phases:
        q = dict(p, weights=min(p["weights"], buffer_bytes), master_weights=0, gradients=0,
                 optimizer=0)
        if p["name"].startswith("optimizer"):
            q["temporary"] = 0
        out.append(q)
    return out, max(host, 0)


def _levers_on_trace(spec: RunSpec, arch: Arch | None, raw: TraceResult, phases: list[dict]
                     ) -> list[dict]:
    """torchtune's levers on the traced (plain) step, as the analytic plan models them:
    optimizer_in_backward keeps at most the largest trainable tensor's gradient; activation
    offloading keeps the in-flight layers' share of the decoder layers' saved activations
    (the loss's saved tensors stay on the device)."""
    from tunepilot.plan.analytic.activations import logits_bytes, precision_bytes, saved_activations

    largest = max((b for _, b, t in raw.model.param_rows if t), default=0)
    keep, logits_kept = 1.0, 0
    if offloads_activations(spec):  # torchtune's, or Unsloth's offloaded checkpointing
        if arch is None:
            raise ValueError("activation_offloading on a traced plan needs the architecture")
        cb, sb, _ = precision_bytes(spec)
        tokens = spec.batch.positions_per_micro_batch
        plain = without_offload(spec)
        full, _ = saved_activations(arch, plain, cb, sb, tokens)
        dev, _ = saved_activations(arch, spec, cb, sb, tokens)
        keep = dev / full if full else 1.0
        logits_kept, _ = logits_bytes(arch, spec, cb, tokens)
    out = []
    for p in phases:
        q = dict(p)
        if spec.optimizer_in_backward:
            q["gradients"] = min(p["gradients"], largest)
            if p["name"].startswith("optimizer"):
                q["temporary"] = min(p["temporary"], largest)
        if keep < 1.0 and not p["name"].startswith(("optimizer", "validation")):
            loss_part = min(p["activations"], logits_kept)
            q["activations"] = loss_part + int((p["activations"] - loss_part) * keep)
        out.append(q)
    return out


def _difference_on_trace(spec: RunSpec, traced_as: RunSpec, arch: Arch, stack: str,
                         phases: list[dict]) -> list[dict]:
    """Each traced phase (of ``traced_as``: FP8's bf16 stand-in, a compiled step run eager)
    plus the spec's difference from it in the analytic plan's matching phase (per component,
    never below zero)."""
    want = {p.name: p for p in analytic_plan(spec, arch, stack).phases}
    base = {p.name: p for p in analytic_plan(traced_as, arch, stack).phases}
    backward = max(("loss-backward", "backward-end"), key=lambda n: base[n].total_bytes)
    out = []
    for p in phases:
        name = p["name"]
        match = ("forward-end" if name.endswith("forward") else backward
                 if name.endswith("backward") else "optimizer-step"
                 if name.startswith("optimizer") else name if name in want else None)
        q = dict(p)
        if match is not None:
            for c in TRACED_COMPONENTS:
                delta = getattr(want[match], f"{c}_bytes") - getattr(base[match], f"{c}_bytes")
                q[c] = max(0, p[c] + delta)
        out.append(q)
    return out


def scaled_planner(traced: MemoryPlan, analytic: MemoryPlan):
    """An analytic planner scaled by traced/analytic ratios taken at the spec, for the inverse
    queries (max micro-batch, max sequence length, device counts), which would otherwise need
    one trace per candidate. Three ratios, each of like phases: model states (largest phase of
    each plan), the rest of the forward/backward phases (activations, temporaries, buffers:
    what grows with tokens) and the rest of the optimizer step (its temporaries)."""
    r_states = _ratio(max(map(_states, traced.phases)), max(map(_states, analytic.phases)))
    r_act = _ratio(_rest_max(traced, False), _rest_max(analytic, False))
    r_opt = _ratio(_rest_max(traced, True), _rest_max(analytic, True))

    def planner(spec: RunSpec, arch: Arch, stack: str) -> MemoryPlan:
        a = analytic_plan(spec, arch, stack)
        step = max(int(_states(ph) * r_states + _rest(ph) * (r_opt if _is_opt(ph) else r_act))
                   for ph in a.phases)
        d = a.per_device
        workspace = d.allocated_peak_bytes - max(max(p.total_bytes for p in a.phases),
                                                 d.load_peak_bytes)
        allocated = max(step, d.load_peak_bytes) + workspace
        a_peak = max(a.phases, key=lambda p: p.total_bytes)
        transient = int((a_peak.total_bytes - a_peak.states_bytes) * r_act)
        d.allocated_peak_bytes = allocated
        d.reserved_peak_bytes = reserve(
            held_bytes(allocated, step + workspace, d.load_stranded_bytes), transient, varied=varied_shapes(spec),
            expandable=expandable_segments(spec, stack)).reserved_bytes
        d.device_peak_bytes = d.reserved_peak_bytes + d.runtime_overhead_bytes
        return a

    return planner


def _states(p: Phase) -> int:
    return p.states_bytes


def _rest(p: Phase) -> int:
    return p.total_bytes - p.states_bytes


def _is_opt(p: Phase) -> bool:
    return p.is_optimizer


def _rest_max(plan: MemoryPlan, optimizer: bool) -> int:
    return max((_rest(p) for p in plan.phases if _is_opt(p) == optimizer), default=0)


def _ratio(a: int, b: int) -> float:
    return a / b if b > 0 else 1.0
