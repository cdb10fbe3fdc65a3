"""Which kernels and adapter variants were active in the user's own run (HF / Lightning
callbacks): read from the live model, never from what the user meant to turn on.

    attention   model.config._attn_implementation (eager, sdpa, flash_attention_2/3, flex)
    Liger       modules whose class or bound forward comes from liger_kernel (LigerRMSNorm,
                LigerLayerNorm, LigerSwiGLUMLP / LigerGEGLUMLP; instance patching binds Liger's
                forward to the stock module), the CausalLM forward (lce_forward: the fused
                linear cross-entropy) and the modeling module's apply_rotary_pos_emb (RoPE)
    CCE         the CausalLM forward from cut_cross_entropy (cce_patch)
    Unsloth     modules or the forward from unsloth / unsloth_zoo
    TE          modules from transformer_engine
    PEFT        use_dora, use_rslora, modules_to_save of the adapter's config
"""

from __future__ import annotations

import sys
from typing import Any

from tunepilot.integrations.importers.kernels import ATTENTION


def _origin(obj: Any) -> str:
    """'module.qualname' of a class, function or bound method ('' when unknown)."""
    fn = getattr(obj, "__func__", obj)
    return f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', '') or ''}"


def _forward_origin(module: Any) -> str:
    bound = module.__dict__.get("forward") if hasattr(module, "__dict__") else None
    return _origin(bound if bound is not None else type(module).forward)


def kernels_in_use(model: Any) -> tuple[dict, list[str]]:
    """(the spec's kernels block, what was seen) of a live transformers / PEFT model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kernels: dict = {}
    attn = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if isinstance(attn, str) and attn.lower() in ATTENTION:
        kernels["attention"] = ATTENTION[attn.lower()]
    liger: list[str] = []
    seen = set()
    for mod in base.modules():
        origins = f"{_origin(type(mod))} {_forward_origin(mod)}"
        seen.update(p for p in ("liger_kernel", "unsloth", "transformer_engine") if p in origins)
        if "liger_kernel" in origins:
            for key, kernel in (("RMSNorm", "rms_norm"), ("LayerNorm", "layer_norm"),
                                ("SwiGLU", "swiglu"), ("GEGLU", "geglu"), ("GeGLU", "geglu")):
                if key in origins and kernel not in liger:
                    liger.append(kernel)
    forward = _forward_origin(base)
    if "liger_kernel" in forward:
        liger.append("fused_linear_cross_entropy")
    rope = getattr(sys.modules.get(type(base).__module__), "apply_rotary_pos_emb", None)
    if rope is not None and _origin(rope).startswith("liger_kernel"):
        liger.append("rope")
    if liger:
        kernels["liger"] = liger
    if "cut_cross_entropy" in forward:
        kernels["cut_cross_entropy"] = True
    if "unsloth" in seen or "unsloth" in forward:
        kernels["unsloth"] = True
        kernels.pop("liger", None)
    if "transformer_engine" in seen:
        kernels["transformer_engine"] = True
    said = [f"{k} {', '.join(v) if isinstance(v, list) else v}" for k, v in kernels.items()]
    return kernels, ([f"kernels active in this run (read from the live model): {'; '.join(said)}"]
                     if said else [])


def adapter_variants(peft_config: Any) -> dict:
    """DoRA, rsLoRA and modules_to_save of a PEFT LoraConfig."""
    out: dict = {}
    if getattr(peft_config, "use_dora", False):
        out["dora"] = True
    if getattr(peft_config, "use_rslora", False):
        out["rslora"] = True
    mods = getattr(peft_config, "modules_to_save", None) or []
    names = sorted({str(m).split(".")[-1] for m in mods})
    if names:
        out["modules_to_save"] = names
    return out
