"""`scale()`: the scaling test. Preflight, a 1-rank baseline, then N ranks per strategy, all
through torchrun, at the same global batch and in the same data order; then the comparison.

The global batch G is the spec's: micro_batch_size x gradient_accumulation_steps x
parallel.world_size. With W ranks in all, each rank holds G / W samples per step as
micro-batch m x accumulation a; m is the spec's micro-batch, or the largest divisor of G / W
under it when the spec's does not divide (said in the result). The baseline runs the same m on
one rank with accumulation G / m, so both sides do the same work per device per micro-batch and
the difference is what N ranks cost or gain. G not divisible by W is refused before launching.

Results written to RUN_DIR/scale.json (RunDir.write_stage):
    strategies.<ddp|fsdp>.{nproc, world_size, efficiency, useful_tokens_per_s, ...}
        plain floats, read by the cost stage; the same numbers as figure dicts (unit,
        measured) under strategies.<s>.figures
    recommendation {strategy, reason}, preflight, baseline, global_batch, warnings
and per launch RUN_DIR/scale/<run>/rank<R>.json + all_ranks.json, logs under RUN_DIR/logs/scale/.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tunepilot.errors import TunepilotError, UserError
from tunepilot.figures import measured
from tunepilot.scaling.launch import LaunchError, Rendezvous, launch
from tunepilot.spec import RunSpec

STRATEGIES = ("ddp", "fsdp")
DEFAULT_STEPS = 5
DEFAULT_WARMUP_STEPS = 2
DEFAULT_TIMEOUT_S = 600.0
# Largest |loss(N ranks) - loss(1 rank)| over the same global batches that still counts as
# agreement. fp32: only the order of the reduction differs (all-reduce of per-rank means vs one
# mean); float32 eps is 2^-23, so after a few Adam steps differences stay near 1e-6; 1e-3 leaves
# room for longer runs. bf16 (8 bits of mantissa, eps 2^-8 = 0.0039): a loss of ~2-10 moves by a
# few hundredths when rounding differs.
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16-mixed": 5e-2, "fp16-mixed": 5e-2, "bf16-true": 1e-1}
SAME_SPEED_FRACTION = 0.05  # throughputs within 5% are a tie (few steps: that is the noise)


@dataclass
class BatchPlan:
    """How the global batch is held equal between 1 rank and W ranks."""

    global_batch_samples: int
    world_size: int
    micro_batch_size: int
    accumulation: int
    baseline_accumulation: int
    sequence_length: int
    note: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arithmetic"] = (
            f"{self.micro_batch_size} micro-batch x {self.accumulation} accumulation x "
            f"{self.world_size} ranks = {self.micro_batch_size} x {self.baseline_accumulation} x 1"
            f" rank = {self.global_batch_samples} samples per optimizer step "
            f"(<= {self.global_batch_samples * self.sequence_length:,} tokens)")
        return d


def plan_batches(spec: RunSpec, world: int) -> BatchPlan:
    """Micro-batch and accumulation per rank for W ranks and for the 1-rank baseline."""
    g = spec.micro_batch_size * spec.gradient_accumulation_steps * spec.parallel.world_size
    if g % world:
        raise UserError("--nproc", f"the spec's global batch of {g} samples (micro_batch_size "
                        f"{spec.micro_batch_size} x gradient_accumulation_steps "
                        f"{spec.gradient_accumulation_steps} x {spec.parallel.world_size} "
                        f"device(s)) cannot be split evenly over {world} ranks, so the scaling "
                        "test could not hold it equal.",
                        f"Use a rank count that divides {g}, or set gradient_accumulation_steps "
                        f"to a multiple of {world}.")
    per_rank = g // world
    micro = max(m for m in range(1, spec.micro_batch_size + 1) if per_rank % m == 0)
    note = None
    if micro != spec.micro_batch_size:
        note = (f"micro-batch per rank is {micro}, not the spec's {spec.micro_batch_size}: "
                f"{world} ranks hold {g} samples as {per_rank} each; the baseline uses {micro} "
                "too, so both measure the same work per micro-batch")
    return BatchPlan(g, world, micro, per_rank // micro, g // micro, spec.sequence_length, note)


@dataclass
class ScalingResult:
    """What `tunepilot scale` found; `to_dict()` is what scale.json holds."""

    label: str
    nproc: int
    nnodes: int
    world_size: int
    device: str
    steps: int
    warmup_steps: int
    global_batch: dict
    preflight: dict
    baseline: dict
    strategies: dict
    recommendation: dict
    warnings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    run_dir: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def scale(spec: RunSpec, nproc: int, strategies: tuple[str, ...] | list[str] = STRATEGIES, *,
          out: str | Path, steps: int = DEFAULT_STEPS, warmup_steps: int = DEFAULT_WARMUP_STEPS,
          base_dir: Path | None = None, device: str = "auto", rdzv: Rendezvous | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, catalog=None, node=None, bench: bool = True,
          bench_sizes_bytes: list[int] | None = None,
          progress: Callable[[str], None] | None = None) -> ScalingResult:
    """Run the scaling test and write RUN_DIR/scale.json. Raises UserError before launching
    anything when the request cannot be run as asked, LaunchError when a rank fails."""
    from tunepilot.scaling.preflight import preflight
    from tunepilot.store import RunDir

    say = progress or (lambda _msg: None)
    strategies = tuple(dict.fromkeys(strategies))
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UserError("--strategy", f"unknown strategy {bad[0] if bad else ''!r}.",
                        "Use ddp, fsdp or both.")
    if steps < 1:
        raise UserError("--steps", f"needs at least 1 measured step (got {steps}).")
    if warmup_steps < 0:
        raise UserError("--warmup-steps", f"cannot be negative (got {warmup_steps}).")
    rdzv = rdzv or Rendezvous()
    world = nproc * rdzv.nnodes
    batches = plan_batches(spec, world)
    run_dir = RunDir(out)
    run_dir.check_spec(spec.spec_hash())
    work = run_dir.path / "scale"
    logs = run_dir.path / "logs" / "scale"  # created by the first launch, not before the checks

    say(f"preflight: {nproc} rank(s) per node x {rdzv.nnodes} node(s)"
        + ("; bus-bandwidth benchmark (a torchrun launch)" if bench and world > 1 else ""))
    pre = preflight(nproc, device=device, nnodes=rdzv.nnodes, node=node, catalog=catalog,
                    bench=bench, log_dir=logs / "bench", out_dir=work, timeout_s=timeout_s,
                    rdzv=rdzv.for_launch("bench"), sizes_bytes=bench_sizes_bytes)
    for w in pre.warnings:
        say(f"preflight warning [{w['code']}]: {w['message']}")
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    ctx = _Ctx(spec_file, base_dir, "cpu" if pre.node.kind == "cpu" else "cuda",
               pre.threads_per_rank, steps, warmup_steps, batches, work, logs, timeout_s, say)

    say(f"baseline: 1 rank, micro-batch {batches.micro_batch_size} x "
        f"{batches.baseline_accumulation} accumulation")
    base_records = ctx.run("baseline", "single", 1, batches.baseline_accumulation, Rendezvous())
    baseline = summarize(base_records)
    say(f"baseline: {baseline['useful_tokens_per_s']:,.0f} useful tokens/s")
    results: dict[str, dict] = {}
    if world == 1:
        say("one rank in all: the baseline is the whole test (use --nproc 2 or more to compare)")
    for s in strategies if world > 1 else ():
        say(f"{s}: {world} ranks, micro-batch {batches.micro_batch_size} x "
            f"{batches.accumulation} accumulation")
        try:
            records = ctx.run(s, s, nproc, batches.accumulation, rdzv.for_launch(s))
        except LaunchError as exc:
            oom = ctx.does_not_fit(s)
            if not oom:
                raise
            results[s] = {"status": "does_not_fit", "nproc": nproc, "world_size": world,
                          "efficiency": None, "useful_tokens_per_s": None, "error": oom,
                          "launch_error": str(exc).splitlines()[0]}
            say(f"{s}: does not fit ({oom})")
            continue
        results[s] = compare(summarize(records), baseline, batches, spec.precision, nproc)
        r = results[s]
        say(f"{s}: {r['useful_tokens_per_s']:,.0f} useful tokens/s, efficiency "
            f"{r['efficiency']:.2f}, loss max diff {r['loss_max_abs_diff']:.2e}")
    rec = recommend(results, baseline, world)
    result = ScalingResult(
        label=spec.label, nproc=nproc, nnodes=rdzv.nnodes, world_size=world,
        device=pre.node.kind, steps=steps, warmup_steps=warmup_steps,
        global_batch=batches.to_dict(), preflight=pre.to_dict(), baseline=baseline,
        strategies=results, recommendation=rec, warnings=pre.warnings,
        notes=([batches.note] if batches.note else []) + _notes(spec, pre),
        run_dir=str(run_dir.path))
    run_dir.write_stage("scale", result.to_dict(), spec.spec_hash())
    return result


@dataclass
class _Ctx:
    """What every launch of one scaling test shares."""

    spec_file: Path
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
            ) -> list[dict]:
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)  # never read a previous run's rank files
        shutil.rmtree(self.logs / name, ignore_errors=True)
        args = ["--spec", str(self.spec_file), "--strategy", strategy,
                "--micro-batch", str(self.batches.micro_batch_size),
                "--accumulation", str(accumulation),
                "--global-batch", str(self.batches.global_batch_samples),
                "--warmup-steps", str(self.warmup_steps), "--steps", str(self.steps),
                "--device", self.device, "--out", str(out)]
        if self.base_dir is not None:
            args += ["--base-dir", str(self.base_dir)]
        env = {}
        if self.device == "cpu":
            args += ["--threads", str(self.threads or 1)]
            env["OMP_NUM_THREADS"] = str(self.threads or 1)
        res = launch(f"scale {name}", "tunepilot.scaling.worker", args, nproc=nproc,
                     log_dir=self.logs / name, timeout_s=self.timeout_s, rdzv=rdzv, env=env)
        self.say(f"{name}: launch took {res.wall_s:.1f} s")
        world = nproc * rdzv.nnodes
        return read_rank_records(out, world)

    def does_not_fit(self, name: str) -> str | None:
        for p in sorted((self.work / name).glob("rank*.json")):
            rec = json.loads(p.read_text())
            if rec.get("status") == "does_not_fit":
                return f"rank {rec.get('rank')}: {rec.get('error')}"
        return None


def read_rank_records(out: Path, world: int) -> list[dict]:
    """Every rank's record: all_ranks.json (gathered over the process group, so it holds the
    other nodes' ranks too), else the rank<R>.json files; all W ranks must be there."""
    recs: dict[int, dict] = {}
    gathered = out / "all_ranks.json"
    if gathered.exists():
        for r in json.loads(gathered.read_text())["ranks"]:
            recs[int(r["rank"])] = r
    for p in out.glob("rank*.json"):
        r = json.loads(p.read_text())
        recs.setdefault(int(r["rank"]), r)
    missing = [r for r in range(world) if r not in recs]
    if missing:
        raise TunepilotError(f"ranks {missing} of {world} wrote no result in {out}; the launch "
                             "ended without error, so their node's output directory is "
                             "elsewhere (multi-node: use a shared --out) or was removed.")
    return [recs[r] for r in range(world)]


# --- analysis ----------------------------------------------------------------------------------


def _dist(values: list[float]) -> dict:
    xs = sorted(values)
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0],
            "max": xs[-1], "values": values}


def summarize(records: list[dict]) -> dict:
    """Throughput, step times, memory, losses and sample order of one launch (all its ranks).

    A step ends when its slowest rank ends (the optimizer step of every rank follows the same
    collective), so the global step time is the max over ranks, and throughput = all ranks'
    useful tokens over the sum of those step times (measured steps only).
    """
    world = len(records)
    n_steps = len(records[0]["steps"])
    meas = [i for i in range(n_steps) if records[0]["steps"][i]["measured"]]
    step_s = [max(r["steps"][i]["wall_s"] for r in records) for i in meas]
    tokens = sum(r["steps"][i]["useful_tokens"] for r in records for i in meas)
    per_rank = []
    for r in records:
        rs = [r["steps"][i] for i in meas]
        inflight = [s["comm_inflight_s"] for s in rs if s.get("comm_inflight_s") is not None]
        exposed = [s["comm_exposed_s"] for s in rs if s.get("comm_exposed_s") is not None]
        wall = sum(s["wall_s"] for s in rs)
        per_rank.append({
            "rank": r["rank"], "host": r["host"], "pid": r["pid"], "device": r["device"],
            "threads": r["threads"], "params_local": r["params_local"],
            "useful_tokens": sum(s["useful_tokens"] for s in rs),
            "useful_tokens_per_s": sum(s["useful_tokens"] for s in rs) / wall if wall else None,
            "step_time_s": _dist([s["wall_s"] for s in rs]),
            "peak_memory_bytes": r["memory"]["peak_bytes"]["value"],
            "memory_measure": r["memory"]["peak_bytes"].get("what"),
            "comm_inflight_s_per_step": statistics.fmean(inflight) if inflight else None,
            "comm_exposed_s_per_step": statistics.fmean(exposed) if exposed else None,
            "comm_measure": r["comm_measure"]})
    losses = [records[0]["steps"][i]["loss_global"] for i in range(n_steps)]
    spread = max(abs(r["steps"][i]["loss_global"] - losses[i]) for r in records
                 for i in range(n_steps))
    return {
        "world_size": world, "strategy": records[0]["strategy"],
        "backend": records[0]["backend"],
        "micro_batch_size": records[0]["micro_batch_size"],
        "accumulation": records[0]["accumulation"],
        "measured_steps": len(meas), "useful_tokens": tokens,
        "useful_tokens_per_s": tokens / sum(step_s), "step_time_s": _dist(step_s),
        "peak_memory_bytes_per_rank": max(p["peak_memory_bytes"] for p in per_rank),
        "losses": losses, "loss_spread_between_ranks": spread,
        "samples": [interleave([r["steps"][i]["samples"] for r in records])
                    for i in range(n_steps)],
        "ranks_reported": sorted(r["rank"] for r in records), "per_rank": per_rank}


def interleave(per_rank: list[list[str]]) -> list[str]:
    """The single-device order of one step: sample k of rank r is sample k*W + r
    (StatefulDistributedSampler hands rank r the indices r, r+W, r+2W, ...)."""
    world = len(per_rank)
    out = [""] * sum(len(x) for x in per_rank)
    for r, xs in enumerate(per_rank):
        for k, fp in enumerate(xs):
            out[k * world + r] = fp
    return out


def compare(run: dict, base: dict, batches: BatchPlan, precision: str, nproc: int) -> dict:
    """The verdict of one strategy against the 1-rank baseline."""
    w = run["world_size"]
    eff = run["useful_tokens_per_s"] / (w * base["useful_tokens_per_s"])
    diffs = [abs(a - b) for a, b in zip(run["losses"], base["losses"], strict=True)]
    tol = LOSS_TOLERANCE.get(precision, 5e-2)
    order = [i for i, (a, b) in enumerate(zip(run["samples"], base["samples"], strict=True))
             if a != b]
    per_micro_s = base["step_time_s"]["median"] / batches.baseline_accumulation
    overhead = run["step_time_s"]["median"] - per_micro_s * batches.accumulation
    rule = ("median N-rank step time - (baseline median step time / baseline accumulation) x "
            "N-rank accumulation: what a step costs beyond its compute on one device "
            "(communication, waiting for the slowest rank, sharding)")
    d = {
        "status": "ok", "nproc": nproc, "world_size": w, "efficiency": eff,
        "useful_tokens_per_s": run["useful_tokens_per_s"],
        "baseline_useful_tokens_per_s": base["useful_tokens_per_s"],
        "speedup": run["useful_tokens_per_s"] / base["useful_tokens_per_s"],
        "step_time_s_median": run["step_time_s"]["median"],
        "peak_memory_bytes_per_rank": run["peak_memory_bytes_per_rank"],
        "baseline_peak_memory_bytes": base["peak_memory_bytes_per_rank"],
        "overhead_s_per_step": overhead, "overhead_fraction": overhead / run["step_time_s"][
            "median"],
        "loss_max_abs_diff": max(diffs), "loss_tolerance": tol, "loss_agrees": max(diffs) <= tol,
        "loss_per_step": {"n_ranks": run["losses"], "one_rank": base["losses"]},
        "data_order_same": not order, "data_order_first_mismatch_step": order[0] if order else
        None, "samples_checked": sum(len(s) for s in run["samples"]),
        "ranks_reported": run["ranks_reported"],
        "all_ranks_reported": run["ranks_reported"] == list(range(w)),
        "global_batch_samples": batches.global_batch_samples,
        "figures": {
            "efficiency": measured(eff, "ratio", rule="T_N / (N x T_1) on useful tokens/s"),
            "useful_tokens_per_s": measured(run["useful_tokens_per_s"], "tokens/s"),
            "peak_memory_per_rank": measured(run["peak_memory_bytes_per_rank"], "bytes"),
            "step_time_median": measured(run["step_time_s"]["median"], "s"),
            "overhead_per_step": measured(overhead, "s", rule=rule),
            "loss_max_abs_diff": measured(max(diffs), "nats/token"),
        },
        "run": {k: v for k, v in run.items() if k not in ("samples", "losses")},
    }
    if eff > 1 + SAME_SPEED_FRACTION:
        d["note"] = (f"efficiency {eff:.2f} is above 1: N ranks cannot do more than N times one "
                     "rank's work, so the baseline ran slow (a busy machine, a cold cache) or "
                     "the steps were too few; rerun with more --steps before trusting it")
    return d


def recommend(results: dict[str, dict], base: dict, world: int) -> dict:
    """Which strategy to use on this hardware, and why (throughput vs memory per rank)."""
    if world == 1:
        return {"strategy": "single", "reason": "one rank: only the baseline ran, there is "
                "nothing to compare it with; run with --nproc 2 or more"}
    ok = {s: r for s, r in results.items() if r["status"] == "ok"}
    broken = [s for s, r in ok.items() if not (r["loss_agrees"] and r["data_order_same"])]
    good = {s: r for s, r in ok.items() if s not in broken}
    unfit = [s for s, r in results.items() if r["status"] == "does_not_fit"]
    if not good:
        why = ("; ".join(f"{s}: loss or data order disagrees with one rank" for s in broken) or
               "; ".join(f"{s} does not fit" for s in unfit) or "no strategy ran")
        return {"strategy": None, "reason": f"no strategy passed: {why}"}
    best = max(good, key=lambda s: good[s]["useful_tokens_per_s"])
    b = good[best]
    if b["useful_tokens_per_s"] <= base["useful_tokens_per_s"]:
        return {"strategy": "single", "reason": (
            f"{world} ranks with {best} deliver {b['useful_tokens_per_s']:,.0f} useful tokens/s, "
            f"not more than one device's {base['useful_tokens_per_s']:,.0f} (efficiency "
            f"{b['efficiency']:.2f}): on this hardware scaling out loses; rent one device, or fix "
            "what the preflight warns about first")}
    reason = [f"{best}: {b['useful_tokens_per_s']:,.0f} useful tokens/s on {world} ranks, "
              f"efficiency {b['efficiency']:.2f}"]
    other = next((s for s in good if s != best), None)
    if other is not None:
        o = good[other]
        gap = 1 - o["useful_tokens_per_s"] / b["useful_tokens_per_s"]
        if gap <= SAME_SPEED_FRACTION and o["peak_memory_bytes_per_rank"] < \
                b["peak_memory_bytes_per_rank"]:
            reason = [f"{other}: as fast within {SAME_SPEED_FRACTION:.0%} ({gap:.1%} under "
                      f"{best}) and less memory per rank ({_gib(o['peak_memory_bytes_per_rank'])}"
                      f" vs {_gib(b['peak_memory_bytes_per_rank'])}): the headroom buys a larger "
                      "micro-batch or longer sequences"]
            best, b = other, o
        else:
            reason.append(f"{b['useful_tokens_per_s'] / o['useful_tokens_per_s']:.2f}x the "
                          f"throughput of {other} "
                          f"({o['useful_tokens_per_s']:,.0f} tokens/s, efficiency "
                          f"{o['efficiency']:.2f}); memory per rank "
                          f"{_gib(b['peak_memory_bytes_per_rank'])} vs "
                          f"{_gib(o['peak_memory_bytes_per_rank'])}")
    if unfit:
        reason.append(f"{', '.join(unfit)} does not fit the device")
    if b["efficiency"] < 0.5:
        reason.append(f"but at efficiency {b['efficiency']:.2f} each added device gives less "
                      "than half a device: price the N-card term against one card's")
    return {"strategy": best, "reason": "; ".join(reason)}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _notes(spec: RunSpec, pre) -> list[str]:
    out = []
    if pre.node.kind == "cpu":
        out.append("peak memory per rank on the CPU is the process's RSS at its peak over "
                   "the training steps: it includes the Python/torch runtime, not only the "
                   "training state, so it hides what FSDP's sharding saves on a small model")
    return out
