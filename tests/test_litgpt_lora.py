"""LitGPT's LoRA on a fused query/key/value matrix, as it runs: adapting some of q, k and v
scatters the adapters' output into zeros with index_copy, which keeps that output for the
backward (lit_gpt/lora.py zero_pad). The plan (analytic and traced) holds it; PEFT's LoRA on
transformers' model does not."""

from __future__ import annotations

import pytest

from tunepilot.errors import UserError
from tunepilot.model.arch import Arch
from tunepilot.model.litgpt import fused_part_index, partial_qkv
from tunepilot.plan.analytic.activations import litgpt_fused_qkv_features, litgpt_kept_features
from tunepilot.spec import spec_from_dict

SMALL = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024}
LLAMA = {"model_type": "llama", "num_key_value_heads": 4, **SMALL}
NEOX = {"model_type": "gpt_neox", "rotary_pct": 0.25, "use_parallel_residual": True, **SMALL}


def _spec(impl: str = "litgpt", **method):
    lora = {"kind": "lora", "lora_rank": 4, "lora_targets": ["q_proj", "v_proj"], **method}
    return spec_from_dict({"model": {"preset": "tiny", "implementation": impl},
                           "precision": "bf16-true", "sequence_length": 64,
                           "method": dict(lora, adapter_dtype="bf16")})


def test_the_adapted_parts_of_q_k_v_are_what_litgpts_zero_pad_keeps():
    present = {"q_proj", "k_proj", "v_proj"}
    assert partial_qkv({"q_proj", "v_proj"}, present) == ["q_proj", "v_proj"]
    assert partial_qkv(present, present) == []  # all three: zero_pad returns its input
    assert partial_qkv(set(), present) == []
    # gpt_neox's fused matrix: each head's q, k, v side by side; phi3's: q, then k, then v
    assert fused_part_index("query_key_value", ["q", "v"], 2, 2, 2) == [0, 1, 4, 5, 6, 7, 10, 11]
    assert fused_part_index("qkv_proj", ["k"], 4, 2, 2) == [8, 9, 10, 11]


def test_the_analytic_plan_counts_the_kept_adapter_output_for_litgpt_only():
    arch = Arch.from_config(LLAMA)
    assert litgpt_kept_features(arch, _spec()) == 2 * 128  # q and v outputs per token
    assert litgpt_kept_features(arch, _spec("transformers")) == 0
    assert litgpt_kept_features(arch, _spec(lora_targets=["q_proj", "k_proj", "v_proj"])) == 0
    neox = Arch.from_config(NEOX)
    fused = _spec(lora_targets=["query_key_value"], lora_qkv_parts=["q", "v"])
    assert litgpt_kept_features(neox, fused) == 2 * 128
    assert litgpt_kept_features(neox, _spec(lora_targets=["query_key_value"])) == 0


def test_the_analytic_plan_counts_litgpts_fused_qkv_output_kept_with_v():
    # v is a view of LitGPT's fused qkv output, so its q and k widths stay alive with it
    arch = Arch.from_config(LLAMA)
    assert litgpt_fused_qkv_features(arch, _spec()) == 2 * 128
    assert litgpt_fused_qkv_features(arch, _spec("transformers")) == 0
    # transformers' gpt_neox is fused already; with fewer K/V heads LitGPT copies v
    assert litgpt_fused_qkv_features(Arch.from_config(NEOX), _spec()) == 0
    gqa = Arch.from_config(dict(LLAMA, num_key_value_heads=2))
    assert litgpt_fused_qkv_features(gqa, _spec()) == 0


@pytest.mark.parametrize("method,field", [
    ({"lora_qkv_parts": ["q", "q"]}, "lora_qkv_parts"),
    ({"lora_qkv_parts": []}, "lora_qkv_parts"),
])
def test_bad_qkv_parts_are_refused_naming_the_field(method, field):
    with pytest.raises(UserError, match=field):
        _spec(lora_targets=["query_key_value"], **method)


def test_qkv_parts_on_a_model_with_split_q_k_v_are_refused_naming_the_field():
    with pytest.raises(UserError, match="method.lora_qkv_parts") as err:
        litgpt_kept_features(Arch.from_config(LLAMA), _spec(lora_qkv_parts=["q", "v"]))
    assert "lora_targets" in err.value.hint


def test_qkv_parts_need_litgpt_and_adapters():
    with pytest.raises(UserError, match="Set model.implementation: litgpt"):
        _spec("transformers", lora_targets=["query_key_value"], lora_qkv_parts=["q", "v"])
    with pytest.raises(UserError, match="lora_qkv_parts"):
        spec_from_dict({"model": {"preset": "tiny", "implementation": "litgpt"},
                        "method": {"kind": "full", "lora_qkv_parts": ["q"]}})


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")


def _saved(model, ids) -> tuple[torch.Tensor, int]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids).logits
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return out, sum(storages.values())


def _model(spec, config):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunepilot.model.build import apply_lora

    cfg = dict(config)
    torch.manual_seed(0)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32, attn_implementation="eager")
    model = apply_lora(spec, model)
    for name, p in model.named_parameters():  # a nonzero update, so zeroed parts show
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def test_a_split_q_v_adapter_keeps_its_output_with_the_same_values():
    ids = torch.randint(0, 512, (2, 64))
    plain = _model(_spec("transformers"), LLAMA)
    lit = _model(_spec(), LLAMA)
    lit.load_state_dict(plain.state_dict())
    a, saved_plain = _saved(plain, ids)
    b, saved_lit = _saved(lit, ids)
    assert torch.equal(a, b)  # index_copy into zeros: the same values
    kept = 2 * 2 * 64 * 2 * 128 * 2  # layers x batch x tokens x (q + v) x bf16 adapter bytes
    assert saved_lit - saved_plain >= kept


def test_a_fused_qkv_adapter_updates_only_its_parts_and_keeps_them():
    ids = torch.randint(0, 512, (1, 64))
    whole = _model(_spec(lora_targets=["query_key_value"]), NEOX)
    parts = _model(_spec(lora_targets=["query_key_value"], lora_qkv_parts=["q", "v"]), NEOX)
    parts.load_state_dict(whole.state_dict())
    _, saved_whole = _saved(whole, ids)
    out, saved_parts = _saved(parts, ids)
    assert saved_parts - saved_whole >= 2 * 64 * 2 * 128 * 2  # layers x tokens x (q+v) x bf16
    layer = parts.base_model.model.gpt_neox.layers[0].attention.query_key_value
    x = torch.randn(1, 8, 128)
    delta = layer(x) - layer.base_layer(x)
    per_head = delta.view(1, 8, 4, 3, 32)  # heads x [q | k | v] x head_dim
    assert per_head[..., 1, :].abs().max() == 0  # the key's update stays zero
    assert per_head[..., 0, :].abs().max() > 0 and per_head[..., 2, :].abs().max() > 0


def test_v_as_a_view_of_a_fused_output_keeps_q_and_k_widths_with_the_same_values():
    # the attention kernels save v as given (flash, SDPA's fused paths: the trace's stand-ins),
    # so v's storage - LitGPT's whole qkv output - stays alive until the backward
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunepilot.model.litgpt import fused_qkv_storage

    def model(config):
        cfg = dict(config)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                                dtype=torch.float32)

    ids = torch.randint(0, 512, (2, 64))
    plain, lit = model(LLAMA), model(LLAMA)
    assert fused_qkv_storage(lit) == 2  # one v_proj per layer
    assert torch.equal(plain(input_ids=ids).logits, lit(input_ids=ids).logits)
    x = torch.randn(2, 64, 128)
    v = lit.model.layers[0].self_attn.v_proj(x)
    assert torch.equal(v, plain.model.layers[0].self_attn.v_proj(x))
    assert v.untyped_storage().nbytes() == 3 * v.numel() * 4  # q | k | v wide, fp32
    assert fused_qkv_storage(model(dict(LLAMA, num_key_value_heads=2))) == 0
