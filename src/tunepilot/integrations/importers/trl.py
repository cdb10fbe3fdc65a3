"""`trl sft|dpo|kto|reward|grpo|rloo --config FILE` YAML (ScriptArguments + the trainer's config
+ ModelConfig in one file), and a file of Hugging Face TrainingArguments fields (as
HfArgumentParser.parse_json_file reads it) plus PEFT LoraConfig and BitsAndBytesConfig fields ->
a tunepilot spec. The file does not name its trainer: `import --objective KIND` does, else its
keys tell (objectives.guess_trl_kind: generation keys -> grpo, beta -> dpo, ...).

TRL's SFTConfig defaults (TRL >= 0.20): max_length 1024, bf16 on, gradient checkpointing on,
completion-only loss for prompt-completion data, every token of messages data unless
``assistant_only_loss``. Plain TrainingArguments default to neither, and the script loads the
model in fp32 unless the file says ``torch_dtype``/``dtype``.
"""

from __future__ import annotations

from tunepilot.integrations.importers import kernels as importer_kernels
from tunepilot.integrations.importers.common import (
    Mapper,
    local_data,
    lora_targets,
    model_source,
    number,
    optimizer,
    scheduler,
    truthy,
)
from tunepilot.integrations.importers.deepspeed import deepspeed_strategy
from tunepilot.integrations.importers.objectives import (
    TRL_OBJECTIVE_KNOWN,
    guess_trl_kind,
    objective_lengths,
    set_kind,
    trl_keys,
)

TRAINING_ARGS = {
    "output_dir", "overwrite_output_dir", "do_train", "do_eval", "eval_strategy",
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio",
    "warmup_steps", "logging_dir", "logging_strategy", "logging_steps", "save_strategy",
    "save_steps", "save_total_limit", "save_safetensors", "seed", "data_seed", "bf16", "fp16",
    "tf32", "local_rank", "dataloader_num_workers", "dataloader_pin_memory", "eval_steps",
    "run_name", "report_to", "optim", "optim_args", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "fsdp", "fsdp_config", "deepspeed", "torch_compile",
    "push_to_hub", "hub_model_id", "resume_from_checkpoint", "ddp_timeout", "remove_unused_columns",
    "label_names", "load_best_model_at_end", "metric_for_best_model", "group_by_length",
    "ignore_data_skip", "disable_tqdm", "logging_first_step", "bf16_full_eval", "save_only_model",
    "include_num_input_tokens_seen", "neftune_noise_alpha", "use_liger_kernel", "average_tokens_across_devices",
    "liger_kernel_config",
}
MODEL_ARGS = {"model_name_or_path", "model_revision", "torch_dtype", "dtype", "trust_remote_code",
              "attn_implementation", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
              "lora_target_modules", "lora_modules_to_save", "lora_task_type", "use_rslora",
              "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type",
              "use_bnb_nested_quant", "lora_target_parameters"}
SFT_ARGS = {"dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
            "dataset_streaming", "datasets", "dataset_text_field", "max_length", "max_seq_length",
            "packing", "packing_strategy", "padding_free", "completion_only_loss",
            "assistant_only_loss", "dataset_num_proc", "eos_token", "pad_token",
            "chat_template_path", "model_init_kwargs", "dataset_kwargs", "use_flash_attention",
            "gradient_checkpointing_use_reentrant", "activation_offloading", "loss_type"}
PEFT_BNB = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias",
            "modules_to_save", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
            "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage",
            "max_seq_length", "max_length", "train_file", "dataset_name", "model_name_or_path",
            "torch_dtype", "dtype", "use_peft", "lora_r", "block_size", "use_dora", "use_rslora",
            "attn_implementation"}
TRL_KNOWN = TRAINING_ARGS | MODEL_ARGS | SFT_ARGS | TRL_OBJECTIVE_KNOWN
HF_KNOWN = TRAINING_ARGS | PEFT_BNB


_PEFT_FIELDS = ("r", "target_modules", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype",
                "bnb_4bit_use_double_quant", "task_type")


def looks_like_trl(raw: dict) -> bool:
    """TRL's own keys, and none of PEFT's LoraConfig / BitsAndBytesConfig field names (which
    a TrainingArguments file carries and TRL's ModelConfig spells lora_r, ...)."""
    return "model_name_or_path" in raw and not any(k in raw for k in _PEFT_FIELDS) and any(
        k in raw for k in ("dataset_name", "datasets", "max_length", "use_peft", "packing",
                           "dataset_text_field", "assistant_only_loss", "completion_only_loss",
                           "lora_r", "beta", "num_generations", "use_vllm",
                           "max_completion_length"))


def looks_like_hf(raw: dict) -> bool:
    return sum(k in TRAINING_ARGS for k in raw) >= 2


def convert_trl(m: Mapper) -> None:
    _model(m)
    peft = truthy(m.get("use_peft")) or truthy(m.get("load_in_4bit"))
    _method(m, peft, rank_key="lora_r", targets_key="lora_target_modules", rank_default=16,
            alpha_default=32.0, dropout_default=0.05)
    _training(m, trl=True)
    _kernels(m, trl=True)
    seq = number(m, "max_length") or number(m, "max_seq_length")
    kind = (m.options.objective if m.options else None) or guess_trl_kind(m.raw) or "sft"
    if kind != "sft":
        set_kind(m, kind)
        if not (m.options and m.options.objective):
            m.note(f"read as `trl {kind}`'s config (from its keys; pass --objective to say "
                   "which trainer it is for)")
        trl_keys(m, kind)
        objective_lengths(m, kind, seq, 1024)
        m.used.update({"max_length", "max_seq_length"})
        if kind in ("dpo", "ipo", "grpo", "rloo", "kto"):
            m.note("TRL >= 1.0 takes log-probs with a fused, chunked LM head (the logits are "
                   "never all alive): planned as the full-logits path of TRL 0.x, axolotl and "
                   "LLaMA-Factory (an upper bound); set chunked_loss: true for TRL's")
    else:
        m.set("sequence_length", seq or 1024, "max_length", "max_seq_length")
        if not seq:
            m.note("max_length not set: SFTConfig's default 1024")
    _data(m, m.get("dataset_name") or _mixture_path(m), trl=True)


def convert_hf(m: Mapper) -> None:
    _model(m)
    peft = any(m.has(k) for k in ("r", "target_modules", "lora_alpha", "use_peft")) or \
        truthy(m.get("load_in_4bit"))
    _method(m, peft, rank_key="r", targets_key="target_modules", rank_default=8,
            alpha_default=8.0, dropout_default=0.0)
    _training(m, trl=False)
    _kernels(m, trl=False)
    seq = number(m, "max_seq_length") or number(m, "max_length") or number(m, "block_size")
    if seq:
        m.set("sequence_length", seq, "max_seq_length", "max_length", "block_size")
    else:
        m.note("no max_seq_length/max_length in the file: sequence_length 2048 assumed (the "
               "script's tokenizer call decides it)")
    _data(m, m.get("train_file") or m.get("dataset_name"), trl=False)


def _model(m: Mapper) -> None:
    if not m.has("model_name_or_path"):
        m.fail("model_name_or_path", "is missing: the file names no model (TrainingArguments "
               "has no model field).", "Add model_name_or_path: a hub id of a shipped preset "
               "or a local model directory.")
    m.set("model", model_source(m, "model_name_or_path", m.get("model_name_or_path")),
          "model_name_or_path")


def _method(m: Mapper, peft: bool, *, rank_key: str, targets_key: str, rank_default: int,
            alpha_default: float, dropout_default: float) -> None:
    four = truthy(m.get("load_in_4bit"))
    if truthy(m.get("load_in_8bit")):
        m.note("load_in_8bit: an 8-bit base is not modelled; planned with a 16-bit base "
               "(an upper bound)")
    if not peft:
        m.set("method.kind", "full", "use_peft")
        return
    m.set("method.kind", "qlora" if four else "lora", "use_peft", "load_in_4bit")
    rank = number(m, rank_key) or rank_default
    m.set("method.lora_rank", rank, rank_key)
    m.set("method.lora_alpha", float(number(m, "lora_alpha", float) or alpha_default),
          "lora_alpha")
    dropout = number(m, "lora_dropout", float)
    m.set("method.lora_dropout", dropout_default if dropout is None else dropout, "lora_dropout")
    targets = lora_targets(m.get(targets_key))
    if targets:
        m.set("method.lora_targets", targets, targets_key)
    if four and (truthy(m.get("use_bnb_nested_quant")) or truthy(m.get(
            "bnb_4bit_use_double_quant"))):
        m.set("method.double_quant", True, "use_bnb_nested_quant", "bnb_4bit_use_double_quant")
    m.used.update({"bnb_4bit_quant_type", "bnb_4bit_compute_dtype"})


def _kernels(m: Mapper, *, trl: bool) -> None:
    """use_liger_kernel (and liger_kernel_config), attn_implementation (ModelConfig, or
    model_init_kwargs), DoRA / rsLoRA / modules_to_save, LoRA on raw parameters (MoE experts)."""
    if truthy(m.get("use_liger_kernel")):
        config = m.get("liger_kernel_config")
        if config is not None:
            importer_kernels.liger_config(m, "liger_kernel_config", config)
            m.mapped["use_liger_kernel"] = "kernels.liger"
        else:
            importer_kernels.liger_default(m, "use_liger_kernel")
    init = m.get("model_init_kwargs") or {}
    attn = m.get("attn_implementation") or (init.get("attn_implementation")
                                            if isinstance(init, dict) else None)
    if attn is not None:
        key = "attn_implementation" if m.has("attn_implementation") else "model_init_kwargs"
        importer_kernels.attention(m, key, attn)
    if m.spec.get("method", {}).get("kind") == "full":
        m.used.update({"use_dora", "use_rslora", "lora_modules_to_save", "modules_to_save"})
        return
    importer_kernels.method_variants(m, dora="use_dora", rslora="use_rslora",
                                     modules=("lora_modules_to_save", "modules_to_save"))
    if trl:
        importer_kernels.lora_target_parameters(m, "lora_target_parameters")


def _training(m: Mapper, *, trl: bool) -> None:
    for key, dotted, kind in (("per_device_train_batch_size", "micro_batch_size", int),
                              ("per_device_eval_batch_size", "validation.micro_batch_size", int),
                              ("gradient_accumulation_steps", "gradient_accumulation_steps", int),
                              ("seed", "seed", int), ("learning_rate", "optimizer.lr", float),
                              ("weight_decay", "optimizer.weight_decay", float),
                              ("warmup_steps", "scheduler.warmup_steps", int)):
        value = number(m, key, kind)
        if value is not None:
            m.set(dotted, value, key)
    if not m.has("per_device_train_batch_size"):
        m.set("micro_batch_size", 8, "per_device_train_batch_size")
        m.note("per_device_train_batch_size not set: TrainingArguments' default 8")
    optimizer(m, "optim", m.get("optim"))
    scheduler(m, "lr_scheduler_type", m.get("lr_scheduler_type", "linear"))
    dtype = str(m.get("dtype") or m.get("torch_dtype") or ("auto" if trl else "float32"))
    bf16 = truthy(m.get("bf16", trl and not truthy(m.get("fp16"))))
    weights16 = dtype in ("bfloat16", "bf16", "auto")
    full = m.spec["method"]["kind"] == "full"
    if bf16:
        m.set("precision", "bf16-true" if full and weights16 else "bf16-mixed", "bf16", "dtype",
              "torch_dtype")
    elif truthy(m.get("fp16")):
        m.set("precision", "fp16-mixed", "fp16")
    else:
        m.set("precision", "fp32", "bf16")
    if truthy(m.get("gradient_checkpointing", trl)):
        m.set("activation_checkpointing", "full", "gradient_checkpointing")
    if truthy(m.get("torch_compile")):
        m.set("torch_compile", True, "torch_compile")
    if truthy(m.get("activation_offloading")):  # SFTConfig's (TRL offloads saved activations)
        m.set("activation_offloading", True, "activation_offloading")
    fsdp = m.get("fsdp")
    if fsdp and not isinstance(fsdp, str) and not (
            isinstance(fsdp, list) and all(isinstance(x, str) for x in fsdp)):
        m.fail("fsdp", f"is {str(fsdp)[:60]}, not FSDP options.",
               "TrainingArguments.fsdp is a string or a list of strings, e.g. "
               "\"full_shard auto_wrap\" or [\"full_shard\", \"auto_wrap\"].")
    if fsdp and "full_shard" in (fsdp if isinstance(fsdp, str) else " ".join(fsdp)):
        m.set("parallel.strategy", "fsdp", "fsdp")
        conf = m.get("fsdp_config") or {}
        if isinstance(conf, dict) and (truthy(conf.get("cpu_offload")) or
                                       truthy(conf.get("offload_params"))):
            m.set("parallel.cpu_offload", True, "fsdp_config")
        if "offload" in str(fsdp):
            m.set("parallel.cpu_offload", True, "fsdp")
    if m.has("deepspeed"):
        deepspeed_strategy(m, "deepspeed", m.get("deepspeed"))
    steps, epochs = number(m, "max_steps"), number(m, "num_train_epochs", float)
    m.spec["_max_steps"] = steps if steps and steps > 0 else None
    m.spec["_epochs"] = epochs if epochs is not None else 3.0  # TrainingArguments' default
    if steps and steps > 0 and epochs is not None:
        m.note(f"num_train_epochs {epochs:g}: max_steps {steps} overrides it (as in the Trainer)")


def _mixture_path(m: Mapper) -> str | None:
    mix = m.get("datasets")
    if isinstance(mix, list) and mix and isinstance(mix[0], dict):
        if len(mix) > 1:
            m.note(f"{len(mix)} datasets: only the first is profiled")
        files = mix[0].get("data_files")
        path = (files[0] if files else None) if isinstance(files, list) else files
        return path or mix[0].get("path")
    return None


def _data(m: Mapper, path, *, trl: bool) -> None:
    epochs = m.spec.pop("_epochs", None)
    if not path or m.options.synthetic_data:
        if epochs and not m.spec.get("_max_steps"):
            m.note(f"num_train_epochs {epochs:g} not mapped: synthetic data has no epochs")
        return
    text_field = m.get("dataset_text_field")
    kind = (m.spec.get("objective") or {}).get("kind", "sft")
    fmt = "prompt" if kind in ("grpo", "rloo") else ("preference" if kind in (
        "dpo", "ipo", "orpo", "simpo", "cpo", "reward") else None)
    data = local_data(m, str(path), fmt=fmt, fields={"text_field": text_field},
                      tokenizer=m.options.tokenizer, key="dataset_name")
    if data is None:
        m.data_unavailable("dataset_name", f"{path!r} is not a local file or directory (a hub dataset): "
               "tunepilot never downloads.", "Save a local copy (JSONL, Parquet, or "
               "save_to_disk) and point dataset_name at it, or pass --data synthetic.")
    if data["format"] == "messages":
        data["train_on"] = "completions" if truthy(m.get("assistant_only_loss")) else "all"
        if trl and data["train_on"] == "all":
            m.note("messages data without assistant_only_loss: TRL trains every token")
    elif data["format"] == "prompt-completion":
        only = m.get("completion_only_loss")
        data["train_on"] = "all" if only is False else "completions"
    packed = [k for k in ("packing", "padding_free") if truthy(m.get(k))]
    if packed:
        data["packing"] = True
    m.used.update({"completion_only_loss", "assistant_only_loss", "packing", "padding_free",
                   "dataset_name", "train_file", "datasets"})
    m.set("data", data, "dataset_name" if m.has("dataset_name") else "train_file")
    m.maps("data.packing", *packed)
    m.maps("data.train_on", *(k for k in ("assistant_only_loss", "completion_only_loss")
                              if m.has(k) and "train_on" in data))
    if epochs and not m.spec.get("_max_steps"):
        m.set("target.epochs", epochs, "num_train_epochs")
