"""Calibrate the analytic plan with what a pilot measured (``tunepilot plan --calibrate RUN_DIR``).

A pilot stores, in RUN_DIR/pilot.json ``calibration``, the ratio measured / planned for each
component of the probe step (warm-up step 2 on the longest batch) and, on a GPU, the allocator's
reserve slack and the runtime overhead it measured (device-wide peak minus reserved peak). A later
plan - another micro-batch, sequence length, LoRA rank, card - applies them:

    activations  x ratios.activations     (the part the plan derives from per-token formulas)
    temporaries  x ratios.temporary
    reserved     = allocated x (1 + reserve_slack_fraction)        same software stack only
    runtime      = runtime_overhead_bytes                          same software stack only
    device peak  = reserved + runtime

Weights, gradients and optimizer state are exact counts, so their ratios (about 1.0) are checked,
not applied. The ratios carry the implementation they were measured on: a CPU pilot's
activation ratio holds CPU autocast rules, and a different model's ratio is a weaker guide; the
plan's assumptions say so when either applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.model.arch import Arch
from tunepilot.plan.analytic.core import analytic_plan, runtime_constants
from tunepilot.plan.fit import Planner
from tunepilot.plan.reserve.core import held_bytes
from tunepilot.results.plan import MemoryPlan
from tunepilot.spec import RunSpec

APPLIED = ("activations", "temporary")
CHECKED = ("weights", "gradients", "optimizer")
EXACT_TOLERANCE = 0.02  # an exact-count component off by more than this is reported


@dataclass
class Calibration:
    """The residuals one pilot measured (see pilot.json ``calibration``)."""

    source: str
    stack: str
    ratios: dict[str, float]
    card_id: str | None = None
    device: str | None = None
    model_config_sha256: str | None = None
    reserve_slack_fraction: float | None = None
    runtime_overhead_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


def load_calibration(run_dir: Path | str) -> Calibration:
    """The calibration block of RUN_DIR/pilot.json; UserError when there is none."""
    from tunepilot.results.pilot import PilotResult
    from tunepilot.store import RunDir

    rd = RunDir(run_dir)
    if not rd.has("pilot"):
        raise UserError("--calibrate", f"{str(rd.path)!r} has no pilot.json.",
                        "Run `tunepilot pilot SPEC --out RUN_DIR` first.")
    try:
        cal = rd.read(PilotResult).calibration
    except UserError as exc:
        raise UserError("--calibrate", exc.message, exc.hint) from None
    if cal is None:
        raise UserError("--calibrate", f"the pilot in {str(rd.path)!r} holds no calibration "
                        "data (it did not fit, so no step was measured).",
                        "Use the run directory of a pilot that fitted.")
    return Calibration(source=str(rd.path), stack=cal.stack, ratios=dict(cal.ratios),
                       card_id=cal.card_id, device=cal.device,
                       model_config_sha256=cal.model_config_sha256,
                       reserve_slack_fraction=cal.reserve_slack_fraction,
                       runtime_overhead_bytes=cal.runtime_overhead_bytes)


def calibrate(plan: MemoryPlan, cal: Calibration, arch: Arch | None = None) -> MemoryPlan:
    """A copy of `plan` with the measured ratios applied (the plan itself is not changed)."""
    out = plan.model_copy(deep=True)
    for ph in out.phases:
        ph.activations_bytes = int(ph.activations_bytes * cal.ratios.get("activations", 1.0))
        ph.temporary_bytes = int(ph.temporary_bytes * cal.ratios.get("temporary", 1.0))
    d = out.per_device
    peak = max(out.phases, key=lambda p: p.total_bytes)
    allocated = peak.total_bytes
    slack = reserved_slack(plan)
    overhead = d.runtime_overhead_bytes
    same_stack = cal.stack == plan.stack
    if same_stack and cal.reserve_slack_fraction is not None:
        slack = max(0.0, cal.reserve_slack_fraction)
    if same_stack and cal.runtime_overhead_bytes is not None:
        overhead = int(cal.runtime_overhead_bytes) + _collective_bytes(plan)
    d.activations_bytes = max(p.activations_bytes for p in out.phases)
    d.temporary_bytes = max(p.temporary_bytes for p in out.phases)
    load_peak = d.load_peak_bytes
    allocated = max(allocated, load_peak)
    d.allocated_peak_bytes = allocated
    d.reserved_peak_bytes = int(held_bytes(allocated, peak.total_bytes, d.load_stranded_bytes)
                                * (1 + slack))
    d.runtime_overhead_bytes = overhead
    d.device_peak_bytes = d.reserved_peak_bytes + overhead
    out.peak_phase = peak.name if load_peak <= peak.total_bytes else "model-load"
    out.fidelity = f"{plan.fidelity}+calibrated"
    applied = ", ".join(f"{k} x {cal.ratios[k]:.3f}" for k in APPLIED if k in cal.ratios)
    note = f"calibrated by the pilot in {cal.source} ({cal.stack}"
    note += f", {cal.card_id})" if cal.card_id else f", {cal.device or 'unknown device'})"
    note += f": {applied or 'no component ratios'}"
    if same_stack and cal.reserve_slack_fraction is not None:
        note += f"; reserve slack {slack:.1%} measured"
    if same_stack and cal.runtime_overhead_bytes is not None:
        note += f"; runtime overhead {cal.runtime_overhead_bytes:,} bytes measured"
    out.assumptions.append(note)
    if not same_stack:
        out.assumptions.append(f"calibration measured on {cal.stack}, this plan is for "
                               f"{plan.stack}: reserve slack and runtime overhead stay the "
                               "plan's defaults" + ("; activation ratios from a CPU pilot carry "
                                                    "CPU autocast rules" if cal.stack == "cpu"
                                                    else ""))
    if arch is not None and cal.model_config_sha256 and cal.model_config_sha256 != \
            arch.config_hash:
        out.assumptions.append("the calibrating pilot ran another model: its ratios are a "
                               "weaker guide for this one")
    off = [f"{k} {cal.ratios[k]:.3f}" for k in CHECKED
           if k in cal.ratios and abs(cal.ratios[k] - 1) > EXACT_TOLERANCE]
    if off:
        out.assumptions.append("the pilot measured exact-count components off the plan (not "
                               "applied; report it): " + ", ".join(off))
    return out


def reserved_slack(plan: MemoryPlan) -> float:
    d = plan.per_device
    return d.reserved_peak_bytes / d.allocated_peak_bytes - 1 if d.allocated_peak_bytes else 0.0


def _collective_bytes(plan: MemoryPlan) -> int:
    """The plan's collective-library share of runtime overhead (a single-device pilot has
    none, so it is kept from the plan when the plan has more than one rank)."""
    if plan.world_size <= 1:
        return 0
    st = runtime_constants()["stacks"].get(plan.stack, {})
    return int(st.get("collective_bytes_per_rank_group", 0))


def calibrated_planner(cal: Calibration) -> Planner:
    """A planner (spec, arch, stack) -> MemoryPlan for fit_card's inverse queries."""
    def planner(spec: RunSpec, arch: Arch, stack: str) -> MemoryPlan:
        return calibrate(analytic_plan(spec, arch, stack), cal, arch)

    return planner
