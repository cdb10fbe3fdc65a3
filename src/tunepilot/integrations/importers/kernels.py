"""The kernel and adapter-variant keys every trainer spells its own way -> the spec's ``kernels:``
block and ``method.dora`` / ``rslora`` / ``modules_to_save``: they change memory and time, so
none is "ignored". Pure data, like the rest of the importers.
"""

from __future__ import annotations

from typing import Any

from tunepilot.integrations.importers.common import Mapper, truthy
from tunepilot.spec.kernels import LIGER_ALL

# transformers' attn_implementation (and the trainers' spellings of it) -> kernels.attention
ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash-attention-2",
             "flash_attention_3": "flash-attention-3", "flex_attention": "flex",
             "fa2": "flash-attention-2", "fa3": "flash-attention-3", "disabled": "eager",
             "auto": "sdpa"}
LIGER_PLUGIN = "axolotl.integrations.liger"
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy"


def attention(m: Mapper, key: str, value: Any) -> None:
    """An attn_implementation value (or flash_attn: fa2|sdpa|disabled|auto)."""
    if value in (None, ""):
        return
    name = str(value).lower()
    impl = ATTENTION.get(name)
    if impl is None and "flash" in name:  # hub kernels ("kernels-community/flash-attn3")
        impl = "flash-attention-3" if "3" in name else "flash-attention-2"
        m.note(f"{key} {value!r}: a hub attention kernel, planned as {impl} (no s x s matrix)")
    if impl is None:
        m.fail(key, f"attention implementation {value!r} is not one tunepilot models.",
               f"Use one of {', '.join(sorted(ATTENTION))}.")
    if name == "auto":
        m.note(f"{key} auto: flash-attention 2 when installed, else SDPA - the same memory "
               "(no s x s matrix); planned as sdpa")
    m.set("kernels.attention", impl, key)


def liger(m: Mapper, key: str, kernels: list[str]) -> None:
    """Liger kernels by name (kernels.liger), merged with any set before."""
    got = m.spec.get("kernels", {}).get("liger", [])
    m.set("kernels.liger", got + [k for k in kernels if k not in got], key)


def liger_default(m: Mapper, key: str) -> None:
    """use_liger_kernel / enable_liger_kernel: transformers' apply_liger_kernel with its
    default kernel_config - rope, rms_norm, swiglu (GeGLU on Gemma) and fused linear
    cross-entropy, the per-model defaults of liger_kernel's apply_liger_kernel_to_*."""
    liger(m, key, list(LIGER_ALL))


def liger_config(m: Mapper, key: str, config: Any) -> None:
    """TrainingArguments.liger_kernel_config: {rope, rms_norm, swiglu, cross_entropy,
    fused_linear_cross_entropy, layer_norm, geglu: bool} over the defaults."""
    if not isinstance(config, dict):
        m.fail(key, f"is {config!r}, not a mapping of Liger kernel names to true/false.")
    on = {k: True for k in LIGER_ALL}
    on.update({str(k): truthy(v) for k, v in config.items()})
    known = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy", "layer_norm", "geglu",
             "cross_entropy")
    liger(m, key, [k for k in known if on.get(k)])


def method_variants(m: Mapper, *, dora: str | None = None, rslora: str | None = None,
                    modules: tuple[str, ...] = ()) -> None:
    """DoRA, rsLoRA and modules trained in full beside the adapters."""
    if dora and truthy(m.get(dora)):
        m.set("method.dora", True, dora)
    if rslora and truthy(m.get(rslora)):
        m.set("method.rslora", True, rslora)
    for key in modules:
        names = module_list(m.get(key))
        if names:
            got = m.spec.get("method", {}).get("modules_to_save", [])
            m.set("method.modules_to_save", got + [n for n in names if n not in got], key)


def module_list(value: Any) -> list[str]:
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list):
        return [str(t).strip() for t in value if str(t).strip()]
    return []


def lora_target_parameters(m: Mapper, key: str) -> None:
    """LoRA on raw parameters (MoE experts: experts.gate_up_proj, experts.down_proj), added to
    the targets: model/arch.py counts each expert's adapters."""
    params = module_list(m.get(key))
    if not params:
        return
    targets = m.spec.get("method", {}).get("lora_targets")
    if targets == "all-linear":
        m.note(f"{key}: all-linear already includes the experts")
        m.used.add(key)
        return
    names = [p.removesuffix(".weight") for p in params]
    m.set("method.lora_targets", list(targets or ["q_proj", "v_proj"]) + names, key)
