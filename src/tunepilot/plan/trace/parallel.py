"""The traced plan under model parallelism and DeepSpeed: what the child traces for one rank,
and ZeRO's partitioning applied to the traced step. Parent side: no torch import.

  tensor parallel   the rank's slice is traced as a narrower model of the same family: the
                    config's attention heads, K/V heads, intermediate size and vocabulary
                    divided by parallel.tensor, head_dim kept - the shapes a column-/row-parallel
                    rank computes on (its collectives are in place). With sequence_parallel the
                    hidden-sized activations are split too: the traced activations are scaled by
                    the analytic plan's sequence-parallel share (MODELLED on the traced step).
  context parallel  the trace runs sequence_length / context tokens per sample; the ring's K/V
                    buffers are added from the analytic plan.
  FSDP              traced per rank over the data-parallel ranks (plan/trace/fsdp.py).
  DeepSpeed ZeRO    DeepSpeed does not run on fake tensors (its engine needs a real accelerator
                    and process group), so the trace runs the step one rank computes - the
                    16-bit module without autocast, as DeepSpeed's bf16/fp16 engine runs it, on
                    one device - and ZeRO's partitioning is applied to the traced states by the
                    analytic plan's rules (plan/analytic/parallel.py zero_states): the traced
                    16-bit weights, gradients and optimizer state become the stage's shards,
                    the fp32 master copy and states, the reduce buckets and (stage 3) the
                    gathered parameters.
"""

from __future__ import annotations

import math

from tunepilot.model.arch import Arch
from tunepilot.plan.analytic.activations import precision_bytes, saved_activations
from tunepilot.plan.analytic.parallel import (
    rank_view,
    ring_bytes,
    sequence_parallel_bytes,
    zero_states,
)
from tunepilot.plan.analytic.states import States, task_counts
from tunepilot.results.plan import ParamSplit
from tunepilot.spec import RunSpec

# HF config keys a tensor-parallel rank holds 1/t of (the first present of each group)
_TP_KEYS = (("num_attention_heads", "n_head"), ("num_key_value_heads",),
            ("intermediate_size", "ffn_dim", "n_inner"), ("moe_intermediate_size",),
            ("shared_expert_intermediate_size",), ("vocab_size",))


def trace_target(spec: RunSpec, config: dict, arch: Arch) -> tuple[RunSpec, dict]:
    """The spec and config the child traces for one rank of `spec`."""
    par = spec.parallel
    experts = par.expert > 1 and par.strategy != "fsdp"
    if not (par.model_parallel or par.strategy == "deepspeed"):
        if not experts:
            return spec, config
        return (spec.with_changes(parallel=dict(par.model_dump(), expert=1)),
                expert_config(config, par.expert))
    step = rank_view(spec, arch).step_spec
    if par.sequence_parallel:  # traced without it, whole sequence through the tensor slice:
        # parallel_on_trace splits the hidden-sized saves (sequence_parallel_share)
        step = step.with_changes(sequence_length=-(-spec.sequence_length // par.context))
    if par.strategy == "fsdp":
        parallel = dict(par.model_dump(), devices=par.replicas, nodes=1, tensor=1,
                        context=1, sequence_parallel=False, expert=1)
    else:
        parallel = {"strategy": "single"}
    step = step.with_changes(parallel=parallel)
    if par.tensor > 1:
        config = tensor_config(config, arch, par.tensor)
    if experts:
        config = expert_config(config, par.expert)
    return step, config


def target_notes(spec: RunSpec) -> list[str]:
    """What the trace ran for one rank, in words."""
    par = spec.parallel
    notes = []
    if par.tensor > 1:
        notes.append(f"tensor parallel {par.tensor}: the rank traced as the model's "
                     f"1/{par.tensor} slice (heads, intermediate size and vocabulary divided; "
                     "hidden size and head_dim kept)")
    if par.strategy == "deepspeed":
        notes.append(f"DeepSpeed ZeRO-{par.deepspeed.stage}: the step traced on one device as "
                     "DeepSpeed's engine runs it (the module in "
                     f"{spec.precision.compute_bytes * 8}-bit, no autocast); ZeRO's partitioning "
                     "applied to the traced states by the analytic plan's rules - DeepSpeed "
                     "itself does not run on fake tensors")
    if par.expert > 1 and par.strategy != "fsdp":
        notes.append(f"expert parallel {par.expert}: the rank traced with 1/{par.expert} of each "
                     "MoE layer's routed experts and the same top-k, so its experts compute "
                     "the tokens x top-k pairs a balanced all-to-all brings each rank")
    elif par.expert > 1:
        notes.append(f"expert parallel {par.expert} under FSDP: the trace shards every expert "
                     "over all the ranks; the plan's expert states follow the analytic rule "
                     "(a rank's experts over the ranks holding the same ones)")
    if par.context > 1:
        notes.append(f"context parallel {par.context}: the trace ran "
                     f"{spec.sequence_length // par.context} tokens per sample, the ring's K/V "
                     "buffers added from the analytic plan")
    return notes


def tensor_config(config: dict, arch: Arch, t: int) -> dict:
    """A tensor-parallel rank's slice of the model as a config of the same family."""
    out = dict(config)
    for keys in _TP_KEYS:
        key = next((k for k in keys if out.get(k)), None)
        if key is not None:
            out[key] = max(1, -(-int(out[key]) // t))
    out["head_dim"] = arch.head_dim
    return out


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_config(config: dict, e: int) -> dict:
    """An expert-parallel rank's slice of the model as a config of the same family: each MoE
    layer with 1/e of its routed experts (top-k kept, at most the experts it holds); a
    multimodal config's text_config sliced the same way."""
    out = dict(config)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = expert_config(out["text_config"], e)
        return out
    key = next((k for k in _EXPERT_KEYS if out.get(k)), None)
    if key is not None:
        out[key] = max(1, int(out[key]) // e)
        if out.get("num_experts_per_tok"):
            out["num_experts_per_tok"] = min(int(out["num_experts_per_tok"]), out[key])
        if out.get("n_group"):  # DeepSeek's group-limited routing: groups of the rank's experts
            out["n_group"] = math.gcd(int(out["n_group"]), out[key])
            out["topk_group"] = min(int(out.get("topk_group") or 1), out["n_group"])
    return out


def sequence_parallel_share(spec: RunSpec, arch: Arch) -> float:
    """The decoder layers' saved activations under sequence parallel over those without it
    (Korthikanti et al. 2022: the hidden-sized ones split too), from the analytic plan."""
    if not spec.parallel.sequence_parallel:
        return 1.0
    view = rank_view(spec, arch)
    plain = rank_view(spec.with_changes(parallel=dict(spec.parallel.model_dump(),
                                                      sequence_parallel=False)), arch)
    cb, sb, _ = precision_bytes(view.step_spec)
    with_sp, _ = saved_activations(view.step_arch, view.step_spec, cb, sb,
                                   view.step_spec.batch.positions_per_micro_batch)
    without, _ = saved_activations(plain.step_arch, plain.step_spec, cb, sb,
                                   plain.step_spec.batch.positions_per_micro_batch)
    return with_sp / without if without else 1.0


def parallel_on_trace(spec: RunSpec, arch: Arch, phases: list[dict]) -> list[dict]:
    """Sequence parallel's split of the traced activations and the ring / all-gather buffers
    of context and sequence parallel, in the forward and backward phases."""
    par = spec.parallel
    if not par.model_parallel:
        return phases
    view = rank_view(spec, arch)
    cb, _, _ = precision_bytes(view.step_spec)
    tokens = view.step_spec.batch.positions_per_micro_batch
    share = sequence_parallel_share(spec, arch)
    extra = ring_bytes(spec, view.step_arch, cb, tokens) + \
        sequence_parallel_bytes(spec, view.step_arch, cb, tokens)
    out = []
    for p in phases:
        q = dict(p)
        if not p["name"].startswith(("optimizer", "validation")):
            q["activations"] = int(p["activations"] * share)
            q["temporary"] = p["temporary"] + extra
        out.append(q)
    return out


def zero_on_trace(spec: RunSpec, arch: Arch, raw, phases: list[dict]
                  ) -> tuple[list[dict], int, int, list[str]]:
    """ZeRO's shares of the traced single-device step: (phases, reduce buckets, host bytes,
    notes). The traced 16-bit module's weights, gradients and optimizer state (PyTorch keeps
    the state in the parameters' 16-bit dtype; DeepSpeed's optimizer keeps fp32 state on the
    fp32 master copy) are handed to zero_states."""
    from tunepilot.model.optimizers import optimizer_info

    view = rank_view(spec, arch)
    counts = task_counts(view.states_arch, spec)
    m = raw.model
    b16 = spec.precision.compute_bytes  # DeepSpeed's module: its 16-bit engine, or fp32
    to_fp32 = 4 / b16
    # only torch's own optimizers keep their state in the parameters' dtype: 8/4-bit codes and
    # their fp32 scales, bitsandbytes' 32-bit states and Adafactor's are the same on the master
    state_to_fp32 = to_fp32 if optimizer_info(spec.optimizer.name)["library"] == "torch" else 1
    weights = max(p["weights"] for p in phases)
    grads_max = max(max(p["gradients"] for p in phases), 1)
    optim = max(p["optimizer"] for p in phases)
    opt_phase = next((p for p in phases if p["name"].startswith("optimizer")), None)
    opt_temp = opt_phase["temporary"] if opt_phase else 0
    frozen = max(0, weights - m.trainable_bytes)
    s = States(weights=weights, master=0, grads=m.trainable_bytes,
               optim=int(optim * state_to_fp32), optim_temp=int(opt_temp * state_to_fp32),
               frozen_bytes=frozen, trainable_bytes=int(m.trainable_bytes * to_fp32),
               linear_weights=0, lm_head_weights=0)
    params = ParamSplit(total=m.total_params, trainable=m.trainable_params,
                        frozen=m.total_params - m.trainable_params)
    s = zero_states(spec, view.states_arch, s, counts, params)
    # ZeRO-2/3 reduce a gradient out of the bucket as it is made, but one larger than the bucket
    # (the LM head's, the embedding's) stays whole until its reduce-scatter is done
    in_flight = max((b for _, b, t in m.param_rows if t), default=0) \
        if spec.parallel.deepspeed.stage >= 2 else 0
    out = []
    for p in phases:
        q = dict(p, weights=s.weights, master_weights=s.master, optimizer=s.optim,
                 gradients=s.grads if s.grads_persistent else
                 int(s.grads * p["gradients"] / grads_max))
        if p["name"].startswith("optimizer"):
            q["temporary"] = max(0, p["temporary"] - opt_temp) + s.optim_temp
        else:
            q["temporary"] = p["temporary"] + s.unsharded
        if p["name"].endswith("backward") and not p.get("twin"):  # (a twin's is made then)
            q["temporary"] += min(p["gradients"], in_flight)
        out.append(q)
    return out, s.buckets, s.host, s.notes
