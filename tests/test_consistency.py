"""One number, one rule, every stage (issue 37): the figures several stages show are pinned to
each other here for SFT, DPO, KTO, reward and GRPO - token positions per optimizer step (plan,
pilot, quote, scale), steps per epoch (`data`, the quote, the report, and the loader itself),
export bytes (quote, host plan, `export`), and the quote's hours against its own FLOPs and MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.cost.quote import quote
from tunepilot.plan.api import make_plan
from tunepilot.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CAT = load_catalog()
CARD = "h100-sxm-80gb"

# a spec per objective: the tiny examples, and KTO and a reward model on the shipped pairs
TINY = {"sft": "tiny.yaml", "dpo": "tiny-dpo.yaml", "grpo": "tiny-grpo.yaml"}
PAIRS = {  # tiny-dpo.yaml with another objective (KTO unpairs the pairs; a reward model scores them)
    "kto": {"objective": {"kind": "kto"}},
    "reward": {"objective": {"kind": "reward"},
               "model": {"preset": "tiny", "task": "sequence-classification", "num_labels": 1}},
}
KINDS = list(TINY) + list(PAIRS)


def _tiny(kind: str):
    return load_spec(EXAMPLES / TINY[kind])


def _spec_of(kind: str):
    if kind in TINY:
        return _tiny(kind)
    base = load_spec(EXAMPLES / "tiny-dpo.yaml").model_dump(mode="json")
    return spec_from_dict({**base, **PAIRS[kind], "name": f"tiny-{kind}"})


def _quote(spec, count: int = 1):
    return quote(spec, card_id=CARD, count=count, term_s=None, catalog=CAT,
                 base_dir=EXAMPLES)


# --- token positions per optimizer step ---------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_the_quote_and_the_plan_count_the_same_positions_per_step(kind):
    spec = _spec_of(kind)
    plan = make_plan(spec, catalog=CAT, card_ids=[CARD], base_dir=EXAMPLES)
    q = _quote(spec)
    pairs = 2 if spec.objective.paired else 1
    per_step = spec.micro_batch_size * spec.gradient_accumulation_steps * \
        spec.sequence_length * pairs
    assert spec.batch.sequences_per_sample == q.run.sequences_per_sample == pairs
    assert plan.tokens_per_optimizer_step == q.tokens_per_step == q.run.positions_per_step \
        == per_step
    assert plan.tokens_per_micro_batch == q.run.positions_per_micro_batch
    assert q.run.useful_tokens_per_step == pytest.approx(
        per_step * q.throughput.useful_fraction.value)


def test_a_pair_is_two_sequences_on_every_card_count():
    """The DPO 2x: a preference sample is chosen + rejected, on 1 card and on 8."""
    dpo = _tiny("dpo")
    sft = dpo.with_changes(objective={"kind": "sft"}, data={"source": "synthetic"},
                           target={"tokens": 1e9})
    for count in (1, 2, 8):
        assert dpo.batch.positions_per_step_on(count) == \
            2 * sft.batch.positions_per_step_on(count)
    from tunepilot.scaling.runner import plan_batches

    b = plan_batches(dpo, 2)
    assert b.positions_per_step == dpo.batch.positions_per_step == _quote(dpo, 2).tokens_per_step


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_pilot_counts_the_positions_the_quote_and_plan_count(kind, tmp_path):
    """A real CPU pilot of each objective: its positions per step are the plan's and the
    quote's, and the positions its measured batches held never exceed them (equal with
    synthetic data: no padding)."""
    from tunepilot.pilot.runner import run_pilot
    from tunepilot.pilot.session import PilotOptions

    spec = _spec_of(kind)
    res = run_pilot(spec, tmp_path / kind, PilotOptions(steps=1, device="cpu",
                                                        base_dir=EXAMPLES))
    plan = make_plan(spec, catalog=CAT, card_ids=[CARD], base_dir=EXAMPLES)
    per_step = res.run.tokens_per_optimizer_step.value
    assert per_step == plan.tokens_per_optimizer_step == _quote(spec).run.positions_per_step
    padded = res.per_step.padded_tokens.value
    assert padded and all(0 < p <= per_step for p in padded)
    if spec.data.source == "synthetic":
        assert padded == [per_step] * len(padded)


# --- steps per epoch ----------------------------------------------------------------------------

def _epoch_spec(kind: str):
    """The spec of ``kind`` with a target in epochs of its dataset (sft: the tiny chat set)."""
    if kind == "sft":
        return load_spec(EXAMPLES / "tiny-chat.yaml")
    return _spec_of(kind).with_changes(target={"epochs": 1})


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo", "kto", "reward"])
def test_data_quote_and_report_show_the_same_steps_per_epoch(kind, tmp_path):
    from tunepilot.dataset.profile import profile_dataset
    from tunepilot.model.arch import resolve_arch
    from tunepilot.report.html import build_report
    from tunepilot.store import RunDir

    spec = _epoch_spec(kind)
    profile = profile_dataset(spec, resolve_arch(spec, EXAMPLES).vocab_size, EXAMPLES)
    run = RunDir(tmp_path / "run")
    run.write(profile, spec.spec_hash())
    q = quote(spec, card_id=CARD, count=spec.parallel.world_size, term_s=None, catalog=CAT,
              base_dir=EXAMPLES, run_dir=run.path)
    steps = profile.used.steps_per_epoch
    assert steps > 0
    assert q.run.steps_per_epoch == steps == spec.batch.steps_per_epoch(profile.used.items)
    assert q.optimizer_steps == max(1, spec.batch.steps_for_epochs(
        spec.target.epochs, profile.used.items, spec.parallel.world_size))
    run.write(q, spec.spec_hash())
    html = build_report(run.path)[0].read_text()
    assert f"<td>steps per epoch</td><td class=\"num\">{steps:,}</td>" in html


@pytest.mark.parametrize("kind, world", [("sft", 1), ("sft", 2), ("dpo", 2), ("grpo", 1),
                                         ("kto", 2), ("reward", 1)])
def test_the_epoch_rule_is_what_the_loader_draws(kind, world):
    """spec/batch.py's epoch rule against the real loader (dataset/loader.py make_loader) on
    rank 0 of ``world``: its batches per epoch, and the optimizer steps the stream makes."""
    from tunepilot.dataset import build_dataset, make_loader

    spec = _epoch_spec(kind)
    ds, info = build_dataset(spec, 512, EXAMPLES)
    split = spec.batch.on(world, exact=False)
    loader = make_loader(spec, ds, info, micro_batch_size=spec.batch.loader_batch(split),
                         rank=0, world_size=world)
    batches = sum(1 for _ in loader)
    assert batches == spec.batch.loader_batches_per_epoch(len(ds), split) > 0
    micro = batches * spec.batch.micro_steps_per_loader_batch(split)
    assert spec.batch.steps_per_epoch(len(ds), world) == micro // split.accumulation


# --- the quote's hours against its own FLOPs and MFU ---------------------------------------------

def test_dpo_over_sft_hours_is_the_flops_ratio_over_the_mfu_ratio():
    """examples/llama3-8b-lora.yaml with activation_checkpointing full and 1,000 steps on one
    H100: DPO's training hours / SFT's = (FLOPs per step ratio) / (MFU ratio) within 2%, from
    the figures the quote prints (it was 1.47 against 2.94: the pair's second sequence was not
    counted)."""
    base = load_spec(EXAMPLES / "llama3-8b-lora.yaml").model_dump(mode="json")
    base.update(activation_checkpointing="full", target={"steps": 1000})
    out = {}
    for kind in ("sft", "dpo"):
        q = quote(spec_from_dict({**base, "objective": {"kind": kind}}), card_id="h100",
                  count=1, term_s=None, catalog=CAT)
        doc = json.loads(q.model_dump_json())
        hours = next(t for t in doc["time_terms"] if t["name"] == "training")["total"]["value"]
        out[kind] = (hours / 3600, float(f"{doc['run']['flops_per_step']['value']:.4g}"),
                     float(f"{doc['run']['mfu']['value']:.3g}"))
    (h_s, f_s, m_s), (h_d, f_d, m_d) = out["sft"], out["dpo"]
    assert h_d / h_s == pytest.approx((f_d / f_s) / (m_d / m_s), rel=0.02)
    assert h_d / h_s > 2.5  # two sequences per pair and the reference's forward


# --- load, checkpoint and export bytes --------------------------------------------------------

def _term(q, name: str):
    return next(t for t in q.time_terms if t.name == name)


@pytest.mark.parametrize("kind", KINDS)
def test_quote_and_host_plan_count_the_same_load_and_export_bytes(kind):
    from tunepilot.model.arch import resolve_arch
    from tunepilot.model.flops import checkpoint_bytes, export_bytes, load_bytes

    spec = _spec_of(kind)
    arch = resolve_arch(spec, EXAMPLES)
    plan = make_plan(spec, catalog=CAT, card_ids=[CARD], base_dir=EXAMPLES)
    q = _quote(spec)
    ckpt = checkpoint_bytes(arch, spec, plan.params.trainable)
    export = export_bytes(spec, ckpt)
    assert export == spec.host.checkpoints_kept * ckpt
    assert _term(q, "export").each.extra("bytes") == plan.host.export_bytes == \
        q.host.export_bytes == export
    weights = next(d for d in plan.host.disk if d.name == "model weights").bytes_per_node
    assert weights == load_bytes(arch, spec)
    assert f"{load_bytes(arch, spec) / 1e9:,.2f} GB of weights" in _term(q, "model load").each.how


def test_export_copies_what_the_quote_and_host_plan_count(tmp_path):
    """A run directory with the kept checkpoints of a real tiny run: `tunepilot export` copies
    them (its checkpoint bytes, measured), and the quote that read the pilot's measured
    checkpoint size times the same export."""
    import torch

    from tunepilot.checkpoint.export import export_run
    from tunepilot.checkpoint.state import save_checkpoint
    from tunepilot.results.figure import Figure
    from tunepilot.results.pilot import DeviceBlock, PilotResult, Throughput, Timings
    from tunepilot.store import RunDir
    from tunepilot.training.build import build_run
    from tunepilot.training.step import train_step

    spec = _tiny("sft")
    torch.manual_seed(0)
    run = build_run(spec, "cpu", total_steps=4, base_dir=EXAMPLES)
    out = RunDir(tmp_path / "run")
    sizes = []
    for step in range(spec.host.checkpoints_kept):
        train_step(run.state, run.stream.next, spec)
        info = save_checkpoint(out.path / "checkpoints" / f"step-{step + 1}", run.state,
                               run.stream, spec)
        sizes.append(int(info.bytes))
    out.write(PilotResult(
        throughput=Throughput(useful_tokens_per_s=Figure.measured(50_000.0, "tokens/s")),
        timings=Timings(checkpoint_bytes=Figure.measured(sizes[0], "bytes")),
        device=DeviceBlock(kind="cpu", name="cpu")), spec.spec_hash())
    exported = export_run(out.path, str(tmp_path / "dest"))
    q = quote(spec, card_id=CARD, count=1, term_s=None, catalog=CAT, run_dir=out.path)
    assert exported.checkpoints == spec.host.checkpoints_kept
    assert exported.checkpoint_bytes.value == sum(sizes)
    assert _term(q, "export").each.extra("bytes") == spec.host.checkpoints_kept * sizes[0] \
        == pytest.approx(exported.checkpoint_bytes.value, rel=1e-3)
    assert "kept" in _term(q, "export").each.how
