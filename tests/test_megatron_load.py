"""Megatron-LM's model load (plan/analytic/megatron_load.py): its DDP copies the parameters into
the distributed optimizer's param buffer beside the main-grad buffer, and the first copies it
frees stay cached in blocks the step's activations do not fit."""

from __future__ import annotations

import pytest

from tunepilot.model.arch import param_counts, resolve_arch
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.plan.analytic.megatron_load import stranded_bytes
from tunepilot.plan.reserve.allocator import LARGE_BUFFER_BYTES
from tunepilot.spec import spec_from_dict

GiB = 2**30


def _plan(preset: str = "qwen3-30b-a3b", stage: int = 1, offload: str = "none",
          expert: int = 4, **fields):
    par = {"strategy": "deepspeed", "devices": 4, "expert": expert,
           "deepspeed": {"stage": stage, "offload_optimizer": offload}}
    if stage == 0:
        par = {"strategy": "ddp", "devices": 4, "expert": expert}
    spec = spec_from_dict({"model": {"preset": preset, "implementation": "megatron"},
                           "method": {"kind": "full"}, "precision": "bf16-mixed",
                           "sequence_length": 8192, "activation_checkpointing": "full",
                           "kernels": {"attention": "flash-attention-2"}, "parallel": par,
                           **fields})
    return spec, analytic_plan(spec, resolve_arch(spec))


def test_the_param_buffer_copy_sets_the_load_peak_when_the_optimizer_is_offloaded():
    # the experts' buffers are made after the dense ones: the module, the whole main-grad
    # buffer and a second copy of the rank's experts
    _, plan = _plan(offload="cpu")
    d = plan.per_device
    n_experts = 29_0 * 10**8 // 4  # ~7.25e9 routed-expert parameters on each of 4 EP ranks
    second_copy = d.load_peak_bytes - d.weights_bytes - d.gradients_bytes
    assert second_copy == pytest.approx(2 * n_experts, rel=0.01)
    assert d.load_peak_bytes > max(p.total_bytes for p in plan.phases)
    assert plan.peak_phase == "model-load"
    assert any("param buffer" in a for a in plan.assumptions)
    assert any("sets the peak" in a and "Megatron's DDP copying" in a for a in plan.assumptions)


def test_first_copies_smaller_than_an_activation_stay_reserved_beside_the_step():
    _, plan = _plan(offload="cpu")
    d = plan.per_device
    # every expert matrix (3-6 MiB, in 20 MiB segments) and the attention projections are
    # below one 8192-token activation (32 MiB); the embedding and output layer are not
    assert 14 * GiB < d.load_stranded_bytes < 16 * GiB
    step = max(p.total_bytes for p in plan.phases)
    assert d.reserved_peak_bytes >= step + d.load_stranded_bytes
    # reserved, not allocated: the allocated peak is the load's (and the workspaces)
    assert d.load_peak_bytes < d.allocated_peak_bytes < d.load_peak_bytes + GiB


def test_expandable_segments_reuse_the_freed_pages():
    _, plan = _plan(offload="cpu", allocator={"expandable_segments": True})
    _, default = _plan(offload="cpu")
    assert plan.per_device.load_stranded_bytes == 0
    assert plan.per_device.load_peak_bytes == default.per_device.load_peak_bytes
    assert plan.per_device.reserved_peak_bytes < default.per_device.reserved_peak_bytes - 10 * GiB


def test_without_the_distributed_optimizer_the_parameters_are_not_copied():
    # "Only re-map param tensors if using distributed optimizer": DDP makes the grad buffer only
    _, plan = _plan(stage=0)
    d = plan.per_device
    assert d.load_stranded_bytes == 0
    # the 16-bit module (2 B a parameter) beside the fp32 main-grad buffer (4 B)
    assert d.load_peak_bytes == pytest.approx(1.5 * d.gradients_bytes, rel=1e-6)


def test_a_block_is_stranded_only_below_the_activation_size():
    spec, _ = _plan()
    arch = resolve_arch(spec)
    counts = param_counts(arch, "fused")
    everything = stranded_bytes(arch, counts, 2, 10**15)
    nothing = stranded_bytes(arch, counts, 2, 1)
    assert nothing == 0
    assert everything == pytest.approx(2 * counts.total, rel=0.01)  # norms left out
    # 1-10 MiB tensors share 20 MiB segments: a block of that segment serves up to 20 MiB
    just_under = stranded_bytes(arch, counts, 2, LARGE_BUFFER_BYTES)
    just_over = stranded_bytes(arch, counts, 2, LARGE_BUFFER_BYTES + 1)
    assert just_over > just_under
