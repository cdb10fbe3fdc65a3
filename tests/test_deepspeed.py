"""DeepSpeed ZeRO as a strategy, and tensor / sequence / context parallel: imported from the
user's ds_config, planned per rank with the states each stage shards, its collectives for the
time model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunepilot.errors import SpecError, UserError
from tunepilot.integrations.importers import ImportOptions, import_config
from tunepilot.model.arch import resolve_arch
from tunepilot.plan.analytic.collectives import collectives
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.spec import spec_from_dict
from tunepilot.units import fmt_bytes

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
DS = CONFIGS / "deepspeed"


def _llamafactory(tmp_path, ds) -> dict:
    raw = yaml.safe_load((CONFIGS / "llamafactory-llama3-lora-sft.yaml").read_text())
    raw["deepspeed"] = ds
    raw["finetuning_type"] = "full"
    p = tmp_path / "lf.yaml"
    p.write_text(yaml.safe_dump(raw))
    return import_config(p, options=ImportOptions(synthetic_data=True, devices=8))


def test_llamafactory_zero2_config_is_deepspeed_stage_2_not_ddp(tmp_path):
    (tmp_path / "ds_z2_config.json").write_text((DS / "ds_z2_config.json").read_text())
    r = _llamafactory(tmp_path, "ds_z2_config.json")
    par = r.spec.parallel
    assert par.strategy == "deepspeed" and par.deepspeed.stage == 2
    assert par.deepspeed.reduce_bucket_size == 500_000_000  # 5e8 in the JSON
    assert par.deepspeed.overlap_comm is False
    assert r.mapped["deepspeed"] == "parallel.deepspeed"
    assert not any("DDP" in n for n in r.notes)


def test_axolotl_zero3_keeps_auto_buckets_and_hf_args_read_offload_inline(tmp_path):
    raw = yaml.safe_load((CONFIGS / "axolotl-lora-8b.yml").read_text())
    raw["deepspeed"] = str(DS / "ds_z3_config.json")
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump(raw))
    ds = import_config(p, options=ImportOptions(synthetic_data=True)).spec.parallel.deepspeed
    assert ds.stage == 3 and ds.reduce_bucket_size == "auto"
    assert ds.stage3_max_live_parameters == 1_000_000_000
    assert ds.elements("reduce_bucket_size", 4096) == 4096 * 4096  # HF's auto: h x h

    body = json.loads((CONFIGS / "hf-training-args.json").read_text())
    body.pop("fsdp")
    body["deepspeed"] = json.loads((DS / "ds_z3_offload_config.json").read_text())
    p = tmp_path / "args.json"
    p.write_text(json.dumps(body))
    ds = import_config(p, options=ImportOptions(synthetic_data=True)).spec.parallel.deepspeed
    assert (ds.stage, ds.offload_optimizer, ds.offload_param) == (3, "cpu", "cpu")


def test_an_unreadable_ds_config_takes_the_stage_its_name_says_and_says_so(tmp_path):
    r = _llamafactory(tmp_path, "examples/deepspeed/ds_z3_config.json")
    assert r.spec.parallel.deepspeed.stage == 3
    assert any("file name" in n for n in r.notes)


@pytest.mark.parametrize("zero,word", [({"stage": 5}, "stage"),
                                        ({"stage": 2, "reduce_bucket_size": "lots"},
                                         "reduce_bucket_size"),
                                        ({"stage": 3, "offload_param": {"device": "disk"}},
                                         "offload_param")])
def test_a_bad_ds_config_value_is_refused_naming_it(tmp_path, zero, word):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero}))
    with pytest.raises(UserError) as e:
        _llamafactory(tmp_path, "ds.json")
    assert word in str(e.value)


def _plan(par: dict, kind: str = "full", **fields):
    spec = spec_from_dict({"model": {"preset": "llama-3.2-1b"}, "method": {"kind": kind},
                           "sequence_length": 1024, "activation_checkpointing": "full",
                           "parallel": par, **fields})
    return spec, analytic_plan(spec, resolve_arch(spec))


def test_each_zero_stage_shards_its_states_per_rank():
    plans = [_plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": stage}})[1]
             for stage in (0, 1, 2, 3)]
    d0, d1, d2, d3 = (p.per_device for p in plans)
    n = plans[0].params.total
    # stage 0 under bf16 is DeepSpeed's BF16_Optimizer: an fp32 gradient buffer whole, the fp32
    # master weights and optimizer state 1/8 - as stage 1, whose gradients are 16-bit
    assert d0.gradients_bytes == 4 * n and d1.gradients_bytes == 2 * n
    assert d1.master_weights_bytes == d0.master_weights_bytes == 4 * n // 8
    assert d1.optimizer_bytes == d0.optimizer_bytes
    # stage 2: + gradients 1/8; stage 3: + the 16-bit weights (about 1/8: norms kept whole)
    assert d2.gradients_bytes == d1.gradients_bytes // 8
    assert d2.weights_bytes == d0.weights_bytes
    assert d0.weights_bytes / 8 <= d3.weights_bytes < d0.weights_bytes / 7
    # DeepSpeed's engine holds the module in bf16: weights are 2 B per parameter
    assert d0.weights_bytes == 2 * plans[0].params.total
    assert d0.allocated_peak_bytes > d1.allocated_peak_bytes > d2.allocated_peak_bytes \
        > d3.allocated_peak_bytes


def test_zero_offload_leaves_only_the_working_set_on_the_device():
    _, on = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 3}})
    _, off = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {
        "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}})
    assert off.per_device.optimizer_bytes == off.per_device.master_weights_bytes == 0
    assert off.per_device.allocated_peak_bytes < on.per_device.allocated_peak_bytes
    assert any("offload_optimizer cpu" in n for n in off.assumptions)
    # the host plan holds what left the device
    from tunepilot.plan.api import make_plan

    spec = spec_from_dict({"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
                           "parallel": {"strategy": "deepspeed", "devices": 8, "deepspeed": {
                               "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}})
    host = {c.name: c for c in make_plan(spec, card_ids=["h100-sxm-80gb"]).host.components}
    n = off.params.total
    assert 12 * n // 8 < host["zero offload"].bytes_per_rank < 20 * n // 8  # ~16 B/param / 8


def test_deepspeed_settings_need_the_deepspeed_strategy_and_stage_3_for_param_offload():
    with pytest.raises(SpecError, match="strategy"):
        spec_from_dict({"model": {"preset": "tiny"}, "parallel": {
            "strategy": "ddp", "devices": 2, "deepspeed": {"stage": 3}}})
    with pytest.raises(SpecError, match="stage 3"):
        spec_from_dict({"model": {"preset": "tiny"}, "parallel": {
            "strategy": "deepspeed", "devices": 2, "deepspeed": {"stage": 2,
                                                                 "offload_param": "cpu"}}})


def test_tensor_parallel_splits_the_states_and_sequence_parallel_the_activations():
    _, one = _plan({"strategy": "ddp", "devices": 2})
    _, tp = _plan({"strategy": "ddp", "devices": 8, "tensor": 4})
    _, sp = _plan({"strategy": "ddp", "devices": 8, "tensor": 4, "sequence_parallel": True})
    # each of 4 tensor ranks holds about a quarter of the model (norms whole)
    ratio = tp.per_device.master_weights_bytes / one.per_device.master_weights_bytes
    assert 0.25 <= ratio < 0.26
    assert sp.per_device.activations_bytes < tp.per_device.activations_bytes
    assert tp.tokens_per_optimizer_step == one.tokens_per_optimizer_step  # dp = 2 in both


def test_context_parallel_divides_the_tokens_and_refuses_an_uneven_split():
    _, one = _plan({"strategy": "fsdp", "devices": 2})
    _, cp = _plan({"strategy": "fsdp", "devices": 4, "context": 2})
    assert cp.per_device.activations_bytes < one.per_device.activations_bytes
    with pytest.raises(SpecError, match="context 4"):
        spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 1022, "parallel": {
            "strategy": "fsdp", "devices": 4, "context": 4}})
    with pytest.raises(SpecError, match="divide"):
        spec_from_dict({"model": {"preset": "tiny"}, "parallel": {
            "strategy": "ddp", "devices": 6, "tensor": 4}})


def test_the_time_model_reads_each_strategys_collectives():
    spec, _ = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 3}})
    arch = resolve_arch(spec)
    ops = {(c.op, c.group) for c in collectives(spec, arch)}
    assert ops == {("reduce-scatter", "data"), ("all-gather", "data")}
    gather = next(c for c in collectives(spec, arch) if c.op == "all-gather")
    assert gather.calls_per_step == 2  # forward and backward, one micro-batch
    spec, _ = _plan({"strategy": "ddp", "devices": 8, "tensor": 2, "context": 2,
                     "sequence_parallel": True})
    groups = {c.group for c in collectives(spec, arch)}
    assert groups == {"data", "tensor", "context"}
    single, _ = _plan({"strategy": "single"})
    assert collectives(single, arch) == []


@pytest.mark.slow
@pytest.mark.parametrize("par", [
    {"strategy": "deepspeed", "devices": 4, "deepspeed": {"stage": 3}},
    {"strategy": "ddp", "devices": 4, "tensor": 2, "context": 2},
])
def test_the_trace_plans_one_rank_and_says_how(par):
    from tunepilot.plan.api import make_plan

    spec = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                           "sequence_length": 256, "parallel": par})
    plan = make_plan(spec, "traced", card_ids=["h100-sxm-80gb"])
    assert plan.fidelity == "trace", plan.assumptions[0]
    analytic = analytic_plan(spec, resolve_arch(spec))
    if par["strategy"] == "deepspeed":
        assert any("does not run on fake tensors" in n for n in plan.assumptions)
        # the traced rank holds ZeRO-3's shard of the 16-bit weights, as the analytic rank
        assert plan.per_device.weights_bytes == pytest.approx(
            analytic.per_device.weights_bytes, rel=0.1)
    else:
        assert any("1/2 slice" in n for n in plan.assumptions)
        assert plan.per_device.master_weights_bytes == pytest.approx(
            analytic.per_device.master_weights_bytes, rel=0.1)


# ------------------------------------------------------------------ 4-bit and paged optimizers


def test_torchao_4bit_and_8bit_states_are_planned_by_their_blocks():
    from tunepilot.model.optimizers import quantized_state_bytes, speed_factor

    shapes = [(4096, 4096), (8, 4096), (4000,), (100, 33)]  # the last two stay unquantized
    four = quantized_state_bytes("adamw_4bit", shapes, 4)
    n = 4096 * 4096 + 8 * 4096
    assert four == 2 * (n // 2 + 4 * n // 128) + 2 * 4 * (4000 + 3300)
    eight_bnb = quantized_state_bytes("adamw_8bit", shapes, 2)  # bnb: small tensors in fp32
    eight_ao = quantized_state_bytes("adamw_8bit_torchao", shapes, 2)  # torchao: param dtype
    assert eight_bnb - eight_ao == 2 * (4 - 2) * (4000 + 3300)
    assert speed_factor("adamw_4bit") < 1.0 == speed_factor("adamw")

    spec = spec_from_dict({"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
                           "precision": "bf16-true", "optimizer": {"name": "adamw_4bit"}})
    p = analytic_plan(spec, resolve_arch(spec))
    params = p.params.trainable
    assert 1.0 < p.per_device.optimizer_bytes / params < 1.2  # ~1.06 B/param, not AdamW's 4
    assert any("torchao.optim.AdamW4bit" in n for n in p.assumptions)


@pytest.mark.slow
def test_the_trace_holds_the_same_quantized_state_as_the_plan():
    from tunepilot.plan.api import make_plan

    spec = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                           "precision": "bf16-true", "optimizer": {"name": "adamw_4bit"},
                           "sequence_length": 128})
    traced = make_plan(spec, "traced", card_ids=["h100-sxm-80gb"])
    analytic = analytic_plan(spec, resolve_arch(spec))
    assert traced.fidelity == "trace"
    assert traced.per_device.optimizer_bytes == pytest.approx(
        analytic.per_device.optimizer_bytes, rel=0.05)


# ------------------------------------------------------------------ DeepSpeed itself


def test_the_ds_config_deepspeed_runs_is_the_specs():
    pytest.importorskip("torch")
    from tunepilot.training.deepspeed import ds_config

    spec = spec_from_dict({"model": {"preset": "tiny"}, "micro_batch_size": 2,
                           "gradient_accumulation_steps": 4, "parallel": {
                               "strategy": "deepspeed", "devices": 2, "deepspeed": {
                                   "stage": 3, "offload_optimizer": "cpu",
                                   "reduce_bucket_size": "auto"}}})
    conf = ds_config(spec)
    zero = conf["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True  # DeepSpeed's stage-3 default
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "reduce_bucket_size" not in zero  # "auto" is the HF integration's, not DeepSpeed's
    assert conf["bf16"]["enabled"] and not conf["fp16"]["enabled"]
    assert (conf["train_micro_batch_size_per_gpu"], conf["gradient_accumulation_steps"]) == (2, 4)


@pytest.mark.gpu
def test_deepspeed_itself_runs_where_it_is_installed_and_a_gpu_is_at_hand():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "deepspeed_check.py")],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("skipped:"):
        pytest.skip(out.stdout.strip())
    assert "ZeRO-3 allocated" in out.stdout


def test_a_pure_bf16_config_under_deepspeed_imports_as_the_engines_bf16_mixed(tmp_path):
    """DeepSpeed's bf16 engine keeps an fp32 master copy and fp32 optimizer state in the ZeRO
    optimizer whatever the model was loaded in: bf16-true would plan the module in 32 bit (the
    ZeRO rules read it as not mixed) and the optimizer state in bf16."""
    raw = yaml.safe_load((CONFIGS / "axolotl-lora-8b.yml").read_text())
    raw.pop("adapter", None)  # a full fine-tune: axolotl's bf16 is bf16-true
    raw["deepspeed"] = str(DS / "ds_z3_config.json")
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump(raw))
    r = import_config(p, options=ImportOptions(synthetic_data=True))
    assert r.spec.method.kind == "full" and r.spec.precision == r.spec.precision.deepspeed_engine
    assert r.spec.precision.mixed
    assert any("not bf16-true" in n for n in r.notes)


def test_a_bf16_true_deepspeed_spec_is_refused_naming_precision():
    spec = spec_from_dict({"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
                           "precision": "bf16-true", "parallel": {
                               "strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 2}}})
    with pytest.raises(SpecError, match="bf16-mixed for a deepspeed run") as e:
        analytic_plan(spec, resolve_arch(spec))
    assert e.value.field == "precision"


@pytest.mark.slow
def test_zero_keeps_a_quantized_optimizers_state_at_its_own_width():
    """Under ZeRO the traced 16-bit step's optimizer state becomes the fp32 master's - for
    torch's AdamW (moments in the parameters' dtype), not for 8-bit codes and their fp32
    scales, which are the same on either: the trace doubled them (shisa-ai's Qwen3-30B-A3B on
    8 x MI300X: 14.4 GiB of torchao 8-bit state per rank where the plan has 7.2)."""
    from tunepilot.plan.api import make_plan

    for name in ("adamw_8bit_torchao", "adamw"):
        spec = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                               "sequence_length": 128, "optimizer": {"name": name},
                               "parallel": {"strategy": "deepspeed", "devices": 4,
                                            "deepspeed": {"stage": 3}}})
        traced = make_plan(spec, "traced", card_ids=["h100-sxm-80gb"])
        analytic = analytic_plan(spec, resolve_arch(spec))
        assert traced.fidelity == "trace"
        assert traced.per_device.optimizer_bytes == pytest.approx(
            analytic.per_device.optimizer_bytes, rel=0.15), name


def _phase(plan, name: str):
    return next(p for p in plan.phases if p.name == name)


def test_zero3_keeps_its_gradient_partition_through_the_forward():
    # stage3.py allocates grad_partitions_flat_buffer once (zeros at init) and keeps it: the
    # rank's 16-bit gradient partition is there in the forward of every step, even without
    # gradient accumulation; stage 2's partition is made in the backward
    _, z3 = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 3}})
    _, z2 = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 2}})
    assert _phase(z3, "forward-end").gradients_bytes == z3.per_device.gradients_bytes > 0
    assert _phase(z2, "forward-end").gradients_bytes == 0


def test_zero3_gathers_the_module_computing_even_with_no_live_parameters_allowed():
    # fetch_sub_module gathers the module about to run whatever stage3_max_live_parameters says;
    # the limit bounds the prefetch and what stays gathered besides it
    from tunepilot.plan.analytic.parallel import largest_module

    spec, plan = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {
        "stage": 3, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}})
    arch = resolve_arch(spec)
    from tunepilot.model.arch import param_counts

    module = largest_module(arch, param_counts(arch))
    assert module == arch.vocab_size * arch.hidden_size  # the embedding
    assert any(f"up to {fmt_bytes(2 * module)} of gathered" in n for n in plan.assumptions)
    assert _phase(plan, "forward-end").temporary_bytes >= 2 * module


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_traced_zero_backward_peaks_with_its_checkpoints_not_its_gradients(stage):
    # the traced single-device step piles up every gradient and peaks at the backward's end,
    # its checkpoints gone; ZeRO-2/3 reduce each gradient into the partition as it is made and
    # stage 0 under bf16 keeps one fp32 buffer from the start, so the rank's backward peaks at
    # the start, every checkpoint alive (a parameter-heavy step)
    from tunepilot.plan.api import make_plan
    from tunepilot.plan.trace.core import grads_made_and_gone

    def traced(par):
        spec = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                               "sequence_length": 32, "activation_checkpointing": "full",
                               "parallel": par})
        plan = make_plan(spec, "traced", card_ids=["h100-sxm-80gb"])
        assert plan.fidelity == "trace", plan.assumptions[0]
        return plan

    single = traced({"strategy": "single"})
    zero = traced({"strategy": "deepspeed", "devices": 4, "deepspeed": {"stage": stage}})
    assert _phase(single, "backward").activations_bytes < \
        0.1 * _phase(single, "forward").activations_bytes
    assert _phase(zero, "backward").activations_bytes > \
        0.9 * _phase(zero, "forward").activations_bytes
    why = grads_made_and_gone(spec_from_dict({"model": {"preset": "tiny"}, "parallel": {
        "strategy": "deepspeed", "devices": 4, "deepspeed": {"stage": stage}}}))
    assert why and why in zero.assumptions


def test_megatron_optimizer_holds_six_plus_twelve_over_d_bytes_per_parameter():
    # Megatron Core docs (Distributed Optimizer): bf16 parameters with fp32 gradients hold
    # 6 + 12/d bytes per parameter with the distributed optimizer - the fp32 main-grad buffer
    # whole on every rank and kept between steps, fp32 main parameters and Adam state sharded
    par = {"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 1}}
    spec, mg = _plan(par, precision="bf16-mixed",
                     model={"preset": "llama-3.2-1b", "implementation": "megatron"})
    _, ds = _plan(par, precision="bf16-mixed")
    n, d = mg.params.total, mg.per_device
    states = d.weights_bytes + d.gradients_bytes + d.master_weights_bytes + d.optimizer_bytes
    assert states == pytest.approx(n * (6 + 12 / 8), rel=1e-3)
    assert d.gradients_bytes == 4 * n == 2 * ds.per_device.gradients_bytes
    assert _phase(mg, "forward-end").gradients_bytes == 4 * n  # kept, unlike ZeRO-1's
    assert _phase(ds, "forward-end").gradients_bytes == 0
    # its optimizer steps on the buffer's shard: no fp32 gradient copy at the step
    assert _phase(mg, "optimizer-step").temporary_bytes < \
        _phase(ds, "optimizer-step").temporary_bytes
    assert any("Megatron-LM's distributed optimizer" in a for a in mg.assumptions)
    # and reduces them in fp32 (accumulate_allreduce_grads_in_fp32): twice ZeRO-1's bytes
    def scatter(s):
        arch = resolve_arch(s)
        return next(c for c in collectives(s, arch) if c.op == "reduce-scatter")
    zero1 = _plan(par, precision="bf16-mixed")[0]
    assert scatter(spec).bytes_per_call == 2 * scatter(zero1).bytes_per_call


def test_megatron_with_a_zero_stage_that_shards_gradients_is_refused():
    with pytest.raises(SpecError, match="parallel.deepspeed.stage") as e:
        _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 2}},
              model={"preset": "llama-3.2-1b", "implementation": "megatron"})
    assert "stage: 1" in str(e.value)


def test_sequence_parallel_is_traced_as_the_tensor_slice_over_the_whole_sequence():
    # the trace runs the rank's tensor slice (heads, MLP, vocabulary / t) without sequence
    # parallel, over every token; the hidden-sized saves are then split by the analytic ratio.
    # Tracing the slice over 1/t of the tokens as well divided the sliced saves twice
    from tunepilot.plan.trace.parallel import sequence_parallel_share, trace_target

    par = {"strategy": "ddp", "devices": 8, "tensor": 4, "sequence_parallel": True}
    spec, _ = _plan(par)
    arch = resolve_arch(spec)
    target, config = trace_target(spec, {"model_type": "llama", "hidden_size": arch.hidden_size,
                                         "num_attention_heads": arch.num_heads,
                                         "num_key_value_heads": arch.num_kv_heads,
                                         "intermediate_size": arch.intermediate_size,
                                         "vocab_size": arch.vocab_size,
                                         "num_hidden_layers": arch.num_layers}, arch)
    assert target.sequence_length == spec.sequence_length
    assert config["hidden_size"] == arch.hidden_size
    assert config["num_attention_heads"] == arch.num_heads // 4
    assert 1 / 4 <= sequence_parallel_share(spec, arch) < 1  # full checkpointing: 1/4


def test_a_gradient_larger_than_the_bucket_stays_whole_until_reduced():
    # ZeRO-2/3 copy each gradient into the reduce bucket as it is made; one larger than the
    # bucket (the LM head's) is reduced from its own tensor, alive in the backward meanwhile
    from types import SimpleNamespace

    from tunepilot.plan.trace.messages import TracedModel
    from tunepilot.plan.trace.parallel import zero_on_trace

    spec, _ = _plan({"strategy": "deepspeed", "devices": 8, "deepspeed": {"stage": 3}})
    arch = resolve_arch(spec)
    head = 2 * arch.vocab_size * arch.hidden_size
    model = TracedModel(total_params=10**9, trainable_params=10**9, trainable_bytes=2 * 10**9,
                        param_rows=[(arch.vocab_size, head, True), (64, 128, False)],
                        layer_numel=1, root_numel=1, total_base_numel=10**9)
    raw = SimpleNamespace(model=model)
    zero = dict(weights=2 * 10**9, master_weights=0, optimizer=0, activations=10**8)
    phases = [dict(zero, name="backward", gradients=2 * 10**9, temporary=10**8),
              dict(zero, name="backward", gradients=0, temporary=10**8, twin=True),
              dict(zero, name="optimizer-step", gradients=2 * 10**9, temporary=0)]
    out, *_ = zero_on_trace(spec, arch, raw, phases)
    assert out[0]["temporary"] - out[1]["temporary"] == head  # the twin made its own then
    stage1 = spec.with_changes(parallel={"strategy": "deepspeed", "devices": 8,
                                         "deepspeed": {"stage": 1}})
    out1, *_ = zero_on_trace(stage1, arch, raw, phases)
    assert out1[0]["temporary"] == out1[1]["temporary"]  # whole gradients: nothing in flight


def test_zero3_steps_one_sub_group_at_a_time_temporaries_included():
    # stage3.py _optimizer_step hands the optimizer one sub_group_size slice of the fp32
    # partition: a foreach AdamW's temporary, like the slice's fp32 gradient, is that slice's
    def step_temp(sub_group: int) -> int:
        _, plan = _plan({"strategy": "deepspeed", "devices": 2,
                         "deepspeed": {"stage": 3, "sub_group_size": sub_group}},
                        optimizer={"name": "adamw", "impl": "foreach"})
        return _phase(plan, "optimizer-step").temporary_bytes

    # Llama-3.2-1B over 2 ranks: a partition of ~0.62e9 elements, stepped whole or in 1e8 slices
    whole, slice_ = step_temp(10**10), step_temp(10**8)
    # fp32 gradient + one fp32 temporary: 8 B per element of the slice
    assert slice_ == pytest.approx(8 * 10**8, rel=0.05)
    assert whole > 5 * slice_


@pytest.mark.parametrize("par", [{"strategy": "deepspeed", "deepspeed": {"stage": 3}},
                                 {"strategy": "fsdp"}])
def test_qlora_quantization_constants_stay_whole_on_every_rank(par):
    from tunepilot.plan.analytic.states import nf4_constants_bytes

    def weights(n):
        spec, plan = _plan(dict(par, devices=n), "qlora")
        return spec, plan.per_device.weights_bytes

    spec, w8 = weights(8)
    w2 = weights(2)[1]
    consts = nf4_constants_bytes(spec, resolve_arch(spec))
    assert consts > 10 * 2**20  # 1/64 B per quantized weight and the nested constants
    # weights(N) = sharded / N + what is whole: the constants (and ZeRO-3's persistent norms)
    whole = w8 - (w2 - w8) / 3
    assert consts - 2**10 < whole < consts + 2**20


def test_zero3_qlora_loads_the_whole_quantized_model_on_every_rank():
    def load(kind, n):
        par = {"strategy": "deepspeed", "devices": n, "deepspeed": {"stage": 3}}
        return _plan(par, kind)[1].per_device.load_peak_bytes

    # zero.Init partitions a 16-bit model as it is built: more ranks, less loaded on each
    assert load("lora", 8) < load("lora", 2)
    # a quantized model is built without it and moved to the device whole before stage 3
    # partitions it: the whole 4-bit model on every rank, however many
    assert load("qlora", 8) == load("qlora", 2) > 2 * 2**30 // 3
