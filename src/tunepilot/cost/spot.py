"""The spot term priced with its interruptions, and the checkpoint interval that minimises it.

A spot card is reclaimed at some rate; each interruption loses the work since the last
checkpoint and pays a restart (provisioning, set-up, model load, checkpoint load, the data
skip). First-order model, stated wherever it is shown (every figure projected):

  rate      r per instance-hour (pricing.spot_interruptions_per_hour with its source, the
            user's --spot-rate, or cost_model.yaml spot_interruptions_per_node_hour); a job of
            n nodes stops when any one is reclaimed: r_job = n x r, M = 1 / r_job
  C         one checkpoint save (restore.json save_s where measured, else the quote's rule)
  T         work between checkpoints: Young (1974), T = sqrt(2 x C x M), unless given; Daly's
            (2006) higher-order T = sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C shown beside it
  B         the job with a checkpoint every T and no interruption: the once-per-job terms +
            the checkpointed work W (training + validation) + floor(W / T) x C
  L         lost per interruption: T/2 of work (an interruption falls anywhere in the interval)
            + R (the restart)
  H         expected wall time: H = B + r_job x H x L, so H = B / (1 - r_job x L); the job
            never finishes in expectation when r_job x L >= 1
  N         expected interruptions r_job x H; the spread takes N as Poisson: at n
            interruptions the run takes B + n x L
Costs: cards x billed hours x the spot rate, rounded to cents once (billing increment of the
card, the run billed as one stretch); the naive spot cost is B at the spot rate - the same job,
saving on the same schedule, with no interruption (pricing it on the spec's own checkpoint
schedule instead made the overhead negative whenever that saved more often than T: issue 40
N20) - the on-demand cost the on-demand job (the spec's schedule) at the on-demand rate. Both formulas assume
memoryless interruptions; published spot traces show early reclaims dominate (median life well
under the mean) and a node's neighbours reclaimed within minutes (NOTES in docs/cost.md).
"""

from __future__ import annotations

import math
from decimal import Decimal

from tunepilot.catalog import Card, check_rate
from tunepilot.cost.assumptions import assumed, cost_model
from tunepilot.cost.terms import billed_seconds, to_cents
from tunepilot.errors import UserError
from tunepilot.results.figure import PROJECTED, Figure
from tunepilot.results.quote import TimeTerm
from tunepilot.results.spot import SpotOutcome, SpotQuote

GPUS_PER_NODE = 8
ONCE = ("provisioning", "set-up", "model load", "export")  # once per job, not checkpointed
WORK = ("training", "validation")  # the work a checkpoint saves
SPREAD = (0.1, 0.5, 0.9)


def node_rate(card: Card, given: float | str | None) -> Figure:
    """Interruptions per instance-hour: the user's (``--spot-rate``), the offer's (catalog, with
    its source), or the cost model's assumption. A rate outside [0, 1) is a UserError."""
    if given is not None:
        try:
            rate = check_rate(given)
        except ValueError as exc:
            raise UserError("spot-rate", f"{exc}.", "E.g. --spot-rate 0.05.") from None
        return Figure.projected(rate, "1/h", "given (--spot-rate)")
    p = card.pricing
    if p.spot_interruptions_per_hour is not None:
        return Figure.projected(p.spot_interruptions_per_hour, "1/h",
                                f"catalog: {p.spot_interruption_source}")
    short = cost_model()["spot_interruptions_per_node_hour"]["short"]
    return Figure.projected(assumed("spot_interruptions_per_node_hour"), "1/h",
                            f"assumed (cost_model.yaml spot_interruptions_per_node_hour): {short}")


def young_interval_s(save_s: float, mtbi_s: float) -> float:
    """Young (1974): T = sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbi_s)


def daly_interval_s(save_s: float, mtbi_s: float) -> float:
    """Daly (2006), eq. 37: sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M."""
    if save_s >= 2 * mtbi_s:
        return mtbi_s
    x = save_s / (2 * mtbi_s)
    return math.sqrt(2 * save_s * mtbi_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest n with P(X <= n) >= q for X ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    n, term = 0, math.exp(-mean) if mean < 700 else 0.0
    if term == 0.0:  # too large for the direct sum: the normal approximation
        return max(0, math.ceil(mean + math.sqrt(mean) * _z(q) - 0.5))
    total = term
    while total < q:
        n += 1
        term *= mean / n
        total += term
    return n


def _z(q: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


def billed_cents(card: Card, count: int, seconds: float, usd_per_hour: Decimal) -> int:
    """``count`` cards for ``seconds`` billed as the on-demand term is (terms.billed_seconds:
    whole seconds up to the increment, at least the minimum charge) at ``usd_per_hour`` per
    card, in cents, rounded once."""
    billed = billed_seconds(card, math.ceil(seconds))
    return to_cents(count * Decimal(billed) / 3600 * usd_per_hour)


def check_interval(interval_s: float | None, save: Figure) -> None:
    """A given checkpoint interval must be a finite time longer than one save."""
    if interval_s is None:
        return
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise UserError("checkpoint-minutes", f"must be a positive number of minutes, got "
                        f"{interval_s / 60:g}.", "E.g. --checkpoint-minutes 30.")
    if interval_s <= save.value:
        raise UserError("checkpoint-minutes", f"{interval_s / 60:g} min between checkpoints is "
                        f"not longer than one checkpoint save, {save.value / 60:,.2f} min "
                        f"({save.basis}: {save.how}): the run would do nothing but save.",
                        "Give a longer interval, or omit --checkpoint-minutes for the one that "
                        "minimises the expected cost.")


def spot_quote(card: Card, count: int, *, terms: list[TimeTerm], steps: int,
               restart: dict[str, Figure], rate: Figure, interval_s: float | None = None
               ) -> SpotQuote | None:
    """The spot term of ``count`` x ``card`` for the job whose time terms are ``terms`` (None
    when the offer has no spot rate). ``interval_s``: a checkpoint interval to price instead of
    the one that minimises the expected cost."""
    p = card.pricing
    if p.spot_usd_per_hour is None:
        return None
    by = {t.name: t for t in terms}
    save = by["checkpoint writes"].each
    check_interval(interval_s, save)
    nodes = math.ceil(count / GPUS_PER_NODE)
    job_rate = rate.value * nodes
    mtbi = 3600.0 / job_rate if job_rate > 0 else None
    once = sum(by[n].total.value for n in ONCE if n in by)
    work = sum(by[n].total.value for n in WORK if n in by)
    step_s = by["training"].total.value / max(steps, 1)
    if interval_s is not None:
        t, rule, daly = interval_s, "given (--checkpoint-minutes)", None
    elif mtbi is None:
        t, rule, daly = work, "no interruptions expected (rate 0): one checkpoint at the end", None
    else:
        t = min(work, max(young_interval_s(save.value, mtbi), save.value))
        rule = (f"Young (1974): sqrt(2 x C x M) = sqrt(2 x {save.value:,.1f} s x "
                f"{mtbi:,.0f} s)" + (", capped at the job's work" if t == work else ""))
        daly = daly_interval_s(save.value, mtbi)
    n_ckpt = int(work // t) if t > 0 else 0
    base = once + work + n_ckpt * save.value
    r_s = sum(f.value for f in restart.values())
    lost = min(t, work) / 2 + r_s
    hazard = job_rate / 3600.0  # per second
    finishes = hazard * lost < 1
    expected = base / (1 - hazard * lost) if finishes else None
    n_mean = hazard * expected if expected is not None else None
    job_s = sum(x.total.value for x in terms)
    naive = billed_cents(card, count, base, p.spot_usd_per_hour)  # B: the same schedule
    spread = [] if n_mean is None else [
        _outcome(card, count, q, poisson_quantile(n_mean, q), base, lost) for q in SPREAD]
    exp_cents = billed_cents(card, count, expected, p.spot_usd_per_hour) if finishes else None
    how_rate = f"{nodes} node(s) x {rate.value:g}/h"
    return SpotQuote(
        spot_usd_per_hour=p.spot_usd_per_hour, spot_source=p.spot_source or "catalog",
        on_demand_usd_per_hour=p.on_demand_usd_per_hour, cards=count, nodes=nodes,
        rate_per_node_hour=rate, rate_per_job_hour=Figure.projected(job_rate, "1/h", how_rate),
        mtbi_s=Figure.projected(mtbi, "s", f"1 / ({how_rate})") if mtbi else None,
        save_s=save, restart=restart, restart_s=_sum(restart.values(), "sum of the restart"),
        interval_s=Figure.projected(t, "s", rule), interval_rule=rule, daly_interval_s=daly,
        interval_steps=max(1, round(t / step_s)) if step_s > 0 else 1, step_s=step_s,
        checkpoints=n_ckpt,
        work_s=Figure.projected(base, "s", f"{once:,.0f} s once + {work:,.0f} s of work + "
                                f"{n_ckpt:,} x {save.value:,.1f} s of saves"),
        lost_per_interruption_s=Figure.projected(
            lost, "s", f"{min(t, work) / 2:,.0f} s (half an interval) + {r_s:,.0f} s restart"),
        expected_interruptions=Figure.projected(
            n_mean, "interruptions", "rate x expected hours") if n_mean is not None else
        Figure.missing("interruptions", "the job does not finish in expectation"),
        expected_s=Figure.projected(expected, "s", f"{base:,.0f} s / (1 - {hazard * lost:.3f})")
        if expected is not None else Figure.missing("s", "rate x lost work >= 1"),
        finishes=finishes,
        reason=None if finishes else (
            f"the job is interrupted every {mtbi / 3600:,.2f} h on average and loses "
            f"{lost / 3600:,.2f} h each time: on spot it does not finish in expectation"),
        spread=spread, naive_cost_cents=naive, expected_cost_cents=exp_cents,
        on_demand_cost_cents=billed_cents(card, count, job_s, p.on_demand_usd_per_hour),
        overhead_fraction=(exp_cents / naive - 1) if exp_cents is not None and naive else None,
        notes=_notes(card, nodes, restart))


def _outcome(card: Card, count: int, q: float, n: int, base: float, lost: float) -> SpotOutcome:
    hours = (base + n * lost) / 3600
    return SpotOutcome(quantile=q, interruptions=n, hours=hours,
                       cost_cents=billed_cents(card, count, base + n * lost,
                                               card.pricing.spot_usd_per_hour))


def _sum(figs, how: str) -> Figure:
    figs = list(figs)
    basis = "measured" if figs and all(f.is_measured for f in figs) else PROJECTED
    return Figure(value=sum(f.value for f in figs), unit="s", basis=basis, how=how)


def _notes(card: Card, nodes: int, restart: dict[str, Figure]) -> list[str]:
    out = ["first-order model: interruptions memoryless (published spot traces show early "
           "reclaims dominate), the run billed as one stretch (a new instance after each "
           "interruption may pay its own minimum charge)"]
    if nodes > 1:
        out.append(f"{nodes} nodes: the job stops when any one is reclaimed (rate x {nodes}); "
                   "reclaims of one type in one zone come together, so the rate is an upper "
                   "bound on separate interruptions")
    out.append("provisioning after an interruption waits for spot capacity, which traces show "
               "is there only part of the time: the restart's provisioning term is a floor")
    return out
