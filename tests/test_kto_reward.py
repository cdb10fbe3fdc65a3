"""KTO and a reward model in tunepilot's own step (they were refused or crashed): TRL's losses
on the tiny model, the rows each reads, and the pilot of each."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tunepilot.dataset import IGNORE_INDEX, build_dataset
from tunepilot.pilot.runner import PilotOptions, run_pilot
from tunepilot.spec import spec_from_dict
from tunepilot.training.build import build_run
from tunepilot.training.preference import mismatched
from tunepilot.training.step import train_step

BASE = {"model": {"preset": "tiny"}, "method": {"kind": "lora"}, "precision": "fp32",
        "sequence_length": 128, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
KTO = {**BASE, "objective": {"kind": "kto"}, "data": {"source": "tiny-preference"}}
REWARD = {**BASE, "objective": {"kind": "reward"}, "data": {"source": "tiny-preference"},
          "model": {"preset": "tiny", "task": "sequence-classification", "num_labels": 1}}


def test_kto_unpairs_preference_pairs_into_desirable_and_undesirable_rows():
    s = spec_from_dict(KTO)
    ds, info = build_dataset(s, 512)
    assert len(ds) == 600 and "unpaired" in " ".join(info.notes)
    chosen, rejected = ds[0], ds[1]
    assert chosen[2] is True and rejected[2] is False
    assert not (len(chosen[0]) == len(rejected[0]) and (chosen[0] == rejected[0]).all())


def test_the_kl_row_is_the_prompt_with_the_row_befores_completion_in_its_chunk():
    """TRL's _get_kl_dataset rotates completions by one within chunks of the per-device batch
    (micro_batch_size 2 here): a property of the sample, so every grouping of the step's rows
    into micro-batches and ranks computes the same KL."""
    s = spec_from_dict(KTO)
    ds, _ = build_dataset(s, 512)

    def parts(item):
        ids, labels = item[0], item[1]
        return ids[labels == IGNORE_INDEX], ids[labels != IGNORE_INDEX]

    for i, partner in ((0, 1), (1, 0), (2, 3), (3, 2)):
        prompt, _ = parts(ds[i])
        _, completion = parts(ds[partner])
        kl_ids, kl_labels = ds[i][3], ds[i][4]
        assert (kl_ids == np.concatenate([prompt, completion])[:128]).all()
        assert (kl_labels[len(prompt):] == kl_ids[len(prompt):]).all()
    run = build_run(s, "cpu", total_steps=1)
    b = run.stream.next()
    kl = mismatched(b)
    assert set(kl) == {"input_ids", "labels", "attention_mask"} and kl["input_ids"].shape[0] == 2


def test_kto_starts_at_one_half_and_trains():
    """LoRA's B starts at zero: the policy is the reference and the KL is 0, so every row's
    loss is 1 - sigmoid(0) = 0.5 (TRL's kto_loss)."""
    s = spec_from_dict(KTO)
    run = build_run(s, "cpu", total_steps=3)
    first = train_step(run.state, run.stream.next, s)
    assert first.loss == pytest.approx(0.5, abs=1e-6) and first.grad_norm > 0
    second = train_step(run.state, run.stream.next, s)
    assert math.isfinite(second.loss) and second.loss != first.loss


def test_a_reward_model_scores_pairs_with_its_head_and_trains():
    s = spec_from_dict(REWARD)
    ds, _ = build_dataset(s, 512)
    chosen, labels, _, _ = ds[0]
    assert (labels == chosen).all()  # every token is scored: none masked
    run = build_run(s, "cpu", total_steps=3)
    losses = [train_step(run.state, run.stream.next, s) for _ in range(2)]
    assert all(math.isfinite(st.loss) and st.grad_norm > 0 for st in losses)


def test_kto_refuses_a_loss_type_its_step_does_not_run():
    from tunepilot.errors import UserError

    s = spec_from_dict({**KTO, "objective": {"kind": "kto", "loss_type": "apo_zero_unpaired"}})
    run = build_run(s, "cpu", total_steps=1)
    with pytest.raises(UserError, match="loss_type"):
        train_step(run.state, run.stream.next, s)


@pytest.mark.slow
@pytest.mark.parametrize("doc", [KTO, REWARD], ids=["kto", "reward"])
def test_the_kto_and_reward_pilots(doc, tmp_path):
    res = run_pilot(spec_from_dict(doc), tmp_path / "run", PilotOptions(steps=2))
    assert res.fits and res.run.objective == doc["objective"]["kind"]
    assert res.throughput.useful_tokens_per_s.value > 0
