"""The routed experts in the plan against what autograd really saves: a small MoE layer of each
kind runs forward on the CPU under every experts implementation transformers has, and the bytes
its saved tensors hold are the plan's (plan/analytic/moe.py) to the byte. Then the spec's moe
block, the plan's notes and the FLOPs a token is computed through."""

from __future__ import annotations

import pytest

from tunepilot.errors import SpecError
from tunepilot.model.arch import Arch, load_preset, param_counts
from tunepilot.model.flops import expert_pairs_per_token, flops_per_token
from tunepilot.plan.analytic import moe
from tunepilot.plan.analytic.activations import precision_bytes
from tunepilot.spec import spec_from_dict

H, INTER, E, K, T = 64, 32, 8, 2, 256
LAYOUTS = {
    "qwen3_moe": dict(num_experts=E, moe_intermediate_size=INTER, num_experts_per_tok=K,
                      head_dim=16),
    "mixtral": dict(num_local_experts=E, intermediate_size=INTER, num_experts_per_tok=K),
    "gpt_oss": dict(num_local_experts=E, intermediate_size=INTER, num_experts_per_tok=K,
                    head_dim=16),
    "llama4_text": dict(num_local_experts=E, intermediate_size=INTER, num_experts_per_tok=K,
                        head_dim=16),
}
BASE = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
# (precision, method): bf16 weights trained; a frozen bf16 base (LoRA); fp32 weights; fp32
# weights under bf16 autocast (the experts' GEMMs are not autocast ops there)
RUNS = [("bf16-true", "full"), ("bf16-true", "lora"), ("fp32", "full"), ("bf16-mixed", "full")]


def config(model_type: str) -> dict:
    return dict(BASE, model_type=model_type, **LAYOUTS[model_type])


def spec_for(precision: str, method: str, implementation: str, **moe_fields):
    return spec_from_dict({"model": {"preset": "tiny"}, "precision": precision,
                           "method": {"kind": method},
                           "moe": dict(implementation=implementation, **moe_fields)})


def measured_saved_bytes(cfg: dict, spec) -> int:
    """Bytes of the tensors autograd saves inside the MoE block's experts and router (each
    storage once, parameters not counted) in one forward of T tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    body = {k: v for k, v in cfg.items() if k != "model_type"}
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **body)
    dtype = torch.bfloat16 if spec.precision == "bf16-true" or spec.method.is_lora else \
        torch.float32
    torch.manual_seed(0)
    llama4 = cfg["model_type"] == "llama4_text"  # its own experts code: no implementation
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype, **(
        {} if llama4 else {"experts_implementation": spec.moe.implementation}))
    if spec.method.is_lora:  # a frozen base; the embedding trains so activations need grad
        for p in model.parameters():
            p.requires_grad_(False)
        model.get_input_embeddings().weight.requires_grad_(True)
    block = model.model.layers[0].feed_forward if llama4 else model.model.layers[0].mlp
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    if llama4:  # its shared expert is the ordinary MLP arithmetic's, not the routed one's
        block.shared_expert.register_forward_pre_hook(lambda *a: inside.__setitem__(0, False))
        block.shared_expert.register_forward_hook(lambda *a: inside.__setitem__(0, True))
    ids = torch.randint(3, 100, (1, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.precision.mixed):
        model(ids)
    return sum(seen.values())


def planned_saved_bytes(cfg: dict, spec) -> int:
    """The plan's bytes for the same block: the routed part, plus what the router's linear
    saves of the block's input when its weight trains (the activation arithmetic counts that
    input once per layer, with the other matmul inputs) and autocast's cached cast of the
    router weight."""
    arch = Arch.from_config(cfg)
    cb, sb, _ = precision_bytes(spec)
    out = moe.routed_saved_per_token(arch, spec, cb, sb) * T + \
        moe.routed_layer_bytes(arch, spec, cb, sb)
    if spec.method.kind == "full":
        out += cb * H * T  # the router's input (its 16-bit cast under autocast)
        if spec.precision.mixed:
            out += cb * E * H  # autocast's cast of the router weight, saved for its input grad
    return out


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_qwen3_moe_routed_experts_save_what_the_plan_says(implementation, run):
    spec = spec_for(*run, implementation)
    cfg = config("qwen3_moe")
    assert planned_saved_bytes(cfg, spec) == measured_saved_bytes(cfg, spec)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "llama4_text"])
@pytest.mark.parametrize("run", RUNS[:2], ids=["-".join(r) for r in RUNS[:2]])
def test_other_routers_and_gates_save_what_the_plan_says(model_type, run):
    spec = spec_for(*run, "grouped_mm")
    cfg = config(model_type)
    assert planned_saved_bytes(cfg, spec) == measured_saved_bytes(cfg, spec)


# --------------------------------------------------------------------------- the spec and plan

def test_the_moe_block_is_validated_and_leaves_older_spec_hashes_alone():
    plain = spec_from_dict({"model": {"preset": "tiny"}})
    assert spec_from_dict({"model": {"preset": "tiny"}, "moe": {}}).spec_hash() == \
        plain.spec_hash()
    assert spec_for("bf16-mixed", "full", "eager").spec_hash() != plain.spec_hash()
    for bad in ({"capacity_factor": 0}, {"implementation": "loop"}, {"load_factor": 0.5}):
        with pytest.raises(SpecError) as err:
            spec_from_dict({"model": {"preset": "tiny"}, "moe": bad})
        assert (err.value.field or "").startswith("moe."), err.value


def _plan(preset: str, **fields):
    from tunepilot.plan.analytic.core import analytic_plan

    spec = spec_from_dict({"model": {"preset": preset}, "sequence_length": 1024, **fields})
    return analytic_plan(spec, Arch.from_config(load_preset(preset)))


def test_the_plan_says_how_the_experts_run_and_what_that_costs():
    plan = _plan("qwen3-30b-a3b", method={"kind": "full"}, precision="bf16-mixed")
    notes = " ".join(plan.assumptions)
    assert "48 of 48 layers route each token to 8 of 128 experts" in notes
    assert "grouped_mm" in notes and "fp32 weights' dtype" in notes  # no autocast op
    assert "16-bit cast" not in notes  # the eager loop's, not grouped_mm's
    true = _plan("qwen3-30b-a3b", method={"kind": "full"}, precision="bf16-true")
    assert plan.per_device.activations_bytes > true.per_device.activations_bytes
    eager = _plan("qwen3-30b-a3b", method={"kind": "full"}, precision="bf16-mixed",
                  moe={"implementation": "eager"})
    assert "16-bit cast of every expert's weights" in " ".join(eager.assumptions)
    dense = _plan("qwen3-8b", moe={"implementation": "eager"})
    assert "moe: no effect" in " ".join(dense.assumptions)


def test_a_capacity_factor_pads_the_routed_pairs():
    arch = Arch.from_config(load_preset("qwen3-30b-a3b"))
    cb = sb = 2
    base = spec_for("bf16-true", "lora", "grouped_mm")
    padded = spec_for("bf16-true", "lora", "grouped_mm", capacity_factor=1.25)
    assert moe.pairs_per_token(arch, padded) == 10.0
    router = moe.router_saved_per_token(arch, base, cb)
    grown = moe.routed_saved_per_token(arch, padded, cb, sb) - router
    assert grown == pytest.approx(1.25 * (moe.routed_saved_per_token(arch, base, cb, sb)
                                          - router), abs=1)


# --------------------------------------------------------------------------- FLOPs per token

def test_flops_count_the_experts_a_token_is_computed_through():
    qwen = Arch.from_config(load_preset("qwen3-30b-a3b"))
    spec = spec_from_dict({"model": {"preset": "qwen3-30b-a3b"}, "method": {"kind": "full"}})
    counts = param_counts(qwen)
    f = flops_per_token(qwen, spec)
    assert f.trainable_matmul_params == counts.active_per_token - counts.embedding
    padded = spec.with_changes(moe={"capacity_factor": 1.5})
    extra = flops_per_token(qwen, padded).trainable_matmul_params - f.trainable_matmul_params
    assert extra == round(counts.routed_experts * 4 / 128)  # 8 -> 12 pairs of 128 experts
    # transformers' Llama 4 runs every expert on every token: the card computes all 16
    scout = Arch.from_config(load_preset("llama-4-scout-17b-16e"))
    s = spec_from_dict({"model": {"preset": "llama-4-scout-17b-16e"}, "method": {"kind": "full"}})
    c = param_counts(scout)
    assert expert_pairs_per_token(scout, s) == 16
    assert flops_per_token(scout, s).trainable_matmul_params == c.total - c.embedding


# --------------------------------------------------------------------------- expert parallel

def _states(preset: str, **parallel):
    from tunepilot.plan.analytic.core import analytic_plan

    spec = spec_from_dict({"model": {"preset": preset}, "method": {"kind": "full"},
                           "precision": "bf16-true", "sequence_length": 1024,
                           "activation_checkpointing": "full", "parallel": parallel})
    return analytic_plan(spec, Arch.from_config(load_preset(preset))).per_device


def test_expert_parallel_holds_a_ranks_share_of_the_routed_experts():
    counts = param_counts(Arch.from_config(load_preset("qwen3-30b-a3b")))
    ddp = _states("qwen3-30b-a3b", strategy="ddp", devices=8, expert=8)
    assert ddp.weights_bytes == 2 * (counts.total - counts.routed_experts
                                     + counts.routed_experts // 8)
    # FSDP spreads each expert over the ranks holding it: 1/(8/8) x 1/8 of the experts, the
    # same states per rank as FSDP over 8 without expert parallel - and a smaller unsharded layer
    fsdp = _states("qwen3-30b-a3b", strategy="fsdp", devices=8)
    fsdp_ep = _states("qwen3-30b-a3b", strategy="fsdp", devices=8, expert=8)
    assert abs(fsdp_ep.weights_bytes - fsdp.weights_bytes) <= 8
    assert abs(fsdp_ep.optimizer_bytes - fsdp.optimizer_bytes) <= 16


def test_expert_parallel_routes_the_busiest_ranks_share_through_the_all_to_all():
    arch = Arch.from_config(load_preset("qwen3-30b-a3b"))
    spec = spec_from_dict({"model": {"preset": "qwen3-30b-a3b"}, "moe": {"load_factor": 1.5},
                           "parallel": {"strategy": "ddp", "devices": 8, "expert": 4}})
    assert moe.pairs_per_token(arch, spec) == 12.0  # top-8 x 1.5 on the busiest rank
    assert moe.routed_transient(arch, spec, 2, 4096) == 2 * 4096 * 12 * 2048 * 2
    one = spec.with_changes(parallel={"strategy": "ddp", "devices": 8})
    assert moe.pairs_per_token(arch, one) == 8.0 and moe.routed_transient(arch, one, 2, 4096) == 0


def fake_saved_bytes(cfg: dict, spec) -> int:
    """measured_saved_bytes on fake tensors, as the trace runs it: the experts loop's nonzero
    and index tests answered by BalancedRouting (plan/trace/routing.py)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunepilot.plan.trace.routing import balanced_routing
    from tunepilot.plan.trace.standins import to_fake

    body = {k: v for k, v in cfg.items() if k != "model_type"}
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **body)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf, dtype=torch.bfloat16, experts_implementation=spec.moe.implementation)
    notes: list[str] = []
    assert balanced_routing(model, notes) == 1 and "balanced routing" in notes[0]
    fake = FakeTensorMode()
    to_fake(model, fake)
    block = model.model.layers[0].mlp
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st._cdata not in params:
            seen[st._cdata] = max(seen.get(st._cdata, 0), st.nbytes())
        return t

    block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    with fake, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.zeros((1, T), dtype=torch.long))
    return sum(seen.values())


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_a_loop_over_experts_traces_on_fake_tensors_as_a_balanced_router(model_type):
    """transformers' eager experts loop (experts_implementation: eager, as axolotl's gpt-oss
    recipes run it) asks nonzero and ``if expert_idx == num_experts`` of its routing, which fake
    tensors refuse: the trace fell back on those rows. Answered as a balanced router (T k / E = 64 tokens per
    expert here), the fake run saves exactly what a real run on the CPU saves."""
    spec = spec_for("bf16-true", "full", "eager")
    cfg = config(model_type)
    assert fake_saved_bytes(cfg, spec) == measured_saved_bytes(cfg, spec) > 0


def test_the_trace_of_an_expert_parallel_rank_holds_its_share_of_the_experts(tmp_path):
    """The traced plan of a DDP run with expert parallel 2 traced every routed expert on the
    rank (Qwen3-30B-A3B over Megatron EP: +62% against the published peak, where the analytic
    plan's rank holds half): the rank is now traced with half the experts and the same top-k."""
    import json

    from tunepilot.plan.api import make_plan

    cfg = dict(config("qwen3_moe"), num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def plans(expert: int):
        spec = spec_from_dict({"model": {"config": str(tmp_path / "config.json")},
                               "method": {"kind": "full"}, "precision": "bf16-true",
                               "sequence_length": 128,
                               "parallel": {"strategy": "ddp", "devices": 2, "expert": expert}})
        return (make_plan(spec, "analytic", card_ids=["h100"]),
                make_plan(spec, "traced", card_ids=["h100"]))

    (analytic, traced), (analytic1, traced1) = plans(2), plans(1)
    assert traced.trace.get("status") != "fallback", traced.trace
    ours, theirs = traced.per_device.weights_bytes, analytic.per_device.weights_bytes
    assert abs(ours - theirs) <= 0.05 * theirs  # the storages' rounding; a router of E / 2
    left_out = analytic1.per_device.weights_bytes - theirs  # half the routed experts
    assert abs((traced1.per_device.weights_bytes - ours) - left_out) <= 0.05 * left_out
    assert any("expert parallel 2: the rank traced with 1/2" in n for n in traced.assumptions)


def test_qlora_leaves_fused_experts_in_the_base_dtype():
    """bitsandbytes quantizes nn.Linear modules only (transformers' replace_with_bnb_linear):
    transformers >= 5 stores each layer's experts as 3-D parameters, which stay in bf16 under
    QLoRA. The plan counted them as NF4: Qwen3-30B-A3B QLoRA planned with 16.8 GiB of weights
    where the model loads ~56."""
    from tunepilot.model.arch import installed_moe_layout
    from tunepilot.plan.analytic.core import analytic_plan

    arch = Arch.from_config(load_preset("qwen3-30b-a3b"))
    spec = spec_from_dict({"model": {"preset": "qwen3-30b-a3b"}, "method": {"kind": "qlora"}})
    plan = analytic_plan(spec, arch)
    counts = param_counts(arch)
    if installed_moe_layout() != "fused":
        pytest.skip("transformers 4.x: one nn.Linear per expert, which bitsandbytes quantizes")
    assert plan.per_device.weights_bytes >= 2 * counts.routed_experts
    assert any("QLoRA on fused MoE experts" in n for n in plan.assumptions)
    dense = spec_from_dict({"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "qlora"}})
    assert not any("fused MoE" in n for n in analytic_plan(
        dense, Arch.from_config(load_preset("llama-3.1-8b"))).assumptions)


@pytest.mark.parametrize("preset,e", [("qwen3-30b-a3b", 4), ("deepseek-v3", 8),
                                      ("deepseek-v3", 64), ("mixtral-8x7b", 2)])
def test_an_expert_parallel_ranks_traced_config_holds_its_share_of_the_experts(preset, e):
    """The config the trace builds for one expert-parallel rank: 1/e of the routed experts, the
    same top-k where the rank holds that many, DeepSeek's routing groups within them."""
    from tunepilot.plan.trace.parallel import expert_config

    cfg = load_preset(preset)
    arch, rank = Arch.from_config(cfg), Arch.from_config(expert_config(cfg, e))
    assert rank.num_experts == arch.num_experts // e
    assert rank.experts_per_token == min(arch.experts_per_token, rank.num_experts)
    sliced = expert_slice_counts(arch, e)
    assert param_counts(rank).routed_experts == sliced
    out = expert_config(cfg, e)
    if "n_group" in out:
        assert rank.num_experts % out["n_group"] == 0 and out["topk_group"] <= out["n_group"]


def expert_slice_counts(arch: Arch, e: int) -> int:
    from tunepilot.model.arch import expert_slice

    return param_counts(expert_slice(arch, e)).routed_experts


def test_a_linearized_checkpoint_counts_and_quantizes_its_experts_as_linears(tmp_path):
    """axolotl's linearized Llama 4 (moe.experts_layout per_expert): the same parameters, each
    expert's gate/up/down an nn.Linear - the model built counts them as the rules do, QLoRA
    quantizes them (transformers' fused experts stay bf16), a target gate_proj reaches only
    the shared expert's, and a model type with no such checkpoint is refused by name."""
    import json

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tunepilot.model.arch import resolve_arch
    from tunepilot.model.build import build_model
    from tunepilot.plan.analytic.core import analytic_plan

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(config("llama4_text"), intermediate_size=512)))

    def spec(layout: str, **more):
        return spec_from_dict({"model": {"config": str(path)}, "moe": {"experts_layout": layout},
                               "method": {"kind": "qlora", "lora_targets": ["gate_proj"]},
                               **more})

    fused, linear = spec("fused"), spec("per_expert")
    a_fused, a_linear = resolve_arch(fused), resolve_arch(linear)
    assert param_counts(a_linear).total == param_counts(a_fused).total
    model = build_model(linear.with_changes(method={"kind": "full"}))
    experts = model.model.layers[0].feed_forward.experts
    assert len(experts.gate_projs) == E and isinstance(experts.down_projs[0], torch.nn.Linear)
    assert sum(p.numel() for p in model.parameters()) == param_counts(a_linear).total
    w_fused = analytic_plan(fused, a_fused).per_device.weights_bytes
    w_linear = analytic_plan(linear, a_linear).per_device.weights_bytes
    routed = param_counts(a_linear).routed_experts
    assert w_fused - w_linear > routed  # 2 B -> ~0.5 B per routed parameter
    lora = build_model(linear.with_changes(method={"kind": "lora", "lora_targets": ["gate_proj"]}))
    wrapped = {n.rsplit(".", 1)[0] for n, _ in lora.named_parameters() if "lora_A" in n}
    assert wrapped and all("shared_expert.gate_proj" in n for n in wrapped)
    from tunepilot.model.arch import resolve_model_config
    from tunepilot.plan.trace.step import trace_step

    traced = {s.moe.experts_layout: max(p.weights_bytes for p in trace_step(
        s, resolve_model_config(s), "cuda").phases) for s in (fused, linear)}
    assert traced["fused"] - traced["per_expert"] > routed  # the trace quantizes them too
    with pytest.raises(SpecError) as err:
        resolve_arch(spec_from_dict({"model": {"preset": "qwen3-30b-a3b"},
                                     "moe": {"experts_layout": "per_expert"}}))
    assert err.value.field == "moe.experts_layout"
