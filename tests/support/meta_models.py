"""The real thing to count against: transformers models built on the meta device (shapes, no
storage: even a 671B model builds in seconds), and PEFT's trainable count on them."""

from __future__ import annotations

import re

from tunepilot.model.arch import META_KEY, Arch, linear_modules


def hf_config(cfg: dict):
    """The transformers config object for a preset/config dict (our block removed; a
    checkpoint's quantization_config and remote-code auto_map are storage, not layout)."""
    import transformers

    body = {k: v for k, v in cfg.items() if k not in (META_KEY, "quantization_config",
                                                      "auto_map")}
    return transformers.AutoConfig.for_model(**body)


def meta_model(cfg: dict):
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(cfg))


def torch_param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights appear once


def peft_trainable(cfg: dict, rank: int, **lora_kwargs) -> int:
    import peft

    model = meta_model(cfg)
    config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, **lora_kwargs)
    wrapped = peft.get_peft_model(model, config)
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def in_layers(named: dict, path: str) -> list:
    """The objects at `<...>.layers.N.<path>` (or gpt2's `h.N.<path>`) of the decoder, one per
    layer that holds it (a vision tower's `encoder.layers.N` is not the decoder's)."""
    pattern = re.compile(rf"(^|\.)(layers|h)\.\d+\.{re.escape(path)}$")
    return [v for k, v in named.items() if pattern.search(k) and "vision_tower" not in k]


def assert_linear_modules_match(arch: Arch, model) -> None:
    """Every LinearSpec exists in as many decoder layers as it says, with the stated shape and
    bias (a fused expert tensor (experts, out, in), or (experts, in, out) where transposed)."""
    import torch

    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for spec in linear_modules(arch):
        if spec.peft_kind == "module":
            found = in_layers(modules, spec.path)
            assert len(found) == spec.layers, (spec.path, len(found), spec.layers)
            mod = found[0]
            if isinstance(mod, torch.nn.Linear):
                assert (mod.in_features, mod.out_features) == (spec.in_features, spec.out_features)
            else:  # transformers' Conv1D (gpt2) stores the weight as (in, out)
                assert tuple(mod.weight.shape) == (spec.in_features, spec.out_features)
            assert (mod.bias is not None) == spec.has_bias, spec.path
        else:  # a raw parameter: MoE experts (experts, out, in) or the router (experts, hidden)
            name = spec.path if spec.count_per_layer > 1 else spec.path + ".weight"
            found = in_layers(params, name)
            assert len(found) == spec.layers, (spec.path, len(found), spec.layers)
            matrix = (spec.in_features, spec.out_features) if spec.transposed else (
                spec.out_features, spec.in_features)
            expected = (spec.count_per_layer, *matrix) if spec.count_per_layer > 1 else matrix
            assert tuple(found[0].shape) == expected, spec.path
