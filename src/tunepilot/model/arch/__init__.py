"""Model architecture facts read from a Hugging Face ``config.json``, with no torch import.

This package sits on the fast ``plan`` path, so it only reads JSON and does arithmetic. It turns a
config dict into an :class:`Arch` (the numbers the memory model needs) by the layout rules of its
model_type (layouts.py: dense decoders; moe.py: routed and shared experts, MLA; vision.py: a
vision tower), lists the weight matrices as PEFT would see them, and counts parameters exactly:
``param_counts(arch).total`` equals ``sum(p.numel() for p in
AutoModelForCausalLM.from_config(cfg).parameters())``, which counts tied weights once
(tests/test_arch*.py check every preset and every layout against transformers on the meta
device). A config whose layout the rules cannot count is refused naming the key.

Presets live in ``resources/presets/<name>.json``: each is the model's hub ``config.json`` plus a
``_tunepilot`` block (``hf_id``, ``source``, ``params_published``).
"""

from __future__ import annotations

from pathlib import Path

from tunepilot.model.arch.core import Arch, LinearSpec, MoeLayout, VisionTower
from tunepilot.model.arch.counts import (
    ParamCounts,
    linear_modules,
    lm_head_spec,
    param_counts,
    parameter_shapes,
)
from tunepilot.model.arch.files import (
    META_KEY,
    config_hash,
    list_presets,
    load_config_file,
    load_preset,
    resolve_model_config,
)
from tunepilot.model.arch.layouts import supported_model_types
from tunepilot.model.arch.lora import (
    ALL_LINEAR,
    installed_moe_layout,
    lora_param_count,
    lora_target_names,
    lora_targets,
)
from tunepilot.model.arch.slices import expert_slice, tensor_slice

__all__ = [
    "ALL_LINEAR", "META_KEY", "Arch", "LinearSpec", "MoeLayout", "ParamCounts", "VisionTower",
    "config_hash", "expert_slice", "installed_moe_layout", "linear_modules", "list_presets", "lm_head_spec",
    "load_config_file", "load_preset", "lora_param_count", "lora_target_names", "lora_targets",
    "param_counts", "parameter_shapes", "resolve_arch", "resolve_model_config",
    "supported_model_types", "tensor_slice",
]


def resolve_arch(spec, base_dir: Path | None = None) -> Arch:
    return Arch.from_config(resolve_model_config(spec, base_dir))
