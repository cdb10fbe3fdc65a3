"""`scale()`: the scaling test. Preflight, a 1-rank baseline, then N ranks per strategy, all
through torchrun, at the same global batch and in the same data order; then the comparison.

The global batch G is the spec's: micro_batch_size x gradient_accumulation_steps x
parallel.world_size. With W ranks in all, each rank holds G / W samples per step as
micro-batch m x accumulation a; m is the spec's micro-batch, or the largest divisor of G / W
under it when the spec's does not divide (said in the result). The baseline runs the same m on
one rank with accumulation G / m, so both sides do the same work per device per micro-batch and
the difference is what N ranks cost or gain. G not divisible by W is refused before launching.

Results written once to RUN_DIR/scale.json (a ScalingResult, tunepilot.results.scale):
    strategies.<ddp|fsdp>.{nproc, world_size, efficiency, useful_tokens_per_s, ...} (read by
        the cost stage), the same numbers as figures under strategies.<s>.figures
    recommendation {strategy, reason}, preflight, baseline, global_batch, warnings
and per launch RUN_DIR/scale/<run>/rank<R>.json + all_ranks.json, logs under RUN_DIR/logs/scale/.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunepilot.errors import TunepilotError, UserError
from tunepilot.proc.child import read_message, write_message
from tunepilot.results.scale import BatchPlan, ScalingResult, StrategyResult
from tunepilot.scaling.analysis import compare, notes, recommend, summarize
from tunepilot.scaling.launch import LaunchError, Rendezvous, launch
from tunepilot.scaling.messages import GatheredRanks, RankRecord, ScaleJob
from tunepilot.spec import RunSpec
from tunepilot.spec.fp8 import stand_in_note

STRATEGIES = ("ddp", "fsdp")
DEFAULT_STEPS = 5
DEFAULT_WARMUP_STEPS = 2
DEFAULT_TIMEOUT_S = 600.0


def plan_batches(spec: RunSpec, world: int, baseline_ranks: int = 1) -> BatchPlan:
    """Micro-batch and accumulation per rank for W ranks and for the baseline (1 rank, or the
    smallest count that fits), by the spec's global-batch rule (spec.batch.on in spec/batch.py,
    which the quote uses too)."""
    split = spec.batch.on(world)
    note = None if split.note is None else (split.note + f"; the baseline uses "
                                            f"{split.micro_batch_size} too, so both measure the "
                                            "same work per micro-batch")
    return BatchPlan(global_batch_samples=split.global_samples, world_size=world,
                     micro_batch_size=split.micro_batch_size, accumulation=split.accumulation,
                     baseline_accumulation=split.global_samples // (split.micro_batch_size
                                                                    * baseline_ranks),
                     sequence_length=spec.sequence_length, note=note,
                     positions_per_step=split.positions_per_step,
                     baseline_world_size=baseline_ranks)


def _check_request(strategies: tuple[str, ...], steps: int, warmup_steps: int) -> None:
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UserError("--strategy", f"unknown strategy {bad[0] if bad else ''!r}.",
                        "Use ddp, fsdp or both.")
    if steps < 1:
        raise UserError("--steps", f"needs at least 1 measured step (got {steps}).")
    if warmup_steps < 0:
        raise UserError("--warmup-steps", f"cannot be negative (got {warmup_steps}).")


def baseline_ranks(spec: RunSpec, node, nproc: int, base_dir: Path | None,
                   memory_limit_bytes: int | None = None) -> tuple[int, list[str]]:
    """The scaling baseline: the smallest rank count whose plan fits this machine (1 when the
    single-device plan fits; else FSDP over 2, 3, ... of the nproc ranks that hold the global
    batch), checked with every strategy's N-rank plan before anything is launched (on a CPU the
    ranks share the host's RAM; ``memory_limit_bytes``: --memory-limit, per rank). DoesNotFit
    when not even the N-rank plan fits. (baseline ranks, notes)."""
    from tunepilot.device import probe_device
    from tunepilot.errors import DoesNotFit
    from tunepilot.model.arch import resolve_arch
    from tunepilot.pilot.prepare import plan_fit_problem, single_device_spec
    from tunepilot.plan.analytic.core import analytic_plan

    info = probe_device(device="cpu" if node.kind == "cpu" else None)
    arch = resolve_arch(spec, base_dir)
    global_samples = spec.batch.on(nproc).global_samples
    first = None
    for n in range(1, nproc + 1):
        if n > 1 and global_samples % n:
            continue
        if n == 1:
            one = single_device_spec(spec)[0]  # a spec not valid on one device: UserError
        else:
            try:
                one = spec.with_changes(parallel=dict(spec.parallel.model_dump(),
                                                      strategy="fsdp", devices=n, nodes=1))
            except ValueError:  # not a valid layout at n ranks (tensor parallel)
                continue
        plan = analytic_plan(one, arch, info.kind)
        problem = plan_fit_problem(one, plan, info, what="scaling test",
                                   ranks=n if info.kind == "cpu" else 1)
        peak = plan.per_device.allocated_peak_bytes
        if problem is None and memory_limit_bytes and peak > memory_limit_bytes:
            problem = (f"the plan needs {peak:,} bytes per rank (projected), more than "
                       f"--memory-limit {memory_limit_bytes:,}")
        first = first or problem
        if problem is None:
            notes = [] if n == 1 else [
                f"baseline: FSDP over {n} ranks, the smallest count whose plan fits (one "
                f"device's does not: {first}); efficiency is per rank relative to it, and DDP, "
                "which holds the whole model on every rank, is not launched"]
            return n, notes
    raise DoesNotFit(first or "no rank count fits")


def scale(spec: RunSpec, nproc: int, strategies: tuple[str, ...] | list[str] = STRATEGIES, *,
          out: str | Path, steps: int = DEFAULT_STEPS, warmup_steps: int = DEFAULT_WARMUP_STEPS,
          base_dir: Path | None = None, device: str = "auto", rdzv: Rendezvous | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, catalog=None, node=None, bench: bool = True,
          bench_sizes_bytes: list[int] | None = None, check_memory: bool = True,
          progress: Callable[[str], None] | None = None,
          memory_limit_bytes: int | None = None) -> ScalingResult:
    """Run the scaling test and write RUN_DIR/scale.json. Raises UserError before launching
    anything when the request cannot be run as asked, LaunchError when a rank fails."""
    from tunepilot.scaling.preflight import preflight, probe_node
    from tunepilot.store import RunDir

    say = progress or (lambda _msg: None)
    strategies = tuple(dict.fromkeys(strategies))
    _check_request(strategies, steps, warmup_steps)
    rdzv = rdzv or Rendezvous()
    world = nproc * rdzv.nnodes
    run_dir = RunDir(out)
    run_dir.check_spec(spec.spec_hash())
    work = run_dir.path / "scale"
    logs = run_dir.path / "logs" / "scale"  # created by the first launch, not before the checks
    say(f"preflight: {nproc} rank(s) per node x {rdzv.nnodes} node(s)"
        + ("; bus-bandwidth benchmark (a torchrun launch)" if bench and world > 1 else ""))
    node = node or probe_node(device, catalog)
    base_n, base_notes = baseline_ranks(spec, node, nproc, base_dir, memory_limit_bytes) \
        if check_memory else (1, [])
    batches = plan_batches(spec, world, base_n)
    pre = preflight(nproc, device=device, nnodes=rdzv.nnodes, node=node, catalog=catalog,
                    bench=bench, log_dir=logs / "bench", out_dir=work, timeout_s=timeout_s,
                    rdzv=rdzv.for_launch("bench"), sizes_bytes=bench_sizes_bytes)
    for w in pre.warnings:
        say(f"preflight warning [{w['code']}]: {w['message']}")
    ctx = _Ctx(spec, base_dir, "cpu" if pre.node.kind == "cpu" else "cuda", pre.threads_per_rank,
               steps, warmup_steps, batches, work, logs, timeout_s, say)
    baseline, results = _launch_all(ctx, strategies, nproc, world, rdzv)
    result = ScalingResult(
        label=spec.label, nproc=nproc, nnodes=rdzv.nnodes, world_size=world,
        device=pre.node.kind, steps=steps, warmup_steps=warmup_steps, global_batch=batches,
        preflight=pre.result(), baseline=baseline, strategies=results,
        recommendation=recommend(results, baseline, world, pre.node.kind), warnings=pre.warnings,
        notes=[n for n in (batches.note, stand_in_note(spec, "scale")) if n] + base_notes
        + notes(pre),
        run_dir=str(run_dir.path),
        spec_hash=spec.spec_hash())
    run_dir.write(result)
    return result


def _launch_all(ctx: _Ctx, strategies: tuple[str, ...], nproc: int, world: int,
                rdzv: Rendezvous):
    """The baseline (1 rank, or the smallest count that fits: FSDP), then each strategy on N
    ranks; (baseline, results by strategy)."""
    b, say = ctx.batches, ctx.say
    n0 = b.baseline_world_size
    say(f"baseline: {n0} rank{'s (FSDP)' if n0 > 1 else ''}, micro-batch {b.micro_batch_size} x "
        f"{b.baseline_accumulation} accumulation")
    baseline = summarize(ctx.run("baseline", "single" if n0 == 1 else "fsdp", n0,
                                 b.baseline_accumulation, Rendezvous()))
    say(f"baseline: {baseline.useful_tokens_per_s:,.0f} useful tokens/s")
    results: dict[str, StrategyResult] = {}
    if world == 1:
        say("one rank in all: the baseline is the whole test (use --nproc 2 or more to compare)")
    for s in strategies if world > 1 else ():
        if n0 > 1 and s == "ddp":  # it replicates the model the baseline had to shard
            results[s] = StrategyResult(
                status="does_not_fit", nproc=nproc, world_size=world,
                error="DDP holds the whole model on every rank, and the single-device plan "
                      f"does not fit (the baseline needed FSDP over {n0} ranks); not launched")
            say(f"{s}: does not fit (not launched: the model does not fit one device)")
            continue
        if n0 == world and s == "fsdp":  # the baseline is this launch already
            results[s] = compare(baseline, baseline, b, ctx.spec.precision, nproc)
            say(f"{s}: the baseline itself (FSDP over {n0} ranks is the smallest that fits)")
            continue
        say(f"{s}: {world} ranks, micro-batch {b.micro_batch_size} x {b.accumulation} "
            "accumulation")
        try:
            records = ctx.run(s, s, nproc, b.accumulation, rdzv.for_launch(s))
        except LaunchError as exc:  # recorded; the next strategy still runs
            results[s] = failed_strategy(s, exc, ctx.does_not_fit(s), nproc, world)
            say(f"{s}: {results[s].status.replace('_', ' ')} ({results[s].error})")
            continue
        results[s] = r = compare(summarize(records), baseline, b, ctx.spec.precision, nproc)
        say(f"{s}: {r.useful_tokens_per_s:,.0f} useful tokens/s, efficiency "
            f"{r.efficiency:.2f}, loss max diff {r.loss_max_abs_diff:.2e}")
    return baseline, results


def failed_strategy(name: str, exc: LaunchError, oom: str | None, nproc: int, world: int
                    ) -> StrategyResult:
    """A strategy whose launch failed: out of memory on a rank (does_not_fit), or a crash or a
    hang (failed), with the failing rank's last log lines."""
    first = str(exc).splitlines()[0]
    if oom:
        return StrategyResult(status="does_not_fit", nproc=nproc, world_size=world, error=oom,
                              launch_error=first, log_tail=exc.log_tail or None)
    why = first.split(": ", 1)[1] if first.startswith(f"scale {name}: ") else first
    why = why.split("; ", 1)[0]  # "rank R failed with exit code C after T s"
    last = next((ln for ln in reversed((exc.log_tail or "").splitlines()) if ln.strip()), "")
    if last:
        why += f": {last.split(']:', 1)[-1].strip()}"  # its last log line, '[rank0]:' cut
    return StrategyResult(status="failed", nproc=nproc, world_size=world, error=why,
                          launch_error=first, log_tail=exc.log_tail or None,
                          log=str(exc.log_path) if exc.log_path else None)


@dataclass
class _Ctx:
    """What every launch of one scaling test shares."""

    spec: RunSpec
    base_dir: Path | None
    device: str
    threads: int | None
    steps: int
    warmup_steps: int
    batches: BatchPlan
    work: Path
    logs: Path
    timeout_s: float
    say: Callable[[str], None]

    def run(self, name: str, strategy: str, nproc: int, accumulation: int, rdzv: Rendezvous
            ) -> list[RankRecord]:
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)  # never read a previous run's rank files
        shutil.rmtree(self.logs / name, ignore_errors=True)
        job = ScaleJob(spec=self.spec.model_dump(mode="json"), strategy=strategy,
                       micro_batch=self.batches.micro_batch_size, accumulation=accumulation,
                       global_batch=self.batches.global_batch_samples,
                       warmup_steps=self.warmup_steps, steps=self.steps, device=self.device,
                       out=str(out), threads=self.threads or 1,
                       base_dir=str(self.base_dir) if self.base_dir is not None else None)
        job_file = write_message(self.work / f"{name}.job.json", job)
        env = {"OMP_NUM_THREADS": str(self.threads or 1)} if self.device == "cpu" else {}
        res = launch(f"scale {name}", "tunepilot.scaling.worker", [str(job_file)], nproc=nproc,
                     log_dir=self.logs / name, timeout_s=self.timeout_s, rdzv=rdzv, env=env)
        self.say(f"{name}: launch took {res.wall_s:.1f} s")
        return read_rank_records(out, nproc * rdzv.nnodes)

    def does_not_fit(self, name: str) -> str | None:
        for p in sorted((self.work / name).glob("rank*.json")):
            rec = read_message(RankRecord, p)
            if rec.status == "does_not_fit":
                return f"rank {rec.rank}: {rec.error}"
        return None


def read_rank_records(out: Path, world: int) -> list[RankRecord]:
    """Every rank's record: all_ranks.json (gathered over the process group, so it holds the
    other nodes' ranks too), else the rank<R>.json files; all W ranks must be there."""
    recs: dict[int, RankRecord] = {}
    gathered = out / "all_ranks.json"
    if gathered.exists():
        for r in read_message(GatheredRanks, gathered).ranks:
            recs[r.rank] = r
    for p in out.glob("rank*.json"):
        r = read_message(RankRecord, p)
        recs.setdefault(r.rank, r)
    missing = [r for r in range(world) if r not in recs]
    if missing:
        raise TunepilotError(f"ranks {missing} of {world} wrote no result in {out}; the launch "
                             "ended without error, so their node's output directory is "
                             "elsewhere (multi-node: use a shared --out) or was removed.")
    return [recs[r] for r in range(world)]
