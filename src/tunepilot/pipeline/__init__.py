"""The staged pilot: (data ->) plan -> pilot -> restore -> scale -> quote, each stage a gate for the next.

The stages are a table: each has a name, the result type it writes, how it runs, whether it is
needed here, and its gate (a verdict with a one-line summary). Reuse is written once: a stage
completed in the same run directory for the same spec hash (and, for restore, whose checkpoint
still verifies) is read back instead of run, unless `force`. A failed gate stops the pipeline
with its reason (exit 1 at the CLI). The last line is the decision: what to book and what it
costs, or why not yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.catalog import Catalog, load_catalog
from tunepilot.errors import TunepilotError, UserError
from tunepilot.results.base import StageResult
from tunepilot.results.data import DataProfile
from tunepilot.results.decision import Decision, Gate
from tunepilot.results.pilot import PilotResult
from tunepilot.results.plan import MemoryPlan
from tunepilot.results.quote import Comparison, Quote
from tunepilot.results.restore import RestoreResult
from tunepilot.results.scale import ScalingResult
from tunepilot.spec import RunSpec
from tunepilot.store import RunDir
from tunepilot.units import fmt_bytes, fmt_hours, fmt_rate, fmt_usd

Say = Callable[..., None]  # say(message), or say(message, done, total) for counted work


class GateFailed(TunepilotError):
    """A stage's gate failed; the pipeline stopped there."""

    def __init__(self, result: Decision):
        self.result = result
        super().__init__(result.decision)


@dataclass
class RunOptions:
    card: str | None = None
    count: int | None = None
    term_s: int | None = None
    nproc: int | None = None
    force: bool = False
    memory_limit_bytes: int | None = None
    pilot_steps: int | None = None
    pilot_max_steps: int = 30
    restore_steps: tuple[int, int] = (3, 3)
    scale_steps: int = 4
    trace: bool = True
    check_memory: bool = True
    base_dir: Path | None = None
    catalog: Catalog | None = None


@dataclass
class Ctx:
    """What every stage of one staged pilot shares."""

    spec: RunSpec
    run: RunDir
    options: RunOptions
    catalog: Catalog
    say: Say
    results: dict[str, StageResult] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def spec_hash(self) -> str:
        return self.spec.spec_hash()

    @property
    def nproc(self) -> int:
        """--nproc, else the sharded pilot's ranks, else the GPUs here."""
        if self.options.nproc:
            return self.options.nproc
        pilot = self.results.get("pilot") or self.run.read_if(PilotResult)
        ranks = pilot.world_size if pilot is not None else 1
        return ranks if ranks > 1 else _device_count()


@dataclass(frozen=True)
class Stage:
    name: str
    result: type[StageResult]
    run: Callable[[Ctx], StageResult]
    gate: Callable[[Ctx, StageResult], Gate]
    needed: Callable[[Ctx], str | None] = lambda _ctx: None
    """None when the stage runs here, else why it is skipped"""
    reusable: Callable[[Ctx, StageResult], str | None] = lambda _ctx, _r: None
    """None when a completed result may be reused, else why it is run again"""


def _passed(stage: str, summary: str) -> Gate:
    return Gate(stage=stage, status="passed", summary=summary)


def _failed(stage: str, summary: str) -> Gate:
    return Gate(stage=stage, status="failed", summary=summary)


def _inconclusive(stage: str, summary: str) -> Gate:
    """The stage ran, but its measurement cannot tell the answer apart: the pipeline goes on,
    and the decision is not ready until a re-run (the summary says which) settles it."""
    return Gate(stage=stage, status="inconclusive", summary=summary)


# A mean step time known only to +-25% (95% CI) or worse cannot tell the job's time, so the
# term and its cost, apart from one a quarter longer or shorter: the pilot gate is inconclusive.
# (+-10% to +-25% passes with the pilot's own warning, pilot/assemble.py WIDE_CI.)
INCONCLUSIVE_CI = 0.25
# The data gate names the share of samples truncation cuts once it is above a few percent.
TRUNCATED_SHARE = 0.03
RERUN = ("re-run on a quiet machine, or measure more steps (tunepilot run SPEC --force "
         "--pilot-max-steps 120 --scale-steps 20)")


# --- 0. data (a dataset only) ------------------------------------------------------------------


def _data_needed(c: Ctx) -> str | None:
    return "synthetic data: every sample is sequence_length long" \
        if c.spec.data.source == "synthetic" else None


def _run_data(c: Ctx) -> DataProfile:
    from tunepilot.dataset.profile import profile_dataset
    from tunepilot.model.arch import resolve_arch

    c.say("data: the whole dataset's lengths, trained tokens and padding (cached)")
    arch = resolve_arch(c.spec, c.options.base_dir)
    return profile_dataset(c.spec, arch.vocab_size, c.options.base_dir)


def _gate_data(c: Ctx, p: DataProfile) -> Gate:
    b = p.used
    cut = truncation_note(p)
    if cut:
        c.warnings.append(f"data: {cut}")
    return _passed("data", f"{p.samples:,} samples, {p.tokens_supervised.value:,} trained "
                           f"tokens (measured); {b.padding_fraction.value:.1%} padding "
                           f"{'packed' if p.packing else 'padded'}" + (f"; {cut}" if cut else ""))


def truncation_note(p: DataProfile) -> str | None:
    """'37% of the samples (149 of 400) are cut at sequence_length 256 ...' above a few
    percent, else None."""
    share = p.truncated_samples / p.samples if p.samples else 0.0
    if share <= TRUNCATED_SHARE:
        return None
    return (f"{share:.0%} of the samples ({p.truncated_samples:,} of {p.samples:,}) are cut at "
            f"sequence_length {p.sequence_length:,}, and their ends are never trained: raise "
            "sequence_length or filter the long samples if they matter")


# --- 1. plan -----------------------------------------------------------------------------------


def _run_plan(c: Ctx) -> MemoryPlan:
    from tunepilot.plan.api import make_plan

    if c.options.trace:
        c.say("plan: tracing the training step on fake tensors (falls back to analytic)")
    else:
        c.say("plan: analytic")
    return make_plan(c.spec, "traced" if c.options.trace else "analytic", catalog=c.catalog,
                     base_dir=c.options.base_dir)


def _gate_plan(c: Ctx, plan: MemoryPlan) -> Gate:
    fitting = [row.card for row in plan.cards if row.fits]
    fsdp = {row.card: row.devices_needed.fsdp for row in plan.cards}
    peak = fmt_bytes(plan.per_device.device_peak_bytes)
    if not fitting and not any(fsdp.values()):
        return _failed("plan", f"{plan.fidelity} plan: device peak {peak} (projected) fits no "
                               "card even with FSDP")
    where = ", ".join(fitting) if fitting else "FSDP only: " + ", ".join(
        f"{k} x{v}" for k, v in fsdp.items() if v)
    host = ""
    if plan.host is not None:
        host = f"; host peak per node {fmt_bytes(plan.host.peak_bytes_per_node)} (projected)"
        c.warnings += [f"plan: {row.card}: {row.host.reason}" for row in plan.cards
                       if row.host is not None and row.host.reason]
    return _passed("plan", f"{plan.fidelity} plan: device peak {peak} (projected); fits "
                           f"{where}{host}")


# --- 2. pilot ----------------------------------------------------------------------------------


def _run_pilot(c: Ctx) -> PilotResult:
    from tunepilot.pilot.runner import PilotOptions, run_pilot

    o = c.options
    c.say("pilot: real training steps on this machine's device, longest batch first")
    return run_pilot(c.spec, c.run.path, PilotOptions(
        steps=o.pilot_steps, max_steps=o.pilot_max_steps, memory_limit_bytes=o.memory_limit_bytes,
        base_dir=o.base_dir, catalog=c.catalog, check_memory=o.check_memory),
        progress=lambda what, done, total: c.say(f"pilot: {what}", done, total))


def _gate_pilot(c: Ctx, pilot: PilotResult) -> Gate:
    if not pilot.fits:
        why = pilot.does_not_fit.message if pilot.does_not_fit else pilot.verdict
        return _failed("pilot", why)
    tps = pilot.throughput.useful_tokens_per_s.value
    rate = "throughput not measured" if tps is None else \
        f"{fmt_rate(tps, 'useful tokens/s')} (measured)"
    where = f"the local {pilot.device.kind.upper()} ({pilot.device.name})"
    if pilot.world_size > 1:
        peaks = ", ".join(f"{fmt_bytes(r.allocated_peak_bytes.value)}"
                          + (f" ({r.plan_ratio.value:.0%} of plan)"
                             if r.plan_ratio.value is not None else "")
                          for r in pilot.ranks if r.allocated_peak_bytes.value is not None)
        where = (f"{pilot.world_size} FSDP ranks on {where}; allocated peak per rank "
                 f"{peaks} (measured)")
        limit = c.options.memory_limit_bytes
        over = [r.rank for r in pilot.ranks if limit and (r.tracked_peak_bytes.value or 0) > limit]
        if over:
            return _failed("pilot", f"ranks {over} passed --memory-limit {fmt_bytes(limit)}")
        rate += " per device"
    ci = pilot.steps.ci95_relative.value
    if ci is not None and ci > INCONCLUSIVE_CI:
        cv = pilot.step_time.cv.value
        spread = f", step times vary {cv:.0%} (CV)" if cv is not None else ""
        return _inconclusive("pilot", f"fits on {where}, but the mean step time is known only "
                             f"to +-{ci:.0%} (95% CI{spread}): too wide to tell the job's time "
                             f"apart; {RERUN}")
    conf = pilot.steps.confidence
    if conf and not conf.startswith("converged"):
        c.warnings.append(f"pilot: {conf}")
        rate += f"; {conf}"
    return _passed("pilot", f"full steps on the longest batch on {where}: {rate}")


def _reuse_pilot(c: Ctx, _pilot: PilotResult) -> str | None:
    return "--memory-limit simulates another device" if c.options.memory_limit_bytes else None


# --- 3. restore --------------------------------------------------------------------------------


def restore_ranks(c: Ctx) -> int:
    """The ranks the restore proof runs on: the pilot's (a sharded pilot: its FSDP ranks, one
    sharded DCP checkpoint), else one process."""
    pilot = c.results.get("pilot") or c.run.read_if(PilotResult)
    return pilot.world_size if pilot is not None else 1


def _run_restore(c: Ctx) -> RestoreResult:
    k, m = c.options.restore_steps
    n = restore_ranks(c)
    if n > 1:
        from tunepilot.pilot.prepare import sharded_spec
        from tunepilot.restore.sharded import verify_sharded_restore

        c.say(f"restore: {n} FSDP ranks save one sharded checkpoint, a fresh process group of "
              f"{n} resumes it, compare every rank")
        spec, _ = sharded_spec(c.spec, n)
        return verify_sharded_restore(spec, n, k, m, c.run.path, base_dir=c.options.base_dir,
                                      progress=lambda msg: c.say(f"restore: {msg}"))
    from tunepilot.restore import verify_restore

    c.say("restore: save, resume in a fresh process, compare the continuation")
    return verify_restore(c.spec, k, m, c.run.path, base_dir=c.options.base_dir,
                          catalog=c.catalog, check_memory=c.options.check_memory,
                          progress=lambda msg: c.say(f"restore: {msg}"))


def _gate_restore(c: Ctx, restore: RestoreResult) -> Gate:
    if not restore.passed:
        bad = ", ".join(restore.failed_components) or "the continuation"
        return _failed("restore", f"restore failed on {bad}")
    names = list(dict.fromkeys(ch.name for ch in restore.components))
    where = f"on {restore.nproc} ranks (sharded DCP) in a fresh process group" \
        if (restore.nproc or 1) > 1 else "in a fresh process"
    return _passed("restore", f"{len(names)} components restored {where} and the continuation "
                              f"{restore.tolerance or 'identical'} ({', '.join(names)})")


def _reuse_restore(c: Ctx, restore: RestoreResult) -> str | None:
    """A reused proof is trusted only while its checkpoint still verifies."""
    from tunepilot.checkpoint import verify_checkpoint

    if not restore.passed or restore.checkpoint is None:
        return None
    problems = verify_checkpoint(Path(restore.checkpoint.path))
    if problems:
        return f"its checkpoint no longer verifies ({problems[0]})"
    return None


# --- 4. scale ----------------------------------------------------------------------------------


def _scale_needed(c: Ctx) -> str | None:
    if c.nproc > 1:
        return None
    return "one device here and no --nproc: multi-card throughput in the quote is projected"


def _scale_ranks(c: Ctx) -> int:
    """The scaling stage's ranks: c.nproc, but on a CPU without --nproc (the sharded pilot's
    ranks) no more than the cores this process may use - the scaling test gives each CPU rank
    a core of its own (scaling/preflight.py), the pilot measures memory and may share them."""
    import os

    n = c.nproc
    if c.options.nproc or _device_count() > 0:
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    if n > cores:
        c.warnings.append(f"scale: {cores} rank(s), not the pilot's {n}: the scaling test gives "
                          f"each CPU rank a core of its own and this process may use {cores}")
        return cores
    return n


def _run_scale(c: Ctx) -> ScalingResult:
    from tunepilot.scaling.runner import scale

    n = _scale_ranks(c)
    c.say(f"scale: torchrun, the smallest rank count that fits vs {n} ranks, DDP and "
          "FSDP, same global batch")
    return scale(c.spec, n, ("ddp", "fsdp"), out=c.run.path, steps=c.options.scale_steps,
                 base_dir=c.options.base_dir, catalog=c.catalog,
                 progress=lambda msg: c.say(f"scale: {msg}"), check_memory=c.options.check_memory,
                 memory_limit_bytes=c.options.memory_limit_bytes)


def _gate_scale(c: Ctx, scale: ScalingResult) -> Gate:
    rec = scale.recommendation
    crashed = {k: v for k, v in scale.strategies.items() if v.status == "failed"}
    if crashed:
        k, v = next(iter(crashed.items()))
        tail = (v.log_tail or "").splitlines()[-GATE_LOG_LINES:]
        return _failed("scale", "\n".join([f"{k} failed: {v.error}" + (
            f"; last lines of its log ({v.log}):" if tail else ""), *("    " + ln for ln in tail)]))
    effs = ", ".join(f"{k} {v.efficiency:.0%}" if v.efficiency is not None else f"{k} {v.status}"
                     for k, v in scale.strategies.items())
    if rec.inconclusive:
        return _inconclusive("scale", f"{scale.world_size} ranks: efficiency {effs} (measured); "
                             f"{rec.reason}")
    use = f"use {rec.strategy}" if rec.strategy else f"no strategy recommended: {rec.reason}"
    return _passed("scale", f"{scale.world_size} ranks: efficiency {effs} (measured); {use}")


# --- 5. quote ----------------------------------------------------------------------------------


def _run_quote(c: Ctx) -> Quote:
    from tunepilot.cost.compare import compare
    from tunepilot.cost.quote import quote

    c.say("quote: the term and cost per useful token from the measured figures")
    o = c.options
    if o.card and o.count and o.term_s:
        return quote(c.spec, card_id=o.card, count=o.count, term_s=o.term_s, run_dir=c.run.path,
                     catalog=c.catalog, base_dir=o.base_dir)
    cmp: Comparison = compare(c.spec, run_dir=c.run.path, catalog=c.catalog,
                              base_dir=o.base_dir)
    c.run.write(cmp, c.spec_hash)
    if not cmp.rows:
        raise _NoQuote("no card and count fits the run")
    return cmp.rows[0]


class _NoQuote(TunepilotError):
    pass


def _gate_quote(c: Ctx, q: Quote) -> Gate:
    basis = q.cost_basis
    if not q.finishes_in_term:
        s = q.shortest_term
        return _failed("quote", f"{q.card_id} x{q.count} for {fmt_hours(q.term.term_s)} does "
                                f"NOT finish the job (needs {fmt_hours(q.job_s.value)}, "
                                f"{basis}): the shortest billing-aligned term that covers it "
                                f"with the {q.safety_margin:.0%} margin is "
                                f"{fmt_hours(s.term_s)} ({fmt_usd(s.total_usd)}); quote that "
                                f"with --hours {s.term_s / 3600:g}")
    summary = (f"{q.card_id} x{q.count}: {fmt_usd(q.term.total_usd)} for the term ({basis})")
    shortest = q.shortest_term
    if c.options.term_s is not None and shortest.term_s < q.term.term_s and \
            shortest.total_cents < q.term.total_cents:
        c.warnings.append(f"a shorter term would do: {fmt_hours(shortest.term_s)} covers the "
                          f"job with the {q.safety_margin:.0%} margin for "
                          f"{fmt_usd(shortest.total_usd)} instead of {fmt_usd(q.term.total_usd)}")
        summary += f"; {c.warnings[-1]}"
    return _passed("quote", summary)


STAGES = (
    Stage("data", DataProfile, _run_data, _gate_data, needed=_data_needed,
          reusable=lambda _c, _r: None),
    Stage("plan", MemoryPlan, _run_plan, _gate_plan),
    Stage("pilot", PilotResult, _run_pilot, _gate_pilot, reusable=_reuse_pilot),
    Stage("restore", RestoreResult, _run_restore, _gate_restore, reusable=_reuse_restore),
    Stage("scale", ScalingResult, _run_scale, _gate_scale, needed=_scale_needed),
    Stage("quote", Quote, _run_quote, _gate_quote,
          reusable=lambda _c, _r: "the quote is made from the stages' results each run"),
)


OWN_PROCESS = ("pilot", "restore", "scale")
"""stages that run real steps: each in a fresh process (pipeline/stage_process.py), so none inherits
another's allocator cache (a GPU's reserve held by the pilot is memory the restore proof's
process cannot have)"""


def _result_of(c: Ctx, stage: Stage) -> tuple[StageResult, bool]:
    """The stage's result, reused from an earlier run when allowed; (result, reused)."""
    if not c.options.force and c.run.stage_done(stage.name, c.spec_hash):
        earlier = c.run.read_if(stage.result)
        why = stage.reusable(c, earlier) if earlier is not None else "it could not be read"
        if why is None:
            c.say(f"{stage.name}: reusing {c.run.file(stage.name)} (same spec hash; --force "
                  "re-runs it)")
            return earlier, True
        c.say(f"{stage.name}: running again: {why}")
    if stage.name in OWN_PROCESS:
        from tunepilot.pipeline.stage_process import in_own_process

        result = in_own_process(c, stage)
    else:
        result = stage.run(c)
    c.run.write(result, c.spec_hash)
    return result, False


def run_pipeline(spec: RunSpec, out: str | Path, options: RunOptions | None = None,
                 say: Say | None = None) -> Decision:
    """Run every stage into `out`; raise GateFailed (with the decision) at the first failed
    gate."""
    o = options or RunOptions()
    c = Ctx(spec, RunDir(out), o, o.catalog or load_catalog(), say or (lambda *_: None))
    c.run.check_spec(c.spec_hash)
    decision = Decision(run_dir=str(c.run.path), spec_label=spec.label, spec_hash=c.spec_hash)
    c.run.update_manifest(spec_hash=c.spec_hash, spec=spec.model_dump(mode="json"),
                          label=spec.label)
    for stage in STAGES:
        skip = stage.needed(c)
        if skip and stage.name == "data":
            continue  # no dataset, no data gate
        if skip:
            decision.gates.append(Gate(stage=stage.name, status="skipped", summary=skip))
            continue
        try:
            result, reused = _result_of(c, stage)
        except (_NoQuote, TunepilotError) as exc:
            if isinstance(exc, UserError):
                raise
            decision.gates.append(_failed(stage.name, failure_summary(exc)))
            _stop(c, decision, stage.name, str(exc).splitlines()[0])
        c.results[stage.name] = result
        gate = stage.gate(c, result)
        decision.gates.append(gate.model_copy(update={"reused": reused}))
        if gate.status == "failed":
            _stop(c, decision, stage.name, gate.summary)
    q: Quote = c.results["quote"]
    unsure = [g.stage for g in decision.gates if g.status == "inconclusive"]
    decision.quote, decision.ready, decision.warnings = q, not unsure, c.warnings
    decision.decision = decision_text(q)
    if unsure:
        decision.decision = (f"Inconclusive: the {' and '.join(unsure)} measurement"
                             f"{'s' if len(unsure) > 1 else ''} cannot tell the answer apart on "
                             f"this machine; {RERUN}. As measured: {decision.decision}")
    data = c.results.get("data")
    cut = truncation_note(data) if isinstance(data, DataProfile) else None
    if cut:
        decision.decision += f" Data: {cut}."
    c.run.write(decision)
    return decision


GATE_LOG_LINES = 8
"""a failed launch's last log lines a gate's summary shows (the whole tail is in its log)"""


def failure_summary(exc: BaseException) -> str:
    """A stage's error as its gate says it: the first line, and for a failed torchrun launch
    (whose first line ends "Last lines of rank R's log (PATH):") those lines after it."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    tail = (getattr(exc, "log_tail", "") or "").splitlines()[-GATE_LOG_LINES:]
    return "\n".join([first, *("    " + ln for ln in tail)])


def _stop(c: Ctx, decision: Decision, stage: str, reason: str) -> None:
    decision.warnings = c.warnings
    result = c.run.path / f"{stage}.json"
    see = f"See {result}." if result.exists() else f"The logs are in {c.run.path / 'logs'}."
    decision.decision = f"Not ready: {stage} failed - {reason.rstrip('.')}. {see}"
    c.run.write(decision)
    raise GateFailed(decision)


def decision_text(q: Quote) -> str:
    """'Book h200 x 1 for 3 days: $X; $Y/M tokens; finishes with Z% margin (...)'."""
    per_m = q.cost_per_million_term_usd or q.cost_per_million_job_usd
    return (f"Book {q.card_id} x {q.count} for {fmt_hours(q.term.term_s)}: "
            f"{fmt_usd(q.term.total_usd)}; {fmt_usd(per_m)} per million useful tokens; finishes "
            f"with {q.margin_fraction:.0%} margin (time {q.cost_basis}; prices from the catalog).")


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
