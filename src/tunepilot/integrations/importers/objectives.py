"""What every importer shares about the objective: TRL's trainer configs (DPO, KTO, ORPO, CPO,
Reward, GRPO, RLOO - the keys axolotl passes through in its ``trl:`` block too), which keys
change memory or time (mapped to the spec's ``objective:``) and which do not (listed as read,
no effect). Pure data: no torch.
"""

from __future__ import annotations

from tunepilot.integrations.importers.common import Mapper, number, truthy, value_number

# TRL 1.16's trainer configs (trl/trainer/*_config.py, trl/experimental/{orpo,cpo}): the keys
# that change memory or time, mapped below.
TRL_OBJECTIVE_MAPPED = {
    "beta", "loss_type", "max_prompt_length", "max_completion_length", "num_generations",
    "num_iterations", "steps_per_generation", "generation_batch_size", "use_vllm", "vllm_mode",
    "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size",
    "precompute_ref_log_probs", "ref_model_init_kwargs", "reward_model_path", "padding_free",
}
# Keys of those configs that do not change memory or time (coefficients, sampling, logging).
TRL_OBJECTIVE_NO_EFFECT = {
    "label_smoothing", "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef",
    "use_weighting", "discopop_tau", "rpo_alpha", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "desirable_weight", "undesirable_weight", "cpo_alpha", "simpo_gamma",
    "alpha", "center_rewards_coefficient", "epsilon", "epsilon_high", "delta", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "reward_weights", "reward_funcs",
    "scale_rewards", "mask_truncated_completions", "log_completions", "num_completions_to_print",
    "disable_dropout", "truncation_mode", "precompute_ref_batch_size", "generation_kwargs",
    "importance_sampling_level", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
    "vllm_server_base_url", "vllm_group_port", "vllm_max_model_length", "vllm_model_impl",
    "num_generations_eval", "shuffle_dataset", "chat_template_kwargs", "cache_implementation",
    "use_transformers_paged", "max_tool_calling_iterations", "dataset_num_proc",
    "is_encoder_decoder", "tools",
}
TRL_OBJECTIVE_KNOWN = TRL_OBJECTIVE_MAPPED | TRL_OBJECTIVE_NO_EFFECT
GENERATIVE_KEYS = ("num_generations", "use_vllm", "reward_funcs", "vllm_mode",
                   "vllm_gpu_memory_utilization", "num_iterations", "steps_per_generation")


def guess_trl_kind(raw: dict) -> str | None:
    """Which TRL trainer a config file is for (the file does not say; the command does):
    generation keys -> grpo; desirable/undesirable weights -> kto; cpo_alpha/simpo_gamma ->
    cpo; center_rewards_coefficient -> reward; beta, loss_type or a reference key -> dpo."""
    if any(k in raw for k in GENERATIVE_KEYS):
        return "grpo"
    if "desirable_weight" in raw or "undesirable_weight" in raw:
        return "kto"
    if "simpo_gamma" in raw or raw.get("loss_type") == "simpo":
        return "simpo"
    if "cpo_alpha" in raw:
        return "cpo"
    if "center_rewards_coefficient" in raw:
        return "reward"
    if any(k in raw for k in ("beta", "precompute_ref_log_probs", "rpo_alpha", "ref_model_init_"
                              "kwargs", "max_prompt_length")):
        return "dpo"
    return None


def set_kind(m: Mapper, kind: str, *keys: str) -> None:
    m.set("objective.kind", kind, *keys)
    if kind == "reward":
        m.set("model.task", "sequence-classification", *keys)
        m.set("model.num_labels", 1, *keys)


def trl_keys(m: Mapper, kind: str, get=None, where=None) -> None:
    """The TRL trainer keys of a config (``get`` reads them: the top level, or axolotl's
    ``trl:`` block) onto objective.* fields; ``where`` names a key in errors (trl.beta)."""
    get = get or (lambda k: m.get(k))
    where = where or (lambda k: k)
    beta = value_number(m, where("beta"), get("beta"), float)
    if beta is not None:
        m.set("objective.beta", beta, "beta")
    loss = get("loss_type")
    if isinstance(loss, list):
        several = len(loss) > 1
        loss = loss[0] if loss else None
        if several:
            m.note("loss_type lists several losses (a combination): planned with the first")
    if loss is not None and not isinstance(loss, str):
        m.fail(where("loss_type"), f"is {str(loss)[:40]}, not the name of a loss.")
    if loss and kind in ("dpo", "ipo", "grpo", "rloo", "cpo", "simpo"):
        m.set("objective.loss_type", str(loss), "loss_type")
    for key in ("max_prompt_length", "max_completion_length", "num_iterations",
                "steps_per_generation"):
        value = value_number(m, where(key), get(key), least=1)
        if value is not None and (kind in ("grpo", "rloo") or key in ("max_prompt_length",
                                                                    "max_completion_length")):
            m.set(f"objective.{key}", value, key)
    if kind in ("grpo", "rloo"):
        _generation(m, get, where)
    if truthy(get("precompute_ref_log_probs")):
        m.set("objective.reference", "precomputed", "precompute_ref_log_probs")
    m.used.update(TRL_OBJECTIVE_MAPPED)
    m.no_effect(*TRL_OBJECTIVE_NO_EFFECT)


def _generation(m: Mapper, get, where) -> None:
    n = value_number(m, where("num_generations"), get("num_generations"), least=1)
    if n is not None:
        m.set("objective.num_generations", n, "num_generations")
    gbs = value_number(m, where("generation_batch_size"), get("generation_batch_size"), least=1)
    if gbs is not None:
        per = m.spec.get("micro_batch_size", 8) * ((m.spec.get("parallel") or {})
                                                   .get("devices", 1))
        m.set("objective.steps_per_generation", max(1, gbs // max(per, 1)),
              "generation_batch_size")
    if not truthy(get("use_vllm")):
        m.set("objective.generation.backend", "transformers", "use_vllm")
        return
    mode = get("vllm_mode") or "colocate"
    if mode not in ("server", "colocate"):
        m.fail(where("vllm_mode"), f"is {str(mode)[:40]!r}, not server or colocate.",
               "TRL's vllm_mode is server or colocate.")
    if mode == "server":
        m.set("objective.generation.backend", "vllm-server", "use_vllm", "vllm_mode")
        tp = value_number(m, where("vllm_tensor_parallel_size"),
                          get("vllm_tensor_parallel_size"), least=1)
        m.set("objective.generation.server_devices", tp or 1, "vllm_tensor_parallel_size")
        m.note("vllm_mode server: the vLLM server runs on cards of its own (`trl vllm-serve`): "
               "objective.generation.server_devices counts them in the quote")
        return
    m.set("objective.generation.backend", "vllm-colocate", "use_vllm", "vllm_mode")
    util = value_number(m, where("vllm_gpu_memory_utilization"),
                        get("vllm_gpu_memory_utilization"), float)
    m.set("objective.generation.gpu_memory_utilization", 0.3 if util is None else util,
          "vllm_gpu_memory_utilization")
    if util is None:
        m.note("vllm_gpu_memory_utilization not set: TRL's default 0.3 of each card")
    if truthy(get("vllm_enable_sleep_mode")):
        m.set("objective.generation.sleep_mode", True, "vllm_enable_sleep_mode")


def objective_lengths(m: Mapper, kind: str, max_length: int | None, default: int) -> None:
    """sequence_length of an objective: pairs -> max_length (TRL's per sequence, default
    ``default``); generation -> prompt + completion (TRL 1.16 does not truncate prompts: 512
    assumed when max_prompt_length is not set)."""
    o = m.spec.setdefault("objective", {})
    if kind not in ("grpo", "rloo", "ppo"):
        m.set("sequence_length", int(max_length or default), "max_length")
        if not max_length:
            m.note(f"max_length not set: the trainer's default {default} per sequence")
        return
    c = o.get("max_completion_length") or (1024 if kind == "ppo" else 512)
    p = o.get("max_prompt_length")
    if p is None:
        p = 512
        o["max_prompt_length"] = p
        m.note("max_prompt_length not set (TRL 1.16 does not truncate prompts): planned with "
               "512-token prompts; the pilot measures the dataset's longest")
    o.setdefault("max_completion_length", c)
    m.spec["sequence_length"] = int(p) + int(c)
    m.note(f"sequence_length {int(p) + int(c)} = prompt {p} + completion {c} (the policy's "
           "sequence)")


def number_or_none(m: Mapper, key: str, kind: type = float):
    return number(m, key, kind)
