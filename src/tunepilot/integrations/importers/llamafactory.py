"""LLaMA-Factory YAML (examples/train_lora/llama3_lora_sft.yaml and friends) -> a tunepilot spec.

LLaMA-Factory loads the model in bf16 under ``bf16: true`` and casts the trainable parameters to
fp32 unless ``pure_bf16`` (so full and LoRA runs are ``bf16-mixed``; ``pure_bf16`` is
``bf16-true``); it checkpoints activations unless ``disable_gradient_checkpointing``; it trains
the responses unless ``train_on_prompt``. Datasets are names in ``dataset_dir/dataset_info.json``.

``stage: dpo`` trains the DPO family (``pref_loss`` sigmoid, hinge, ipo, orpo, simpo;
``pref_beta``), ``kto`` KTO, ``rm`` a reward model (a value head on the last token), ``ppo``
PPO (generation with transformers' generate, a reference and a reward model: ``reward_model_type``
lora is an adapter on the same base, full a second model). The reference of a LoRA run is the
base with the adapters disabled unless ``ref_model`` names one (a copy).
"""

from __future__ import annotations

from pathlib import Path

from tunepilot.integrations.importers import kernels as importer_kernels
from tunepilot.integrations.importers.common import (
    Mapper,
    config_path,
    fp8_precision,
    local_data,
    lora_targets,
    model_source,
    number,
    optimizer,
    scheduler,
    truthy,
)
from tunepilot.integrations.importers.deepspeed import deepspeed_strategy
from tunepilot.integrations.importers.objectives import set_kind

SOURCE = "llamafactory"
MAPPED = {"model_name_or_path", "finetuning_type", "quantization_bit", "lora_rank", "lora_alpha",
          "lora_dropout", "lora_target", "cutoff_len", "per_device_train_batch_size",
          "gradient_accumulation_steps", "num_train_epochs", "max_steps", "learning_rate",
          "lr_scheduler_type", "warmup_steps", "weight_decay", "bf16", "fp16", "pure_bf16",
          "disable_gradient_checkpointing", "optim", "deepspeed", "dataset", "dataset_dir",
          "template", "train_on_prompt", "packing", "neat_packing", "max_samples", "seed",
          "double_quantization", "stage", "do_train", "quantization_method", "pref_beta",
          "pref_loss", "ref_model", "reward_model_type", "ppo_epochs", "max_new_tokens",
          "fp8", "fp8_backend"}
NO_EFFECT = {"pref_ftx", "pref_bco_weight", "dpo_label_smoothing", "simpo_gamma",
             "kto_chosen_weight", "kto_rejected_weight", "ld_alpha", "ppo_buffer_size",
             "ppo_score_norm", "ppo_target", "ppo_whiten_rewards", "ppo_logger", "top_p",
             "top_k", "temperature", "do_sample", "repetition_penalty", "reward_model_adapters", "reward_model_quantization_bit", "ref_model_adapters",
             "ref_model_quantization_bit", "num_beams", "length_penalty"}
KNOWN = MAPPED | NO_EFFECT | {
    "trust_remote_code", "overwrite_cache", "preprocessing_num_workers", "dataloader_num_workers",
    "output_dir", "logging_steps", "save_steps", "plot_loss", "overwrite_output_dir",
    "save_only_model", "report_to", "warmup_ratio", "ddp_timeout", "resume_from_checkpoint",
    "eval_dataset", "val_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps",
    "flash_attn", "use_unsloth", "enable_liger_kernel", "rope_scaling", "shift_attn",
    "use_dora", "pissa_init", "additional_target", "use_rslora", "use_unsloth_gc", "create_new_adapter", "adapter_name_or_path",
    "export_dir", "export_size", "freeze_trainable_layers", "freeze_trainable_modules",
    "tokenized_path", "streaming", "mix_strategy", "upcast_layernorm", "upcast_lmhead_output",
    "max_grad_norm", "save_strategy", "load_best_model_at_end", "run_name", "hub_model_id",
    "push_to_hub", "ignore_data_skip", "enable_thinking", "image_max_pixels", "video_max_pixels",
    "fp8_enable_fsdp_float8_all_gather",
}


def looks_like(raw: dict) -> bool:
    return "model_name_or_path" in raw and any(k in raw for k in (
        "finetuning_type", "cutoff_len", "template", "stage", "lora_target"))


def convert(m: Mapper) -> None:
    m.set("model", model_source(m, "model_name_or_path", m.get("model_name_or_path")),
          "model_name_or_path")
    m.used.update({"stage", "do_train"})
    _method(m)
    _objective(m)
    for key, dotted, kind in (("cutoff_len", "sequence_length", int),
                              ("per_device_train_batch_size", "micro_batch_size", int),
                              ("per_device_eval_batch_size", "validation.micro_batch_size", int),
                              ("gradient_accumulation_steps", "gradient_accumulation_steps", int),
                              ("seed", "seed", int), ("learning_rate", "optimizer.lr", float),
                              ("weight_decay", "optimizer.weight_decay", float),
                              ("warmup_steps", "scheduler.warmup_steps", int)):
        value = number(m, key, kind)
        if value is not None:
            m.set(dotted, value, key)
    if not m.has("cutoff_len"):
        m.set("sequence_length", 2048, "cutoff_len")
        m.note("cutoff_len not set: LLaMA-Factory's default 2048")
    o = m.spec.get("objective") or {}
    if o.get("kind") == "ppo":  # the prompt is cut at cutoff_len; the policy sees + completion
        o["max_prompt_length"] = m.spec["sequence_length"]
        m.spec["sequence_length"] += o["max_completion_length"]
    optimizer(m, "optim", m.get("optim"))
    scheduler(m, "lr_scheduler_type", m.get("lr_scheduler_type"))
    if fp8_precision(m, "fp8_backend", m.get("fp8_backend"), "auto"):
        m.maps("precision", "pure_bf16", "bf16", "fp16")
    elif truthy(m.get("pure_bf16")):
        m.set("precision", "bf16-true", "pure_bf16")
    elif truthy(m.get("bf16")):
        m.set("precision", "bf16-mixed", "bf16")
    elif truthy(m.get("fp16")):
        m.set("precision", "fp16-mixed", "fp16")
    else:
        m.set("precision", "fp32", "bf16")
    if not truthy(m.get("disable_gradient_checkpointing")):
        m.set("activation_checkpointing", "full", "disable_gradient_checkpointing")
        m.note("LLaMA-Factory checkpoints activations unless disable_gradient_checkpointing")
    if m.has("deepspeed"):
        deepspeed_strategy(m, "deepspeed", m.get("deepspeed"))
    _kernels(m)
    _data(m)
    steps, epochs = number(m, "max_steps"), number(m, "num_train_epochs", float)
    if steps and steps > 0:
        m.spec["_max_steps"] = steps
        if epochs is not None:
            m.note(f"num_train_epochs {epochs:g}: max_steps {steps} overrides it (as in the "
                   "Trainer)")
    elif epochs and m.spec.get("data"):
        m.set("target.epochs", epochs, "num_train_epochs")
    elif epochs:
        m.note(f"num_train_epochs {epochs:g} not mapped: synthetic data has no epochs")


_PREF_LOSS = {"sigmoid": ("dpo", "sigmoid"), "hinge": ("dpo", "hinge"), "ipo": ("ipo", "ipo"),
              "kto_pair": ("dpo", "sigmoid"), "bco_pair": ("dpo", "bco_pair"),
              "orpo": ("orpo", None), "simpo": ("simpo", None)}


def _objective(m: Mapper) -> None:
    """stage: dpo|kto|rm|ppo -> objective.*; pref_beta its beta, pref_loss the DPO family's
    loss (orpo, simpo: no reference model, as LLaMA-Factory's use_ref_model)."""
    m.no_effect(*NO_EFFECT)
    stage = str(m.get("stage", "sft"))
    if stage in ("sft", "pt"):
        return
    if stage not in ("dpo", "kto", "rm", "ppo"):
        m.fail("stage", f"{stage!r} is not one of pt, sft, rm, ppo, dpo, kto.",
               "tunepilot models these LLaMA-Factory stages.")
    if stage == "dpo":
        loss = str(m.get("pref_loss", "sigmoid"))
        if loss not in _PREF_LOSS:
            m.fail("pref_loss", f"{loss!r} is not one of {', '.join(_PREF_LOSS)}.")
        kind, loss_type = _PREF_LOSS[loss]
        set_kind(m, kind, "stage", "pref_loss")
        if loss_type and loss_type != "sigmoid":
            m.set("objective.loss_type", loss_type, "pref_loss")
        if loss == "kto_pair":
            m.note("pref_loss kto_pair: planned as DPO's sigmoid loss (the same pairs and "
                   "reference forward)")
        m.note("LLaMA-Factory's DPO upcasts all the logits to fp32 before the log-softmax: "
               "planned with TRL's row-by-row log-probs (the kept fp32 log-softmax is the same; "
               "its forward transient is about one fp32 copy of the logits smaller)")
    else:
        set_kind(m, {"kto": "kto", "rm": "reward", "ppo": "ppo"}[stage], "stage")
    if stage != "rm" and (m.has("pref_beta") or stage == "dpo"):
        m.set("objective.beta", float(number(m, "pref_beta", float) or 0.1), "pref_beta")
    if m.has("ref_model") and stage in ("dpo", "kto", "ppo"):
        m.set("objective.reference", "copy", "ref_model")
    if stage == "rm":
        m.note("stage rm: LLaMA-Factory's value head on the causal LM, planned as a "
               "sequence-classification head (its LM logits are computed and not trained: "
               "not counted)")
    if stage == "ppo":
        _ppo(m)


def _ppo(m: Mapper) -> None:
    rtype = str(m.get("reward_model_type", "lora"))
    m.set("objective.reward_model", {"lora": "adapter", "full": "copy"}.get(rtype, "none"),
          "reward_model_type", "reward_model")
    epochs = number(m, "ppo_epochs")
    m.set("objective.num_iterations", epochs or 4, "ppo_epochs")  # LLaMA-Factory's default 4
    new = number(m, "max_new_tokens")
    c = new or 1024  # GeneratingArguments.max_new_tokens
    m.set("objective.max_completion_length", c, "max_new_tokens")
    m.note(f"stage ppo: one completion per prompt by transformers' generate, up to {c} new "
           "tokens (max_new_tokens); cutoff_len is the prompt")


def _method(m: Mapper) -> None:
    kind = m.get("finetuning_type", "lora")
    if kind == "freeze":
        m.fail("finetuning_type", "'freeze' (training some layers) is not modelled.",
               "tunepilot models full, lora and qlora.")
    if kind not in ("full", "lora"):
        m.fail("finetuning_type", f"{kind!r} is not full, freeze or lora.")
    bits = number(m, "quantization_bit")
    if bits is not None and bits not in _QUANT_BITS:
        m.fail("quantization_bit", f"is {bits}: LLaMA-Factory quantizes the base to "
               f"{', '.join(map(str, _QUANT_BITS))} bits.", "tunepilot plans 4 as QLoRA and 8 "
               "as a 16-bit base; remove the key for an unquantized base.")
    if bits is not None and bits not in (4, 8):
        m.fail("quantization_bit", f"is {bits}: only 4-bit (QLoRA, bitsandbytes NF4) and 8-bit "
               "bases are modelled.", "Use quantization_bit 4 (or 8), or remove it.")
    m.used.add("quantization_method")
    if kind == "full":
        m.set("method.kind", "full", "finetuning_type")
        return
    if bits == 8:
        m.note("quantization_bit 8 is not modelled; planned with a 16-bit base (an upper bound)")
    qlora = bits == 4
    m.set("method.kind", "qlora" if qlora else "lora", "finetuning_type",
          *(("quantization_bit",) if qlora else ()))
    rank = number(m, "lora_rank") or 8  # LLaMA-Factory's default
    m.set("method.lora_rank", rank, "lora_rank")
    m.set("method.lora_alpha", float(number(m, "lora_alpha", float) or 2 * rank), "lora_alpha")
    dropout = number(m, "lora_dropout", float)
    if dropout is not None:
        m.set("method.lora_dropout", dropout, "lora_dropout")
    m.set("method.lora_targets", lora_targets(m.get("lora_target", "all")) or "all-linear",
          "lora_target")
    if qlora and truthy(m.get("double_quantization", True)):
        m.set("method.double_quant", True, "double_quantization")


def _dataset_entry(m: Mapper, info_file: Path, name: str) -> object:
    """The dataset's entry in dataset_info.json (size- and depth-bounded), None when the file
    or the entry is not there."""
    from tunepilot.limits import Refused, load_json_capped
    from tunepilot.spec.yaml_input import MAX_SPEC_BYTES

    try:
        info = load_json_capped(info_file, MAX_SPEC_BYTES * 16)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (Refused, OSError) as exc:
        m.fail("dataset_dir", f"{info_file} cannot be read as LLaMA-Factory's dataset list "
               f"({str(exc)[:120]}).")
    return info.get(name) if isinstance(info, dict) else None


_QUANT_BITS = (1, 2, 3, 4, 5, 6, 8)  # LLaMA-Factory's quantization_bit (bnb 4/8, HQQ 1-8, EETQ 8)


def _kernels(m: Mapper) -> None:
    """flash_attn (fa2|sdpa|disabled|auto), enable_liger_kernel, use_unsloth and use_unsloth_gc,
    and the adapter variants: use_dora, use_rslora, additional_target (modules trained in full:
    LLaMA-Factory passes them to PEFT's modules_to_save)."""
    importer_kernels.attention(m, "flash_attn", m.get("flash_attn", "auto"))
    if not m.has("flash_attn"):
        m.mapped.pop("flash_attn", None)
    if truthy(m.get("enable_liger_kernel")):
        importer_kernels.liger_default(m, "enable_liger_kernel")
    if truthy(m.get("use_unsloth")):
        m.set("kernels.unsloth", True, "use_unsloth")
        if m.spec.get("kernels", {}).get("liger"):  # Unsloth's kernels replace Liger's
            m.spec["kernels"].pop("liger")
            m.note("use_unsloth with enable_liger_kernel: Unsloth's kernels are planned")
    if truthy(m.get("use_unsloth_gc")):
        if m.spec.get("activation_checkpointing") != "full":
            m.set("activation_checkpointing", "full", "use_unsloth_gc")
        m.set("kernels.unsloth_gradient_checkpointing", True, "use_unsloth_gc")
    if m.spec.get("method", {}).get("kind") == "full":
        m.used.update({"use_dora", "use_rslora", "additional_target"})
        return
    importer_kernels.method_variants(m, dora="use_dora", rslora="use_rslora",
                                     modules=("additional_target",))


def _data(m: Mapper) -> None:
    names = m.get("dataset")
    if not names or m.options.synthetic_data:
        return
    name = str(names).split(",")[0].strip()
    info_dir = config_path(m, "dataset_dir", m.get("dataset_dir", "data"))
    info_file = info_dir / "dataset_info.json"
    entry = _dataset_entry(m, info_file, name)
    if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str) or \
            not entry["file_name"]:
        where = "a hub dataset" if isinstance(entry, dict) else f"not in {info_file}"
        m.data_unavailable("dataset", f"{name!r} is {where}: tunepilot reads only local datasets listed "
               "with a file_name in dataset_info.json.", "Add a local copy there, or pass "
               "--data synthetic.")
    cols = entry.get("columns") or {}
    if not isinstance(cols, dict) or not all(isinstance(v, str) for v in cols.values()):
        m.fail("dataset", f"{name!r} in {info_file.name} has columns that are not a mapping of "
               "names.", "columns: {prompt: instruction, response: output, ...}")
    kind = (m.spec.get("objective") or {}).get("kind", "sft")
    if kind in ("dpo", "ipo", "orpo", "simpo", "reward"):
        fmt = "preference"
        fields = {"chosen_field": cols.get("chosen", "chosen"),
                  "rejected_field": cols.get("rejected", "rejected"),
                  "prompt_field": cols.get("prompt", "instruction"),
                  "messages_field": cols.get("messages", "conversations")}
        if entry.get("formatting") == "sharegpt":
            fields.pop("prompt_field")
    elif entry.get("formatting") == "sharegpt":
        fmt, fields = "messages", {"messages_field": cols.get("messages", "conversations")}
    else:
        fmt, fields = "prompt-completion", {"prompt_field": cols.get("prompt", "instruction"),
                                            "completion_field": cols.get("response", "output")}
        m.note("alpaca rows: instruction -> prompt, output -> completion (the query/input "
               "column is not rendered)")
    rel = str((info_dir / entry["file_name"]).relative_to(m.path.parent)) \
        if (info_dir / entry["file_name"]).is_relative_to(m.path.parent) else \
        str(info_dir / entry["file_name"])
    if kind == "ppo":
        fmt = "prompt"
    data = local_data(m, rel, fmt=fmt, fields=fields, tokenizer=m.options.tokenizer,
                      key="dataset")
    data["train_on"] = "all" if truthy(m.get("train_on_prompt")) else "completions"
    if truthy(m.get("packing")) or truthy(m.get("neat_packing")):
        data["packing"] = True
    limit = number(m, "max_samples", least=1)
    if limit:
        data["max_samples"] = limit
    template = m.get("template")
    if template in ("llama3", "chatml", "qwen"):
        data["chat_template"] = {"llama3": "llama-3", "qwen": "chatml"}.get(template, template)
    m.set("data", data, "dataset", "dataset_dir", "train_on_prompt", "packing", "neat_packing",
          "max_samples", "template")
