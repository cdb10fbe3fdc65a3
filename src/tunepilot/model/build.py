"""Build the model a spec describes: a Hugging Face causal LM from its config, with the spec's
precision, PEFT LoRA, and activation checkpointing - on a real device, on meta, or for a trace.

Weights are random (seeded) unless `model.weights` names a local checkpoint directory: memory and
speed do not depend on weight values, and nothing is ever downloaded.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tunepilot.errors import UserError
from tunepilot.model.arch import META_KEY, resolve_model_config
from tunepilot.spec import RunSpec

if TYPE_CHECKING:
    import torch


# transformers 5 deprecates the gradient-checkpointing names PEFT still calls; not the user's concern
warnings.filterwarnings("ignore", category=FutureWarning, message=".*gradient_checkpointing.*")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def parameter_dtype(spec: RunSpec) -> str:
    """The dtype the model is built in: the frozen base's for LoRA, else by precision
    (fp32 parameters under fp32 and *-mixed, bf16 under bf16-true)."""
    if spec.method.is_lora:
        return spec.frozen_base_dtype
    return spec.precision.parameter_dtype


def attention_impl(spec: RunSpec, device=None) -> str:
    """transformers' attn_implementation tunepilot builds (model/kernels.py): eager when the
    spec says so, flash-attention 2/3 or flex where they run on ``device``, else sdpa."""
    from tunepilot.model.kernels import attention_impl as impl

    return impl(spec, device)


def hf_config(spec: RunSpec, base_dir: Path | None = None, config: dict | None = None):
    """transformers' config object for the spec's model (SDPA attention, no KV cache)."""
    from transformers import AutoConfig

    cfg = dict(config if config is not None else resolve_model_config(spec, base_dir))
    cfg.pop(META_KEY, None)
    model_type = cfg.pop("model_type", None)
    if spec.model.rope_scaling:
        _scale_rope(cfg, spec.model.rope_scaling)
    if not model_type:
        raise UserError("model.config", "the config has no 'model_type'.",
                        "Use the model's own config.json from the Hugging Face hub.")
    try:
        hf = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as exc:
        raise UserError("model.config", f"transformers cannot build model_type {model_type!r}: "
                        f"{exc}", "Upgrade transformers, or use a supported architecture.") from None
    hf.use_cache = False
    return hf


def _scale_rope(cfg: dict, factor: float) -> None:
    """The spec's RoPE scaling (model/context.py): linear position interpolation by ``factor``;
    over a config that scales RoPE already (Llama 3.1's llama3, YaRN), its own factor x this,
    so the context is the config's x ``factor`` either way."""
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        rope.update(rope_type="linear", factor=float(factor))
    else:
        rope["factor"] = float(rope.get("factor") or 1.0) * factor
    cfg[key] = rope


def build_model(spec: RunSpec, device: str | torch.device = "cpu", *, base_dir: Path | None = None,
                config: dict | None = None, kernels: bool = False) -> torch.nn.Module:
    """The spec's model on `device` ("meta" builds without allocating), materialised whole:
    built on the meta device, then every module initialised on `device` (seeded per module:
    model/materialize.py) or read from `model.weights` a tensor at a time. ``kernels``: the
    spec's kernels that run on `device` go in (model/kernels.py; the pilot's choice), else
    transformers' stock path."""
    import torch

    if spec.method.kind == "qlora":
        return _build_qlora(spec, device, base_dir, config)
    if str(device) == "meta":
        return _build_on_meta(spec, base_dir, config)
    model = build_meta_model(spec, base_dir, config, device if kernels else None)
    materializer(model, spec, device, base_dir)(model)
    torch.manual_seed(spec.seed)
    return model


def _build_on_meta(spec: RunSpec, base_dir: Path | None, config: dict | None):
    """Everything on meta, buffers too (the trace turns them into fake tensors)."""
    import torch

    with torch.device("meta"):
        model = _from_config(spec, hf_config(spec, base_dir, config))
    return _finish(spec, model)


def build_meta_model(spec: RunSpec, base_dir: Path | None = None, config: dict | None = None,
                     device=None):
    """The spec's model - the kernels that run on ``device`` (model/kernels.py), LoRA adapters,
    activation checkpointing - with every parameter on the meta device (no bytes) and its
    buffers as the model's code computes them; materialise it with ``materializer`` (whole, or
    one FSDP unit at a time: model/shard.py)."""
    from tunepilot.model.kernels import apply_kernels
    from tunepilot.model.materialize import parameters_on_meta

    hf = hf_config(spec, base_dir, config)
    weights_path(spec, base_dir)  # a bad path fails before anything is built
    with parameters_on_meta():
        model = _from_config(spec, hf, device=device)
        if device is not None:
            apply_kernels(spec, model, device)
        return _finish(spec, model)


def _from_config(spec: RunSpec, hf, dtype=None, device=None):
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch_dtype(parameter_dtype(spec))
    if spec.model.task == "sequence-classification":
        from transformers import AutoModelForSequenceClassification

        hf.num_labels = spec.model.num_labels
        if getattr(hf, "pad_token_id", None) is None:
            hf.pad_token_id = 0  # the head pools the last non-pad token: it needs one
        return AutoModelForSequenceClassification.from_config(
            hf, attn_implementation=attention_impl(spec, device), dtype=dtype)
    attn = attention_impl(spec, device)
    try:
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=attn, dtype=dtype)
    except ValueError as exc:  # a model with no SDPA path (gpt-oss: its attention sinks)
        if attn != "sdpa" or "does not support an attention implementation" not in str(exc):
            raise
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=dtype)
    if spec.moe.experts_layout == "per_expert":  # a linearized checkpoint's nn.Linear experts
        from tunepilot.model.linearized import linearize_experts

        linearize_experts(model)
    return model


def _finish(spec: RunSpec, model):
    model.config.use_cache = False
    apply_experts_implementation(spec, model)
    if spec.method.is_lora:
        model = apply_lora(spec, model)
    elif spec.model.implementation == "litgpt":  # its fused qkv output, kept through v
        from tunepilot.model.litgpt import fused_qkv_storage

        fused_qkv_storage(model)
    apply_checkpointing(spec, model)
    return model


def weights_path(spec: RunSpec, base_dir: Path | None) -> Path | None:
    """The local checkpoint directory model.weights names (None: random weights)."""
    if spec.model.weights == "random":
        return None
    path = Path(spec.model.weights)
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    if not (path / "config.json").exists():
        raise UserError("model.weights", f"{str(path)!r} is not a local Hugging Face "
                        "checkpoint directory (no config.json).",
                        "Use 'random' or the path of a directory saved by save_pretrained().")
    return path


def materializer(model, spec: RunSpec, device, base_dir: Path | None = None):
    """What fills a meta model on `device`: seeded random init, or `model.weights` read a
    tensor at a time (model/materialize.py)."""
    from tunepilot.model.materialize import Materializer, SafetensorsWeights

    path = weights_path(spec, base_dir)
    return Materializer(model, spec.seed, device,
                        SafetensorsWeights(path) if path is not None else None)


def apply_experts_implementation(spec: RunSpec, model: torch.nn.Module) -> None:
    """An MoE model's experts run as spec.moe.implementation (transformers >= 5 dispatches them:
    grouped_mm, eager, batched_mm) - what the plan models. A dense model, or experts code that
    takes no implementation (Llama 4's), is left as built; where torch has no grouped_mm kernel
    transformers' own fallback to eager stays (the default asked for nothing else)."""
    if not any(hasattr(m, "_is_expert_parallel") for m in model.modules()):
        return  # no @use_experts_implementation experts in this model
    try:
        model.set_experts_implementation(spec.moe.implementation)
    except (ValueError, ImportError) as exc:
        if spec.moe.implementation != "grouped_mm":
            raise UserError("moe.implementation", f"transformers cannot run the experts as "
                            f"{spec.moe.implementation!r} here: {exc}",
                            "Use grouped_mm (the default) or eager.") from None


def apply_lora(spec: RunSpec, model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA with the spec's rank, alpha, dropout and targets: adapters in fp32 (PEFT's
    default autocast_adapter_dtype=True), or in bf16 with method.adapter_dtype: bf16 (LitGPT's
    and torchtune's pure-bf16 runs); DoRA (use_dora), rsLoRA (use_rslora) and modules trained
    in full beside the adapters (modules_to_save) as the spec's method says."""
    from peft import LoraConfig, get_peft_model

    m = spec.method
    targets = m.lora_targets if m.lora_targets == "all-linear" else list(m.lora_targets)
    params = expert_parameters(model, targets)  # LoRA on raw parameters: fused MoE experts
    if params:
        targets = [t for t in targets if t not in params]
    # Megatron's LoRA drops out every target's input, fused experts' included; PEFT's adapter on a
    # raw parameter (lora.ParamWrapper) takes no dropout and refuses the config: the stand-in is
    # built without and the modules' adapters get theirs after (the experts' copies not traced)
    later_dropout = m.lora_dropout if spec.model.implementation == "megatron" else 0.0
    cfg = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha,
                     lora_dropout=0.0 if later_dropout else m.lora_dropout,
                     target_modules=targets, bias="none", use_dora=m.dora,
                     target_parameters=[params[t] for t in params] or None,
                     use_rslora=m.rslora, modules_to_save=list(m.modules_to_save) or None,
                     task_type="SEQ_CLS" if spec.model.task == "sequence-classification" else
                     "CAUSAL_LM")
    bf16 = m.adapter_dtype == "bf16"
    try:
        peft_model = get_peft_model(model, cfg, autocast_adapter_dtype=not bf16)
    except ValueError as exc:
        if "ParamWrapper" in str(exc):  # PEFT's LoRA on fused MoE experts (raw parameters)
            raise UserError("method.dora" if "use_dora" in str(exc) else "method.lora_dropout",
                            "PEFT puts LoRA on this model's fused MoE "
                            "experts as parameters (lora.ParamWrapper), which refuses this "
                            f"method: {exc} Your PEFT run would stop the same way.",
                            "Set method.lora_dropout: 0 (and no DoRA), or list "
                            "method.lora_targets without the experts (e.g. q_proj, k_proj, "
                            "v_proj, o_proj).") from None
        field = "method.modules_to_save" if m.modules_to_save and "modules_to_save" in str(
            exc) else "method.lora_targets"
        raise UserError(field, f"PEFT cannot apply LoRA to {targets!r}: {exc}",
                        "Use module names of this model (e.g. q_proj, v_proj) or 'all-linear'."
                        ) from None
    if later_dropout:
        _dropout_on_module_adapters(peft_model, later_dropout)
    if bf16:
        import torch

        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # adapters and DoRA's magnitude (not modules_to_save copies)
                p.data = p.data.to(torch.bfloat16)
    if spec.model.implementation == "litgpt":  # its fused-qkv LoRA keeps the adapters' output
        from tunepilot.model.litgpt import fused_qkv_storage, keep_lora_output

        keep_lora_output(peft_model, m.lora_qkv_parts)
        fused_qkv_storage(peft_model)
    return peft_model


def _dropout_on_module_adapters(peft_model, p: float) -> None:
    """Dropout of probability `p` on the input of every module adapter (PEFT's LoraLayer, as
    LoraConfig(lora_dropout=p) builds it), none on the raw-parameter adapters (ParamWrapper)."""
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    for mod in peft_model.modules():
        if isinstance(mod, LoraLayer) and not isinstance(mod, ParamWrapper):
            for name in list(mod.lora_dropout.keys()):
                mod.lora_dropout[name] = torch.nn.Dropout(p=p)


def expert_parameters(model, targets) -> dict[str, str]:
    """Target names that are raw parameters, not modules (transformers >= 5 fuses each layer's
    MoE experts into experts.gate_up_proj / experts.down_proj): name -> the parameter's path
    in a layer, for PEFT's target_parameters (its 4.x aliases w1/w2/w3 PEFT maps itself)."""
    if not isinstance(targets, list):
        return {}
    modules = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    out = {}
    for t in targets:
        if t in modules:
            continue
        hit = next((n for n, _ in model.named_parameters() if n.endswith("." + t)), None)
        if hit is not None:  # model.layers.0.mlp.experts.gate_up_proj -> mlp.experts.gate_up_proj
            out[t] = ".".join(hit.split(".")[3:]) if ".layers." in hit else t
    return out


def _every_other_mm_contexts():
    """torchtitan's per-op SAC for one checkpointed layer: keep SDPA outputs and every other
    matmul output (the 1st, 3rd, ...), recompute the rest - counted separately in the forward
    and in the recompute, so both make the same choices."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}
    sdpa = {torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return (CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else
                    CheckpointPolicy.PREFER_RECOMPUTE)
        return CheckpointPolicy.MUST_SAVE if op in sdpa else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _selective_policy(ctx, op, *args, **kwargs):
    """Op-level selective checkpointing (as torchtitan's 'op' SAC): keep matmul and attention
    outputs, recompute the cheap elementwise ops in backward."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(spec: RunSpec, model: torch.nn.Module) -> None:
    """Per-decoder-layer activation checkpointing (non-reentrant) as the spec asks."""
    if spec.activation_checkpointing == "none":
        return
    kwargs: dict = {"use_reentrant": False}
    if spec.activation_checkpointing == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    elif spec.activation_checkpointing == "selective-op":
        kwargs["context_fn"] = _every_other_mm_contexts
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable = getattr(target, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    target.train()


def _check_qlora(spec: RunSpec, device) -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available() or \
            str(device) in ("cpu", "meta"):
        raise UserError("method.kind", "qlora needs bitsandbytes and a CUDA device, which this "
                        "machine does not have.",
                        "Plan it here (`tunepilot plan` models the NF4 base), pilot it on the GPU "
                        "you intend to rent (pip install bitsandbytes), or use kind: lora for a "
                        "CPU pilot.")


def _build_qlora(spec: RunSpec, device, base_dir, config) -> torch.nn.Module:
    """QLoRA, whole on one device: bitsandbytes NF4 linears (CUDA only) packed in
    method.quant_storage's dtype, bf16 compute, LoRA on top - built on meta and quantised a
    module at a time on the device (the host never holds the bf16 model)."""
    import torch

    model = build_qlora_meta_model(spec, device, base_dir, config)
    materializer(model, spec, device, base_dir)(model)
    torch.manual_seed(spec.seed)
    return model


def build_qlora_meta_model(spec: RunSpec, device, base_dir, config) -> torch.nn.Module:
    """The QLoRA model on meta: every linear bitsandbytes quantizes is a Linear4bit whose
    Params4bit packs its codes in ``spec.quant_storage_dtype`` (bnb_4bit_quant_storage: bf16
    lets FSDP flatten and shard it beside the bf16 norms); Materializer quantizes each on the
    device from a seeded (or checkpoint) bf16 weight."""
    _check_qlora(spec, device)
    import bitsandbytes as bnb
    import torch

    from tunepilot.model.materialize import parameters_on_meta

    hf = hf_config(spec, base_dir, config)
    weights_path(spec, base_dir)
    storage = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16,
               "fp32": torch.float32}[spec.quant_storage_dtype]
    skip = set() if spec.method.quantize_lm_head else {"lm_head"}
    with parameters_on_meta():
        model = _from_config(spec, hf, torch.bfloat16, device)
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child_name not in skip:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                      bias=child.bias is not None, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", quant_storage=storage,
                                      compress_statistics=spec.method.double_quant,
                                      device="meta")
                setattr(module, child_name, q)
    for p in model.parameters():
        p.requires_grad_(False)
    model.config.use_cache = False
    apply_experts_implementation(spec, model)
    model = apply_lora(spec, model)
    apply_checkpointing(spec, model)
    return model


def build_sharded_model(spec: RunSpec, device, *, mesh=None, offload: bool = False,
                        base_dir: Path | None = None, config: dict | None = None,
                        kernels: bool = False):
    """The spec's model sharded with FSDP (model/shard.py) as it is materialised: built on the
    meta device, then each unit - a decoder layer, then the root - materialised whole on
    `device` (seeded init, or its tensors read from model.weights) and sharded before the next,
    so this rank never holds more than its shards plus one unsharded unit."""
    import torch

    from tunepilot.model.shard import shard_model

    model = build_qlora_meta_model(spec, device, base_dir, config) \
        if spec.method.kind == "qlora" else \
        build_meta_model(spec, base_dir, config, device if kernels else None)
    fill = materializer(model, spec, device, base_dir)
    model = shard_model(model, spec, mesh=mesh, device=torch.device(device), offload=offload,
                        materialize=fill)
    torch.manual_seed(spec.seed)
    return model


def trainable_parameters(model: torch.nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def output_head(model: torch.nn.Module):
    """(decoder body, lm_head) of a causal LM, through a PEFT wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()  # .model/.lm_head, .gpt_neox/.embed_out
