"""axolotl YAML (examples/*/lora-8b.yml and friends) -> a tunepilot spec.

``rl: dpo|ipo|orpo|simpo|kto|grpo`` trains that objective (axolotl builds TRL's trainer):
``rl_beta`` (``orpo_alpha`` for ORPO) is its beta, ``sequence_len`` each sequence's max_length,
``max_prompt_len`` the prompt (axolotl's default for GRPO: sequence_len), the ``trl:`` block
GRPO's generation (num_generations, max_completion_length, use_vllm, vllm_mode, ...) and the
``vllm:`` block its server; ``rl_adapter_ref_model`` loads a reference copy instead of
disabling the adapters, ``precompute_ref_log_probs`` precomputes it.

axolotl loads the model in bf16 when ``bf16``/``bfloat16`` is set, so a full fine-tune trains
bf16 weights with bf16 optimizer state (``bf16-true``); LoRA keeps fp32 adapters under autocast
(``bf16-mixed``, a bf16 base). ``train_on_inputs: false`` (the default) trains the completions.
"""

from __future__ import annotations

from tunepilot.integrations.importers import kernels as importer_kernels
from tunepilot.integrations.importers.common import (
    Mapper,
    fp8_precision,
    local_data,
    lora_targets,
    model_source,
    number,
    optimizer,
    scheduler,
    truthy,
    value_number,
)
from tunepilot.integrations.importers.deepspeed import deepspeed_strategy
from tunepilot.integrations.importers.objectives import set_kind, trl_keys

SOURCE = "axolotl"
MAPPED = {"base_model", "base_model_config", "adapter", "load_in_4bit", "load_in_8bit", "lora_r",
          "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
          "sequence_len", "sample_packing", "micro_batch_size", "gradient_accumulation_steps",
          "num_epochs", "max_steps", "optimizer", "lr_scheduler", "learning_rate",
          "weight_decay", "warmup_steps", "bf16", "fp16", "bfloat16", "float16", "tf32",
          "gradient_checkpointing", "datasets", "train_on_inputs", "chat_template", "fsdp",
          "fsdp_config", "deepspeed", "seed", "tokenizer_config", "torch_compile", "val_set_size",
          "eval_steps", "evals_per_epoch", "eval_batch_size", "activation_offloading",
          "save_steps", "saves_per_epoch", "bnb_4bit_use_double_quant", "rl", "rl_beta",
          "orpo_alpha", "rl_adapter_ref_model", "precompute_ref_log_probs", "max_prompt_len",
          "trl", "vllm", "fp8", "fp8_config", "llama4_linearized_experts"}
NO_EFFECT = {"rpo_alpha", "simpo_gamma", "cpo_alpha", "kto_desirable_weight",
             "kto_undesirable_weight", "dpo_use_weighting", "dpo_label_smoothing",
             "dpo_norm_loss", "dpo_use_logits_to_keep", "use_wandb"}
KNOWN = MAPPED | NO_EFFECT | {
    "model_type", "tokenizer_type", "trust_remote_code", "strict", "dataset_prepared_path",
    "output_dir", "pad_to_sequence_len", "lora_model_dir", "lora_fan_in_fan_out", "wandb_project",
    "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "group_by_length",
    "early_stopping_patience", "resume_from_checkpoint", "local_rank", "logging_steps",
    "xformers_attention", "flash_attention", "sdp_attention", "s2_attention", "warmup_ratio",
    "eval_table_size", "eval_max_new_tokens", "debug", "special_tokens", "tokens", "hub_model_id",
    "push_dataset_to_hub", "max_grad_norm", "lr_scheduler_kwargs", "cosine_min_lr_ratio",
    "plugins", "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy",
    "liger_layer_norm", "liger_cross_entropy", "cut_cross_entropy", "eager_attention",
    "flex_attention", "unsloth_cross_entropy_loss", "unsloth_lora_mlp", "unsloth_lora_qkv",
    "unsloth_lora_o", "unsloth_rms_norm", "unsloth_rope", "lora_target_parameters",
    "save_total_limit", "eval_sample_packing", "save_safetensors", "shuffle_merged_datasets",
    "peft_use_dora", "peft_use_rslora", "lora_modules_to_save", "unfrozen_parameters",
    "gradient_checkpointing_kwargs", "ddp_timeout", "seed", "chat_template_jinja",
    "sample_packing_eff_est", "total_num_tokens", "mlflow_experiment_name", "use_wandb",
    "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model", "hf_use_auth_token",
    "ddp_find_unused_parameters", "auto_resume_from_checkpoints", "test_datasets", "eval_strategy",
    "save_strategy", "save_only_model", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_prefetch_factor", "remove_unused_columns", "train_on_eos", "roles_to_train",
    "default_system_message", "eot_tokens", "processor_type", "load_in_8bit_optim",
    "fp8_enable_fsdp_float8_all_gather",
}
_TEMPLATES = {"chatml": "chatml", "llama3": "llama-3", "tokenizer_default": "tokenizer"}


def looks_like(raw: dict) -> bool:
    return "base_model" in raw or ("sequence_len" in raw and "micro_batch_size" in raw)


def convert(m: Mapper) -> None:
    m.set("model", model_source(m, "base_model", m.get("base_model")), "base_model")
    if m.has("base_model_config"):
        m.note("base_model_config is read as the model (its config) when it is local")
    _method(m)
    for key, dotted in (("sequence_len", "sequence_length"), ("micro_batch_size",
                        "micro_batch_size"), ("gradient_accumulation_steps",
                                              "gradient_accumulation_steps"), ("seed", "seed"),
                        ("eval_batch_size", "validation.micro_batch_size")):
        value = number(m, key)
        if value is not None:
            m.set(dotted, value, key)
    optimizer(m, "optimizer", m.get("optimizer"))
    scheduler(m, "lr_scheduler", m.get("lr_scheduler"))
    for key, dotted, kind in (("learning_rate", "optimizer.lr", float),
                              ("weight_decay", "optimizer.weight_decay", float),
                              ("warmup_steps", "scheduler.warmup_steps", int)):
        value = number(m, key, kind)
        if value is not None:
            m.set(dotted, value, key)
    _precision(m)
    gc = m.get("gradient_checkpointing")
    if gc:
        m.set("activation_checkpointing", "full", "gradient_checkpointing")
        if isinstance(gc, str) and gc.lower() in ("offload", "unsloth"):  # layer inputs to host
            m.set("kernels.unsloth_gradient_checkpointing", True, "gradient_checkpointing")
            m.note(f"gradient_checkpointing {gc!r}: the checkpointed layer inputs offloaded to "
                   "host memory (planned as Unsloth's offloaded checkpointing)")
        elif isinstance(gc, str) and gc not in ("true", "True"):
            m.note(f"gradient_checkpointing {gc!r} is planned as full checkpointing")
    if truthy(m.get("torch_compile")):
        m.set("torch_compile", True, "torch_compile")
    if truthy(m.get("activation_offloading")):
        m.set("activation_offloading", True, "activation_offloading")
    if truthy(m.get("llama4_linearized_experts")):  # each expert an nn.Linear: QLoRA quantizes it
        m.set("moe.experts_layout", "per_expert", "llama4_linearized_experts")
    _parallel(m)
    _kernels(m)
    _objective(m)
    _data(m)
    _target(m)


_LIGER_KEYS = {"liger_rms_norm": "rms_norm", "liger_rope": "rope", "liger_layer_norm": "layer_norm",
               "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy",
               "liger_cross_entropy": "cross_entropy"}
# axolotl's Unsloth kernel keys, planned as the Liger kernel that saves the same tensors
_UNSLOTH_KEYS = {"unsloth_rms_norm": "rms_norm", "unsloth_rope": "rope",
                 "unsloth_cross_entropy_loss": "cross_entropy", "unsloth_lora_mlp": "swiglu"}


def _kernels(m: Mapper) -> None:
    """Attention (flash_attention, sdp_attention, eager_attention, flex_attention), the Liger and
    Cut Cross-Entropy plugins' keys, axolotl's Unsloth kernel keys, and the adapter variants."""
    for key, impl in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"),
                      ("eager_attention", "eager"), ("flex_attention", "flex_attention")):
        if truthy(m.get(key)):
            importer_kernels.attention(m, key, impl)
    if truthy(m.get("xformers_attention")):
        importer_kernels.attention(m, "xformers_attention", "sdpa")
        m.note("xformers_attention: memory-efficient attention, planned as sdpa (no s x s)")
    if truthy(m.get("s2_attention")):
        m.note("s2_attention (shifted sparse attention) is planned as flash attention")
    plugins = m.get("plugins") or []
    if not isinstance(plugins, list | str):
        m.fail("plugins", f"is {str(plugins)[:40]}, not a list of plugin names.",
               f"E.g. plugins: [{importer_kernels.LIGER_PLUGIN}].")
    plugins = " ".join(str(p) for p in ([plugins] if isinstance(plugins, str) else plugins))
    on = [k for k in _LIGER_KEYS if truthy(m.get(k))]
    for key in on:
        importer_kernels.liger(m, key, [_LIGER_KEYS[key]])
    if truthy(m.get("liger_glu_activation")):
        importer_kernels.liger(m, "liger_glu_activation", ["swiglu"])
        on.append("liger_glu_activation")
    if on and importer_kernels.LIGER_PLUGIN not in plugins:
        m.note("liger_* keys without plugins: [axolotl.integrations.liger.LigerPlugin]: "
               "planned as if the plugin is listed (axolotl needs it for them to act)")
    if truthy(m.get("cut_cross_entropy")):
        m.set("kernels.cut_cross_entropy", True, "cut_cross_entropy")
        if importer_kernels.CCE_PLUGIN not in plugins:
            m.note("cut_cross_entropy without the CutCrossEntropyPlugin in plugins: planned "
                   "as if it is listed")
    if on or truthy(m.get("cut_cross_entropy")):
        m.mapped["plugins"] = "kernels"
    unsloth = [k for k in _UNSLOTH_KEYS if truthy(m.get(k))]
    for key in unsloth:
        importer_kernels.liger(m, key, [_UNSLOTH_KEYS[key]])
    m.used.update({"unsloth_lora_qkv", "unsloth_lora_o"})
    if unsloth:
        m.note(f"{', '.join(unsloth)}: Unsloth's kernels, planned as the Liger kernels that save "
               "the same tensors (norm: input + fp32 rstd; MLP: gate and up; cross-entropy: "
               "gradient in the logits); unsloth_lora_qkv/o: planned as PEFT's LoRA layers")
    importer_kernels.method_variants(m, dora="peft_use_dora", rslora="peft_use_rslora",
                                     modules=("lora_modules_to_save",))
    importer_kernels.lora_target_parameters(m, "lora_target_parameters")
    _unfrozen(m)


def _unfrozen(m: Mapper) -> None:
    """unfrozen_parameters: regexes of the parameters that train. The embeddings and lm_head
    under an adapter are trained in full (as modules_to_save); a full fine-tune that freezes
    the rest is planned with every parameter trained (an upper bound)."""
    patterns = importer_kernels.module_list(m.get("unfrozen_parameters"))
    if not patterns:
        return
    full = m.spec.get("method", {}).get("kind") == "full"
    names = [n for n in ("embed_tokens", "lm_head") if any(n in p for p in patterns)]
    if full:
        m.set("method.kind", "full", "unfrozen_parameters")
        m.note("unfrozen_parameters on a full fine-tune: planned with every parameter trained "
               "(gradients and optimizer state for all: an upper bound)")
        return
    if names:
        importer_kernels.method_variants(m, modules=())
        got = m.spec.get("method", {}).get("modules_to_save", [])
        m.set("method.modules_to_save", got + [n for n in names if n not in got],
              "unfrozen_parameters")
    rest = [p for p in patterns if not any(n in p for n in ("embed_tokens", "lm_head"))]
    if rest:
        m.note(f"unfrozen_parameters {rest}: layers unfrozen beside the adapters are not "
               "modelled (only embed_tokens / lm_head are: trained in full)")


_RL = {"dpo": "dpo", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo", "kto": "kto",
       "grpo": "grpo"}


def _objective(m: Mapper) -> None:
    """rl: and its keys -> objective.*; sequence_len stays each sequence's length (pairs) or
    becomes prompt + completion (GRPO)."""
    rl = m.get("rl")
    m.no_effect(*NO_EFFECT)
    if rl in (None, "", False):
        return
    kind = _RL.get(str(rl).lower())
    if kind is None:
        m.fail("rl", f"{rl!r} is not an objective tunepilot models.",
               f"Use one of {', '.join(_RL)} (axolotl's RLType).")
    set_kind(m, kind, "rl")
    beta_key = "orpo_alpha" if kind == "orpo" and m.has("orpo_alpha") else "rl_beta"
    beta = number(m, beta_key, float)
    if beta is not None:
        m.set("objective.beta", beta, "rl_beta", "orpo_alpha")
    if truthy(m.get("rl_adapter_ref_model")) and kind not in ("orpo", "simpo"):
        m.set("objective.reference", "copy", "rl_adapter_ref_model")
    if truthy(m.get("precompute_ref_log_probs")):
        m.set("objective.reference", "precomputed", "precompute_ref_log_probs")
    block = m.get("trl") or {}
    if not isinstance(block, dict):
        m.fail("trl", "is not a mapping of TRL trainer settings.")
    vllm = m.get("vllm") or {}
    server = truthy(block.get("use_vllm")) and not block.get("vllm_mode")

    def get(key: str):
        """trl: keys as TRL reads them; axolotl serves vLLM (vllm-serve) unless vllm_mode."""
        if key == "vllm_mode" and server:
            return "server"
        if key == "vllm_tensor_parallel_size" and server and isinstance(vllm, dict):
            tp = value_number(m, "vllm.tensor_parallel_size",
                              vllm.get("tensor_parallel_size"), least=1)
            dp = value_number(m, "vllm.data_parallel_size", vllm.get("data_parallel_size"),
                              least=1)
            return (tp or 1) * (dp or 1)
        return block.get(key)

    trl_keys(m, kind, get=get, where=lambda k: f"trl.{k}")
    if server:
        m.mapped["vllm"] = "objective.generation.server_devices"
        m.note("trl.use_vllm without vllm_mode: axolotl serves vLLM on cards of its own "
               "(`axolotl vllm-serve`): vllm.tensor_parallel_size x data_parallel_size of them")
    if block:
        m.mapped["trl"] = "objective"
    prompt = number(m, "max_prompt_len", least=1)
    seq = m.spec.get("sequence_length", 2048)
    o = m.spec.setdefault("objective", {})
    if kind == "grpo":
        _grpo(m, o, prompt or seq)
    elif prompt is not None and prompt < seq:
        m.set("objective.max_prompt_length", prompt, "max_prompt_len")


def _grpo(m: Mapper, o: dict, prompt: int) -> None:
    """axolotl's GRPO: max_prompt_length = max_prompt_len or sequence_len, the completion from
    trl.max_completion_length."""
    c = o.get("max_completion_length") or 256
    if "max_completion_length" not in o:
        o["max_completion_length"] = c
        m.note("trl.max_completion_length not set: 256 assumed (axolotl's GRPO examples)")
    o["max_prompt_length"] = int(prompt)
    m.spec["sequence_length"] = int(prompt) + int(c)
    m.used.add("max_prompt_len")
    m.note(f"sequence_length {int(prompt) + int(c)} = prompt {prompt} (max_prompt_len, else "
           f"sequence_len) + completion {c}")



def _method(m: Mapper) -> None:
    adapter = m.get("adapter")
    four, eight = truthy(m.get("load_in_4bit")), truthy(m.get("load_in_8bit"))
    if adapter in (None, "", "full"):
        m.set("method.kind", "full", "adapter")
        return
    if adapter not in ("lora", "qlora"):
        m.fail("adapter", f"{adapter!r} is not lora or qlora.",
               "tunepilot models full fine-tuning, LoRA and QLoRA.")
    kind = "qlora" if adapter == "qlora" or four else "lora"
    m.set("method.kind", kind, "adapter", *(("load_in_4bit",) if four else ()))
    if eight:
        m.note("load_in_8bit: an 8-bit base is not modelled; planned with a 16-bit base "
               "(an upper bound)")
        m.used.add("load_in_8bit")
    for key, dotted, kind_ in (("lora_r", "method.lora_rank", int),
                               ("lora_alpha", "method.lora_alpha", float),
                               ("lora_dropout", "method.lora_dropout", float)):
        value = number(m, key, kind_)
        if value is not None:
            m.set(dotted, value, key)
    if truthy(m.get("lora_target_linear")):
        m.set("method.lora_targets", "all-linear", "lora_target_linear")
    else:
        targets = lora_targets(m.get("lora_target_modules"))
        if targets:
            m.set("method.lora_targets", targets, "lora_target_modules")
    if kind == "qlora" and truthy(m.get("bnb_4bit_use_double_quant")):
        m.set("method.double_quant", True, "bnb_4bit_use_double_quant")


def _precision(m: Mapper) -> None:
    bf16 = truthy(m.get("bf16")) or truthy(m.get("bfloat16"))
    fp16 = truthy(m.get("fp16")) or truthy(m.get("float16"))
    m.used.add("tf32")
    full = m.spec.get("method", {}).get("kind") == "full"
    conf = m.get("fp8_config")
    if fp8_precision(m, "fp8_config.recipe", conf.get("recipe") if isinstance(conf, dict)
                     else None, "tensorwise"):
        m.maps("precision", "bf16", "bfloat16", "fp16", "float16", "fp8_config")
        if full and bf16:
            m.note("fp8 on a bf16-loaded full fine-tune: the plan keeps fp32 master weights and "
                   "optimizer state (an upper bound where axolotl trains the bf16 weights)")
    elif bf16:
        m.set("precision", "bf16-true" if full else "bf16-mixed", "bf16")
        if full:
            m.note("bf16 full fine-tune: axolotl loads the weights in bf16, so the optimizer "
                   "state is bf16 too (precision bf16-true)")
    elif fp16:
        m.set("precision", "fp16-mixed", "fp16")
    else:
        m.set("precision", "fp32", "bf16")


def _parallel(m: Mapper) -> None:
    fsdp, conf = m.get("fsdp"), m.get("fsdp_config") or {}
    if fsdp or (isinstance(conf, dict) and conf.get("fsdp_version")):
        m.set("parallel.strategy", "fsdp", "fsdp", "fsdp_config")
        if isinstance(conf, dict) and truthy(conf.get("fsdp_offload_params",
                                                      conf.get("offload_params"))):
            m.set("parallel.cpu_offload", True, "fsdp_config")
    if m.has("deepspeed"):
        deepspeed_strategy(m, "deepspeed", m.get("deepspeed"))


def _data(m: Mapper) -> None:
    datasets = m.get("datasets")
    opts = m.options
    if not datasets or opts.synthetic_data:
        if datasets:
            m.note("--data synthetic: the config's datasets are not read")
        return
    if not isinstance(datasets, list) or not isinstance(datasets[0], dict):
        m.fail("datasets", "is not a list of datasets with a path.")
    d = datasets[0]
    if len(datasets) > 1:
        m.note(f"{len(datasets)} datasets: only the first ({d.get('path')}) is profiled")
    path = d.get("data_files") or d.get("path")
    if isinstance(path, list):
        path = path[0] if path else None
    if not isinstance(path, str) or not path.strip():
        m.fail("datasets", f"the first dataset's path is {str(path)[:40]!r}, not a path.",
               "Give datasets[0].path (or data_files): a local file or directory.")
    kind = str(d.get("type") or "")
    fmt, fields = _format(m, kind, d)
    objective = (m.spec.get("objective") or {}).get("kind")
    if objective in ("dpo", "ipo", "orpo", "simpo"):
        fmt, fields = "preference", _pair_fields(d)
    elif objective == "grpo":
        fmt, fields = "prompt", {}
    tok = opts.tokenizer or m.get("tokenizer_config")
    data = local_data(m, str(path), fmt=fmt, fields=fields, tokenizer=tok, key="datasets")
    if data is None:
        m.data_unavailable("datasets", f"{path!r} is not a local file or directory (a hub dataset): "
               "tunepilot never downloads.", "Save a local copy (JSONL, Parquet, or "
               "save_to_disk) and point path at it, or pass --data synthetic.")
    train_inputs = truthy(m.get("train_on_inputs"))
    if data["format"] != "text":
        data["train_on"] = "all" if train_inputs else "completions"
    template = m.get("chat_template")
    if template and data["format"] != "text":
        if isinstance(template, str) and template in _TEMPLATES:
            data["chat_template"] = _TEMPLATES[template]
        else:
            m.note(f"chat_template {template!r}: rendered with the tokenizer's own template")
    if truthy(m.get("sample_packing")):
        data["packing"] = True
    if truthy(m.get("pad_to_sequence_len")):
        m.note("pad_to_sequence_len: true pads every micro-batch to sequence_len: the plan's "
               "memory is at sequence_len already; the data profile pads a batch to its longest "
               "sample only, so the quote's positions per step are a lower bound unless "
               "sample_packing fills the batches")
    m.set("data", data, "datasets", "train_on_inputs", "chat_template", "sample_packing")


def _pair_fields(d: dict) -> dict:
    """axolotl's chat_template preference type names its fields (field_chosen, ...)."""
    out = {"prompt_field": d.get("field_prompt"), "chosen_field": d.get("field_chosen"),
           "rejected_field": d.get("field_rejected"), "messages_field": d.get("field_messages")}
    return {k: v for k, v in out.items() if v}


def _format(m: Mapper, kind: str, d: dict) -> tuple[str | None, dict]:
    if kind in ("chat_template", "sharegpt") or kind.startswith("chat_template."):
        field = d.get("field_messages") or ("conversations" if kind == "sharegpt" else
                                            "messages")
        return "messages", {"messages_field": field}
    if kind == "alpaca":
        m.note("alpaca rows: instruction -> prompt, output -> completion (the input field is "
               "not rendered)")
        return "prompt-completion", {"prompt_field": "instruction", "completion_field": "output"}
    if kind in ("completion", "pretrain"):
        return "text", {"text_field": d.get("field") or "text"}
    if kind:
        m.note(f"dataset type {kind!r}: the format is read from the first row")
    return None, {}


def _target(m: Mapper) -> None:
    steps, epochs = number(m, "max_steps"), number(m, "num_epochs", float)
    synthetic = m.spec.get("data") is None
    if steps:
        m.note(f"max_steps {steps}: the target is steps x tokens per optimizer step (padded "
               "positions on one device; set target.tokens for useful tokens)")
        m.spec["_max_steps"] = steps
        m.used.add("max_steps")
        if epochs is not None:
            m.note(f"num_epochs {epochs:g}: max_steps {steps} overrides it (as in axolotl)")
    elif epochs and not synthetic:
        m.set("target.epochs", epochs, "num_epochs")
    elif epochs:
        m.note(f"num_epochs {epochs:g} not mapped: synthetic data has no epochs; set "
               "target.tokens")
