"""Round 3 of plan accuracy (issue 28): FSDP's load and init, FSDP + QLoRA's spec, LitGPT's loss.

The traced per-rank FSDP step itself is tested in test_trace.py; the allocator replay in
test_allocator.py.
"""

from __future__ import annotations

import pytest

from tunepilot.errors import SpecError
from tunepilot.model.arch import Arch, load_preset
from tunepilot.plan.analytic.activations import logits_bytes
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.spec import spec_from_dict

BASE = {"model": {"preset": "llama-2-7b"}, "method": {"kind": "qlora"},
        "precision": "bf16-true", "sequence_length": 2048}
FSDP = {"strategy": "fsdp", "devices": 2}


def plan(**over):
    s = spec_from_dict({**BASE, **over})
    return s, analytic_plan(s, Arch.from_config(load_preset("llama-2-7b")))


def test_fsdp_qlora_packs_in_the_base_dtype_and_fsdp1_refuses_uint8_with_the_fix():
    s, _ = plan(parallel=FSDP)
    assert s.quant_storage_dtype == "bf16"  # sharded with the rest of the layer
    assert plan()[0].quant_storage_dtype == "uint8"  # one device: bitsandbytes' default
    with pytest.raises(SpecError, match="quant_storage: bf16"):
        spec_from_dict({**BASE, "method": {"kind": "qlora", "quant_storage": "uint8"},
                        "parallel": dict(FSDP, fsdp_version=1)})


def test_fsdp_loads_a_unit_at_a_time_and_offload_keeps_no_shards_on_the_device():
    _, one = plan()
    _, two = plan(parallel=FSDP)
    _, off = plan(parallel=dict(FSDP, cpu_offload=True))
    assert two.per_device.load_peak_bytes < one.per_device.load_peak_bytes
    assert off.per_device.load_peak_bytes < two.per_device.load_peak_bytes
    assert off.peak_phase != "model-load"  # the step, not the load, sets an offloaded peak


def test_litgpt_keeps_every_chunk_of_its_loss_and_tunepilots_chunked_loss_does_not():
    a = Arch.from_config(load_preset("llama-2-7b"))
    lit = spec_from_dict({**BASE, "method": {"kind": "lora"}, "micro_batch_size": 4,
                          "model": {"preset": "llama-2-7b", "implementation": "litgpt"}})
    chunked = lit.with_changes(model={"preset": "llama-2-7b"}, chunked_loss=True)
    tokens = lit.batch.positions_per_micro_batch
    kept, _ = logits_bytes(a, lit, 2, tokens)
    assert lit.litgpt_loss and not lit.loss_is_chunked
    assert kept == (2 + 2) * a.vocab_size * tokens  # bf16 logits + bf16 log-softmax, all tokens
    assert logits_bytes(a, chunked, 2, tokens)[0] < kept / 4


def test_litgpt_loss_is_what_the_step_runs_and_matches_plain_cross_entropy():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tunepilot.training.build import build_run
    from tunepilot.training.step import compute_loss

    lit = spec_from_dict({"model": {"preset": "tiny", "implementation": "litgpt"},
                          "method": {"kind": "full"}, "precision": "fp32",
                          "sequence_length": 300, "micro_batch_size": 2})
    model = build_run(lit, "cpu", total_steps=1, data=False).state.model
    ids = torch.randint(0, int(model.config.vocab_size), (2, 300))
    batch = {"input_ids": ids, "labels": ids.clone()}
    loss = compute_loss(model, batch, lit)
    assert len(loss.litgpt_logits) == 3  # 300 positions in chunks of 128
    plain = compute_loss(model, batch, lit.with_changes(model={"preset": "tiny"}))
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)


@pytest.mark.slow
def test_a_trace_leaves_no_process_group_behind():
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from tunepilot.model.arch import resolve_model_config
    from tunepilot.plan.trace.step import trace_step

    s = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                        "sequence_length": 64, "micro_batch_size": 2, "parallel": FSDP})
    assert trace_step(s, resolve_model_config(s), "cuda").world_size == 2
    assert not dist.is_initialized()  # a later step in this process sees one rank


@pytest.mark.slow
def test_fsdp1_init_is_replayed_unit_by_unit_before_the_step():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tunepilot.model.arch import resolve_model_config
    from tunepilot.plan.trace import step as ts
    from tunepilot.plan.trace.fsdp import fsdp1_init_events, release_fake_process_group
    from tunepilot.plan.trace.standins import unpacked_sequences

    s = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "lora"},
                        "precision": "bf16-true", "sequence_length": 128,
                        "micro_batch_size": 2, "parallel": dict(FSDP, fsdp_version=1)})
    t = ts.build_traced(s, resolve_model_config(s), "cuda", fake=True, device="cpu")
    with t.fake_mode, unpacked_sequences():
        ts.register_model(t.tracker, t.run.model, s, t.nf4, counts=t.counts)
        ts._run_two_steps(t)
    events, taken = fsdp1_init_events(t.run.model, t.tracker, offload=False)
    whole = sum(e[2] for e in events if e[0] > 0 and e[1] < 0)
    assert whole >= 2 * 2 * t.counts["total_params"]  # each unit's params, then its flat copy
    assert taken  # the shards are allocated inside their unit's init, not after all of them
    assert sum(e[0] for e in events if e[1] < 0) == 0  # every whole copy is freed again
    assert not fsdp1_init_events(t.run.model, t.tracker, offload=True)[1]  # shards on the host
    release_fake_process_group()


def _save(p):
    return next((ph for ph in p.phases if ph.name == "checkpoint-save"), None)


def test_an_fsdp1_sharded_save_clones_the_ranks_shard_on_the_device():
    from tunepilot.plan.analytic.states import nf4_constants_bytes

    fsdp1 = dict(FSDP, fsdp_version=1)
    spec, p = plan(parallel=fsdp1)
    step = next(ph for ph in p.phases if ph.is_optimizer)
    save = _save(p)
    # every parameter's local chunk cloned beside the resident shard: more than the shard again
    consts = nf4_constants_bytes(spec, Arch.from_config(load_preset("llama-2-7b")))
    shard = step.weights_bytes - consts  # (QLoRA's quantization constants are not sharded)
    assert save is not None and save.temporary_bytes > shard
    assert save.weights_bytes == step.weights_bytes and save.gradients_bytes == 0
    # CPU offload: the shard lives on the host, yet its clones are made on the device
    _, off = plan(parallel=dict(fsdp1, cpu_offload=True))
    assert _save(off).temporary_bytes == save.temporary_bytes
    assert _save(off).weights_bytes == consts
    assert any(n.startswith("checkpoint save: FSDP1") for n in off.assumptions)
    # rank 0 to the CPU a unit at a time, no save, FSDP2's in-place shards: no such phase
    for p2 in (plan(parallel=fsdp1, checkpoint={"state_dict": "full"})[1],
               plan(parallel=fsdp1, checkpoint={"state_dict": "none"})[1],
               plan(parallel=FSDP)[1]):
        assert _save(p2) is None


@pytest.mark.slow
def test_the_traced_plan_carries_the_fsdp1_save_beside_its_traced_states():
    pytest.importorskip("transformers")
    from tunepilot.model.arch import resolve_arch, resolve_model_config
    from tunepilot.plan.trace.core import traced_plan_from
    from tunepilot.plan.trace.step import trace_step

    s = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                        "sequence_length": 64, "micro_batch_size": 2,
                        "parallel": dict(FSDP, fsdp_version=1)})
    arch = resolve_arch(s)
    analytic = analytic_plan(s, arch)
    traced = traced_plan_from(s, trace_step(s, resolve_model_config(s), "cuda"), analytic,
                              "cuda", arch)
    save, want = _save(traced), _save(analytic)
    step = next(p for p in traced.phases if p.is_optimizer)
    assert save.temporary_bytes == want.temporary_bytes  # the analytic plan's clones
    assert save.weights_bytes == step.weights_bytes  # beside the traced states
    assert any(n.startswith("checkpoint save:") and "MODELLED, not traced" in n
               for n in traced.assumptions)
