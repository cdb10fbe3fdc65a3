"""arch.py against the real thing: transformers models built on the meta device, and PEFT.

Meta-device models have shapes but no storage, so even Llama-3.1-405B builds in about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tunepilot.errors import SpecError
from tunepilot.model.arch import (
    META_KEY,
    Arch,
    installed_moe_layout,
    list_presets,
    load_config_file,
    load_preset,
    lora_param_count,
    param_counts,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.meta_models import (  # noqa: E402
    assert_linear_modules_match,
    meta_model,
    torch_param_count,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",  # transformers 5 internal deprecation
    "ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning",  # PEFT MoE remap
)

PRESETS = list_presets()
LORA_PRESETS = ["tiny", "llama-3-8b", "qwen2.5-0.5b", "phi-3-mini", "gemma-2-2b", "mixtral-8x7b"]
LORA_RANK = 8


# --------------------------------------------------------------------------- exact counts


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_matches_transformers_exactly(name):
    cfg = load_preset(name)
    arch = Arch.from_config(cfg)
    model = meta_model(cfg)
    counts = param_counts(arch)
    assert counts.total == torch_param_count(model)
    assert arch.known_layout
    assert counts.embedding == model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == arch.tied_embeddings
    assert_linear_modules_match(arch, model)


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "tiny"])
def test_param_count_is_close_to_the_published_figure(name):
    cfg = load_preset(name)
    meta = cfg[META_KEY]
    assert meta["hf_id"] and meta["source"]
    published = meta["params_published"]
    if published is None:  # only a nominal size is published ("7B"): the source says so
        assert "nominal" in meta["source"]
        return
    assert isinstance(published, int)
    total = param_counts(Arch.from_config(cfg)).total
    assert abs(total - published) / published < 0.02, (total, published)


def test_tiny_preset_is_the_two_layer_test_model():
    cfg = load_preset("tiny")
    assert cfg[META_KEY] == {
        "hf_id": None,
        "source": "tunepilot test model",
        "params_published": None,
    }
    arch = Arch.from_config(cfg)
    assert (arch.model_type, arch.num_layers, arch.hidden_size, arch.num_heads) == (
        "llama",
        2,
        64,
        4,
    )
    assert (arch.num_kv_heads, arch.intermediate_size, arch.vocab_size) == (2, 176, 512)
    assert not arch.tied_embeddings and arch.max_position_embeddings == 512


def test_moe_counts_active_experts_only_per_token():
    arch = Arch.from_config(load_preset("mixtral-8x7b"))
    counts = param_counts(arch)
    assert (arch.num_experts, arch.experts_per_token) == (8, 2)
    # Mixtral's own figure: 46.7B total, 12.9B used per token (mistral.ai, "Mixtral of experts")
    assert counts.active_per_token == pytest.approx(12.9e9, rel=0.01)
    dense = param_counts(Arch.from_config(load_preset("mistral-7b")))
    assert dense.active_per_token == dense.total


def test_moe_layouts_count_the_same_parameters():
    arch = Arch.from_config(load_preset("mixtral-8x7b"))
    assert param_counts(arch, "fused").total == param_counts(arch, "per_expert").total


FALLBACKS = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32),
    "gpt_neox": dict(
        model_type="gpt_neox", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=100,
    ),
    "phi": dict(
        model_type="phi", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=100,
    ),
    "stablelm": dict(
        model_type="stablelm", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(FALLBACKS))
def test_other_decoder_families_count_exactly(kind):
    cfg = FALLBACKS[kind]
    arch = Arch.from_config(cfg)
    model = meta_model(cfg)
    assert param_counts(arch).total == torch_param_count(model)
    assert_linear_modules_match(arch, model)


def test_an_unknown_model_type_is_refused_naming_the_key_never_planned_as_llama():
    """Apertus-8B counted as Llama was 10.95B, not 8.05B: a type without a rule now stops."""
    cfg = dict(load_preset("tiny"), model_type="somefuturellama")
    with pytest.raises(SpecError) as err:
        Arch.from_config(cfg)
    assert err.value.field == "model.config"
    assert "'model_type'" in err.value.message and "somefuturellama" in err.value.message
    assert "llama" in err.value.hint and "qwen3_moe" in err.value.hint


def test_an_unknown_moe_type_is_refused_rather_than_undercounted():
    cfg = dict(load_preset("tiny"), model_type="dbrx_like_moe", num_experts=60)
    with pytest.raises(SpecError) as err:
        Arch.from_config(cfg)
    assert err.value.field == "model.config" and "'model_type'" in err.value.message


def test_missing_essential_key_names_it():
    cfg = {k: v for k, v in load_preset("tiny").items() if k != "num_hidden_layers"}
    with pytest.raises(SpecError) as err:
        Arch.from_config(cfg)
    assert err.value.field == "model.config"
    assert "num_hidden_layers" in err.value.message


def test_config_hash_ignores_our_block_and_sees_real_changes():
    cfg = load_preset("tiny")
    plain = {k: v for k, v in cfg.items() if k != META_KEY}
    assert Arch.from_config(cfg).config_hash == Arch.from_config(plain).config_hash
    assert (
        Arch.from_config(dict(plain, vocab_size=513)).config_hash
        != Arch.from_config(plain).config_hash
    )


# --------------------------------------------------------------------------- LoRA vs PEFT


def peft_trainable(cfg: dict, **lora_kwargs) -> int:
    pytest.importorskip("peft")
    from tests.support.meta_models import peft_trainable as trainable

    return trainable(cfg, LORA_RANK, **lora_kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"], ids=["q_v", "all_linear"])
@pytest.mark.parametrize("name", LORA_PRESETS)
def test_lora_count_matches_peft(name, targets):
    cfg = load_preset(name)
    arch = Arch.from_config(cfg)
    if name == "phi-3-mini" and targets != "all-linear":
        targets = ["qkv_proj", "o_proj"]  # phi3 fuses q/k/v into one matrix
    expected = peft_trainable(cfg, target_modules=targets)
    assert lora_param_count(arch, targets, LORA_RANK) == expected


@pytest.mark.slow
def test_lora_on_fused_moe_experts_matches_peft_target_parameters():
    if installed_moe_layout() != "fused":
        pytest.skip("transformers < 5 keeps one nn.Linear per expert")
    cfg = load_preset("mixtral-8x7b")
    arch = Arch.from_config(cfg)
    params = ["experts.gate_up_proj", "experts.down_proj"]
    expected = peft_trainable(cfg, target_modules=[], target_parameters=params)
    assert lora_param_count(arch, params, LORA_RANK) == expected
    assert lora_param_count(arch, ["gate_up_proj", "down_proj"], LORA_RANK) == expected


@pytest.mark.slow
@pytest.mark.parametrize("targets", [["w1", "w3"], ["w2", "gate"], ["q_proj", "w1", "w2", "w3"]])
def test_lora_with_transformers4_moe_names_matches_peft_translation(targets):
    if installed_moe_layout() != "fused":
        pytest.skip("the translation only happens on transformers >= 5")
    cfg = load_preset("mixtral-8x7b")
    expected = peft_trainable(cfg, target_modules=targets)
    assert lora_param_count(Arch.from_config(cfg), targets, LORA_RANK) == expected


def test_lora_w1_without_w3_is_refused_on_fused_experts():
    arch = Arch.from_config(load_preset("mixtral-8x7b"))
    with pytest.raises(SpecError) as err:
        lora_param_count(arch, ["w1"], 8, moe_layout="fused")
    assert err.value.field == "method.lora_targets"


def test_lora_on_per_expert_layout_counts_every_expert_linear():
    arch = Arch.from_config(load_preset("mixtral-8x7b"))
    h, i, e, r = 4096, 14336, 8, 8
    attention = r * (h + h) * 2 + r * (h + 1024) * 2  # q, o and k, v (8 kv heads x 128)
    moe = r * (h + e) + e * (2 * r * (h + i) + r * (i + h))  # router + w1, w3, w2 per expert
    assert lora_param_count(arch, "all-linear", r, moe_layout="per_expert") == 32 * (
        attention + moe
    )


def test_lora_arithmetic_for_the_tiny_model():
    arch = Arch.from_config(load_preset("tiny"))
    # q: 64->64, v: 64->32 (2 kv heads x 16); rank 8 -> 8*(64+64) + 8*(64+32) = 1792 per layer
    assert lora_param_count(arch, ["q_proj", "v_proj"], 8) == 2 * 1792


def test_unknown_lora_target_lists_the_valid_names():
    arch = Arch.from_config(load_preset("phi-3-mini"))
    with pytest.raises(SpecError) as err:
        lora_param_count(arch, ["q_proj"], 8)
    assert err.value.field == "method.lora_targets"
    assert "qkv_proj" in err.value.hint and "gate_up_proj" in err.value.hint


def test_lora_rank_must_be_positive():
    arch = Arch.from_config(load_preset("tiny"))
    with pytest.raises(SpecError):
        lora_param_count(arch, "all-linear", 0)


# --------------------------------------------------------------------------- names and files


@pytest.mark.parametrize(
    "alias", ["Llama-3-8B", "llama_3_8b", "LLAMA 3 8B", "meta-llama/Meta-Llama-3-8B"]
)
def test_preset_names_are_normalised(alias):
    assert load_preset(alias) == load_preset("llama-3-8b")


def test_dotted_versions_and_hub_ids_resolve():
    assert load_preset("Qwen2.5_7B")[META_KEY]["hf_id"] == "Qwen/Qwen2.5-7B"
    assert load_preset("llama-3.1-8b") != load_preset("llama-3-8b")


def test_unknown_preset_suggests_the_nearest():
    with pytest.raises(SpecError) as err:
        load_preset("llama-3-8")
    assert err.value.field == "model.preset"
    assert "Did you mean" in err.value.hint and "llama-3-8b" in err.value.hint


def test_every_preset_is_a_config_with_a_source():
    for name in PRESETS:
        cfg = load_preset(name)
        assert {"hf_id", "source", "params_published"} <= set(cfg[META_KEY]) <= {
            "hf_id", "source", "params_published", "hf_aliases"}
        assert cfg["model_type"] and cfg["architectures"], name


def test_load_config_file_accepts_a_directory_or_the_file(tmp_path):
    body = {k: v for k, v in load_preset("tiny").items() if k != META_KEY}
    (tmp_path / "config.json").write_text(json.dumps(body))
    assert load_config_file(tmp_path) == body
    assert load_config_file(tmp_path / "config.json") == body


def test_load_config_file_errors_name_the_field(tmp_path):
    with pytest.raises(SpecError) as err:
        load_config_file(tmp_path / "nowhere")
    assert err.value.field == "model.config"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError) as err:
        load_config_file(tmp_path)
    assert err.value.field == "model.config" and "line 1" in err.value.message


def test_arch_imports_without_torch():
    code = "import sys, tunepilot.model.arch; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
