"""Useful tokens per second of one card and of N cards, for the quote.

Per card, best evidence first:
- measured by the pilot on this very card (pilot.json throughput.useful_tokens_per_s);
- measured on another catalog card M: step time on the target = measured x (f x peak_M /
  peak_T + (1 - f) x hbm_M / hbm_T), f = compute_bound_fraction (assumed);
- projected from FLOPs: MFU x dense peak / FLOPs per token (model/flops.py), the MFU from the
  throughput model (cost/mfu.py: by implementation, method, precision and card, each value from
  a published measurement).
N cards: N x scaling efficiency x one card, the efficiency measured by scale.json on this card
(exact when its nproc is N) or from cost_model.yaml: assumed within a node, by node count from
published multi-node runs past one (scaling_efficiency_by_nodes, its column set by the tokens
each card processes per optimizer step under the global-batch rule).
An FP8 spec measured by a pilot (which runs bf16: pilot/prepare.py) is quoted with the FP8
recipe's speed-up over bf16 from the time model (cost/calibration.py fp8_speedup).
"""

from __future__ import annotations

from tunepilot.catalog import Card
from tunepilot.cost.assumptions import assumed, efficiency_parts
from tunepilot.cost.context import QuoteContext
from tunepilot.cost.measurements import measured_value
from tunepilot.model.flops import (
    MFU_RULE,
    decode_seconds_per_position,
    flops_per_token,
    positions_per_s_at,
)
from tunepilot.results.figure import MEASURED, PROJECTED, Figure
from tunepilot.units import fmt_number


def useful_fraction(ctx: QuoteContext) -> Figure:
    """Useful (supervised) tokens / token positions: measured by the pilot, else the data
    profile's, else none lost."""
    pilot = ctx.run.pilot if ctx.run else None
    useful = measured_value(pilot.throughput.useful_tokens_per_s) if pilot else None
    padded = measured_value(pilot.throughput.padded_tokens_per_s) if pilot else None
    if useful and padded:
        return Figure.measured(min(useful / padded, 1.0), "fraction",
                               "pilot.json useful / padded tokens per s (a property of the data)")
    if ctx.profile is not None:
        return ctx.profile.useful_fraction_figure(ctx.spec)
    if ctx.spec.objective.generative and ctx.spec.data.source == "synthetic":
        from tunepilot.cost.rollout import completion_shape

        shape = completion_shape(ctx.spec)
        return Figure.projected(shape.mean / ctx.spec.sequence_length, "fraction",
                                f"the completions' mean {shape.mean:,.0f} tokens of the "
                                f"{ctx.spec.sequence_length:,}-token sequence (the prompt is "
                                "not trained; cost/rollout.py completion lengths)")
    if ctx.spec.data.source == "synthetic":
        from tunepilot.spec.objective import useful_fraction_at_full_length

        return Figure.projected(useful_fraction_at_full_length(ctx.spec), "fraction",
                                "synthetic data has no padding (the objective's prompt is not "
                                "trained)")
    return Figure.projected(1.0, "fraction", "assumed no padding: the pilot measures it")


def processed_length(ctx: QuoteContext) -> Figure:
    """The mean sequence length the card processes (MFU_RULE's length): the pilot's measured
    batches, else the dataset profile's padded micro-batches, else the spec's (synthetic data:
    every sample full length)."""
    pilot = ctx.run.pilot if ctx.run else None
    seq = measured_value(pilot.throughput.mean_sequence_length) if pilot else None
    if seq:
        return Figure.measured(seq, "tokens", "pilot.json throughput.mean_sequence_length")
    if ctx.profile is not None and ctx.profile.used.mean_padded_length:
        return Figure.projected(ctx.profile.used.mean_padded_length, "tokens",
                                "the dataset profile's mean padded micro-batch length")
    return Figure.projected(float(ctx.spec.sequence_length), "tokens", "the spec's "
                            "sequence_length (synthetic data: every sample full length)")


def _with_levers(ctx: QuoteContext, card: Card, tps: float, how: str, basis: str) -> Figure:
    """A throughput the pilot measured with the spec's levers off (it runs the plain step),
    times each lever's speed factor, said per lever: a pilot and a no-pilot quote of the same
    spec then count the same levers."""
    from tunepilot.cost.mfu import pilot_lever_factors

    levers = pilot_lever_factors(ctx.spec) + _fp8_lever(ctx, card)
    if not levers:
        return Figure(value=tps, unit="tokens/s", basis=basis, how=how)
    factor = 1.0
    for lv in levers:
        factor *= lv.factor
    said = "; ".join(f"x {lv.factor:.3g} for {lv.lever} ({lv.kind}: {lv.source})"
                     for lv in levers)
    return Figure.projected(tps * factor, "tokens/s", f"{how}, measured with the spec's levers "
                            f"off (the pilot runs the plain step) {said}",
                            levers={lv.lever: lv.factor for lv in levers})


def _fp8_lever(ctx: QuoteContext, card: Card) -> list:
    """An FP8 spec's pilot ran bf16 (FP8 is not measured): the recipe's speed-up on this card."""
    if not ctx.spec.precision.is_fp8:
        return []
    from tunepilot.cost.calibration import fp8_speedup
    from tunepilot.cost.mfu import LeverFactor, card_family, shape_of

    s = ctx.spec
    value, how = fp8_speedup(s.model.implementation, card_family(card.id), s.method.kind,
                             s.precision, card.peak_flops("bf16"), card.peak_flops("fp8"),
                             **{k: v for k, v in shape_of(s, ctx.arch, processed_length(
                                 ctx).value).items() if k != "model_parallel"})
    return [LeverFactor(s.precision, value, "derived", how)]


def per_card(ctx: QuoteContext, card: Card, useful: Figure) -> Figure:
    """Useful tokens/s of one card of this kind (as if the run fitted on one)."""
    from tunepilot.errors import UserError
    from tunepilot.spec.fp8 import require_fp8_card

    require_fp8_card(ctx.spec, card)
    key = ctx.spec.precision.peak_key
    peak = card.peak_flops(key)
    if peak is None:
        raise UserError("card", f"{card.id} has no {key} peak in the catalog.", None)
    run = ctx.run
    pilot = run.pilot if run else None
    measured = measured_value(pilot.throughput.useful_tokens_per_s) if pilot else None
    if measured and run.card_id == card.id:
        return _with_levers(ctx, card, measured, f"pilot.json throughput.useful_tokens_per_s on "
                            f"{card.id}", MEASURED)
    if measured and run.card_id is not None:
        m = ctx.catalog.get(run.card_id)
        f = assumed("compute_bound_fraction")
        key = ctx.spec.precision.stand_in.peak_key  # the pilot ran FP8's stand-in; its gain after
        peak = card.peak_flops(key)
        m_peak = m.peak_flops(key) or peak
        ratio = f * m_peak / peak + (1 - f) * m.hbm_bandwidth_tbps / card.hbm_bandwidth_tbps
        return _with_levers(
            ctx, card, measured / ratio,
            f"{measured:,.0f} tokens/s measured on {m.id}; step time x ({f:g} x {key} peak "
            f"{m_peak / 1e12:g}/{peak / 1e12:g} + {1 - f:g} x HBM {m.hbm_bandwidth_tbps:g}/"
            f"{card.hbm_bandwidth_tbps:g}) (compute_bound_fraction assumed)", PROJECTED)
    from tunepilot.cost.mfu import mfu_for

    seq = processed_length(ctx)
    mfu = mfu_for(ctx.spec, card, ctx.arch, seq.value)
    positions = positions_per_s_at(ctx.arch, ctx.spec, mfu.value, seq.value, peak)
    fpt = flops_per_token(ctx.arch, ctx.spec, seq.value)
    decode = decode_seconds_per_position(ctx.arch, ctx.spec, card.hbm_bandwidth_bytes_per_s)
    if decode:  # generation's decode, bound by HBM bandwidth: its seconds add to the FLOPs'
        positions = 1 / (1 / positions + decode)
    positions, floor = _launch_floor(ctx, positions, seq.value)
    return Figure.projected(
        positions * useful.value, "tokens/s",
        f"MFU {mfu.value:.3g} ({mfu.how}) x dense {key} peak {fmt_number(peak / 1e12)} TFLOP/s "
        f"/ {fpt.formula}" + (f" x useful fraction {useful.value:.3g}"
                              if useful.value < 1 else "") + f" ({MFU_RULE})"
        + (f"; + the decode at {card.hbm_bandwidth_tbps:g} TB/s HBM, {decode * 1e6:.3g} us "
           "per position (model/flops.decode_seconds_per_position)" if decode else "")
        + (f"; held to the step's launch floor: {floor.how}, longer than the FLOPs' "
           "time at this MFU" if floor else ""),
        mfu=mfu.to_dict(), processed_length=seq.to_dict())


def _launch_floor(ctx: QuoteContext, positions: float, seq: float):
    """(positions/s, the floor when it binds): one rank's optimizer step cannot take less than
    its kernel launches (cost/launch.py)."""
    from tunepilot.cost.launch import step_floor
    from tunepilot.model.flops import trainable_shapes

    spec = ctx.spec
    shapes = trainable_shapes(ctx.arch, spec)
    elements = sum(_numel(s) for s in shapes)
    floor = step_floor(ctx.arch, spec, spec.gradient_accumulation_steps, len(shapes), elements)
    per_step = spec.micro_batch_size * spec.batch.sequences_per_sample * \
        spec.gradient_accumulation_steps * seq
    if per_step / positions >= floor.seconds:
        return positions, None
    return per_step / floor.seconds, floor


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def scaled(ctx: QuoteContext, card: Card, count: int, strategy: str, one: Figure
           ) -> tuple[Figure, Figure]:
    """(efficiency, total useful tokens/s) of ``count`` cards."""
    if count == 1:
        from tunepilot.cost.comms import step_terms

        tokens = ctx.spec.batch.positions_per_step_on(1) * _useful_of(ctx)
        extra, said = step_terms(ctx.spec, ctx.arch, card, 1, "single", tokens / one.value,
                                 ctx.params) if one.basis != MEASURED else (0.0, "")
        if not extra:
            return Figure(value=1.0, unit="fraction", basis=one.basis,
                          how="one card: no scaling"), one
        f = (tokens / one.value) / (tokens / one.value + extra)
        return (Figure.projected(f, "fraction", f"one card: {said}"),
                Figure.projected(one.value * f, "tokens/s", f"{one.value:,.0f} tokens/s x {f:.3g}"
                                 f" ({said})"))
    run = ctx.run
    entry = run.strategy(strategy) if run else None
    same_card = run is not None and run.card_id == card.id
    # ranks in all (a multi-node scale.json: nproc per node x nodes), not ranks per node
    ranks = (entry.world_size or entry.nproc) if entry is not None else None
    if same_card and entry is not None and ranks == count and entry.useful_tokens_per_s:
        eff = entry.efficiency if entry.efficiency is not None else \
            entry.useful_tokens_per_s / (count * one.value)
        how = f"scale.json strategies.{strategy} at {count} ranks on {card.id}" + (
            f" ({entry.nproc} per node x {count // entry.nproc} nodes)"
            if entry.nproc and entry.nproc != count else "")
        return (Figure.measured(eff, "fraction", how),
                Figure.measured(entry.useful_tokens_per_s, "tokens/s", how))
    if same_card and entry is not None and entry.efficiency is not None and ranks:
        e = Figure.projected(entry.efficiency, "fraction",
                             f"scale.json strategies.{strategy}.efficiency measured at "
                             f"{ranks} ranks on {card.id}, applied at {count}")
    else:
        value, how = efficiency_parts(strategy, count, None,
                                      ctx.spec.batch.positions_per_step_on(count) / count,
                                      card.peak_flops("bf16") / 1e12)
        value, how = _with_step_terms(ctx, card, count, strategy, one, value, how)
        e = Figure.projected(value, "fraction", f"{count} cards: {how}")
    return e, Figure.projected(count * e.value * one.value, "tokens/s",
                               f"{count} x efficiency {e.value:.3g} x {one.value:,.0f} tokens/s "
                               "per card")


def _with_step_terms(ctx: QuoteContext, card: Card, count: int, strategy: str, one: Figure,
                     eff: float, how: str) -> tuple[float, str]:
    """The efficiency with the step's communication terms the node-scaling columns do not hold
    (cost/comms.py): the offer's fabric against the published runs', tensor and context
    parallel, CPU offload's optimizer step - each as seconds added to a rank's step."""
    from tunepilot.cost.comms import step_terms

    per_rank_step = ctx.spec.batch.positions_per_step_on(count) / count * _useful_of(ctx)
    step_s = per_rank_step / (eff * one.value)
    extra, said = step_terms(ctx.spec, ctx.arch, card, count, strategy, step_s * eff,
                             ctx.params)
    if not extra:
        return eff, how
    return eff * step_s / (step_s + extra), how + "; " + said


def _useful_of(ctx: QuoteContext) -> float:
    """The useful fraction the per-card figure carries (its tokens/s count useful tokens)."""
    return useful_fraction(ctx).value


def all_measured(*figures: Figure | None) -> str:
    return MEASURED if all(f is None or f.basis == MEASURED for f in figures) else PROJECTED
