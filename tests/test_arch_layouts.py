"""Every layout rule against transformers' meta-device model: the named architectures of issue 38
from local config.json files (tests/data/configs, sources in SOURCES.yaml), a small config of
every model_type tunepilot counts with each feature switched on, LoRA on MoE experts and vision
towers against PEFT, and the configs the rules refuse (naming the key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunepilot.errors import SpecError
from tunepilot.model.arch import (
    Arch,
    lora_param_count,
    param_counts,
    parameter_shapes,
    supported_model_types,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.meta_models import (  # noqa: E402
    assert_linear_modules_match,
    meta_model,
    peft_trainable,
    torch_param_count,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::RuntimeWarning")

CONFIGS = Path(__file__).parent / "data" / "configs"


def fixture(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def assert_counts_like_transformers(cfg: dict) -> Arch:
    arch = Arch.from_config(cfg)
    model = meta_model(cfg)
    counts = param_counts(arch)
    assert counts.total == torch_param_count(model)
    positions = arch.num_position_embeddings * arch.hidden_size  # GPT-2's learned positions
    assert counts.embedding == model.get_input_embeddings().weight.numel() + positions
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == arch.tied_embeddings
    assert_linear_modules_match(arch, model)
    shapes = parameter_shapes(arch)  # the per-tensor view counts the same parameters
    assert sum(_numel(s) for s in shapes) == counts.total
    return arch


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --------------------------------------------------------------------------- issue 38's models

# (fixture, total transformers 5.25 builds, active per token, the model card's figure)
NAMED = {
    "Apertus-8B": (8_053_338_176, 8_053_338_176, 8.05e9),
    "Olmo-3-7B": (7_298_011_136, 7_298_011_136, 7.3e9),
    "Qwen3-30B-A3B": (30_532_122_624, 3_353_032_704, 30.5e9),
    "Llama-4-Scout-17B-16E": (107_769_861_120, 17_172_894_720, 17.2e9),
    "gpt-oss-20b": (20_914_757_184, 4_187_440_704, 20.91e9),
    "DeepSeek-V2-Lite": (15_706_484_224, 2_661_150_208, 15.7e9),
}


@pytest.mark.slow
def test_apertus_counts_exactly_non_gated_xielu_and_qk_norms():
    arch = assert_counts_like_transformers(fixture("Apertus-8B"))
    assert param_counts(arch).total == NAMED["Apertus-8B"][0]  # was 10.95B planned as Llama
    assert arch.mlp_kind == "plain" and arch.hidden_act == "xielu"
    assert {s.name for s in arch.decoder} == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                             "down_proj"}


def test_olmo3_counts_exactly_post_norms_full_qk_norms_and_sliding_layers():
    arch = assert_counts_like_transformers(fixture("Olmo-3-7B"))
    assert param_counts(arch).total == NAMED["Olmo-3-7B"][0]
    assert (arch.sliding_window, arch.num_sliding_layers) == (4096, 24)  # 3 of every 4


def test_qwen3_moe_counts_exactly_and_activates_top_8_of_128():
    arch = assert_counts_like_transformers(fixture("Qwen3-30B-A3B"))
    counts = param_counts(arch)
    assert (counts.total, counts.active_per_token) == NAMED["Qwen3-30B-A3B"][:2]
    assert (arch.num_experts, arch.experts_per_token, arch.num_moe_layers) == (128, 8, 48)
    # the card: 30.5B total, 3.3B activated, 29.9B non-embedding
    assert round(counts.total / 1e9, 1) == 30.5 and 3.3e9 <= counts.active_per_token < 3.4e9
    assert round((counts.total - counts.embedding - counts.lm_head) / 1e9, 1) == 29.9


def test_llama4_counts_exactly_shared_expert_router_module_and_text_model_only():
    arch = assert_counts_like_transformers(fixture("Llama-4-Scout-17B-16E"))
    counts = param_counts(arch)
    assert (counts.total, counts.active_per_token) == NAMED["Llama-4-Scout-17B-16E"][:2]
    assert (arch.num_shared_experts, arch.experts_per_token, arch.num_experts) == (1, 1, 16)
    router = next(s for s in arch.decoder if s.name == "router")
    assert router.peft_kind == "module"  # Llama4Router is an nn.Linear: all-linear wraps it
    assert round(counts.active_per_token / 1e9) == 17  # "17B active"


def test_gpt_oss_counts_exactly_expert_and_router_biases_and_sinks():
    arch = assert_counts_like_transformers(fixture("gpt-oss-20b"))
    counts = param_counts(arch)
    assert (counts.total, counts.active_per_token) == NAMED["gpt-oss-20b"][:2]
    # the model card counts the unembedding but not the embedding: 3.61B active
    assert round((counts.active_per_token - counts.embedding) / 1e9, 2) == 3.61
    experts = [s for s in arch.decoder if s.routed]
    assert all(s.has_bias and s.transposed for s in experts)
    assert (arch.sliding_window, arch.num_sliding_layers) == (128, 12)


def test_deepseek_mla_and_shared_experts_count_exactly():
    arch = assert_counts_like_transformers(fixture("DeepSeek-V2-Lite"))
    counts = param_counts(arch)
    assert (counts.total, counts.active_per_token) == NAMED["DeepSeek-V2-Lite"][:2]
    # 2.4B activated (README): the active count without the embedding lookup
    assert 2.4e9 <= counts.active_per_token - counts.embedding < 2.5e9
    assert (arch.num_moe_layers, arch.num_shared_experts, arch.shared_intermediate_size) == (
        26, 2, 2 * 1408)
    assert arch.dense_intermediate_size == 10944 and arch.head_dim == 192  # 128 nope + 64 rope
    assert arch.mlp_width_per_token == round((26 * (6 * 1408 + 2816) + 10944) / 27)


# --------------------------------------------------------------------------- every layout rule

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
              vision_use_head=False)
LAYOUTS = {
    "llama": dict(attention_bias=True, mlp_bias=True, head_dim=24),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "granite": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(attention_bias=True, head_dim=32),
    "qwen2": dict(attention_bias=False),
    "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=16,
                          max_window_layers=1),
    "qwen3": dict(head_dim=16, attention_bias=True),
    "gemma": dict(head_dim=16, attention_bias=True),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=8),
    "olmo2": dict(attention_bias=True),
    "olmo3": dict(sliding_window=8),
    "apertus": dict(qk_norm=False),
    "apertus-silu": dict(model_type="apertus", hidden_act="silu"),
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True, num_key_value_heads=4),
    "stablelm-parallel": dict(model_type="stablelm", use_parallel_residual=True),
    "phi": dict(qk_layernorm=True, num_key_value_heads=4),
    "phi3": dict(),
    "gpt_neox": dict(attention_bias=False, num_key_value_heads=4),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=32, n_inner=80),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[1], qkv_bias=False),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, decoder_sparse_step=2,
                      head_dim=16, attention_bias=True),
    "qwen3_moe-no-experts": dict(model_type="qwen3_moe", num_experts=0, head_dim=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(MLA, q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=2,
                        mlp_bias=True, attention_bias=True),
    "deepseek_v3": dict(MLA, q_lora_rank=24, first_k_dense_replace=2, n_shared_experts=1,
                        n_group=2, topk_group=1),
    "llama4_text": dict(num_local_experts=4, head_dim=16, interleave_moe_layer_step=2,
                        intermediate_size_mlp=128, attention_bias=True),
    "llama4": dict(text_config=dict(BASE, num_local_experts=4, head_dim=16,
                                    intermediate_size_mlp=128, moe_layers=[0, 3])),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3": dict(text_config=dict(BASE, model_type="gemma3_text", head_dim=16),
                   vision_config=SIGLIP, mm_tokens_per_image=4),
    "gemma3-untied": dict(model_type="gemma3", tie_word_embeddings=False,
                          text_config=dict(BASE, model_type="gemma3_text", head_dim=16),
                          vision_config=SIGLIP, mm_tokens_per_image=4),
}


def layout_config(name: str) -> dict:
    over = dict(LAYOUTS[name])
    model_type = over.pop("model_type", name)
    if "text_config" in over:  # a multimodal wrapper: the sizes live in text_config
        return dict(over, model_type=model_type)
    return dict(BASE, model_type=model_type, **over)


def test_every_supported_model_type_has_a_layout_case():
    covered = {layout_config(n)["model_type"] for n in LAYOUTS}
    assert covered >= set(supported_model_types()) - {"gemma3_text", "llama4_text"} | {"gemma3"}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_rule_counts_exactly_like_transformers(name):
    assert_counts_like_transformers(layout_config(name))


def test_moe_layers_follow_each_rule():
    def moe_layers(name):
        return Arch.from_config(layout_config(name)).num_moe_layers

    assert moe_layers("qwen2_moe") == 3  # mlp_only_layers [1]
    assert moe_layers("qwen3_moe") == 2  # decoder_sparse_step 2: layers 1 and 3
    assert moe_layers("qwen3_moe-no-experts") == 0
    assert moe_layers("deepseek_v3") == 2  # first_k_dense_replace 2
    assert moe_layers("llama4_text") == 2 and moe_layers("llama4") == 2


def test_deepseek_v3_mtp_module_is_counted_apart_as_one_more_moe_layer():
    """transformers builds no MTP module: the count is the checkpoint's, not in total."""
    cfg = dict(layout_config("deepseek_v3"), num_nextn_predict_layers=1)
    arch = Arch.from_config(cfg)
    model = meta_model(cfg)
    last = model.model.layers[-1]  # an MoE layer, as the MTP block is
    h = arch.hidden_size
    assert param_counts(arch).mtp == torch_param_count(last) + 3 * h + 2 * h * h
    assert param_counts(arch).total == torch_param_count(model)


def test_gemma3_vision_tower_is_counted_but_never_active():
    arch = Arch.from_config(layout_config("gemma3"))
    counts = param_counts(arch)
    assert counts.vision > 0 and counts.active_per_token == counts.total - counts.vision


# --------------------------------------------------------------------------- LoRA against PEFT

LORA = [
    ("qwen3_moe", "all-linear"), ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
    ("qwen3_moe", ["q_proj", "gate"]), ("olmoe", "all-linear"),
    ("deepseek_v2", "all-linear"), ("deepseek_v2", ["kv_b_proj", "down_proj"]),
    ("deepseek_v3", "all-linear"), ("qwen2_moe", "all-linear"), ("qwen2_moe", ["gate_proj"]),
    ("llama4_text", "all-linear"), ("gpt_oss", "all-linear"), ("gemma3", "all-linear"),
    ("gemma3", ["q_proj", "v_proj"]), ("apertus", "all-linear"), ("olmo3", ["q_proj"]),
]


@pytest.mark.parametrize(("name", "targets"), LORA, ids=[f"{n}-{t}" for n, t in LORA])
def test_lora_count_matches_peft(name, targets):
    pytest.importorskip("peft")
    cfg = layout_config(name)
    expected = peft_trainable(cfg, 8, target_modules=targets)
    assert lora_param_count(Arch.from_config(cfg), targets, 8) == expected


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text", "qwen3_moe"])
def test_lora_on_fused_experts_by_target_parameters_matches_peft(name):
    pytest.importorskip("peft")
    cfg = layout_config(name)
    path = "feed_forward" if name.startswith("llama4") else "mlp"
    params = [f"{path}.experts.gate_up_proj", f"{path}.experts.down_proj"]
    expected = peft_trainable(cfg, 8, target_modules=[], target_parameters=params)
    targets = ["experts.gate_up_proj", "experts.down_proj"]
    assert lora_param_count(Arch.from_config(cfg), targets, 8) == expected


def test_lora_gate_proj_without_up_proj_is_refused_on_converted_experts():
    arch = Arch.from_config(layout_config("qwen3_moe"))
    with pytest.raises(SpecError) as err:
        lora_param_count(arch, ["gate_proj"], 8, moe_layout="fused")
    assert err.value.field == "method.lora_targets" and "up_proj" in err.value.hint


# --------------------------------------------------------------------------- refused, by key

REFUSED = {
    "mlp_only_layers": (dict(layout_config("qwen3_moe"), mlp_only_layers="1"), "mlp_only_layers"),
    "num_experts": (dict(layout_config("olmoe"), num_experts=-1), "num_experts"),
    "vision_use_head": (dict(layout_config("gemma3"), vision_config=dict(
        SIGLIP, vision_use_head=True)), "vision_config.vision_use_head"),
    "text_config": ({"model_type": "gemma3", "vision_config": SIGLIP}, "text_config"),
    "text_config.hidden_size": ({"model_type": "llama4", "text_config": {
        "num_hidden_layers": 2}}, "text_config.hidden_size"),
    "model_type": (dict(BASE, model_type="jamba"), "model_type"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_config_the_rules_cannot_count_is_refused_naming_the_key(case):
    cfg, key = REFUSED[case]
    with pytest.raises(SpecError) as err:
        Arch.from_config(cfg)
    assert err.value.field == "model.config" and repr(key) in err.value.message


# --------------------------------------------------------------------------- one rank's slice

SLICED = ["qwen3", "qwen3_moe", "llama", "gpt_oss", "deepseek_v3", "phi3"]


@pytest.mark.parametrize("name", SLICED)
def test_a_tensor_parallel_slice_counts_the_narrower_model(name):
    """TP=2 holds the model with half the heads, MLP columns and vocabulary (a row-parallel
    bias whole, as the narrower model's is; a router and MLA's latent projections replicated)."""
    from tunepilot.model.arch import tensor_slice

    cfg = layout_config(name)
    arch = Arch.from_config(cfg)
    half = dict(cfg, num_attention_heads=cfg["num_attention_heads"] // 2,
                num_key_value_heads=cfg["num_key_value_heads"] // 2,
                head_dim=arch.head_dim if arch.family != "mla" else None,
                intermediate_size=cfg["intermediate_size"] // 2, vocab_size=cfg["vocab_size"] // 2)
    for key in ("moe_intermediate_size",):
        if key in cfg:
            half[key] = cfg[key] // 2
    if arch.family == "mla":  # per-head sizes stay; only the head count halves
        half.pop("head_dim")
    sliced = param_counts(tensor_slice(arch, 2))
    narrow = Arch.from_config(half)
    replicated = sum(s.total_numel for s in arch.decoder if s.group == "router") - sum(
        s.total_numel for s in narrow.decoder if s.group == "router")
    assert sliced.total == torch_param_count(meta_model(half)) + replicated


def test_an_expert_parallel_slice_holds_its_share_of_the_routed_experts():
    from tunepilot.model.arch import expert_slice

    arch = Arch.from_config(layout_config("qwen3_moe"))
    full, half = param_counts(arch), param_counts(expert_slice(arch, 2))
    assert full.total - half.total == full.routed_experts // 2 == half.routed_experts
    with pytest.raises(SpecError) as err:
        expert_slice(arch, 3)
    assert err.value.field == "parallel.expert"


def test_plan_refuses_an_unknown_layout_naming_the_key_with_exit_2(tmp_path):
    """The CLI: one paragraph naming model_type, exit 2, no traceback - never a Llama plan."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="jamba")))
    (tmp_path / "spec.yaml").write_text("model: {config: config.json}\n")
    proc = subprocess.run([sys.executable, "-m", "tunepilot", "plan", str(tmp_path / "spec.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "'model_type'" in proc.stderr and "jamba" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lora_dropout_on_fused_experts_is_refused_as_peft_refuses_it_unless_megatron(tmp_path):
    """PEFT's adapter on a raw parameter (lora.ParamWrapper: transformers 5's fused experts,
    which 'all-linear' reaches) refuses lora_dropout: a PEFT spec gets the field and the fix;
    Megatron's LoRA drops out every input, so its stand-in keeps the modules' dropout."""
    pytest.importorskip("peft")
    import json

    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    from tunepilot.errors import UserError
    from tunepilot.model.build import build_meta_model
    from tunepilot.spec import spec_from_dict

    cfg = layout_config("qwen3_moe")
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg))

    def built(impl):
        spec = spec_from_dict({"model": {"config": str(path), "implementation": impl},
                               "method": {"kind": "lora", "lora_rank": 8, "lora_dropout": 0.05,
                                          "lora_targets": "all-linear"}})
        return build_meta_model(spec, config=cfg)

    with pytest.raises(UserError) as err:
        built("transformers")
    assert err.value.field == "method.lora_dropout" and "lora_dropout: 0" in err.value.hint
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan

    def refusal_said(impl):  # the analytic plan, which builds nothing, says it too
        spec = spec_from_dict({"model": {"config": str(path), "implementation": impl},
                               "method": {"kind": "lora", "lora_rank": 8, "lora_dropout": 0.05,
                                          "lora_targets": "all-linear"}})
        plan = analytic_plan(spec, resolve_arch(spec), "cuda")
        return any("PEFT refuses" in a for a in plan.assumptions)

    assert refusal_said("transformers") and not refusal_said("megatron")
    model = built("megatron")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    wrapped = [m for m in layers if isinstance(m, ParamWrapper)]
    assert wrapped and len(wrapped) < len(layers)  # the experts, and the linear modules
    for m in layers:
        dropout = m.lora_dropout["default"]
        assert isinstance(dropout, torch.nn.Dropout) != isinstance(m, ParamWrapper)
        if isinstance(dropout, torch.nn.Dropout):
            assert dropout.p == 0.05
