"""Term quotes: how long the job needs on N cards, what the term costs, and the cost per useful token.

Time the job needs = provisioning + set-up + model load + training (target useful tokens /
useful tokens/s at that card and count, cost/throughput.py) + validation passes
(spec.validation.every_steps) + checkpoint writes (spec.checkpoint.every_steps) + the final
export. Each term is **measured** when the run directory (``--from RUN_DIR``) holds a measurement
made on *this* card, else **projected** by a stated rule:

- provisioning (before tunepilot's process starts on the rented cluster) is always assumed;
- set-up, model load, checkpoint write and export are machine-bound: measured on another card,
  or on a device that is not a catalog card (a CPU pilot), they are carried over unchanged
  (projected). A CPU pilot's throughput and validation pass are compute-bound and not carried (a
  CPU has no catalog peak to scale by). Sizes (checkpoint bytes, the useful-token fraction) are
  properties of the run, not the machine: measured anywhere, they stay measured.
Every assumption comes from ``resources/cost_model.yaml`` with its source. The term's price
(billed time, term discount, options, in integer cents) is cost/terms.py. Money is Decimal or
integer cents, never a float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, localcontext
from pathlib import Path

from tunepilot.catalog import Card, Catalog, load_catalog
from tunepilot.cost.assumptions import assumed
from tunepilot.cost.context import QuoteContext, context
from tunepilot.cost.measurements import measured_value
from tunepilot.cost.rl_quote import generation_layout, rl_note, rl_of, rl_phases, rl_throughput
from tunepilot.cost.spot import node_rate, spot_quote
from tunepilot.cost.terms import billed_seconds, check_count, parse_options, term_cost
from tunepilot.cost.throughput import all_measured, per_card, scaled, useful_fraction
from tunepilot.errors import UserError
from tunepilot.model.context import context_warning
from tunepilot.model.flops import (
    EXPORT_RULE,
    export_bytes,
)
from tunepilot.plan.fit import DEFAULT_HEADROOM
from tunepilot.plan.host import Layout, host_fit, host_plan
from tunepilot.results.figure import MEASURED, PROJECTED, Figure
from tunepilot.results.host import HostFit
from tunepilot.results.quote import (
    BatchOnCards,
    Quote,
    QuoteThroughput,
    RunNumbers,
    TimeTerm,
)
from tunepilot.spec import RunSpec
from tunepilot.spec.objective import generation_cards, unit_notes
from tunepilot.units import fmt_bytes

__all__ = ["MEASURED", "PROJECTED", "quote"]
_USD_PER_M = Decimal("1e-10")  # cost per million useful tokens: kept fine, rounded once for display


def _machine(ctx: QuoteContext, card: Card, stage: str, fig: Figure | None, unit: str, what: str,
             where: str, *, from_cpu: bool = True) -> Figure | None:
    """A machine-bound measurement: measured on this card; carried over unchanged (projected)
    from another card or (``from_cpu``) a device that is not a catalog card (a CPU pilot)."""
    value = measured_value(fig)
    if value is None or ctx.run is None or (ctx.run.card_id is None and not from_cpu):
        return None
    where = f"{stage}.json {where}"
    if ctx.run.card_id == card.id:
        return Figure.measured(value, unit, f"{what}: {where} on {card.id}")
    return Figure.projected(value, unit, f"{what}: {where} measured on "
                            f"{ctx.run.card_id or ctx.run.device}, carried over unchanged "
                            "(machine-bound, not card-bound)")


def strategy_at(ctx: QuoteContext, card: Card, count: int) -> tuple[str | None, str | None]:
    """(the parallel strategy the quote assumes, why the fit is tight): strategy None when the
    run does not fit at ``count`` even with no headroom; tight when it fits only with less free
    memory than the headroom asked."""
    row = ctx.fit[card.id]
    need = row.devices_needed
    room = _pick(ctx, count, need.ddp == 1, need.fsdp is not None and count >= need.fsdp)
    if room is not None:
        return room, None
    tight = _pick(ctx, count, need.ddp_tight == 1,
                  need.fsdp_tight is not None and count >= need.fsdp_tight)
    return tight, _tight_reason(ctx, card, count) if tight else None


def _pick(ctx: QuoteContext, count: int, ddp_ok: bool, fsdp_ok: bool) -> str | None:
    if count == 1:
        return "single" if ddp_ok else None
    if ctx.spec.parallel.strategy == "fsdp" and fsdp_ok:
        return "fsdp"
    return "ddp" if ddp_ok else ("fsdp" if fsdp_ok else None)


def _tight_reason(ctx: QuoteContext, card: Card, count: int) -> str:
    row = ctx.fit[card.id]
    peak = row.device_peak_bytes
    if count > 1:  # the per-rank peak of the FSDP shards at this count, not one card's whole run
        from tunepilot.plan.analytic.core import analytic_plan

        par = dict(ctx.spec.parallel.model_dump(), strategy="fsdp", devices=min(count, 8),
                   nodes=max(1, count // 8))
        peak = analytic_plan(ctx.spec.with_changes(parallel=par), ctx.arch,
                             card.software_stack).per_device.device_peak_bytes
    return (f"tight: the run fits {count} x {card.id} only with less free memory than the "
            f"{row.headroom_asked:.0%} headroom asked (a rank's device peak {fmt_bytes(peak)} "
            f"of {fmt_bytes(row.capacity_bytes)}, projected); a longer batch than planned, "
            "allocator fragmentation or a library's workspace can run it out of memory - a "
            "smaller micro_batch_size, activation_checkpointing or more cards give room; ranked "
            "below runs with room")


def does_not_fit_text(ctx: QuoteContext, card: Card, count: int) -> str:
    row = ctx.fit[card.id]
    need = row.devices_needed.fsdp
    head = (f"device peak {fmt_bytes(row.device_peak_bytes)} on a card of "
            f"{fmt_bytes(row.capacity_bytes)} leaves {row.headroom_fraction:.0%} free")
    if need is None:
        return (f"the run does not fit {card.id} at any card count: {head}, and FSDP does not "
                "shrink the per-rank activations; see `tunepilot plan` (activation_checkpointing "
                "or a smaller micro_batch_size)")
    return f"the run does not fit {count} x {card.id}: {head}; FSDP needs at least {need} cards"


class _Terms:
    """The job's time terms, one added at a time."""

    def __init__(self) -> None:
        self.terms: list[TimeTerm] = []

    def add(self, name: str, times: int, each: Figure) -> None:
        total = Figure(value=each.value * times, unit="s", basis=each.basis,
                       how=f"{times} x {each.value:,.1f} s")
        self.terms.append(TimeTerm(name=name, times=times, each=each, total=total))


def _fixed_terms(ctx: QuoteContext, card: Card, t: _Terms) -> None:
    """Provisioning, set-up and model load: paid once per job."""
    pilot = ctx.run.pilot if ctx.run else None
    t.add("provisioning", 1, Figure.projected(
        assumed("provisioning_s"), "s", "assumed (cost_model.yaml provisioning_s): happens on "
        "the rented cluster, no stage measures it"))
    # a CPU pilot's set-up (imports, tokenising on a shared, often loaded, CPU) says nothing of
    # a rented card's host: not carried over
    cpu_setup = ctx.run is not None and ctx.run.card_id is None
    t.add("set-up", 1, _machine(ctx, card, "pilot", pilot and pilot.timings.setup_s, "s",
                                "set-up", "timings.setup_s", from_cpu=False)
          or Figure.projected(assumed("process_setup_s"), "s",
                              "assumed (cost_model.yaml process_setup_s)"
                              + ("; the set-up measured on the CPU pilot is not carried to a "
                                 "rented card" if cpu_setup else "")))
    load = _machine(ctx, card, "pilot", pilot and pilot.timings.model_load_s, "s", "load",
                    "timings.model_load_s")
    if load is not None and ctx.spec.model.weights == "random":
        load = load.model_copy(update={"how": load.how + " (random weights, as the spec says; "
                                               "reading pretrained weights takes longer)"})
    rate = assumed("model_load_bytes_per_s")
    t.add("model load", 1, load or Figure.projected(
        ctx.load_bytes / rate, "s", f"{ctx.load_bytes / 1e9:,.2f} GB of weights / assumed "
        f"{rate / 1e9:g} GB/s (model_load_bytes_per_s)"))


def _validation(ctx: QuoteContext, card: Card, useful: Figure, one: Figure) -> Figure:
    pilot = ctx.run.pilot if ctx.run else None
    val = _machine(ctx, card, "pilot", pilot and pilot.timings.validation_pass_s, "s",
                   "validation pass", "timings.validation_pass_s")
    if val is not None and ctx.run.card_id is None:
        val = None  # compute-bound, and a CPU has no catalog peak to scale it by
    elif val is not None and val.basis == PROJECTED:
        m_one = per_card(ctx, ctx.catalog.get(ctx.run.card_id), useful)
        val = Figure.projected(val.value * m_one.value / one.value, "s",
                               f"validation pass measured on {ctx.run.card_id}, scaled by the "
                               "per-card throughput ratio")
    if val is None:
        spec, f = ctx.spec, ctx.flops
        vt = spec.validation.num_batches * spec.batch.positions_per_micro_batch
        val = Figure.projected(vt * f.forward / f.train / one.value, "s",
                               f"{vt:,} tokens forward only (forward/training FLOPs "
                               f"{f.forward / f.train:.2f}) at the per-card rate; each rank runs "
                               "num_batches")
    return val


def _checkpoint_terms(ctx: QuoteContext, card: Card, t: _Terms, steps: int) -> None:
    run = ctx.run
    size = None
    if run and run.restore:
        size = measured_value(run.restore.checkpoint_bytes)
    if size is None and run and run.pilot:
        size = measured_value(run.pilot.timings.checkpoint_bytes)
    ckpt = Figure.measured(size, "bytes", how="checkpoint_bytes from the run directory") \
        if size is not None else Figure.projected(
            ctx.checkpoint_bytes, "bytes", "trainable parameters x (weight + optimizer-state "
            "bytes, the optimizer-state table of model/flops.py)")
    write = (_machine(ctx, card, "restore", run.restore.save_s, "s", "checkpoint save", "save_s")
             if run and run.restore else None) or (
        _machine(ctx, card, "pilot", run.pilot.timings.checkpoint_write_s, "s",
                 "checkpoint write", "timings.checkpoint_write_s") if run and run.pilot else None)
    bw = assumed("checkpoint_write_bytes_per_s")
    t.add("checkpoint writes", steps // ctx.spec.checkpoint.every_steps, write or Figure.projected(
        ckpt.value / bw, "s", f"{ckpt.value / 1e9:,.3g} GB ({ckpt.basis}) / assumed "
        f"{bw / 1e9:g} GB/s"))
    rate = _export_rate(ctx, card)
    ebw = assumed("export_bytes_per_s")
    out = export_bytes(ctx.spec, ckpt.value)
    what = (f"{out / 1e9:,.3g} GB = {ctx.spec.host.checkpoints_kept} kept x "
            f"{ckpt.value / 1e9:,.3g} GB ({ckpt.basis}) ({EXPORT_RULE})")
    t.add("export", 1, Figure(value=out / rate.value, unit="s", basis=all_measured(rate, ckpt),
                              how=f"{what} / {rate.how}", bytes=out)
          if rate and rate.value else Figure.projected(
              out / ebw, "s", f"{what} / assumed {ebw / 1e9:g} GB/s (export_bytes_per_s)",
              bytes=out))


def _export_rate(ctx: QuoteContext, card: Card) -> Figure | None:
    """export.json bytes_per_s (or bytes / seconds), as a machine-bound figure."""
    export = ctx.run.export if ctx.run else None
    if export is None:
        return None
    rate = _machine(ctx, card, "export", export.bytes_per_s, "B/s", "export bandwidth",
                    "bytes_per_s")
    b, s = measured_value(export.bytes), measured_value(export.seconds)
    if rate is None and b and s:
        base = _machine(ctx, card, "export", export.seconds, "s", "export bytes / seconds",
                        "seconds")
        rate = base and Figure(value=b / s, unit="B/s", basis=base.basis, how=base.how)
    return rate


def _job(ctx: QuoteContext, card: Card, count: int, strategy: str):
    spec = ctx.spec
    useful = useful_fraction(ctx)
    rl = rl_of(ctx, card, count, strategy)
    if rl is not None:
        one, eff, total = rl_throughput(rl, count)
    else:
        one = per_card(ctx, card, useful)
        eff, total = scaled(ctx, card, count, strategy, one)
    tokens_per_step = spec.batch.positions_per_step_on(count)
    target, steps = ctx.target(count, useful)
    if not total.value or total.value <= 0:  # no token is trained: the job never ends
        raise UserError("data", f"the run trains no useful token ({useful.basis} useful share "
                        f"{useful.value}: {useful.how}); a term cannot be quoted for it.",
                        "Check the data with `tunepilot data SPEC`: raise sequence_length or "
                        "set data.train_on: all.")
    t = _Terms()
    _fixed_terms(ctx, card, t)
    t.add("training", 1, Figure(value=target / total.value, unit="s", basis=total.basis,
                                how=f"{target:,.0f} useful tokens / {total.value:,.0f} tokens/s"))
    if rl is not None:
        t.terms[-1] = rl_phases(t.terms[-1], rl, steps)
    rate = rl.training_positions_per_s if rl is not None else one  # a validation pass's
    passes = steps // spec.validation.every_steps if spec.validation.enabled else 0
    t.add("validation", passes, _validation(ctx, card, useful, rate))
    _checkpoint_terms(ctx, card, t, steps)
    job = Figure(value=sum(x.total.value for x in t.terms), unit="s",
                 basis=all_measured(*(x.total for x in t.terms)), how="sum of the terms")
    throughput = QuoteThroughput(useful_fraction=useful, per_card=one, efficiency=eff,
                                 total=total)
    return throughput, t.terms, job, steps, tokens_per_step, target


def run_numbers(ctx: QuoteContext, card: Card, count: int, throughput: QuoteThroughput,
                steps: int) -> RunNumbers:
    """The run in numbers on ``count`` cards (spec/batch.py): what the training term is made
    of, and the MFU that one card's throughput implies over the spec's peak."""
    split = ctx.spec.batch.on(count, exact=False)
    u, fpt = throughput.useful_fraction, ctx.flops.train
    per_step = fpt * split.positions_per_step
    positions_per_s = throughput.per_card.value / u.value if u.value else 0.0
    key = ctx.spec.precision.peak_key
    peak = card.peak_flops(key) or float("nan")
    return RunNumbers(
        sequences_per_sample=ctx.spec.batch.sequences_per_sample,
        positions_per_micro_batch=split.positions_per_micro_batch,
        positions_per_step=split.positions_per_step, useful_fraction=u.value,
        useful_tokens_per_step=split.useful_tokens_per_step(u.value), optimizer_steps=steps,
        steps_per_epoch=ctx.steps_per_epoch(count),
        flops_per_step=Figure.projected(per_step, "FLOP", f"{fpt:.4g} FLOP/token x "
                                        f"{split.positions_per_step:,} positions per step"),
        mfu=Figure(value=positions_per_s * fpt / peak, unit="fraction",
                   basis=throughput.per_card.basis,
                   how=f"one card's {positions_per_s:,.0f} positions/s (useful tokens/s / useful "
                       f"fraction) x {fpt:.4g} FLOP/token / {card.id} dense {key} peak "
                       f"{peak / 1e12:g} TFLOP/s"))


def _cost_per_million(cents: int | Decimal, tokens: float) -> Decimal | None:
    """Dollars per million useful tokens, kept to 1e-10 so that the display rounds once (to
    cents, or two significant digits under a dollar): $6.544999 shows as $6.54, not $6.55."""
    if tokens <= 0:
        return None
    with localcontext() as dec:  # digits enough for any term over one useful token
        dec.prec = 80
        usd = Decimal(cents) / 100 * Decimal(10**6) / Decimal(repr(float(tokens)))
        return usd.quantize(_USD_PER_M, rounding=ROUND_HALF_UP)


def _terms(card: Card, count: int, job: Figure, term_s: int | None, options: dict):
    """(the term quoted, the shortest covering term, its billing steps, the cheapest covering
    term): the shortest is the job plus the safety margin as it is billed (terms.billed_seconds,
    the one billing rule); the cheapest may be a longer, discounted one."""
    margin = assumed("safety_margin")
    shortest = term_cost(card, count, billed_seconds(card, math.ceil(job.value * (1 + margin))),
                         options)
    n_steps = shortest.term_s // card.pricing.billing_increment_s
    candidates = [shortest] + [term_cost(card, count, t.hours * 3600, options)
                               for t in card.pricing.terms if t.hours * 3600 > shortest.term_s]
    cheapest = min(candidates, key=lambda c: (c.total_cents, c.term_s))
    term = term_cost(card, count, term_s, options) if term_s is not None else cheapest
    return term, shortest, n_steps, cheapest


def build_quote(ctx: QuoteContext, card: Card, count: int, term_s: int | None, options: dict,
           spot: SpotAsk | None = None) -> Quote:
    strategy, tight = strategy_at(ctx, card, count)
    if strategy is None:
        raise UserError("card", does_not_fit_text(ctx, card, count) + ".",
                        "Pick a card and count from `tunepilot compare SPEC`.")
    host = _host(ctx, card, count, strategy)
    throughput, terms, job, steps, tps, target = _job(ctx, card, count, strategy)
    billed = count + generation_cards(ctx.spec)  # a vLLM server's cards are rented too
    term, shortest, n_steps, cheapest = _terms(card, billed, job, term_s, options)
    fixed = sum(t.total.value for t in terms
                if t.name in ("provisioning", "set-up", "model load", "export"))
    share = min(1.0, max(0.0, (term.term_s - fixed) / max(job.value - fixed, 1e-9)))
    disc = Decimal(term.discount_percent) / 100
    job_cost = (billed * Decimal(repr(job.value)) / 3600 * card.pricing.on_demand_usd_per_hour
                * (1 - disc))
    notes = []
    if count > card.inventory.count:
        notes.append(f"the local inventory has {card.inventory.count} x {card.id}; "
                     "`tunepilot book` will refuse more")
    if term.term_s < job.value:
        notes.append(f"the term is {(job.value - term.term_s) / 3600:,.1f} h short: it delivers "
                     f"{share:.0%} of the target")
    notes += unit_notes(ctx.spec, target)
    training = next(x for x in terms if x.name == "training")
    if training.parts:
        notes.append(rl_note(training))
    notes += [w for w in [context_warning(ctx.arch, ctx.spec)] if w]
    split = ctx.spec.batch.on(count, exact=False)
    if split.note:
        notes.append(split.note)
    return Quote(
        spec_label=ctx.spec.label, spec_hash=ctx.spec.spec_hash(), card_id=card.id, count=count,
        strategy=strategy, precision=ctx.spec.precision, tight=tight,
        generation_layout=generation_layout(ctx.spec),
        target_useful_tokens=target, optimizer_steps=steps,
        tokens_per_step=tps, run=run_numbers(ctx, card, count, throughput, steps),
        flops_per_token=Figure.projected(
            ctx.flops.train, "FLOP/token", ctx.flops.formula),
        throughput=throughput, time_terms=terms, job_s=job, term=term,
        batch=BatchOnCards(global_batch_samples=split.global_samples,
                           micro_batch_size=split.micro_batch_size,
                           accumulation_per_rank=split.accumulation, note=split.note),
        finishes_in_term=term.term_s >= job.value, margin_s=term.term_s - job.value,
        margin_fraction=(term.term_s - job.value) / job.value,
        useful_tokens_in_term=target * share, shortest_term=shortest,
        shortest_term_steps=n_steps, cheapest_term=cheapest,
        cost_per_million_term_usd=_cost_per_million(term.total_cents, target * share),
        cost_per_million_job_usd=_cost_per_million(job_cost * 100, target) or Decimal(0),
        job_cost_usd=job_cost.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP),
        safety_margin=assumed("safety_margin"), pricing_source=card.pricing.source,
        pricing_as_of=card.pricing.as_of,
        run_dir=ctx.run.source() if ctx.run else None,
        padding=_padding(ctx, terms), host=host,
        spot=spot_quote(card, billed, terms=terms, steps=steps, restart=_restart(ctx, card, terms),
                        rate=node_rate(card, (spot or SpotAsk()).rate),
                        interval_s=(spot or SpotAsk()).interval_s),
        notes=notes + ([host.warning] if host.warning else [])
        + (ctx.run.notes if ctx.run else []))


@dataclass(frozen=True)
class SpotAsk:
    """What the user asks of the spot quote: an interruption rate per instance-hour
    (--spot-rate) and a checkpoint interval (--checkpoint-minutes), each None for the default."""

    rate: float | str | None = None
    interval_s: float | None = None


def host_fit_at(ctx: QuoteContext, card: Card, count: int, strategy: str) -> HostFit:
    """The host plan at ``count`` cards (nodes of up to 8) against the card's offer."""
    layout = Layout.on_cards(ctx.spec, count, strategy)
    positions = ctx.profile.tokens_total.value if ctx.profile is not None else None
    plan = host_plan(ctx.spec, ctx.arch, card.software_stack, layout, positions)
    row = ctx.fit[card.id]
    fit = host_fit(plan, card, row.device_peak_bytes /
                   (row.capacity_bytes * (1 - DEFAULT_HEADROOM)))
    return fit.model_copy(update=_measured_host(ctx))


def _measured_host(ctx: QuoteContext) -> dict[str, Figure]:
    """What the run directory measured of host RAM: the pilot's process, scale.json's nodes."""
    run, out = ctx.run, {}
    rss = measured_value(run.pilot.memory.process.peak_rss_bytes) if run and run.pilot else None
    if rss:
        out["measured_rss_bytes_per_process"] = Figure.measured(
            rss, "bytes", f"pilot.json memory.process.peak_rss_bytes on {run.card_id or run.device}"
            " (one process)")
    nodes = [v for s in (run.scale.strategies.values() if run and run.scale else ())
             if s.run for v in (s.run.get("host_peak_rss_bytes_per_node") or {}).values()]
    if nodes:
        out["measured_rss_bytes_per_node"] = Figure.measured(
            max(nodes), "bytes", "scale.json: the largest node's sum of its ranks' peak RSS")
    return out


def _host(ctx: QuoteContext, card: Card, count: int, strategy: str) -> HostFit:
    """_host_fit, or a UserError when host RAM refuses the offer or the offer lists none
    where the plan needs it."""
    fit = host_fit_at(ctx, card, count, strategy)
    if fit.reason is not None:
        field = ("card" if card.pricing.host is not None
                 else f"catalog: {card.id}.pricing.host.ram_gib")
        raise UserError(field, fit.reason + ".", fit.hint)
    return fit


def _restored_data(restore):
    """The data-position component of a restore proof (the checkpoint package is read only for
    a quote --from a run that has one: start-up)."""
    from tunepilot.checkpoint.components import DATA

    return next((c for c in restore.components if c.name == DATA), None)


def _restart(ctx: QuoteContext, card: Card, terms: list[TimeTerm]) -> dict[str, Figure]:
    """What an interruption costs besides the lost work: the once-per-job start again, the
    checkpoint load (restore.json load_s) and the data skip (0 when the restore proof shows the
    data position restored)."""
    by = {t.name: t.each for t in terms}
    out = {n: by[n] for n in ("provisioning", "set-up", "model load")}
    restore = ctx.run.restore if ctx.run else None
    load = _machine(ctx, card, "restore", restore.load_s, "s", "checkpoint load",
                    "load_s") if restore else None
    save = by["checkpoint writes"]
    out["checkpoint load"] = load or Figure.projected(
        save.value, "s", f"as long as one save ({save.basis}): the same bytes read back")
    data = _restored_data(restore) if restore else None
    if data is not None and data.passed:
        out["data skip"] = Figure.measured(0.0, "s", "restore.json: the data position was "
                                           "restored, so the loader resumes where it stopped")
    else:
        why = ("restore.json: the data position was NOT restored; " if data is not None
               else "")
        out["data skip"] = Figure.projected(assumed("restart_data_skip_s"), "s",
                                            why + "assumed (cost_model.yaml restart_data_skip_s)")
    return out


def _padding(ctx: QuoteContext, terms: list[TimeTerm]) -> dict | None:
    """How much of the training time pays for padding, and what packing would save (a dataset
    profile knows both)."""
    if ctx.profile is None:
        return None
    training = next(t for t in terms if t.name == "training")
    return ctx.profile.padding_summary(training.total)


def quote(spec: RunSpec, *, card_id: str, count: int, term_s: int | None,
          options: list[str] | None = None, run_dir: Path | str | None = None,
          catalog: Catalog | None = None, base_dir: Path | None = None,
          spot: SpotAsk | None = None) -> Quote:
    """Quote ``count`` x ``card_id`` for ``term_s`` seconds (None: the cheapest covering term),
    the same job on spot capacity beside it (``spot``: the rate and interval asked for)."""
    catalog = catalog or load_catalog()
    card = catalog.get(card_id)
    check_count(count)
    if term_s is not None and term_s <= 0:
        raise UserError("hours", f"the term must be longer than 0 s, got {term_s}.")
    opts = parse_options(card, options)
    _check_spot(card, spot)
    ctx = context(spec, catalog, run_dir, [card.id], base_dir)
    return build_quote(ctx, card, count, term_s, opts, spot)


def _check_spot(card: Card, spot: SpotAsk | None) -> None:
    """Refuse a bad --spot-rate before any work, and a spot question on an offer without spot."""
    if spot is None or (spot.rate is None and spot.interval_s is None):
        return
    node_rate(card, spot.rate)
    if card.pricing.spot_usd_per_hour is None:
        flag = "spot-rate" if spot.rate is not None else "checkpoint-minutes"
        raise UserError(flag, f"{card.id}'s offer lists no spot price "
                        "(catalog pricing.spot_usd_per_hour), so there is no spot term to price.",
                        "Add spot_usd_per_hour to the card's pricing in --catalog, or drop "
                        f"--{flag}.")
