"""The pilot against its plan: the device-wide reading, the residual per component, and the
calibration ratios later plans apply (plan/calibrate.py, `plan --calibrate`)."""

from __future__ import annotations

from tunepilot.results.figure import Figure
from tunepilot.results.pilot import Calibration, PlanVsMeasured, Residual

CALIBRATED_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "temporary")
M = Figure.measured


def _rows(s) -> list[tuple[str, int, int | None, str]]:
    d, mem, a = s.plan.per_device, s.step_memory, s.m.allocator
    rows: list[tuple[str, int, int | None, str]] = []
    if mem is not None:
        rows += [
            ("weights", d.weights_bytes + d.master_weights_bytes, mem.weights_bytes,
             "parameters + buffers (the plan's weights + master weights)"),
            ("gradients", d.gradients_bytes, mem.gradients_bytes, "at the optimizer step"),
            ("optimizer", d.optimizer_bytes, mem.optimizer_bytes, "state after the step"),
            ("activations", d.activations_bytes, mem.activations_bytes,
             "alive at the start of backward (saved tensors, logits)"),
            ("temporary", d.temporary_bytes, mem.temporary_bytes,
             "largest transient beyond the phase's live tensors"),
        ]
    alloc = a.steady_peak_allocated_bytes if s.gpu else (mem.peak_bytes if mem else None)
    rows.append(("allocated_peak", d.allocated_peak_bytes, alloc,
                 "allocator max_memory_allocated" if s.gpu else "tracked tensor peak"))
    if s.gpu:
        rows.append(("reserved_peak", d.reserved_peak_bytes, a.steady_peak_reserved_bytes,
                     "allocator max_memory_reserved"))
        if s.m.reading is not None:
            delta = s.m.reading.peak_minus_baseline_bytes
            reserved = a.max_reserved_bytes
            rows.append(("runtime_overhead", d.runtime_overhead_bytes,
                         delta - reserved if reserved is not None else None,
                         "device-wide peak minus reserved peak"))
            rows.append(("device_peak", d.device_peak_bytes, delta,
                         "device-wide peak minus the pre-run baseline"))
    return rows


def plan_vs_measured(s) -> PlanVsMeasured:
    """Residual per component: measured - planned (bytes) and measured / planned."""
    plan = s.plan
    comps = {}
    for name, planned, measured, what in _rows(s):
        row = Residual(planned=Figure.projected(planned, "bytes",
                                                f"{plan.fidelity} plan, {plan.stack} stack"),
                       measured=M(measured, "bytes", why="not measured (the run did not fit)"),
                       what=what)
        if measured is not None:
            row.residual_bytes = M(measured - planned, "bytes", rule="measured - planned")
            row.ratio = M(measured / planned if planned else None, "ratio",
                          rule="measured / planned")
        comps[name] = row
    return PlanVsMeasured(plan_fidelity=plan.fidelity, stack=plan.stack,
                          peak_phase=plan.peak_phase, components=comps,
                          note="the plan describes step 2+ (optimizer state exists), as the "
                               "probe step is")


def calibration(s, pvm: PlanVsMeasured) -> Calibration | None:
    """The residual ratios later plans apply (plan/calibrate.py, `plan --calibrate`)."""
    ratios = {c: pvm.components[c].ratio.value for c in CALIBRATED_COMPONENTS
              if c in pvm.components and pvm.components[c].ratio is not None
              and pvm.components[c].ratio.value is not None}
    if not ratios:
        return None
    out = Calibration(stack=s.device.kind, card_id=s.device.card_id, device=s.device.name,
                      model_config_sha256=s.arch.config_hash, spec_hash=s.spec.spec_hash(),
                      micro_batch_size=s.pilot_spec.micro_batch_size,
                      sequence_length=s.longest["sequence_length"] if s.longest else None,
                      ratios=ratios)
    a = s.m.allocator
    if s.gpu and a.steady_peak_allocated_bytes:
        out.reserve_slack_fraction = (a.steady_peak_reserved_bytes /
                                      a.steady_peak_allocated_bytes - 1)
        ro = pvm.components.get("runtime_overhead")
        if ro is not None and ro.measured.value is not None:
            out.runtime_overhead_bytes = max(0, int(ro.measured.value))
    return out
