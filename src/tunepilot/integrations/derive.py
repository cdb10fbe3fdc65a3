"""The tunepilot spec of a run the user started themselves (HF Trainer, TRL, Lightning): read from
the live model and the trainer's arguments, written as spec.yaml + model-config.json in the run
directory so that `tunepilot quote RUN/spec.yaml --from RUN` and `report --from RUN` work on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunepilot.integrations.importers.common import OPTIMIZERS

SPEC_FILE = "spec.yaml"
MODEL_CONFIG_FILE = "model-config.json"


def _base_model(model: Any) -> tuple[Any, dict]:
    """The transformers model under a PEFT wrapper, and the LoRA fields of the wrapper."""
    method: dict = {"kind": "full"}
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        cfg = next(iter(peft_config.values()))
        targets = getattr(cfg, "target_modules", None)
        if isinstance(targets, str):
            targets = "all-linear" if targets == "all-linear" else [targets]
        elif targets is not None:
            targets = sorted(targets)
        method = {"kind": "lora", "lora_rank": int(getattr(cfg, "r", 8)),
                  "lora_alpha": float(getattr(cfg, "lora_alpha", 8)),
                  "lora_dropout": float(getattr(cfg, "lora_dropout", 0.0) or 0.0)}
        if targets:
            method["lora_targets"] = targets
        method.update(_variants(cfg))  # DoRA, rsLoRA, modules_to_save
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        q = quant if isinstance(quant, dict) else quant.to_dict()
        if q.get("load_in_4bit") and method["kind"] == "lora":
            method["kind"] = "qlora"
            method["double_quant"] = bool(q.get("bnb_4bit_use_double_quant"))
    return model, method


def _variants(cfg: Any) -> dict:
    """The adapter variants the plan models (modules_to_save: the ones it can size)."""
    from tunepilot.integrations.kernels_seen import adapter_variants
    from tunepilot.plan.analytic.variants import EMBEDDING_NAMES

    out = adapter_variants(cfg)
    mods = [m for m in out.pop("modules_to_save", []) if m in EMBEDDING_NAMES + ("lm_head",)]
    return dict(out, modules_to_save=mods) if mods else out


def _precision(model: Any, bf16: bool, fp16: bool, method: dict, notes: list[str]) -> str:
    """The spec's precision from what the trained parameters are, then the trainer's flags: a
    full fine-tune of a model loaded in bfloat16 keeps bf16 weights, gradients and optimizer
    state whatever autocast does (bf16-true); bf16 LoRA adapters are method.adapter_dtype."""
    import torch

    trained = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if trained == {torch.bfloat16}:
        if method["kind"] == "full":
            notes.append("the trained parameters are bf16 (the model was loaded in bfloat16): "
                         "planned as bf16-true - bf16 weights, gradients and optimizer state")
            return "bf16-true"
        method["adapter_dtype"] = "bf16"
    if bf16:
        return "bf16-mixed"
    if fp16:
        return "fp16-mixed"
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return "bf16-true" if dtypes == {torch.bfloat16} else "fp32"


def derive_spec(model: Any, out_dir: Path, *, micro_batch_size: int, accumulation: int,
                sequence_length: int, bf16: bool = False, fp16: bool = False,
                optim: str | None = None, lr: float | None = None,
                gradient_checkpointing: bool = False, world_size: int = 1,
                name: str | None = None, precision: str | None = None,
                optimizer: str | None = None, max_steps: int | None = None,
                eval_every_steps: int | None = None, save_every_steps: int | None = None,
                objective: dict | None = None) -> tuple[Any, Any, list[str]]:
    """(RunSpec, Arch, notes) of the live run; writes spec.yaml and model-config.json."""
    import yaml

    from tunepilot.integrations.fp8_seen import fp8_in_use
    from tunepilot.model.arch import resolve_arch
    from tunepilot.spec import load_spec
    from tunepilot.store import atomic_write_bytes

    notes: list[str] = []
    base, method = _base_model(model)
    fp8, seen = fp8_in_use(model)  # FP8 modules decide the precision whatever the flags say
    if fp8 and method["kind"] != "qlora":
        precision = fp8
        notes.append(seen)
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise ValueError("the model has no transformers config: the spec cannot name it")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / MODEL_CONFIG_FILE,
                       config.to_json_string(use_diff=False).encode())
    opt_name, impl = OPTIMIZERS.get(str(optim or "adamw_torch"), ("adamw", None))
    if optimizer:
        opt_name, impl = optimizer, None
    elif optim and str(optim) not in OPTIMIZERS:
        notes.append(f"optimizer {optim!r} is not modelled: planned as adamw")
    spec: dict = {
        "name": name or Path(str(getattr(config, "_name_or_path", "") or "run")).name or "run",
        "model": {"config": MODEL_CONFIG_FILE}, "method": method,
        "sequence_length": int(sequence_length), "micro_batch_size": int(micro_batch_size),
        "gradient_accumulation_steps": int(accumulation),
        "precision": precision or _precision(base, bf16, fp16, method, notes),
        "optimizer": {"name": opt_name, **({"impl": impl} if impl else {}),
                      **({"lr": float(lr)} if lr else {})},
        "activation_checkpointing": "full" if gradient_checkpointing else "none",
    }
    from tunepilot.integrations.kernels_seen import kernels_in_use

    kernels, seen = kernels_in_use(model)  # what the live model runs: Liger, attention, ...
    if kernels:
        spec["kernels"] = kernels
        notes += seen
    if max_steps and max_steps > 0:  # the trainer's own length, not tunepilot's default target
        spec["target"] = {"steps": int(max_steps)}
    if eval_every_steps and eval_every_steps > 0:
        spec["validation"] = {"every_steps": int(eval_every_steps)}
    if save_every_steps and save_every_steps > 0:
        spec["checkpoint"] = {"every_steps": int(save_every_steps)}
    if objective:  # a TRL trainer's objective (hf.objective_of)
        spec["objective"] = objective
    if world_size > 1:
        spec["parallel"] = {"strategy": "ddp", "devices": int(world_size)}
        notes.append(f"{world_size} ranks: recorded as DDP (the strategy is not visible to "
                     "the callback)")
    head = "# derived by tunepilot's callback from the user's own run (model, trainer args)\n"
    path = out_dir / SPEC_FILE
    atomic_write_bytes(path, (head + yaml.safe_dump(spec, sort_keys=False)).encode())
    loaded = load_spec(path)
    return loaded, resolve_arch(loaded, out_dir), notes


def find_hf_model(module: Any) -> Any:
    """The transformers (or PEFT) model inside a LightningModule: itself or a submodule."""
    if _has_config(module):
        return module
    for child in getattr(module, "modules", lambda: [])():
        if child is not module and (_has_config(child) or hasattr(child, "peft_config")):
            return child
    return None


def _has_config(m: Any) -> bool:
    return hasattr(getattr(m, "config", None), "to_json_string")


def provenance_model(model: Any) -> dict:
    base, _ = _base_model(model)
    config = getattr(base, "config", None)
    return {"name_or_path": getattr(config, "_name_or_path", None),
            "class": type(base).__name__, "config_file": MODEL_CONFIG_FILE,
            "transformers_version": getattr(config, "transformers_version", None)}
