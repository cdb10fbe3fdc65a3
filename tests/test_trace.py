"""The traced memory plan: the storage tracker, fake-vs-real CPU steps, every method, fallbacks.

The central check: the same training step of the tiny model on *real* CPU tensors under the same
tracker gives the same peak as the fake-tensor trace, byte for byte (in 512-byte CUDA blocks).
"""

from __future__ import annotations

import gc
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tunepilot.catalog import load_catalog  # noqa: E402
from tunepilot.model.arch import resolve_arch, resolve_model_config  # noqa: E402
from tunepilot.plan.analytic.core import analytic_plan, workspace_bytes  # noqa: E402
from tunepilot.plan.api import make_plan  # noqa: E402
from tunepilot.plan.trace.core import traced_plan_from  # noqa: E402
from tunepilot.plan.trace.standins import CudaAutocastRules, nf4_parts  # noqa: E402
from tunepilot.plan.trace.step import trace_step  # noqa: E402
from tunepilot.plan.trace.tracker import CUDA_BLOCK_BYTES, StorageTracker, round_block  # noqa: E402
from tunepilot.proc.child import HOOK_ENV  # noqa: E402
from tunepilot.spec import spec_from_dict  # noqa: E402

TINY = {"model": {"preset": "tiny"}, "sequence_length": 128, "micro_batch_size": 4,
        "optimizer": {"name": "adamw", "lr": 1e-3}}


def tiny(**over):
    d = dict(TINY)
    d.update(over)
    return spec_from_dict(d)


def traced(spec, *, fake=True, stack="cuda"):
    return trace_step(spec, resolve_model_config(spec), stack, fake=fake)


def plan_of(spec, raw, stack="cuda"):
    arch = resolve_arch(spec)
    return traced_plan_from(spec, raw, analytic_plan(spec, arch, stack), stack, arch)


# ------------------------------------------------------------------------------ the tracker


def test_rounding_is_the_cuda_allocators_512_byte_blocks():
    assert [round_block(n) for n in (0, 1, 511, 512, 513, 4096)] == [0, 512, 512, 512, 1024, 4096]


def test_a_storage_is_counted_once_and_released_when_its_last_view_dies():
    tr = StorageTracker()
    with tr:
        a = torch.empty(1000)  # 4000 B -> 4096 B
        v = a.view(10, 100)[2:]  # a view: the same storage, not counted again
        b = a + 1
    assert tr.live_bytes == 2 * 4096 and tr.live_raw_bytes == 2 * 4000
    del a
    gc.collect()
    assert tr.live_bytes == 2 * 4096  # the view keeps the storage alive
    del v, b
    gc.collect()
    assert tr.live_bytes == 0


def test_peaks_keep_their_breakdown_when_a_role_is_learned_later():
    tr = StorageTracker()
    with tr:
        w = tr.open_window("w")
        g = torch.empty(256)  # 1 KiB, unclassified (temporary) at the peak
        tr.classify(g, "gradients")  # learned after the peak: applied to it
        tr.close_window(w)
    assert w.peak_bytes == 1024
    assert w.by_category["gradients"] == 1024 and w.by_category["temporary"] == 0


def test_a_window_keeps_the_instant_with_the_most_bytes_besides_gradients():
    # ZeRO-2/3 and the optimizer in the backward hold no pile of gradients: their peak is the
    # instant the step held the most else (tracker.Peak.sans_grad), not the one with every .grad
    tr = StorageTracker()
    with tr:
        w = tr.open_window("w")
        a = torch.empty(512)  # 2 KiB of activations
        tr.classify(a, "activations")
        fresh = torch.empty(128)  # 512 B a backward op makes, stored in .grad a moment later:
        tr.classify(fresh, "gradients")  # at that instant still the op's output
        del a
        gc.collect()
        grads = []
        for _ in range(3):  # 3 KiB of gradients afterwards: the window's peak
            grads.append(torch.empty(256))
            tr.classify(grads[-1], "gradients")
        tr.close_window(w)
    assert w.peak_bytes == 3584 and w.by_category["gradients"] == 3584
    assert w.sans_grad["activations"] == 2048 and w.sans_grad["temporary"] == 512
    assert w.sans_grad["gradients"] == 0
    assert w.to_dict()["sans_grad_bytes"]["activations"] == 2048


def test_nf4_parts_match_bitsandbytes_layout():
    n = 4096 * 4096
    plain = nf4_parts(n, double_quant=False)
    assert plain[0] == n // 2 and plain[-1] == 4 * n // 64  # packed codes, fp32 absmax
    dq = nf4_parts(n, double_quant=True)
    assert dq[2] == n // 64  # 8-bit absmax
    assert sum(dq) < sum(plain)


def test_cuda_autocast_rules_run_its_float32_ops_in_float32_on_the_cpu():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.layer_norm(x, (8,), w).dtype == torch.bfloat16  # CPU rule
        with CudaAutocastRules():
            assert torch.nn.functional.layer_norm(x, (8,), w).dtype == torch.float32
            assert (x ** 3).dtype == torch.float32 and x.softmax(-1).dtype == torch.float32
            assert (x.float() @ x.float().t()).dtype == torch.bfloat16  # 16-bit list unchanged


# ------------------------------------------------------------------------------ fake vs real


@pytest.mark.slow
@pytest.mark.parametrize("over", [
    {"method": {"kind": "full"}, "precision": "fp32"},
    {"method": {"kind": "lora", "lora_dropout": 0.1}, "precision": "bf16-mixed",
     "gradient_accumulation_steps": 3},
    {"method": {"kind": "full"}, "precision": "bf16-mixed", "activation_checkpointing": "full"},
    {"method": {"kind": "qlora", "lora_targets": "all-linear"}, "precision": "bf16-true",
     "optimizer": {"name": "paged_adamw_8bit"}},
], ids=["full-fp32", "lora-mixed-accum", "full-mixed-checkpointed", "qlora-8bit"])
def test_fake_trace_peak_equals_the_real_cpu_step(over):
    spec = tiny(**over)
    fake, real = traced(spec, fake=True), traced(spec, fake=False)
    assert fake.traced_on.startswith("fake") and real.traced_on.startswith("real")
    assert fake.peak_bytes == real.peak_bytes > 0  # byte-exact, 512-byte blocks
    assert fake.peak_bytes % CUDA_BLOCK_BYTES == 0
    assert abs(fake.peak_raw_bytes - real.peak_raw_bytes) <= CUDA_BLOCK_BYTES
    assert [p.peak_bytes for p in fake.phases] == [p.peak_bytes for p in real.phases]


# ------------------------------------------------------------------------------ every method


@pytest.mark.slow
@pytest.mark.parametrize("over,expect", [
    ({"method": {"kind": "lora", "lora_targets": ["q_proj", "v_proj"]}}, "master_weights"),
    ({"method": {"kind": "full"}, "precision": "bf16-true"}, "weights"),
    ({"method": {"kind": "qlora", "double_quant": True}, "precision": "bf16-mixed"}, "NF4"),
    ({"method": {"kind": "full"}, "activation_checkpointing": "full"}, "master_weights"),
    ({"method": {"kind": "lora"}, "activation_checkpointing": "selective", "chunked_loss": True,
      "sequence_length": 1536, "micro_batch_size": 1}, "master_weights"),
], ids=["lora", "full-bf16-true", "qlora-mixed", "checkpointed", "selective-chunked"])
def test_every_method_traces_with_a_consistent_breakdown(over, expect):
    spec = tiny(**over)
    plan = plan_of(spec, traced(spec))
    assert plan.fidelity == "trace"
    d = plan.per_device
    peak = next(p for p in plan.phases if p.name == plan.peak_phase)
    assert peak.total_bytes + workspace_bytes("cuda") == d.allocated_peak_bytes > 0
    assert d.device_peak_bytes > d.reserved_peak_bytes > d.allocated_peak_bytes
    assert d.gradients_bytes > 0 and d.optimizer_bytes > 0
    if expect == "NF4":
        assert any("NF4" in a for a in plan.assumptions)
        # the quantized linears count at ~0.5 B/param (+ absmax, each part in 512-B blocks)
        assert d.weights_bytes < 2 * plan.params.frozen * 0.75
    else:
        assert getattr(d, f"{expect}_bytes") > 0
    assert "sdpa-flash" in plan.trace["attention_path"]


@pytest.mark.slow
def test_accumulation_micro_batches_do_not_raise_the_peak():
    raw = traced(tiny(method={"kind": "full"}, gradient_accumulation_steps=4))
    first, second, third = raw.micro_batch_peaks_bytes
    assert second > first  # the gradients of micro-batch 1 are alive through micro-batch 2
    assert raw.accumulation_peak_stable and third - second <= CUDA_BLOCK_BYTES


@pytest.mark.slow
def test_ddp_adds_buckets_to_the_single_device_trace():
    base = tiny(method={"kind": "full"}, precision="bf16-mixed")
    raw = traced(base)
    single = plan_of(base, raw)
    ddp = plan_of(base.with_changes(parallel={"strategy": "ddp", "devices": 2}), raw)
    assert ddp.per_device.collective_buffers_bytes == pytest.approx(
        single.per_device.gradients_bytes, rel=0.01)


FSDP4 = {"strategy": "fsdp", "devices": 4}


@pytest.mark.slow
def test_fsdp_is_traced_per_rank_with_its_unsharded_layers_and_buffers():
    base = tiny(method={"kind": "full"}, precision="bf16-mixed")
    fsdp_spec = base.with_changes(parallel=FSDP4)
    single, fsdp = plan_of(base, traced(base)), plan_of(fsdp_spec, raw := traced(fsdp_spec))
    w1, w4 = single.per_device.master_weights_bytes, fsdp.per_device.master_weights_bytes
    assert w1 / 4 <= w4 <= w1 / 4 * 1.05  # rank 0's dim-0 shards, 512-byte blocks each
    assert raw.fsdp_version == 2 and raw.world_size == 4
    facts = fsdp.trace["fsdp"]
    assert facts["how"] == "traced per rank" and facts["unsharded_params_bytes"] > 0
    assert any(p.labelled_bytes.get("all-gather") for p in raw.phases)
    assert not any("derived" in a for a in fsdp.assumptions)
    # per rank the activations are the whole micro-batch's: they do not shrink with the ranks
    two = plan_of(s2 := base.with_changes(parallel=dict(FSDP4, devices=2)), traced(s2))
    assert fsdp.per_device.activations_bytes == two.per_device.activations_bytes


@pytest.mark.slow
@pytest.mark.parametrize("version,kind", [(2, "full"), (1, "lora"), (2, "qlora"),
                                          (1, "qlora")])
def test_fsdp_fake_trace_equals_the_real_cpu_step_under_a_fake_process_group(version, kind):
    spec = tiny(method={"kind": kind}, precision="bf16-true" if kind == "qlora" else
                "bf16-mixed", parallel=dict(FSDP4, fsdp_version=version))
    fake, real = traced(spec), traced(spec, fake=False)
    assert [p.peak_bytes for p in fake.phases] == [p.peak_bytes for p in real.phases]
    assert fake.fsdp_version == version
    unsharded = max(p.labelled_bytes.get("unsharded", 0) for p in fake.phases)
    assert unsharded > 0  # FSDP's resized storages were followed


@pytest.mark.slow
def test_fsdp_qlora_shards_the_packed_storage_and_keeps_absmax_whole():
    q = tiny(method={"kind": "qlora"}, precision="bf16-true", parallel=FSDP4)
    one, four = traced(q.with_changes(parallel={"strategy": "fsdp", "devices": 1})), traced(q)
    w1 = max(p.weights_bytes for p in one.phases)
    w4 = max(p.weights_bytes for p in four.phases)
    assert w4 < w1 / 2  # the packed codes (and the 16-bit rest) shard; absmax does not
    assert four.model.total_params == one.model.total_params  # counted before packing
    assert any("quant_storage bf16" in n for n in four.notes)


def test_a_single_device_trace_cannot_plan_an_fsdp_rank():
    from tunepilot.plan.trace.core import TraceFailed

    base = tiny(method={"kind": "full"})
    with pytest.raises(TraceFailed, match="shards over 4 ranks"):
        plan_of(base.with_changes(parallel=FSDP4), traced(base))


@pytest.mark.slow
def test_fsdp_accumulation_keeps_gradients_sharded():
    # the scaling worker reduce-scatters every micro-batch, so no phase holds full gradients
    spec = tiny(method={"kind": "full"}, gradient_accumulation_steps=2, parallel=FSDP4)
    plan = plan_of(spec, traced(spec))
    full = max(p.gradients_bytes for p in traced(spec.with_changes(
        parallel={"strategy": "single", "devices": 1})).phases)
    grads = {p.name: p.gradients_bytes for p in plan.phases}
    assert grads["micro 2 forward"] < full / 3
    assert grads["optimizer-step"] < full / 3


# ------------------------------------------------------------------------------ the child process


@pytest.mark.slow
def test_an_abort_in_the_child_falls_back_to_the_analytic_plan(monkeypatch):
    monkeypatch.setenv(HOOK_ENV, "support.faults:abort")
    plan = make_plan(tiny(method={"kind": "full"}), "traced", card_ids=["h100"])
    assert plan.fidelity == "analytic" and plan.trace["status"] == "fallback"
    assert "SIGABRT" in plan.trace["fallback_reason"]
    assert plan.assumptions[0].startswith("trace failed")
    assert plan.cards and plan.cards[0].card == load_catalog().get("h100").id


@pytest.mark.slow
def test_an_error_in_the_child_falls_back_with_the_reason(monkeypatch):
    monkeypatch.setenv(HOOK_ENV, "support.faults:raise_value_error")
    plan = make_plan(tiny(method={"kind": "full"}), "traced", card_ids=["h100"])
    assert plan.fidelity == "analytic"
    assert "a library refused the step" in plan.trace["fallback_reason"]


def test_a_spec_the_step_would_refuse_is_refused_by_the_validator_first():
    # bf16 optimizer state on fp32 parameters: refused before any plan, never "trace failed"
    from tunepilot.errors import SpecError

    with pytest.raises(SpecError) as e:
        tiny(method={"kind": "full"}, optimizer={"name": "adamw", "state_dtype": "bf16"})
    assert "state_dtype" in str(e.value) and "parameter dtype" in str(e.value)


@pytest.mark.slow
def test_cli_plan_trace_json_gives_a_traced_plan():
    from typer.testing import CliRunner

    from tunepilot.cli import app

    res = CliRunner().invoke(app, ["plan", "examples/tiny.yaml", "--trace", "--json",
                                   "--card", "h100"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["fidelity"] == "trace"
    assert data["trace"]["status"] == "traced"
    assert data["per_device"]["allocated_peak_bytes"] > 0
    row = data["cards"][0]
    card = load_catalog().get("h100")
    assert row["card"] == card.id and row["capacity_bytes"] == card.capacity_bytes
    assert row["fits"] and row["max_micro_batch"] > 4


# ------------------------------------------------------------------------------ issue 13 fields

def test_bf16_adapters_with_bf16_state_trace_and_agree_with_the_analytic_plan():
    spec = tiny(method={"kind": "lora", "lora_rank": 8, "adapter_dtype": "bf16"},
                precision="bf16-true", optimizer={"name": "adamw", "state_dtype": "bf16"})
    plan = plan_of(spec, traced(spec))
    assert plan.fidelity == "trace"
    analytic = analytic_plan(spec, resolve_arch(spec))
    trainable = plan.params.trainable
    assert analytic.per_device.optimizer_bytes == 2 * 2 * trainable  # two bf16 moments
    assert abs(plan.per_device.optimizer_bytes - analytic.per_device.optimizer_bytes) <= \
        0.01 * analytic.per_device.optimizer_bytes + 64 * CUDA_BLOCK_BYTES
    fp32 = tiny(method={"kind": "lora", "lora_rank": 8}, precision="bf16-true")
    assert analytic_plan(fp32, resolve_arch(fp32)).per_device.optimizer_bytes == \
        2 * 4 * trainable  # PEFT's fp32 adapters keep fp32 moments (plan and trace agree)


def test_bf16_state_on_fp32_adapters_is_refused_by_the_spec_with_the_fix():
    from tunepilot.errors import SpecError

    with pytest.raises(SpecError) as e:
        tiny(method={"kind": "lora"}, precision="bf16-true", optimizer={"state_dtype": "bf16"})
    assert "adapter_dtype: bf16" in str(e.value)


@pytest.mark.slow
def test_selective_op_keeps_less_than_selective_and_more_than_full():
    acts = {}
    for ac in ("selective", "selective-op", "full"):
        spec = tiny(method={"kind": "full"}, activation_checkpointing=ac)
        acts[ac] = (analytic_plan(spec, resolve_arch(spec)).per_device.activations_bytes,
                    plan_of(spec, traced(spec)).per_device.activations_bytes)
    for i in (0, 1):  # analytic, traced
        assert acts["full"][i] < acts["selective-op"][i] < acts["selective"][i], acts


def test_torch_compile_is_modelled_on_the_traced_plan_and_said_so():
    eager = tiny(method={"kind": "full"})
    compiled = tiny(method={"kind": "full"}, torch_compile=True)
    raw = traced(eager)
    a, b = plan_of(eager, raw), plan_of(compiled, raw)
    assert b.per_device.activations_bytes < a.per_device.activations_bytes
    assert any("torch_compile" in n and "MODELLED" in n for n in b.assumptions)


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective-op"])
def test_compile_changes_the_traced_plan_by_what_it_changes_in_the_analytic_plan(checkpointing):
    """Compile recomputes a layer's pointwise outputs: under checkpointing only the recomputed
    layer's, not the tensors checkpointing keeps. The trace scaled every traced activation by
    0.8, so torchtitan's compiled 8B run (selective-op) was traced -11% against -4% analytic."""
    eager = tiny(method={"kind": "full"}, activation_checkpointing=checkpointing)
    compiled = eager.with_changes(torch_compile=True)
    raw = traced(eager)
    traced_gain = plan_of(eager, raw).per_device.activations_bytes - \
        plan_of(compiled, raw).per_device.activations_bytes
    analytic_gain = analytic_plan(eager, resolve_arch(eager), "cuda").per_device.\
        activations_bytes - analytic_plan(compiled, resolve_arch(compiled), "cuda").\
        per_device.activations_bytes
    # the same difference in each phase; the peak phase may differ (a checkpointed run's
    # traced peak can sit where compile changes nothing)
    assert 0 <= traced_gain <= analytic_gain
    if checkpointing == "none":
        assert traced_gain == analytic_gain > 0


@pytest.mark.slow
def test_the_validation_pass_is_a_phase_of_the_timeline_and_can_set_the_peak():
    """A forward without gradients at validation.micro_batch_size: planned and traced; a
    large evaluation batch (HF's per_device_eval_batch_size) moves the peak there."""
    small = tiny()
    big = tiny(validation={"micro_batch_size": 64})
    for spec, peak_there in ((small, False), (big, True)):
        analytic = analytic_plan(spec, resolve_arch(spec), "cuda")
        plan = plan_of(spec, traced(spec))
        for p in (analytic, plan):
            v = next(ph for ph in p.phases if ph.name == "validation")
            assert v.gradients_bytes == 0 and v.activations_bytes <= 4 * CUDA_BLOCK_BYTES
            assert (p.peak_phase == "validation") is peak_there, (p.fidelity, p.peak_phase)
        va = next(ph for ph in analytic.phases if ph.name == "validation").total_bytes
        vt = next(ph for ph in plan.phases if ph.name == "validation").total_bytes
        assert abs(vt - va) / vt < 0.15  # the derivation agrees with the traced pass


@pytest.mark.slow
def test_fsdp_cpu_offload_moves_the_sharded_states_to_the_host_in_both_plans():
    base = {"method": {"kind": "full"}, "precision": "bf16-mixed"}
    on = tiny(**base, parallel={"strategy": "fsdp", "devices": 4, "cpu_offload": True})
    off = tiny(**base, parallel={"strategy": "fsdp", "devices": 4})
    raw = traced(on)  # the trace is of one device: the same for both
    a_on = analytic_plan(on, resolve_arch(on), "cuda")
    a_off = analytic_plan(off, resolve_arch(off), "cuda")
    for with_offload, without in ((a_on, a_off), (plan_of(on, raw), plan_of(off, raw))):
        buffers = raw.model.buffer_bytes if with_offload.fidelity == "trace" else 0
        for ph in with_offload.phases:  # buffers (rotary tables) are not offloaded
            assert (ph.weights_bytes, ph.master_weights_bytes, ph.gradients_bytes,
                    ph.optimizer_bytes) == (min(buffers, ph.weights_bytes), 0, 0, 0), \
                (with_offload.fidelity, ph.name)
            assert ph.weights_bytes <= buffers
        assert with_offload.per_device.allocated_peak_bytes < \
            without.per_device.allocated_peak_bytes
        note = next(a for a in with_offload.assumptions if a.startswith("cpu_offload"))
        assert "host memory" in note and "per rank" in note


@pytest.mark.slow
def test_torchtunes_levers_are_modelled_in_both_plans_and_refused_where_they_cannot_work(
        tmp_path):
    from tunepilot.errors import SpecError
    from tunepilot.pilot.prepare import without_modelled_levers

    cfg = dict(resolve_model_config(tiny()), num_hidden_layers=6)  # offloading keeps 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = {"model": {"config": str(tmp_path / "config.json")}, "method": {"kind": "full"},
            "precision": "bf16-true", "activation_checkpointing": "full", "micro_batch_size": 8}
    plain = tiny(**base)
    levers = tiny(**base, optimizer_in_backward=True, activation_offloading=True)
    arch = resolve_arch(plain)
    raw = traced(plain)  # the trace runs the plain step; the levers are modelled on top
    for p0, p1 in ((analytic_plan(plain, arch, "cuda"), analytic_plan(levers, arch, "cuda")),
                   (plan_of(plain, raw), traced_plan_from(levers, raw, analytic_plan(
                       levers, arch, "cuda"), "cuda", arch))):
        g0 = max(ph.gradients_bytes for ph in p0.phases)
        g1 = max(ph.gradients_bytes for ph in p1.phases)
        assert 0 < g1 < g0  # at most the largest parameter's gradient
        a0 = next(ph.activations_bytes for ph in p0.phases if ph.name.startswith("forward"))
        a1 = next(ph.activations_bytes for ph in p1.phases if ph.name.startswith("forward"))
        assert a1 < a0
        assert sum("MODELLED" in a and ("optimizer_in_backward" in a or
                                        "activation_offloading" in a)
                   for a in p1.assumptions) == 2
    with pytest.raises(SpecError, match="gradient_accumulation_steps"):
        tiny(optimizer_in_backward=True, gradient_accumulation_steps=4)
    with pytest.raises(SpecError, match="fp16-mixed"):
        tiny(optimizer_in_backward=True, precision="fp16-mixed")
    run, notes = without_modelled_levers(levers)
    assert not run.optimizer_in_backward and not run.activation_offloading
    assert len(notes) == 2 and all("not measured here" in n for n in notes)


@pytest.mark.slow
def test_a_python_gelu_saves_more_in_transformers_than_the_fused_gelu_other_code_calls(
        tmp_path):
    """Phi's gelu_new is Python elementwise ops in transformers (tanh out, 0.5x, 1+tanh saved
    per layer); LitGPT calls the fused tanh GELU. The analytic plan and the trace agree on
    the difference: the trace swaps the modules for the other implementations."""
    cfg = {"model_type": "phi", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 512,
           "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
           "max_position_embeddings": 256, "hidden_act": "gelu_new"}
    (tmp_path / "phi.json").write_text(json.dumps(cfg))
    plans = {}
    for impl in ("transformers", "torchtune"):  # torchtune: same loss, fused GELU
        spec = tiny(model={"config": str(tmp_path / "phi.json"), "implementation": impl},
                    method={"kind": "full"}, precision="bf16-true")
        raw = traced(spec)
        fwd = next(p for p in raw.phases if p.name == "forward").activations_bytes
        arch = resolve_arch(spec)
        a = next(ph for ph in analytic_plan(spec, arch, "cuda").phases
                 if ph.name == "forward-end").activations_bytes
        plans[impl] = (fwd, a, raw.notes)
    tokens = 4 * 128
    extra = 3 * 2 * 256 * tokens * 2  # 3 intermediate-sized bf16 tensors x 2 layers
    traced_diff = plans["transformers"][0] - plans["torchtune"][0]
    analytic_diff = plans["transformers"][1] - plans["torchtune"][1]
    assert analytic_diff == extra
    assert abs(traced_diff - extra) <= 0.1 * extra, (traced_diff, extra)
    assert any("fused tanh GELU" in n for n in plans["torchtune"][2])


@pytest.mark.slow
@pytest.mark.parametrize("method", [{"kind": "full"}, {"kind": "lora", "lora_rank": 4}])
def test_sequence_classification_traces_with_the_score_head_the_analytic_plan_counts(method):
    """AutoModelForSequenceClassification: no vocabulary lm_head, a num_labels score head
    (trained under LoRA: PEFT's SEQ_CLS); traced, not a fallback; the counts agree exactly."""
    spec = tiny(model={"preset": "tiny", "task": "sequence-classification", "num_labels": 3},
                method=method)
    causal = tiny(method=method)
    plan = make_plan(spec, "traced", card_ids=["h100"])
    assert plan.fidelity == "trace" and plan.trace["status"] == "traced"
    analytic = analytic_plan(spec, resolve_arch(spec), "cuda")
    assert plan.params == analytic.params
    assert plan.params.total < analytic_plan(causal, resolve_arch(causal), "cuda").params.total
    if method["kind"] == "lora":
        assert plan.params.trainable > analytic_plan(
            causal, resolve_arch(causal), "cuda").params.trainable  # + the score head
