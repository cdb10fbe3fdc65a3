"""The spec's kernels on a card that has them: which ones the pilot runs, and how they are put in.

    choose(spec, device) -> KernelChoice   kernels that run here (package installed, the card
                                           supports them) and the stand-ins for the rest, each
                                           with what it leaves unmeasured
    apply_kernels(spec, model, device)     Liger (liger_kernel's _apply_liger_kernel_to_instance),
                                           Cut Cross-Entropy (cut_cross_entropy's cce_patch),
                                           torchao float8 (convert_to_float8_training) on the
                                           meta model, before LoRA and before materialisation
    attention_impl(spec, device)           transformers' attn_implementation: flash_attention_2/3
                                           or flex_attention where they run, else sdpa / eager

A kernel runs only on a GPU whose compute capability it supports, with its package importable
(``importlib.util.find_spec``: nothing is installed here); everything else is the stock path the
CPU pilot has always run - transformers' SDPA attention and PyTorch's bf16 - and the pilot says
which stand-in ran and what that leaves unmeasured. Unsloth (it replaces the model's code) and
Transformer Engine (its own modules and fp8_autocast, not a patch of transformers' model) always
stand in.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

# kernel -> (package to import, its pip name, the least compute capability it needs (NVIDIA))
PACKAGES = {
    "liger": ("liger_kernel", "liger-kernel", (7, 0)),
    "cut_cross_entropy": ("cut_cross_entropy", "cut-cross-entropy", (8, 0)),
    "flash-attention-2": ("flash_attn", "flash-attn", (8, 0)),
    "flash-attention-3": ("flash_attn_interface", "flash-attn-3 (hopper/ of Dao-AILab/"
                          "flash-attention)", (9, 0)),
    "flex": ("torch.nn.attention.flex_attention", "torch >= 2.5", (8, 0)),
    "fp8": ("torchao", "torchao", (8, 9)),
}
HF_ATTENTION = {"flash-attention-2": "flash_attention_2", "flash-attention-3": "flash_attention_3",
                "flex": "flex_attention"}
FP8_LABEL = " (torchao float8)"  # an FP8 precision's entry among the kernels


@dataclass
class KernelChoice:
    """What the pilot runs of the spec's kernels, and what stands in for the rest."""

    ran: list[str] = field(default_factory=list)
    stand_ins: dict[str, str] = field(default_factory=dict)
    """kernel -> why it did not run (the missing package, the card, the precision)"""
    missing_packages: dict[str, str] = field(default_factory=dict)
    """kernel -> its pip name, for the kernels whose package is not installed"""
    kernels: dict = field(default_factory=dict)
    """the spec's kernels block as the pilot runs it (stand-ins turned off)"""
    precision: str | None = None
    """the precision the pilot runs (FP8 without torchao: its bf16-mixed stand-in)"""

    def notes(self) -> list[str]:
        out = []
        if self.ran:
            out.append(f"kernels {', '.join(self.ran)}: ran as the spec says (measured)")
        fp8 = [k for k in self.stand_ins if k.endswith(FP8_LABEL)]
        other = {k: v for k, v in self.stand_ins.items() if k not in fp8}
        if other:
            out.append(f"kernels {'; '.join(f'{k} ({why})' for k, why in other.items())}: not "
                       "run here - the pilot ran transformers' stock path (SDPA attention) in "
                       "their place and did NOT measure them; their memory is in the plan "
                       "(plan/analytic/variants.py), their speed in the time model")
        for k in fp8:
            out.append(f"precision {k.split(' ')[0]}: FP8 is NOT measured ({self.stand_ins[k]}) "
                       "- the pilot ran its bf16-mixed stand-in; the quote applies the recipe's "
                       "speed-up from published FP8 runs, and the plan models FP8's memory")
        return out


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _why_not(name: str, device, spec, has: Callable[[str], bool]) -> str | None:
    """Why kernel ``name`` cannot run here (None: it can)."""
    kind = getattr(device, "kind", "cpu")
    if kind == "cpu":
        return "Triton/CUDA kernels need a GPU; this pilot runs on the CPU"
    if name in ("unsloth", "unsloth_gradient_checkpointing"):
        return "Unsloth replaces the model's code; tunepilot's step builds transformers' own"
    if name == "transformer_engine" or (name == "fp8" and spec.precision.fp8_recipe.own_modules):
        return ("Transformer Engine trains through its own modules under te.fp8_autocast, not a "
                "patch of transformers' model")
    package, pip, least = PACKAGES[name]
    if kind == "rocm" and name != "liger":
        return f"{name} has no ROCm build tunepilot runs"
    cc = _capability(device)
    if kind == "cuda" and cc is not None and cc < least:
        return (f"{name} needs compute capability {least[0]}.{least[1]}+; "
                f"{getattr(device, 'name', 'this GPU')} is {cc[0]}.{cc[1]}")
    if name == "fp8" and spec.method.is_lora:
        return ("torchao's float8 training converts the linears that train; a LoRA run's base "
                "is frozen (the plan models its FP8 memory)")
    if name in HF_ATTENTION and name != "flex" and spec.precision.all_fp32:
        return f"{name} runs in 16-bit; precision {spec.precision} computes in fp32"
    if not has(package):
        return f"{package} is not installed (pip install {pip})"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        return False


def choose(spec, device, has: Callable[[str], bool] = _installed) -> KernelChoice:
    """Which of the spec's kernels run on ``device`` (a DeviceInfo), which stand in and why."""
    k = spec.kernels
    wanted = {"liger": bool(k.liger), "cut_cross_entropy": k.cut_cross_entropy,
              "unsloth": k.unsloth,
              "unsloth_gradient_checkpointing": k.unsloth_gradient_checkpointing,
              "transformer_engine": k.transformer_engine,
              k.attention: k.attention in HF_ATTENTION,
              "fp8": spec.precision.is_fp8}
    out = KernelChoice(kernels=k.model_dump(), precision=str(spec.precision))
    off = {"liger": [], "cut_cross_entropy": False, "unsloth": False,
           "unsloth_gradient_checkpointing": False, "transformer_engine": False}
    for name, on in wanted.items():
        if not on:
            continue
        why = _why_not(name, device, spec, has)
        label = {"liger": f"liger {', '.join(k.liger)}",
                 "fp8": f"{spec.precision}{FP8_LABEL}"}.get(name, name)
        if why is None:
            out.ran.append(label)
            continue
        out.stand_ins[label] = why
        if "is not installed" in why:
            out.missing_packages[label] = PACKAGES[name][1]
        if name == "fp8":
            out.precision = str(spec.precision.stand_in)
        elif name in HF_ATTENTION:
            out.kernels["attention"] = "sdpa"
        else:
            out.kernels[name] = off[name]
    return out


def attention_impl(spec, device=None) -> str:
    """transformers' attn_implementation: eager when the spec says so; flash-attention 2/3 and
    flex where they run on ``device`` (a DeviceInfo, or a torch device on a GPU with the package);
    else sdpa (SDPA's flash kernel saves the same, said where the pilot runs it)."""
    a = spec.kernels.attention
    if a == "eager":
        return "eager"
    if a in HF_ATTENTION and device is not None and str(device).startswith("cuda") and \
            _installed(PACKAGES[a][0]) and not spec.precision.all_fp32:
        return HF_ATTENTION[a]
    return "sdpa"


def apply_kernels(spec, model, device) -> list[str]:
    """Put the spec's kernels into the model (on meta, before LoRA and materialisation) where
    they run on ``device``; the names applied. A kernel that cannot run here is left out (the
    pilot chose its stand-in beforehand and said so)."""
    if not str(device).startswith("cuda"):
        return []
    done = []
    k = spec.kernels
    if k.liger and _installed("liger_kernel"):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        flags = {n: n in k.liger for n in ("rope", "rms_norm", "swiglu", "cross_entropy",
                                           "fused_linear_cross_entropy", "layer_norm", "geglu")}
        _apply_liger_kernel_to_instance(model=model, **_accepted(
            _apply_liger_kernel_to_instance, flags))
        done.append("liger")
    if k.cut_cross_entropy and _installed("cut_cross_entropy"):
        from cut_cross_entropy.transformers import cce_patch

        cce_patch(model)
        done.append("cut_cross_entropy")
    fp8 = spec.precision.fp8_recipe
    recipe = fp8.torchao_recipe if fp8 is not None else None
    if recipe is not None and _installed("torchao") and not spec.method.is_lora:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def eligible(mod, fqn: str) -> bool:  # torchao's own rule: dims multiples of 16
            return fqn.split(".")[-1] != "lm_head" and mod.in_features % 16 == 0 and \
                mod.out_features % 16 == 0

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=eligible)
        done.append(f"torchao float8 {recipe}")
    return done


def _accepted(fn, flags: dict) -> dict:
    """The flags ``fn`` takes (Liger's per-model functions differ: GeGLU models have no swiglu)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return flags
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return flags
    return {n: v for n, v in flags.items() if n in params}
