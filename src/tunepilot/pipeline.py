"""The staged pilot: plan -> pilot -> restore -> scale -> quote, each stage a gate for the next.

A failed gate stops the pipeline with its reason (exit 1 at the CLI). Re-running the same spec
into the same run directory reuses the stages already completed for the same spec hash unless
`force` is set. The last line is the decision: what to book and what it costs, or why not yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path

from tunepilot.catalog import Catalog, load_catalog
from tunepilot.errors import TunepilotError, UserError
from tunepilot.figures import value_of
from tunepilot.spec import RunSpec
from tunepilot.store import RunDir

Say = Callable[[str], None]


@dataclass
class Gate:
    """One stage's verdict: passed | failed | skipped (not needed here) | reused (earlier run)."""

    stage: str
    status: str
    summary: str
    reused: bool = False


@dataclass
class PipelineResult:
    run_dir: str
    spec_label: str
    spec_hash: str
    ready: bool
    decision: str
    gates: list[Gate] = field(default_factory=list)
    quote: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class GateFailed(TunepilotError):
    """A stage's gate failed; the pipeline stopped there."""

    def __init__(self, result: PipelineResult):
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
    base_dir: Path | None = None
    catalog: Catalog | None = None


def run_pipeline(spec: RunSpec, out: str | Path, options: RunOptions | None = None,
                 say: Say | None = None) -> PipelineResult:
    """Run every stage into `out`; raise GateFailed (with the result) at the first failed gate."""
    o = options or RunOptions()
    say = say or (lambda _m: None)
    catalog = o.catalog or load_catalog()
    run = RunDir(out)
    h = spec.spec_hash()
    run.check_spec(h)
    result = PipelineResult(str(run.path), spec.label, h, ready=False, decision="")
    run.update_manifest(spec_hash=h, spec=spec.model_dump(mode="json"), label=spec.label)

    def reuse(stage: str) -> dict | None:
        if not o.force and run.stage_done(stage, h):
            say(f"{stage}: reusing {run.file(stage)} (same spec hash; --force re-runs it)")
            return run.read(stage)
        return None

    def stop(stage: str, reason: str) -> None:
        result.decision = f"Not ready: {stage} failed - {reason} See {run.path}/{stage}.json."
        _write(run, result)
        raise GateFailed(result)

    # 1. plan ---------------------------------------------------------------------------------
    plan = reuse("plan")
    reused = plan is not None
    if plan is None:
        say("plan: tracing the training step on fake tensors (falls back to analytic)"
            if o.trace else "plan: analytic")
        plan = _plan(spec, catalog, o)
        run.write_stage("plan", plan, h)
    fitting = [c["card"] for c in plan["cards"] if c["fits"]]
    fsdp = {c["card"]: c["devices_needed"]["fsdp"] for c in plan["cards"]}
    peak = plan["per_device"]["device_peak_bytes"] / 2**30
    if not fitting and not any(fsdp.values()):
        result.gates.append(Gate("plan", "failed", f"{plan['fidelity']} plan: device peak "
                                 f"{peak:.1f} GiB (projected) fits no card even with FSDP", reused))
        stop("plan", "the run fits no card of the catalog.")
    where = ", ".join(fitting) if fitting else "FSDP only: " + ", ".join(
        f"{k} x{v}" for k, v in fsdp.items() if v)
    result.gates.append(Gate("plan", "passed", f"{plan['fidelity']} plan: device peak "
                             f"{peak:.2f} GiB (projected); fits {where}", reused))

    # 2. pilot --------------------------------------------------------------------------------
    pilot = None if o.memory_limit_bytes else reuse("pilot")
    reused = pilot is not None
    if pilot is None:
        from tunepilot.pilot.runner import PilotOptions, run_pilot

        say("pilot: real training steps on this machine's device, longest batch first")
        pr = run_pilot(spec, run.path, PilotOptions(
            steps=o.pilot_steps, max_steps=o.pilot_max_steps,
            memory_limit_bytes=o.memory_limit_bytes, base_dir=o.base_dir, catalog=catalog),
            progress=lambda what, i, n: None)
        pilot = pr.data
    if not pilot.get("fits"):
        why = pilot.get("verdict") or pilot.get("does_not_fit") or "full steps did not complete"
        result.gates.append(Gate("pilot", "failed", str(why), reused))
        stop("pilot", f"{why}.")
    tps = value_of(pilot.get("throughput", {}).get("useful_tokens_per_s"))
    dev = pilot.get("device", {})
    rate = "throughput not measured" if tps is None else f"{tps:,.0f} useful tokens/s (measured)"
    result.gates.append(Gate("pilot", "passed", f"full steps on the longest batch on "
                             f"{dev.get('name', dev.get('kind', '?'))}: {rate}", reused))

    # 3. restore ------------------------------------------------------------------------------
    restore = reuse("restore")
    reused = restore is not None
    if restore is None:
        from tunepilot.restore import verify_restore

        say("restore: save, resume in a fresh process, compare the continuation")
        k, m = o.restore_steps
        restore = verify_restore(spec, k, m, run.path, base_dir=o.base_dir,
                                 catalog=catalog).to_dict()
    if not restore.get("passed"):
        bad = ", ".join(restore.get("failed_components") or []) or "the continuation"
        result.gates.append(Gate("restore", "failed", f"failed on {bad}", reused))
        stop("restore", f"restore failed on {bad}.")
    names = [c["name"] for c in restore.get("components", [])]
    result.gates.append(Gate("restore", "passed", f"{len(names)} components restored in a fresh "
                             f"process and the continuation identical ({', '.join(names)})",
                             reused))

    # 4. scale --------------------------------------------------------------------------------
    nproc = o.nproc or _device_count()
    if nproc and nproc > 1:
        scale = reuse("scale")
        reused = scale is not None
        if scale is None:
            from tunepilot.scaling.runner import scale as run_scale

            say(f"scale: torchrun, 1 rank vs {nproc} ranks, DDP and FSDP, same global batch")
            try:
                scale = run_scale(spec, nproc, ("ddp", "fsdp"), out=run.path,
                                  steps=o.scale_steps, base_dir=o.base_dir, catalog=catalog,
                                  progress=say).to_dict()
            except TunepilotError as exc:  # a crashed or hung rank (UserErrors pass through)
                if isinstance(exc, UserError):
                    raise
                result.gates.append(Gate("scale", "failed", str(exc).splitlines()[0]))
                stop("scale", str(exc).splitlines()[0])
        rec = scale.get("recommendation", {})
        effs = ", ".join(
            f"{k} {v['efficiency']:.0%}" if v.get("efficiency") is not None
            else f"{k} {v.get('status', 'not measured')}"
            for k, v in scale.get("strategies", {}).items() if isinstance(v, dict))
        use = (f"use {rec['strategy']}" if rec.get("strategy") else
               f"no strategy recommended: {rec.get('reason', '?')}")
        result.gates.append(Gate("scale", "passed", f"{nproc} ranks: efficiency {effs} "
                                 f"(measured); {use}", reused))
    else:
        result.gates.append(Gate("scale", "skipped", "one device here and no --nproc: "
                                 "multi-card throughput in the quote is projected"))

    # 5. quote --------------------------------------------------------------------------------
    say("quote: the term and cost per useful token from the measured figures")
    from tunepilot import cost

    if o.card and o.count and o.term_s:
        q = cost.quote(spec, card_id=o.card, count=o.count, term_s=o.term_s,
                       run_dir=run.path, catalog=catalog, base_dir=o.base_dir).to_dict()
        quotes = [q]
    else:
        cmp = cost.compare(spec, run_dir=run.path, catalog=catalog, base_dir=o.base_dir)
        quotes = [r.to_dict() for r in cmp.rows]
        run.write_stage("compare", cmp.to_dict(), h)
    if not quotes:
        result.gates.append(Gate("quote", "failed", "no card x count could be quoted"))
        stop("quote", "no card and count fits the run.")
    best = quotes[0]
    run.write_stage("quote", best, h)
    result.quote = best
    result.gates.append(Gate("quote", "passed", f"{best['card_id']} x{best['count']}: "
                             f"{_money(best['term']['total_usd'])} for the term "
                             f"({best.get('cost_basis', 'projected')})"))
    result.ready = True
    result.decision = decision_text(best)
    _write(run, result)
    return result


def decision_text(q: dict) -> str:
    """'Book H200 x 1 for 3 days: $X; $Y per million useful tokens; finishes with Z% margin'."""
    term_s = q["term"]["term_s"]
    length = f"{term_s / 86400:.4g} days" if term_s >= 86400 else f"{term_s / 3600:.4g} hours"
    per_m = q.get("cost_per_million_term_usd") or q.get("cost_per_million_job_usd")
    fin = (f"finishes with {q['margin_fraction']:.0%} margin" if q.get("finishes_in_term") else
           "does NOT finish inside the term")
    basis = q.get("cost_basis", "projected")
    return (f"Book {q['card_id']} x {q['count']} for {length}: {_money(q['term']['total_usd'])}; "
            f"{_money(per_m)} per million useful tokens; {fin} (time {basis}; prices from the "
            "catalog).")


def _money(v) -> str:
    """Dollars to the cent; amounts under a dollar keep 4 significant digits ($0.004812)."""
    if v is None:
        return "-"
    d = Decimal(str(v))
    if abs(d) < 1 and d != 0:  # 4 significant digits, in Decimal
        exp = d.adjusted() - 3
        return f"${d.quantize(Decimal(1).scaleb(exp)).normalize():f}"
    return f"${d.quantize(Decimal('0.01')):,}"


def _plan(spec: RunSpec, catalog: Catalog, o: RunOptions) -> dict:
    from tunepilot.memory.plan import make_plan

    if o.trace:
        from tunepilot.memory.trace import make_traced_plan

        return make_traced_plan(spec, catalog=catalog, base_dir=o.base_dir).to_dict()
    return make_plan(spec, catalog=catalog, base_dir=o.base_dir).to_dict()


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _write(run: RunDir, result: PipelineResult) -> None:
    from tunepilot.store import write_json

    write_json(run.path / "decision.json", result.to_dict())
