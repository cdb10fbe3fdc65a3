"""One rule per number: where two stages need the same figure, both call one function, and
these tests hold the two sides to it (issue 23) - MFU, the global batch on N cards, the
checkpoint's bytes, and what a pilot measured with levers off means for a quote with them on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.cost.quote import quote
from tunepilot.model.arch import Arch, load_preset
from tunepilot.model.flops import checkpoint_bytes, mfu, positions_per_s_at
from tunepilot.pilot.assemble import pilot_result
from tunepilot.pilot.measurements import Measurements, StepRecord
from tunepilot.plan.api import make_plan
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import DeviceBlock, PilotResult, Throughput
from tunepilot.scaling.runner import plan_batches
from tunepilot.spec import spec_from_dict
from tunepilot.store import RunDir

CAT = load_catalog()
CARD = "h100-sxm-80gb"
H = 3600


def _spec(**changes):
    base = {"name": "rule", "model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
            "precision": "bf16-mixed", "sequence_length": 2048, "micro_batch_size": 2,
            "gradient_accumulation_steps": 8, "data": {"source": "synthetic"},
            "target": {"tokens": 1e9}}
    base.update(changes)
    return spec_from_dict(base)


def _h100():
    return SimpleNamespace(card_id=CARD, name="H100", kind="cuda", count=1, memory_bytes=None,
                           notes=[], summary=lambda: {"kind": "cuda", "card_id": CARD})


def test_mfu_one_definition_the_pilot_measures_and_the_quote_inverts():
    """The pilot divides token positions/s (padding included) at the mean processed length by
    the dense peak of spec.precision.peak_key; the quote's projection is the same equation solved for
    the throughput: a pilot's MFU fed back gives the pilot's throughput."""
    spec = _spec()
    arch = Arch.from_config(load_preset("llama-3.2-1b"))
    # padded batches: 1,500 of 2,048 positions per row on average, 60% of them supervised
    steps = [StepRecord(wall_s=0.5, data_wait_s=0.0, forward_s=None, backward_s=None,
                        optimizer_s=None, useful_tokens=14_400, padded_tokens=24_000,
                        sequence_length=2048, loss=1.0)] * 4
    m = Measurements(spec=spec, arch=arch, device=_h100(), catalog=CAT, steps=steps)
    got = pilot_result(m)
    peak = CAT.get(CARD).peak_flops(spec.precision.peak_key)
    mean_len = 24_000 / 16  # positions / rows (micro-batch 2 x accumulation 8)
    assert got.throughput.mean_sequence_length.value == pytest.approx(mean_len)
    assert got.mfu.value == pytest.approx(mfu(arch, spec, 48_000, mean_len, peak))
    assert positions_per_s_at(arch, spec, got.mfu.value, mean_len, peak) == pytest.approx(48_000)
    assert got.mfu.extra("peak_precision") == "bf16"


def test_the_quote_projects_at_the_length_the_pilot_measured(tmp_path):
    spec = _spec()
    run = RunDir(tmp_path / "run")
    run.write(PilotResult(throughput=Throughput(
        useful_tokens_per_s=Figure.measured(30_000.0, "tokens/s"),
        padded_tokens_per_s=Figure.measured(50_000.0, "tokens/s"),
        mean_sequence_length=Figure.measured(1_500.0, "tokens")),
        device=DeviceBlock(kind="cuda", name="A100", card_id="a100-sxm-80gb")), spec.spec_hash())
    run.update_manifest(device={"kind": "cuda", "card_id": "a100-sxm-80gb"})
    q = quote(spec, card_id="a100", count=1, term_s=H, run_dir=run.path)
    assert q.throughput.per_card.basis == "measured"  # the pilot's own card
    other = quote(spec, card_id="h200", count=1, term_s=H, run_dir=run.path)
    assert other.throughput.per_card.basis == "projected"
    from tunepilot.cost.context import context
    from tunepilot.cost.throughput import processed_length

    ctx = context(spec, CAT, run.path, [CARD], None)
    assert processed_length(ctx).value == 1_500.0 and processed_length(ctx).is_measured


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_the_global_batch_is_held_fixed_across_card_counts_in_quote_and_scale(count):
    """The scaling test holds the spec's global batch on N ranks; the quote now does too (it
    grew with N), so the efficiency scale.json measured applies under the same rule."""
    spec = _spec()
    q = quote(spec, card_id=CARD, count=count, term_s=None)
    batches = plan_batches(spec, count)
    assert q.batch.global_batch_samples == batches.global_batch_samples == \
        spec.batch.global_samples == 16
    assert q.batch.accumulation_per_rank == batches.accumulation
    assert q.tokens_per_step == 16 * 2048  # the same optimizer step on 1 or 8 cards
    assert q.optimizer_steps == quote(spec, card_id=CARD, count=1, term_s=None).optimizer_steps


def test_a_global_batch_the_cards_do_not_divide_is_rounded_up_and_said():
    spec = _spec(micro_batch_size=1, gradient_accumulation_steps=3)
    q = quote(spec, card_id=CARD, count=2, term_s=None)
    assert q.batch.global_batch_samples == 4 and q.batch.accumulation_per_rank == 2
    assert any("do not divide the global batch of 3" in n for n in q.notes)


@pytest.mark.parametrize("fields", [
    {"method": {"kind": "full"}, "precision": "bf16-mixed"},
    {"method": {"kind": "full"}, "precision": "bf16-true"},
    {"method": {"kind": "lora", "adapter_dtype": "bf16"}, "precision": "bf16-true"},
    {"method": {"kind": "lora"}, "precision": "bf16-mixed"},
])
def test_checkpoint_bytes_one_rule_in_the_plan_and_the_quote(fields):
    """A checkpoint holds the trained parameters in their dtype and the optimizer state: the
    plan's gradients (one per trained parameter, in its dtype) + optimizer state, and the
    quote's projected checkpoint; a bf16 LoRA adapter was 2x in the quote before."""
    spec = _spec(optimizer={"name": "adamw", "impl": "fused"}, **fields)
    arch = Arch.from_config(load_preset("llama-3.2-1b"))
    plan = make_plan(spec, catalog=CAT, card_ids=[CARD], arch=arch)
    d = plan.per_device
    rule = checkpoint_bytes(arch, spec, plan.params.trainable)
    assert rule == d.gradients_bytes + d.optimizer_bytes
    q = quote(spec, card_id=CARD, count=1, term_s=None)
    each = next(t for t in q.time_terms if t.name == "checkpoint writes").each
    assert f"{rule / 1e9:,.3g} GB" in each.how


def test_a_pilot_measured_with_compile_off_is_quoted_with_the_compile_factor(tmp_path):
    """The pilot runs the plain step (torch_compile off); a quote for a compiled run applies the
    same compile factor the no-pilot projection applies, and says so - it no longer jumps."""
    from tunepilot.cost.mfu import throughput_model

    compiled = _spec(torch_compile=True)
    run = RunDir(tmp_path / "run")
    run.write(PilotResult(throughput=Throughput(
        useful_tokens_per_s=Figure.measured(40_000.0, "tokens/s")),
        device=DeviceBlock(kind="cuda", name="H100", card_id=CARD)), compiled.spec_hash())
    run.update_manifest(device={"kind": "cuda", "card_id": CARD})
    q = quote(compiled, card_id=CARD, count=1, term_s=None, run_dir=run.path)
    factor = throughput_model().torch_compile.factor
    one = q.throughput.per_card
    assert one.value == pytest.approx(40_000.0 * factor)
    assert "torch_compile" in one.how and "levers off" in one.how
    plain = _spec()
    run2 = RunDir(tmp_path / "plain")
    run2.write(PilotResult(throughput=Throughput(
        useful_tokens_per_s=Figure.measured(40_000.0, "tokens/s")),
        device=DeviceBlock(kind="cuda", name="H100", card_id=CARD)), plain.spec_hash())
    run2.update_manifest(device={"kind": "cuda", "card_id": CARD})
    q2 = quote(plain, card_id=CARD, count=1, term_s=None, run_dir=run2.path)
    assert q2.throughput.per_card.value == 40_000.0 and q2.throughput.per_card.is_measured


def test_the_scaling_test_refuses_what_the_quote_rounds():
    spec = _spec(micro_batch_size=1, gradient_accumulation_steps=3)
    from tunepilot.errors import UserError

    with pytest.raises(UserError, match="cannot be split evenly over 2 ranks"):
        plan_batches(spec, 2)


def test_steps_per_epoch_are_what_the_loader_draws():
    """One epoch rule (spec/batch.py) for data, quote and report, as dataset/loader.py draws:
    floor(items / W) per rank (the sampler's drop_last), whole micro-batches (the loader's
    drop_last), and a partial accumulation carried into the next epoch by the stream."""
    b = _spec(micro_batch_size=2, gradient_accumulation_steps=2).batch  # G = 4 samples
    assert b.steps_per_epoch(10, 1) == 2  # 5 micro-batches of 2 make 2 whole steps (2.5)
    assert b.steps_for_epochs(2, 10, 1) == 5  # two epochs: 10 micro-batches, 5 steps
    assert b.steps_per_epoch(11, 2) == 2  # 5 items per rank, 2 micro-batches of 2, accum 1
    assert b.steps_per_epoch(3, 1) == 0  # an epoch shorter than a step


