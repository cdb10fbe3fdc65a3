"""`tunepilot import` of kernels and adapter variants, from configs as people write them: the
Liger and Cut Cross-Entropy plugins, Unsloth, the attention implementation, DoRA, rsLoRA and the
modules trained in full - none of them "ignored" (each changes memory or time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepilot.integrations.importers import ImportOptions, import_config, read_config
from tunepilot.plan.api import make_plan

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
KERNEL_KEYS = {
    "plugins", "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm",
    "liger_fused_linear_cross_entropy", "liger_cross_entropy", "cut_cross_entropy",
    "flash_attention", "sdp_attention", "eager_attention", "flex_attention", "peft_use_dora",
    "peft_use_rslora", "lora_modules_to_save", "unfrozen_parameters", "use_liger_kernel",
    "liger_kernel_config", "attn_implementation", "model_init_kwargs", "use_dora", "use_rslora",
    "modules_to_save", "enable_liger_kernel", "use_unsloth", "use_unsloth_gc", "flash_attn",
    "additional_target", "gradient_checkpointing",
}


def imported(name: str):
    result = import_config(CONFIGS / name, options=ImportOptions(synthetic_data=True))
    raw = read_config(CONFIGS / name)
    assert not (KERNEL_KEYS & set(result.ignored)), result.ignored
    assert set(raw) <= set(result.mapped) | set(result.ignored) | set(result.defaults) | \
        set(result.not_mapped) | {k for k in raw if raw[k] in (None, False, "")}
    return result, result.spec


def test_axolotl_liger_plugin_config_plans_below_its_twin_without_liger():
    result, spec = imported("axolotl-liger-fsdp.yml")
    assert spec.kernels.liger == ["rms_norm", "rope", "fused_linear_cross_entropy", "swiglu"]
    assert spec.kernels.attention == "flash-attention-2"
    assert result.mapped["liger_fused_linear_cross_entropy"] == "kernels.liger"
    assert result.mapped["plugins"] == "kernels"
    twin = spec.with_changes(kernels={"attention": "flash-attention-2"})
    with_liger = make_plan(spec).per_device.device_peak_bytes
    without = make_plan(twin).per_device.device_peak_bytes
    assert without - with_liger > 4 * 2**30  # the (8192, 128256) logits it never holds


def test_axolotl_dora_cce_and_trainable_embeddings():
    result, spec = imported("axolotl-dora-cce.yml")
    m = spec.method
    assert (m.dora, m.rslora, m.modules_to_save) == (True, True, ["embed_tokens", "lm_head"])
    assert spec.kernels.cut_cross_entropy and spec.kernels.attention == "sdpa"
    assert spec.kernels.unsloth_gradient_checkpointing  # gradient_checkpointing: offload
    assert spec.activation_checkpointing == "full"
    assert result.mapped["peft_use_dora"] == "method.dora"
    assert make_plan(spec).params.trainable > 2 * 152064 * 3584  # the two copies


def test_axolotl_unfrozen_embeddings_under_lora_train_in_full(tmp_path):
    cfg = tmp_path / "ax.yml"
    cfg.write_text("base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\n"
                   "lora_target_linear: true\nsequence_len: 1024\nmicro_batch_size: 1\n"
                   "unfrozen_parameters:\n  - ^lm_head.weight$\n  - ^model.embed_tokens.weight$\n"
                   "  - model.layers.2[0-9]+\n")
    result = import_config(cfg)
    assert result.spec.method.modules_to_save == ["embed_tokens", "lm_head"]
    assert "unfrozen_parameters" in result.mapped
    assert any("not modelled" in n for n in result.notes)  # the layer regex, said


def test_trl_use_liger_kernel_attention_and_dora():
    result, spec = imported("trl-liger-dora.yaml")
    assert spec.kernels.liger == ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]
    assert spec.kernels.attention == "flash-attention-2"
    assert spec.method.dora and spec.method.modules_to_save == ["lm_head"]
    assert result.mapped["model_init_kwargs"] == "kernels.attention"


def test_hf_training_arguments_liger_config_and_peft_variants():
    result, spec = imported("hf-liger-args.json")
    assert spec.kernels.liger == ["rms_norm", "swiglu", "rope", "cross_entropy"]
    assert spec.method.dora and spec.method.modules_to_save == ["lm_head"]
    assert result.mapped["use_liger_kernel"] == "kernels.liger"


@pytest.mark.parametrize("name,kernels,method", [
    ("llamafactory-unsloth.yaml", {"unsloth": True, "unsloth_gradient_checkpointing": True,
                                   "attention": "flash-attention-2"},
     {"rslora": True, "dora": False, "modules_to_save": ["embed_tokens", "lm_head"]}),
    ("llamafactory-liger-eager.yaml", {"attention": "eager",
                                       "liger": ["rms_norm", "swiglu", "rope",
                                                 "fused_linear_cross_entropy"]},
     {"dora": True}),
])
def test_llamafactory_kernel_keys(name, kernels, method):
    result, spec = imported(name)
    for k, v in kernels.items():
        assert getattr(spec.kernels, k) == v, k
    for k, v in method.items():
        assert getattr(spec.method, k) == v, k
    plan = make_plan(spec)
    assert plan.per_device.device_peak_bytes > 0


def test_an_unknown_attention_implementation_is_refused_with_the_choices(tmp_path):
    from tunepilot.errors import UserError

    cfg = tmp_path / "trl.yaml"
    cfg.write_text("model_name_or_path: meta-llama/Llama-3.2-1B\ndataset_name: x\n"
                   "attn_implementation: paged_magic\n")
    with pytest.raises(UserError, match="paged_magic"):
        import_config(cfg, options=ImportOptions(synthetic_data=True))


def test_the_fsdp_configs_state_dict_type_and_save_strategy_say_how_checkpoints_build():
    _, spec = imported("axolotl-liger-fsdp.yml")  # fsdp_state_dict_type: FULL_STATE_DICT
    assert spec.checkpoint.state_dict == "full"
