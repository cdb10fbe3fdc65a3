"""An older transformers' loss path (model.transformers_version) and a loop that keeps each
micro-batch's model output (loop_keeps_output): the spec, the training step, both plans."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tunepilot.errors import SpecError  # noqa: E402
from tunepilot.model.arch import resolve_arch, resolve_model_config  # noqa: E402
from tunepilot.plan.analytic.core import analytic_plan  # noqa: E402
from tunepilot.plan.trace.core import traced_plan_from  # noqa: E402
from tunepilot.plan.trace.step import trace_step  # noqa: E402
from tunepilot.spec import spec_from_dict  # noqa: E402

TINY = {"model": {"preset": "tiny"}, "sequence_length": 128, "micro_batch_size": 4,
        "optimizer": {"name": "adamw", "lr": 1e-3}, "precision": "bf16-true"}


def tiny(version=None, **over):
    d = dict(TINY, **over)
    if version is not None:
        d["model"] = dict(d["model"], transformers_version=version)
    return spec_from_dict(d)


@pytest.mark.parametrize("version,path", [
    (None, "current"), ("4.38.2", "fp32-output"), ("4.45", "fp32-output"),
    ("4.46.0", "shift-copy"), ("4.48.3", "shift-copy"), ("4.49.0", "current"),
    ("5.0.0rc1", "current")])
def test_the_release_picks_the_loss_path(version, path):
    assert tiny(version).hf_loss_path == path


@pytest.mark.parametrize("over", [
    {"chunked_loss": True}, {"kernels": {"liger": ["fused_linear_cross_entropy"]}},
    {"objective": {"kind": "dpo"}, "data": {"source": "tiny-preference"}},
    {"model": {"preset": "tiny", "task": "sequence-classification"}}])
def test_a_loss_the_forward_does_not_compute_has_no_path(over):
    assert tiny("4.40", **over).hf_loss_path == "none"


def test_a_version_that_is_not_one_is_refused_naming_the_field():
    with pytest.raises(SpecError) as info:
        tiny("latest")
    assert "model.transformers_version" in str(info.value)


def _outputs(spec):
    from tunepilot.training.build import build_run
    from tunepilot.training.step import forward_loss

    run = build_run(spec, "cpu", total_steps=1, data=False)
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (2, 16)), "labels": torch.randint(0, 100, (2, 16))}
    loss = forward_loss(run.state, batch, spec, None)
    return run.state, loss


def test_the_old_path_keeps_fp32_logits_in_the_output_and_gives_the_same_loss():
    now_state, now = _outputs(tiny(seed=3, loop_keeps_output="through-backward"))
    old_state, old = _outputs(tiny("4.40", seed=3, loop_keeps_output="through-backward"))
    mid_state, mid = _outputs(tiny("4.47", seed=3, loop_keeps_output="through-backward"))
    assert now_state.kept_output.logits.dtype == torch.bfloat16
    assert mid_state.kept_output.logits.dtype == torch.bfloat16
    assert old_state.kept_output.logits.dtype == torch.float32
    assert old.item() == pytest.approx(now.item(), rel=1e-3)
    assert mid.item() == pytest.approx(now.item(), rel=1e-3)


@pytest.mark.parametrize("until,after_step", [("through-backward", False),
                                              ("to-next-forward", True)])
def test_the_loop_drops_the_output_after_the_step_or_at_the_next_forward(until, after_step):
    from tunepilot.training.step import backward, update

    state, loss = _outputs(tiny("4.40", seed=3, loop_keeps_output=until))
    backward(state, loss)
    assert state.kept_output.logits.shape[:2] == (2, 16)  # alive through its own backward
    update(state)
    assert (state.kept_output is not None) is after_step


def test_the_loop_without_kept_output_holds_nothing():
    state, _ = _outputs(tiny("4.40", seed=3))
    assert state.kept_output is None


def _plans(spec):
    arch = resolve_arch(spec)
    analytic = analytic_plan(spec, arch, "cuda")
    raw = trace_step(spec, resolve_model_config(spec), "cuda", fake=True)
    return analytic, traced_plan_from(spec, raw, analytic, "cuda", arch)


@pytest.mark.parametrize("until", ["through-backward", "to-next-forward"])
def test_a_kept_fp32_output_raises_both_plans_by_about_a_micro_batch_of_fp32_logits(until):
    base = tiny(activation_checkpointing="full")
    kept = tiny("4.40", activation_checkpointing="full", loop_keeps_output=until)
    arch = resolve_arch(base)
    fp32_logits = 4 * arch.vocab_size * base.micro_batch_size * base.sequence_length
    (a0, t0), (a1, t1) = _plans(base), _plans(kept)
    grew_a = a1.per_device.allocated_peak_bytes - a0.per_device.allocated_peak_bytes
    grew_t = t1.per_device.allocated_peak_bytes - t0.per_device.allocated_peak_bytes
    assert 0.9 * fp32_logits <= grew_a <= 2.1 * fp32_logits
    assert 0.9 * fp32_logits <= grew_t <= 2.1 * fp32_logits
    assert any(f"loop_keeps_output {until}" in a for a in a1.assumptions)
    assert any("transformers_version 4.40" in a for a in a1.assumptions)
