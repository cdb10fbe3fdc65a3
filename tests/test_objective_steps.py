"""The DPO family's and GRPO's steps in tunepilot's own training code on the tiny model: the
losses as TRL computes them, preference and prompt data, the trace of the real loss on fake
tensors against the analytic plan, and the tiny DPO and GRPO pilots (generation its own phase)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tunepilot.dataset import build_dataset, collate, longest_batch, useful_tokens
from tunepilot.errors import UserError
from tunepilot.model.arch import Arch, resolve_model_config
from tunepilot.pilot.runner import PilotOptions, run_pilot
from tunepilot.plan.analytic.core import analytic_plan, workspace_bytes
from tunepilot.plan.trace.step import trace_step
from tunepilot.spec import spec_from_dict
from tunepilot.training.build import build_run
from tunepilot.training.step import train_step

DPO = {"model": {"preset": "tiny"}, "method": {"kind": "lora"}, "precision": "fp32",
       "sequence_length": 256, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
       "objective": {"kind": "dpo", "beta": 0.1}, "data": {"source": "tiny-preference"},
       "validation": {"num_batches": 2}}
GRPO = {"model": {"preset": "tiny"}, "method": {"kind": "lora"}, "precision": "fp32",
        "sequence_length": 160, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
        "objective": {"kind": "grpo", "beta": 0.04, "num_generations": 4,
                      "max_completion_length": 32}, "data": {"source": "tiny-prompts"}}


def spec(base: dict, **changes):
    return spec_from_dict({**base, **changes})


def test_preference_rows_become_pairs_the_longest_pair_first():
    s = spec(DPO)
    ds, info = build_dataset(s, 512)
    assert len(ds) == 300 and info.eos_token_id is not None
    b = collate([ds[0], ds[1]], info.pad_token_id)
    assert b["input_ids"].shape[0] == 4  # chosen, chosen, rejected, rejected
    lb = longest_batch(ds, info, 4)
    assert lb["input_ids"].shape[1] == int(ds.lengths().max())
    n_prompt = int((b["labels"][0] == -100).sum())
    assert 0 < useful_tokens(b) < b["input_ids"].numel() and n_prompt > 0


def test_prompt_rows_are_left_padded_and_train_nothing():
    s = spec(GRPO)
    ds, info = build_dataset(s, 512)
    b = collate([ds[i] for i in range(4)], info.pad_token_id)
    assert useful_tokens(b) == 0
    assert bool((b["attention_mask"][:, -1] == 1).all())  # generation continues at the end


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_starts_at_its_reference_value_and_trains(loss):
    """LoRA's B starts at zero: the policy is the reference, so the sigmoid loss is log 2."""
    s = spec(DPO, objective={"kind": "dpo", "beta": 0.1, "loss_type": loss},
             data={"source": "synthetic"}, sequence_length=64)
    run = build_run(s, "cpu", total_steps=3)
    st = train_step(run.state, run.stream.next, s)
    if loss == "sigmoid":
        assert st.loss == pytest.approx(math.log(2), abs=1e-4)
    assert math.isfinite(st.loss) and st.grad_norm > 0


@pytest.mark.parametrize("kind", ["orpo", "simpo", "cpo"])
def test_reference_free_pair_losses_run_without_a_reference(kind):
    s = spec(DPO, objective={"kind": kind}, method={"kind": "full"},
             data={"source": "synthetic"}, sequence_length=64)
    run = build_run(s, "cpu", total_steps=2)
    assert run.state.reference is None
    st = train_step(run.state, run.stream.next, s)
    assert math.isfinite(st.loss) and st.grad_norm > 0


def test_a_full_dpo_run_builds_a_frozen_reference_copy():
    s = spec(DPO, method={"kind": "full"}, data={"source": "synthetic"}, sequence_length=64)
    run = build_run(s, "cpu", total_steps=2)
    ref = run.state.reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    before = [p.detach().clone() for p in ref.parameters()]
    train_step(run.state, run.stream.next, s)
    assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters(), strict=True))


def test_grpo_step_generates_then_updates_the_policy():
    s = spec(GRPO)
    run = build_run(s, "cpu", total_steps=3)
    st = train_step(run.state, run.stream.next, s)
    assert st.generation_s > 0 and st.generated_tokens == 8 * 32  # 2 prompts x 4 x 32
    assert st.useful_tokens == 8 * 32 and st.grad_norm > 0


@pytest.mark.slow
@pytest.mark.parametrize("base, objective", [
    (DPO, {"kind": "dpo"}),
    (GRPO, {"kind": "grpo", "beta": 0.04, "num_generations": 4, "max_completion_length": 64,
            "generation": {"backend": "transformers"}}),
])
def test_the_trace_runs_the_real_loss_and_agrees_with_the_analytic_plan(base, objective):
    """The real DPO / GRPO loss on fake tensors (generation: the KV cache prefilled, grown to
    prompt + completion, one decode step) within 15% of the analytic plan's peak on the tiny
    model, where the small terms the analytic plan leaves out weigh most (an 8B DPO and a 7B
    GRPO agree within 1%: docs/objectives.md)."""
    s = spec(base, objective=objective, precision="bf16-mixed", data={"source": "synthetic"},
             sequence_length=256)
    cfg = resolve_model_config(s)
    traced = trace_step(s, cfg, "cuda", fake=True)
    plan = analytic_plan(s, Arch.from_config(cfg), "cuda")
    step_peak = plan.per_device.allocated_peak_bytes - workspace_bytes("cuda")  # + cuBLAS's
    assert traced.peak_bytes == pytest.approx(step_peak, rel=0.15)
    names = [p.name for p in traced.phases]
    if s.objective.generative:
        assert names[:2] == ["generation", "reference-forward"]
        gen = next(p for p in traced.phases if p.name == "generation")
        assert gen.peak_bytes == pytest.approx(plan.phase("generation").total_bytes, rel=0.35)


def test_the_pilot_refuses_an_objective_its_step_does_not_run(tmp_path):
    s = spec(DPO, objective={"kind": "ppo", "max_completion_length": 64},
             data={"source": "synthetic"})
    with pytest.raises(UserError, match="ppo"):
        run_pilot(s, tmp_path / "ppo", PilotOptions(steps=1))


@pytest.mark.slow
def test_the_tiny_dpo_pilot(tmp_path):
    res = run_pilot(spec(DPO), tmp_path / "dpo", PilotOptions(steps=2))
    assert res.fits and res.run.objective == "dpo" and res.generation is None
    assert res.data.longest_batch.micro_batch_size == 4
    tp = res.throughput
    assert 0 < tp.useful_fraction.value < 1  # the prompts are not trained
    assert res.validation.loss is not None
    doc = json.loads((tmp_path / "dpo" / "pilot.json").read_text())
    assert doc["run"]["objective"] == "dpo"


@pytest.mark.slow
def test_the_tiny_grpo_pilot_measures_generation_as_its_own_phase(tmp_path):
    res = run_pilot(spec(GRPO), tmp_path / "grpo", PilotOptions(steps=2))
    g = res.generation
    assert res.fits and g is not None
    assert g.seconds_per_step.is_measured and g.seconds_per_step.value > 0
    assert 0 < g.fraction_of_step_time.value < 1
    assert g.generated_tokens_per_s.value > 0 and g.peak_bytes.value > 0
    assert res.split.generation_s.value > 0
    assert res.data.longest_batch.sequence_length <= 160
    doc = json.loads((tmp_path / "grpo" / "pilot.json").read_text())
    assert doc["generation"]["seconds_per_step"]["basis"] == "measured"
