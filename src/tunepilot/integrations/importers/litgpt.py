"""LitGPT's `litgpt finetune_lora|finetune_full --config FILE` YAML (config_hub/finetune/*) -> a
tunepilot spec with model.implementation litgpt (its chunked loss; its fused-qkv LoRA).

LitGPT adapts the matrices its flags name: lora_query, lora_key, lora_value (parts of its one
fused qkv matrix per layer - on a model with split q/k/v projections, those projections; on a
fused one, method.lora_qkv_parts), lora_projection (the attention output), lora_mlp (every MLP
matrix), lora_head (lm_head). Its defaults (litgpt 0.5 finetune/lora.py setup): r 8, alpha 16,
dropout 0.05 on query and value; precision bf16-true where the card has bf16. The model is
built in the precision's dtype (bf16-true: weights and adapters bf16; -mixed: fp32 under
autocast). ``quantize: bnb.nf4[-dq]`` is QLoRA as Fabric's BitsandbytesPrecision runs it: every
Linear quantized (lm_head too) after the 16-bit weights load, AdamW replaced by bitsandbytes'
PagedAdamW (utils.instantiate_bnb_optimizer); LitGPT refuses it with mixed precision or more
than one device. On more than one device finetune_lora runs FSDP2 (ModelParallelStrategy's
parallelize_fn: fully_shard per Block and trainable Linear, each Block checkpointed) and
finetune_full Lightning's FSDPStrategy (FSDP1, each Block wrapped and checkpointed).
"""

from __future__ import annotations

from pathlib import Path

from tunepilot.integrations.importers.common import (
    Mapper,
    model_source,
    number,
    truthy,
    value_number,
)
from tunepilot.spec.precision import Precision

SOURCE = "litgpt"
LORA_FLAGS = ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head")
MAPPED = {"checkpoint_dir", "precision", "quantize", "devices", "num_nodes", "lora_r",
          "lora_alpha", "lora_dropout", *LORA_FLAGS, "train", "eval", "optimizer", "seed", "data"}
KNOWN = MAPPED | {"out_dir", "logger_name", "access_token", "resume", "initial_checkpoint_dir"}
_PRECISION = {"bf16-true": "bf16-true", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
              "32-true": "fp32", "32": "fp32", "bf16": "bf16-mixed", "16": "fp16-mixed"}
_OPTIMIZERS = {"adamw": "adamw", "torch.optim.adamw": "adamw", "sgd": "sgd",
               "torch.optim.sgd": "sgd", "bitsandbytes.optim.pagedadamw": "paged_adamw",
               "bitsandbytes.optim.adamw8bit": "adamw_8bit",
               "bitsandbytes.optim.pagedadamw8bit": "paged_adamw_8bit"}
_ATTN_OUT = ("o_proj", "dense", "out_proj", "c_proj")


def looks_like(raw: dict) -> bool:
    return "checkpoint_dir" in raw and (isinstance(raw.get("train"), dict)
                                        or any(k in raw for k in LORA_FLAGS))


def convert(m: Mapper) -> None:
    ckpt = m.get("checkpoint_dir")
    local = Path(str(ckpt)) if ckpt else None
    if local is not None and not local.is_absolute():
        local = m.path.parent / local
    hub = str(ckpt) if local is not None and local.exists() else \
        "/".join(str(ckpt).rstrip("/").split("/")[-2:]) if ckpt else ckpt
    m.set("model", dict(model_source(m, "checkpoint_dir", hub), implementation="litgpt"),
          "checkpoint_dir")
    written = str(m.get("precision", "bf16-true"))  # LitGPT's (Lightning's) name
    if written not in _PRECISION:
        m.fail("precision", f"{written!r} is not a precision tunepilot plans.",
               f"Use one of {', '.join(_PRECISION)}.")
    m.set("precision", _PRECISION[written], "precision")
    precision = Precision(_PRECISION[written])
    train = _section(m, "train")
    seq = value_number(m, "train.max_seq_length", train.get("max_seq_length"), least=1)
    if seq is None:
        m.fail("train.max_seq_length", "is not set: LitGPT then pads each batch to its longest "
               "sample, which the config does not say.",
               "Set train.max_seq_length to your data's longest sample (in tokens).")
    _set(m, "sequence_length", seq, "train.max_seq_length")
    devices = _devices(m)
    micro = value_number(m, "train.micro_batch_size", train.get("micro_batch_size"), least=1) or 1
    _set(m, "micro_batch_size", micro, "train.micro_batch_size")
    glob = value_number(m, "train.global_batch_size", train.get("global_batch_size"), least=1)
    if glob:
        per_step = micro * devices
        if glob % per_step:
            m.fail("train.global_batch_size", f"{glob} is not a multiple of micro_batch_size x "
                   f"devices ({per_step}).", "LitGPT accumulates global / (micro x devices) "
                   "micro-batches: make it a multiple.")
        _set(m, "gradient_accumulation_steps", glob // per_step, "train.global_batch_size")
    _method(m, precision)
    lora = m.spec["method"]["kind"] != "full"
    if devices > 1:
        if m.spec["method"]["kind"] == "qlora":
            m.fail("quantize", f"with {devices} devices: LitGPT runs quantization on one device "
                   "only (NotImplementedError in finetune/lora.py).",
                   "Set devices: 1 and num_nodes: 1, or remove quantize.")
        version = 2 if lora else 1
        m.set("parallel", {"strategy": "fsdp", "devices": devices, "fsdp_version": version},
              "devices", "num_nodes")
        m.set("activation_checkpointing", "full", "devices")
        m.note(f"devices {devices}: LitGPT's " + ("FSDP2 (fully_shard per Block" if lora else
               "FSDPStrategy (FSDP1, each Block wrapped") + "), each Block checkpointed")
    _optimizer(m)
    seed = number(m, "seed")
    if seed is not None:
        m.set("seed", seed, "seed")
    _targets(m)
    _schedule(m, train)
    if m.has("data"):
        m.get("data")
        m.note("data: LitGPT's data module downloads or prepares its dataset, which is not "
               "read here: planned with synthetic tokens at train.max_seq_length")


def _schedule(m: Mapper, train: dict) -> None:
    """train/eval's schedule: checkpoint and validation intervals, validation batches, the
    run's length; every other key in them said to have no effect or to be ignored."""
    evals = _section(m, "eval")
    for where, value, dotted in (("train.save_interval", train.get("save_interval"),
                                  "checkpoint.every_steps"),
                                 ("eval.interval", evals.get("interval"),
                                  "validation.every_steps")):
        n = value_number(m, where, value, least=1)
        if n is not None:
            _set(m, dotted, n, where)
    iters = value_number(m, "eval.max_iters", evals.get("max_iters"), least=1)
    if iters is not None:
        _set(m, "validation.num_batches", iters, "eval.max_iters")
    steps = value_number(m, "train.max_steps", train.get("max_steps"), least=1)
    tokens = value_number(m, "train.max_tokens", train.get("max_tokens"), least=1)
    if steps:
        m.spec["_max_steps"] = steps
    elif tokens:
        _set(m, "target.tokens", tokens, "train.max_tokens")
    elif train.get("epochs") is not None:
        m.note(f"train.epochs {train['epochs']}: not mapped - synthetic data has no epochs "
               "(set target.steps, or plan with your data)")
    if truthy(train.get("tie_embeddings")):
        m.fail("train.tie_embeddings", "is true: tying the input and output embeddings changes "
               "the model tunepilot sizes from its config.",
               "Remove it (the checkpoint's config says whether they are tied).")
    _unread(m, "train", train, _TRAIN_READ, _TRAIN_NO_EFFECT)
    _unread(m, "eval", evals, _EVAL_READ, _EVAL_NO_EFFECT)


# litgpt/args.py TrainArgs / EvalArgs: the keys read above, and those that change neither memory
# nor time (logging, the learning-rate schedule, clipping, the sample generated after validation)
_TRAIN_READ = {"save_interval", "global_batch_size", "micro_batch_size", "max_seq_length",
               "max_steps", "max_tokens", "epochs", "tie_embeddings"}
_TRAIN_NO_EFFECT = {"log_interval", "lr_warmup_steps", "lr_warmup_fraction", "max_time",
                    "max_norm", "min_lr"}
_EVAL_READ = {"interval", "max_iters"}
_EVAL_NO_EFFECT = {"max_new_tokens", "initial_validation", "final_validation",
                   "evaluate_example"}


def _unread(m: Mapper, name: str, section: dict, read: set[str], no_effect: set[str]) -> None:
    """A section's keys beyond those read: said to have no effect, or not modelled - never
    dropped in silence."""
    quiet = sorted(k for k in section if k in no_effect and section[k] is not None)
    other = sorted(k for k in section if k not in read and k not in no_effect)
    if quiet:
        m.note(f"{', '.join(f'{name}.{k}' for k in quiet)}: no effect on memory or time")
    if other:
        m.note(f"{', '.join(f'{name}.{k}' for k in other)}: not LitGPT keys tunepilot knows - "
               "ignored (not modelled)")


def _set(m: Mapper, dotted: str, value, where: str) -> None:
    """Set a spec field from a key inside a section (train.max_seq_length): the section maps to
    every field its keys set."""
    section = where.split(".")[0]
    before = m.mapped.get(section)
    m.set(dotted, value, section)
    m.mapped[section] = f"{before}, {dotted}" if before else dotted


def _section(m: Mapper, key: str) -> dict:
    value = m.get(key, {})
    if not isinstance(value, dict):
        m.fail(key, f"is {value!r}: LitGPT writes it as a mapping of settings.")
    return value


def _devices(m: Mapper) -> int:
    devices = m.get("devices", 1)
    if devices in ("auto", -1):
        m.fail("devices", f"is {devices!r}: LitGPT then takes every visible GPU.",
               "Set devices to the number of GPUs per node you will rent.")
    n = number(m, "devices", least=1) or 1
    return n * (number(m, "num_nodes", least=1) or 1)


def _method(m: Mapper, precision: Precision) -> None:
    lora = any(m.has(k) for k in ("lora_r", "lora_alpha", "lora_dropout", *LORA_FLAGS))
    quant = m.get("quantize")
    if not lora:
        if quant:
            m.fail("quantize", f"{quant!r} on a full fine-tune: LitGPT quantizes the frozen base "
                   "of an adapter run.", "Remove quantize, or fine-tune with LoRA.")
        m.set("method", {"kind": "full"})
        return
    method = {"kind": "lora", "lora_rank": number(m, "lora_r") or 8,
              "lora_alpha": float(number(m, "lora_alpha", float) or 16),
              "lora_dropout": float(number(m, "lora_dropout", float) or 0.0)
              if m.has("lora_dropout") else 0.05}
    m.maps("method", "lora_r", "lora_alpha", "lora_dropout")
    if quant:
        if str(quant) not in ("bnb.nf4", "bnb.nf4-dq"):
            m.fail("quantize", f"{quant!r} is not a quantization tunepilot plans.",
                   "Use bnb.nf4 or bnb.nf4-dq (QLoRA), or remove quantize.")
        if precision.mixed:
            m.fail("quantize", f"with precision {m.raw.get('precision')}: LitGPT refuses "
                   "quantization with mixed precision.", "Use precision bf16-true.")
        method.update(kind="qlora", double_quant=str(quant).endswith("-dq"),
                      quantize_lm_head=True, quantize_on_load=False)
        m.maps("method.kind", "quantize")
    if precision.mixed:
        method["base_dtype"] = "fp32"  # LitGPT builds the model in fp32 under autocast
    elif precision.computes_in_bf16:  # the model, adapters too, built in bf16
        method["adapter_dtype"] = "bf16"
    m.set("method", {k: v for k, v in method.items() if v is not None})


def _targets(m: Mapper) -> None:
    """LitGPT's flags as this model's module names (its arch decides split or fused qkv)."""
    if m.spec["method"]["kind"] == "full":
        return
    from tunepilot.model.arch import linear_modules, resolve_arch
    from tunepilot.model.litgpt import QKV_FUSED
    from tunepilot.spec import spec_from_dict

    flags = {k: truthy(m.get(k, k in ("lora_query", "lora_value"))) for k in LORA_FLAGS}
    m.maps("method.lora_targets", *LORA_FLAGS)
    arch = resolve_arch(spec_from_dict({"model": m.spec["model"]}), m.path.parent)
    names = [lin.name for lin in linear_modules(arch)]
    parts = [p for p, k in (("q", "lora_query"), ("k", "lora_key"), ("v", "lora_value"))
             if flags[k]]
    targets: list[str] = []
    fused = next((n for n in QKV_FUSED if n in names), None)
    if fused and parts:
        targets.append(fused)
        if len(parts) < 3:
            m.spec["method"]["lora_qkv_parts"] = parts
    elif parts:
        targets += [f"{p}_proj" for p in parts if f"{p}_proj" in names]
    if flags["lora_projection"]:
        targets += [n for n in _ATTN_OUT if n in names][:1]
    if flags["lora_mlp"]:
        targets += [lin.name for lin in linear_modules(arch) if lin.group == "mlp"
                    and lin.peft_kind == "module" and lin.name not in targets]
    if flags["lora_head"]:
        targets.append("lm_head")
    if not targets:
        m.fail("lora_query", "every lora_* flag is off: LoRA would adapt nothing.",
               "Turn on at least one of " + ", ".join(LORA_FLAGS) + ".")
    m.spec["method"]["lora_targets"] = list(dict.fromkeys(targets))


def _optimizer(m: Mapper) -> None:
    value = m.get("optimizer", "AdamW")  # LitGPT's default
    name, args = (value.get("class_path"), value.get("init_args") or {}) \
        if isinstance(value, dict) else (value, {})
    got = _OPTIMIZERS.get(str(name).lower())
    if got is None:
        m.fail("optimizer", f"{name!r} is not an optimizer tunepilot models.",
               f"Use one of {', '.join(sorted(_OPTIMIZERS))}.")
    if m.spec["method"]["kind"] == "qlora":  # utils.instantiate_bnb_optimizer
        if got != "adamw":
            m.fail("optimizer", f"{name!r} with quantize: LitGPT's quantized runs take AdamW "
                   "only (as bitsandbytes' PagedAdamW).", "Use AdamW, or remove quantize.")
        got = "paged_adamw"
        m.note("quantize: LitGPT replaces AdamW with bitsandbytes' PagedAdamW")
    m.set("optimizer.name", got, "optimizer")
    m.mapped["optimizer"] = "optimizer"
    for key in ("lr", "weight_decay"):
        if isinstance(args, dict) and args.get(key) is not None:
            m.spec["optimizer"][key] = value_number(m, f"optimizer.init_args.{key}", args[key],
                                                    float, least=0)
