"""The scaling test's analysis: one launch's throughput, step times, memory, losses and sample
order (summarize), a strategy against the 1-rank baseline (compare), and which strategy to use
on this hardware (recommend)."""

from __future__ import annotations

import statistics

from tunepilot.results.figure import Figure
from tunepilot.results.scale import (
    BatchPlan,
    LaunchSummary,
    Recommendation,
    StrategyResult,
)
from tunepilot.scaling.messages import RankRecord
from tunepilot.spec.precision import Precision
from tunepilot.units import fmt_bytes

SAME_SPEED_FRACTION = 0.05  # throughputs within 5% are a tie (few steps: that is the noise)


def _dist(values: list[float]) -> dict:
    xs = sorted(values)
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0],
            "max": xs[-1], "values": values}


def summarize(records: list[RankRecord]) -> LaunchSummary:
    """Throughput, step times, memory, losses and sample order of one launch (all its ranks).

    A step ends when its slowest rank ends (the optimizer step of every rank follows the same
    collective), so the global step time is the max over ranks, and throughput = all ranks'
    useful tokens over the sum of those step times (measured steps only).
    """
    world = len(records)
    first = records[0]
    n_steps = len(first.steps)
    meas = [i for i in range(n_steps) if first.steps[i].measured]
    step_s = [max(r.steps[i].wall_s for r in records) for i in meas]
    tokens = sum(r.steps[i].useful_tokens for r in records for i in meas)
    per_rank = []
    for r in records:
        rs = [r.steps[i] for i in meas]
        inflight = [s.comm_inflight_s for s in rs if s.comm_inflight_s is not None]
        exposed = [s.comm_exposed_s for s in rs if s.comm_exposed_s is not None]
        wall = sum(s.wall_s for s in rs)
        per_rank.append({
            "rank": r.rank, "host": r.host, "pid": r.pid, "device": r.device,
            "threads": r.threads, "params_local": r.params_local,
            "useful_tokens": sum(s.useful_tokens for s in rs),
            "useful_tokens_per_s": sum(s.useful_tokens for s in rs) / wall if wall else None,
            "step_time_s": _dist([s.wall_s for s in rs]),
            "peak_memory_bytes": r.peak_memory_bytes, "memory_measure": r.memory_measure,
            "host_peak_rss_bytes": r.host_peak_rss_bytes,
            "comm_inflight_s_per_step": statistics.fmean(inflight) if inflight else None,
            "comm_exposed_s_per_step": statistics.fmean(exposed) if exposed else None,
            "comm_measure": r.comm_measure})
    losses = [first.steps[i].loss_global for i in range(n_steps)]
    spread = max(abs(r.steps[i].loss_global - losses[i]) for r in records
                 for i in range(n_steps))
    return LaunchSummary(**{
        "world_size": world, "strategy": first.strategy, "backend": first.backend,
        "micro_batch_size": first.micro_batch_size, "accumulation": first.accumulation,
        "measured_steps": len(meas), "useful_tokens": tokens,
        "useful_tokens_per_s": tokens / sum(step_s), "step_time_s": _dist(step_s),
        "peak_memory_bytes_per_rank": max(p["peak_memory_bytes"] for p in per_rank),
        "losses": losses, "loss_spread_between_ranks": spread,
        "samples": [interleave([r.steps[i].samples for r in records])
                    for i in range(n_steps)],
        "ranks_reported": sorted(r.rank for r in records), "per_rank": per_rank,
        "host_peak_rss_bytes_per_node": host_per_node(records)})


def host_per_node(records: list[RankRecord]) -> dict[str, int]:
    """Host name -> the sum of its ranks' peak RSS: the node's host RAM as measured (an upper
    bound of its peak: the ranks' peaks need not coincide). Ranks that did not record it are
    left out of their node's sum."""
    out: dict[str, int] = {}
    for r in records:
        if r.host_peak_rss_bytes is not None:
            key = r.host or "unknown host"
            out[key] = out.get(key, 0) + int(r.host_peak_rss_bytes)
    return out


def interleave(per_rank: list[list[str]]) -> list[str]:
    """The single-device order of one step: sample k of rank r is sample k*W + r
    (StatefulDistributedSampler hands rank r the indices r, r+W, r+2W, ...)."""
    world = len(per_rank)
    out = [""] * sum(len(x) for x in per_rank)
    for r, xs in enumerate(per_rank):
        for k, fp in enumerate(xs):
            out[k * world + r] = fp
    return out


def compare(run: LaunchSummary, base: LaunchSummary, batches: BatchPlan, precision: Precision,
            nproc: int) -> StrategyResult:
    """The verdict of one strategy against the baseline (1 rank, or the smallest rank count
    that fits): efficiency is per-rank throughput relative to the baseline's per rank."""
    w = run.world_size
    eff = run.useful_tokens_per_s * base.world_size / (w * base.useful_tokens_per_s)
    diffs = [abs(a - b) for a, b in zip(run.losses, base.losses, strict=True)]
    tol = precision.rank_loss_tolerance  # the largest |loss(N) - loss(baseline)| that agrees
    order = [i for i, (a, b) in enumerate(zip(run.samples, base.samples, strict=True)) if a != b]
    per_micro_s = base.step_time_s.median / batches.baseline_accumulation
    overhead = run.step_time_s.median - per_micro_s * batches.accumulation
    rule = ("median N-rank step time - (baseline median step time / baseline accumulation) x "
            "N-rank accumulation: what a step costs beyond its compute on one device "
            "(communication, waiting for the slowest rank, sharding)")
    M = Figure.measured
    d = StrategyResult(
        status="ok", nproc=nproc, world_size=w, efficiency=eff,
        useful_tokens_per_s=run.useful_tokens_per_s,
        baseline_useful_tokens_per_s=base.useful_tokens_per_s,
        speedup=run.useful_tokens_per_s / base.useful_tokens_per_s,
        step_time_s_median=run.step_time_s.median,
        peak_memory_bytes_per_rank=run.peak_memory_bytes_per_rank,
        baseline_peak_memory_bytes=base.peak_memory_bytes_per_rank,
        overhead_s_per_step=overhead, overhead_fraction=overhead / run.step_time_s.median,
        loss_max_abs_diff=max(diffs), loss_tolerance=tol, loss_agrees=max(diffs) <= tol,
        loss_per_step={"n_ranks": run.losses, "one_rank": base.losses},
        data_order_same=not order, data_order_first_mismatch_step=order[0] if order else None,
        samples_checked=sum(len(s) for s in run.samples), ranks_reported=run.ranks_reported,
        all_ranks_reported=run.ranks_reported == list(range(w)),
        global_batch_samples=batches.global_batch_samples,
        figures={
            "efficiency": M(eff, "ratio", rule="T_N / (N x T_1) on useful tokens/s"
                            if base.world_size == 1 else
                            f"(T_N / N) / (T_b / b) on useful tokens/s, against the smallest "
                            f"rank count that fits (b = {base.world_size})"),
            "useful_tokens_per_s": M(run.useful_tokens_per_s, "tokens/s"),
            "peak_memory_per_rank": M(run.peak_memory_bytes_per_rank, "bytes"),
            "step_time_median": M(run.step_time_s.median, "s"),
            "overhead_per_step": M(overhead, "s", rule=rule),
            "loss_max_abs_diff": M(max(diffs), "nats/token"),
        },
        run=run.model_dump(exclude={"samples", "losses"}))
    if eff > 1 + SAME_SPEED_FRACTION:
        d.note = (f"efficiency {eff:.2f} is above 1: N ranks cannot do more than N times one "
                     "rank's work, so the baseline ran slow (a busy machine, a cold cache) or "
                     "the steps were too few; rerun with more --steps before trusting it")
    return d


def recommend(results: dict[str, StrategyResult], base: LaunchSummary, world: int,
              device: str = "cuda") -> Recommendation:
    """Which strategy to use on this hardware, and why (throughput vs memory per rank); none,
    inconclusive, when the measured efficiency is noise."""
    if world == 1:
        return Recommendation(strategy="single", reason="one rank: only the baseline ran, there "
                              "is nothing to compare it with; run with --nproc 2 or more")
    ok = {s: r for s, r in results.items() if r.status == "ok"}
    broken = [s for s, r in ok.items() if not (r.loss_agrees and r.data_order_same)]
    good = {s: r for s, r in ok.items() if s not in broken}
    unfit = [s for s, r in results.items() if r.status == "does_not_fit"]
    crashed = [s for s, r in results.items() if r.status == "failed"]
    if not good:
        why = "; ".join([f"{s}: loss or data order disagrees with one rank" for s in broken] +
                        [f"{s} does not fit" for s in unfit] +
                        [f"{s} failed ({results[s].error})" for s in crashed]) or \
            "no strategy ran"
        return Recommendation(strategy=None, reason=f"no strategy passed: {why}")
    best = max(good, key=lambda s: good[s].useful_tokens_per_s)
    b = good[best]
    failed = f"; {', '.join(crashed)} failed (see its error and log lines)" if crashed else ""
    if base.world_size > 1:  # the model fits no single device: sharding is the only way
        return Recommendation(strategy=best, reason=(
            f"{best}: the model fits no single device (the baseline is FSDP over "
            f"{base.world_size} ranks, the fewest that fit); {b.useful_tokens_per_s:,.0f} useful "
            f"tokens/s on {world} ranks, efficiency {b.efficiency:.2f} per rank relative to it"
            + failed))
    if b.useful_tokens_per_s <= base.useful_tokens_per_s:
        return Recommendation(strategy="single", reason=(
            f"{world} ranks with {best} deliver {b.useful_tokens_per_s:,.0f} useful tokens/s, "
            f"not more than one device's {base.useful_tokens_per_s:,.0f} (efficiency "
            f"{b.efficiency:.2f}): on this hardware scaling out loses; rent one device, or fix "
            "what the preflight warns about first" + failed))
    noise = _noise(good, device)
    if noise:
        return Recommendation(strategy=None, inconclusive=True, reason=noise + failed)
    reason = [f"{best}: {b.useful_tokens_per_s:,.0f} useful tokens/s on {world} ranks, "
              f"efficiency {b.efficiency:.2f}"]
    other = next((s for s in good if s != best), None)
    if other is not None:
        o = good[other]
        gap = 1 - o.useful_tokens_per_s / b.useful_tokens_per_s
        if gap <= SAME_SPEED_FRACTION and o.peak_memory_bytes_per_rank < \
                b.peak_memory_bytes_per_rank:
            reason = [f"{other}: as fast within {SAME_SPEED_FRACTION:.0%} ({gap:.1%} under "
                      f"{best}) and less memory per rank ({fmt_bytes(o.peak_memory_bytes_per_rank)}"
                      f" vs {fmt_bytes(b.peak_memory_bytes_per_rank)}): the headroom buys a larger "
                      "micro-batch or longer sequences"]
            best, b = other, o
        else:
            reason.append(f"{b.useful_tokens_per_s / o.useful_tokens_per_s:.2f}x the "
                          f"throughput of {other} "
                          f"({o.useful_tokens_per_s:,.0f} tokens/s, efficiency "
                          f"{o.efficiency:.2f}); memory per rank "
                          f"{fmt_bytes(b.peak_memory_bytes_per_rank)} vs "
                          f"{fmt_bytes(o.peak_memory_bytes_per_rank)}")
    if unfit:
        reason.append(f"{', '.join(unfit)} does not fit the device")
    if crashed:
        reason.append(f"{', '.join(crashed)} failed (see its error and log lines)")
    if b.efficiency < 0.5:
        reason.append(f"but at efficiency {b.efficiency:.2f} each added device gives less "
                      "than half a device: price the N-card term against one card's")
    return Recommendation(strategy=best, reason="; ".join(reason))


def _noise(good: dict[str, StrategyResult], device: str) -> str | None:
    """Why the efficiencies are noise, or None: N ranks cannot do more than N times one rank's
    work, so an efficiency above 1 means the baseline ran slow (a busy machine, a cold cache)
    or the steps were too few - on CPU ranks, which share the host's cores, any excess; on
    accelerators, beyond SAME_SPEED_FRACTION."""
    limit = 1.0 if device == "cpu" else 1 + SAME_SPEED_FRACTION
    over = {s: r.efficiency for s, r in good.items() if r.efficiency and r.efficiency > limit}
    if not over:
        return None
    shown = ", ".join(f"{s} {e:.0%}" for s, e in over.items())
    where = "on CPU ranks, which share this host's cores" if device == "cpu" else "here"
    return (f"inconclusive: efficiency {shown} is above 100% {where}, which N ranks cannot "
            "reach: the one-rank baseline ran slow or the steps were too few, so the "
            "strategies' throughputs are noise and none is recommended; re-run on a quiet "
            "machine with more --steps")


def notes(pre) -> list[str]:
    out = []
    if pre.node.kind == "cpu":
        out.append("peak memory per rank on the CPU is the process's RSS at its peak over "
                   "the training steps: it includes the Python/torch runtime, not only the "
                   "training state, so it hides what FSDP's sharding saves on a small model")
    return out
