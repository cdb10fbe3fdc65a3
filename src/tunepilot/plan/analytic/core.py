"""The analytic memory plan: pure arithmetic over the model's architecture and the run spec.

No torch import on this path (it is what `tunepilot plan` runs in milliseconds). The model is the
implementation tunepilot's pilot runs: Hugging Face transformers decoders with SDPA attention (a
flash/memory-efficient kernel, so no s x s term), PEFT LoRA, PyTorch optimizers, autocast for the
*-mixed precisions. Byte counts per token are derived in plan/analytic/activations.py.

The peak is taken over the step's timeline (a list of phases), not as a sum of maxima:
  forward-end    inside autocast: saved activations, autocast's weight casts, the logits and
                 their fp32 upcast
  loss-backward  the cross-entropy backward: saved activations and the fp32 loss gradients
  backward-end   all gradients materialised, activations freed
  optimizer-step gradients + optimizer state + the optimizer's temporaries
Optimizer state exists from step 1 on, so every phase includes it (the plan is of step 2+).
"""

from __future__ import annotations

from tunepilot.model.arch import Arch, ParamCounts, linear_modules
from tunepilot.model.flops import default_optimizer_impl
from tunepilot.plan.analytic import moe as moe_plan
from tunepilot.plan.analytic import variants
from tunepilot.plan.analytic.activations import (
    CHUNKED_LOSS_TOKENS,
    kept_output_bytes,
    layer_backward_bytes,
    logits_bytes,
    logits_forward_bytes,
    logprob_bytes,
    no_grad_layer_bytes,
    precision_bytes,
    saved_activations,
)
from tunepilot.plan.analytic.megatron_load import megatron_load, megatron_load_note
from tunepilot.plan.analytic.parallel import (
    offload_note,
    parallelize,
    rank_view,
    ring_bytes,
    sequence_parallel_bytes,
)
from tunepilot.plan.analytic.phases import no_grad_forward_bytes, objective_notes, objective_phases
from tunepilot.plan.analytic.states import (
    States,
    model_states,
    split_params,
    state_bytes,
    task_counts,
)
from tunepilot.plan.reserve.core import expandable_segments, reserve_note, varied_shapes
from tunepilot.resources import runtime_constants
from tunepilot.results.plan import MemoryPlan, ParamSplit, PerDevice, Phase
from tunepilot.spec import RunSpec
from tunepilot.units import fmt_bytes

__all__ = ["CHUNKED_LOSS_TOKENS", "analytic_plan", "offload_note", "per_device_figures",
           "runtime_constants", "split_params", "state_bytes", "task_counts"]



def loss_path_notes(spec: RunSpec) -> list[str]:
    """What the plan takes from model.transformers_version and loop_keeps_output."""
    path, out = spec.hf_loss_path, []
    v = spec.model.transformers_version
    if v is not None and path == "none":
        out.append(f"model.transformers_version {v}: the model's forward computes no "
                   "cross-entropy here (another objective, task or loss), so the release "
                   "changes nothing the plan counts")
    elif v is not None:
        out.append(f"model.transformers_version {v}: the loss path of that release - " + {
            "fp32-output": "the forward upcasts the logits to fp32 and keeps them in its "
                           "output, the loss copies the shifted logits (before 4.46)",
            "shift-copy": "the loss upcasts the logits to fp32 and copies the shifted "
                          "logits (4.46 to 4.48)",
            "current": "the installed transformers' (4.49 on: fp32 upcast, labels shifted)",
        }[path] + "; the rest of the model is the installed transformers' code")
    if spec.loop_keeps_output != "none":
        out.append(f"loop_keeps_output {spec.loop_keeps_output}: the loop's model output "
                   "(its logits) alive through its backward and the optimizer step" +
                   (" and the next micro-batch's forward"
                    if spec.loop_keeps_output == "to-next-forward" else "") +
                   ("" if path != "none" else " - the loss here returns no logits, so "
                    "nothing more is kept"))
    return out


def lever_notes(spec: RunSpec) -> list[str]:
    """What the plan models on top of the step for torchtune's memory levers."""
    from tunepilot.plan.analytic.activations import OFFLOAD_LAYERS_ON_DEVICE

    out = []
    if spec.optimizer_in_backward:
        out.append("optimizer_in_backward: each parameter stepped in its gradient hook, its "
                   "gradient freed at once - at most the largest parameter's gradient alive; "
                   "MODELLED (the trace and the pilot run the plain step)")
    if spec.activation_offloading:
        out.append("activation_offloading: the decoder layers' saved activations in host "
                   f"memory, {OFFLOAD_LAYERS_ON_DEVICE} layers' worth on the device; MODELLED "
                   "(the trace and the pilot run without offloading)")
    return out


def _timeline(spec: RunSpec, arch: Arch, s: States) -> tuple[list[Phase], int]:
    """The four phases of step 2+ and the validation pass, and the largest weight (what the
    load holds besides)."""
    cb, sb, _ = precision_bytes(spec)
    tokens = spec.batch.positions_per_micro_batch
    shard = spec.parallel.state_shards if spec.parallel.strategy == "fsdp" else 1
    saved, layer_ws = saved_activations(arch, spec, cb, sb, tokens)
    # context parallel's ring and sequence parallel's gathered input, in a layer's working set
    parallel_ws = ring_bytes(spec, arch, cb, tokens) + sequence_parallel_bytes(spec, arch, cb,
                                                                               tokens)
    casts_fwd, casts_bwd = _autocast_casts(spec, s, shard)
    fp8_ws = 0
    if spec.precision.is_fp8:  # FP8's casts, saves, working set, all-gather (analytic/fp8.py)
        from tunepilot.plan.analytic.fp8 import fp8_terms

        f8 = fp8_terms(spec, arch, cb, tokens, shard, s.linear_weights, casts_fwd)
        saved += f8.saved_delta
        casts_fwd += f8.casts_delta
        if spec.activation_checkpointing == "none":
            casts_bwd += f8.casts_delta
        s.unsharded += f8.unsharded_delta
        fp8_ws = f8.transient
        s.notes += f8.notes
    logits_kept, logits_transient = logits_bytes(arch, spec, cb, tokens)
    layer_bwd = layer_backward_bytes(arch, spec, cb, tokens) if \
        spec.activation_checkpointing == "none" else 0  # (checkpointed: the recompute's)
    logits_fwd = logits_forward_bytes(arch, spec, cb, tokens)  # lm_head output + fp32 upcast
    lp = _logprobs(spec, arch, cb)
    if lp is not None:  # the DPO family / GRPO: log-probs of the labels (training/preference.py)
        logits_kept, logits_transient, logits_fwd = lp["kept"], lp["backward"], lp["forward"]
    linears = linear_modules(arch)
    dequant = 2 * max(m.in_features * m.out_features for m in linears) \
        if spec.method.kind == "qlora" else 0  # one linear dequantised to bf16 at a time
    # fused experts are one (experts, out, in) tensor; per-expert modules one expert each
    largest = max([m.numel if m.peft_kind == "parameter" else m.numel // m.count_per_layer
                   for m in linears] + [s.lm_head_weights])
    acc_grads = s.grads if spec.gradient_accumulation_steps > 1 or s.grads_persistent else 0
    grads, optim_temp = s.grads, s.optim_temp
    if spec.optimizer_in_backward:  # each gradient lives only until its parameter is stepped
        _, _, pb = precision_bytes(spec)
        grads = min(s.grads, pb * largest)
        optim_temp = min(s.optim_temp, pb * largest)
    states = (s.weights, s.master)
    dora = variants.dora_transient(arch, spec)  # each DoRA forward's weight-sized temporaries
    routing = moe_plan.routed_transient(arch, spec, cb, tokens)  # one-hot mask, all-to-all
    recompute = dora if spec.activation_checkpointing != "none" else 0
    no_grad = no_grad_forward_bytes(spec, arch, cb, tokens, lp["reference"]) if lp else 0
    # a layer's backward: QLoRA's dequantised weight, DoRA's recomputed temporaries, FP8's and
    # the parallel working sets, FSDP's unsharded layers; at the first recompute (the last
    # layer's, every layer's input still kept) a full run's largest layer weight gradient
    layer_tmp = dequant + recompute + fp8_ws + parallel_ws + s.unsharded
    layer_grad = cb * max(m.numel if m.peft_kind == "parameter" else m.numel // m.count_per_layer
                          for m in linears) if spec.method.kind == "full" else 0
    head_grad = lm_head_gradient(spec, s, cb)
    out = kept_output_bytes(arch, spec, cb, tokens)  # a loop's kept output, from the loss on
    prev = out if spec.output_kept == "to-next-forward" else 0  # and the next forward's
    phases = [
        Phase.make("forward-end", *states, acc_grads, s.optim,
                   saved + casts_fwd + logits_kept + prev,
                   max(logits_fwd, dora, fp8_ws, routing) + s.unsharded, s.buckets),
        Phase.make("loss-backward", *states, acc_grads, s.optim,
                   saved + casts_bwd + logits_kept + out,
                   max(logits_transient, layer_bwd) + head_grad + s.unsharded, s.buckets),
        # checkpointed: the last layer recomputed while every layer's input is still kept
        *([Phase.make("first-recompute", *states, acc_grads, s.optim, saved + layer_ws + out,
                      layer_grad + layer_tmp, s.buckets)]
          if spec.activation_checkpointing != "none" else []),
        Phase.make("backward-end", *states, grads, s.optim, layer_ws + out,
                   cb * largest + layer_tmp + (optim_temp if grads < s.grads else 0),
                   s.buckets),
        Phase.make("optimizer-step", *states, grads, s.optim, out, optim_temp, s.buckets),
        *([_validation_phase(spec, arch, s, cb, sb)] if spec.validation.enabled else []),
        *filter(None, [checkpoint_phase(spec, s)]),
    ]
    phases = objective_phases(spec, arch, phases, states=(*states, acc_grads, s.optim),
                              saved_and_kept=saved + casts_fwd + logits_kept, no_grad=no_grad,
                              cb=cb, unsharded=s.unsharded, buckets=s.buckets)
    return phases, largest


def _autocast_casts(spec: RunSpec, s, shard: int) -> tuple[int, int]:
    """The 16-bit weight casts alive at the forward's end and in the loss backward: autocast
    casts each fp32 weight to 16 bit per matmul and caches the trainable ones until the forward
    ends; autograd saves the casts for the input gradients - unless the layer is checkpointed,
    then only lm_head's (outside the checkpointed layers) survives."""
    if not (spec.precision.mixed
            and (spec.method.kind == "full" or spec.frozen_base_dtype == "fp32")):
        return 0, 0
    fwd = 2 * (s.linear_weights + s.lm_head_weights) // shard
    return fwd, (fwd if spec.activation_checkpointing == "none"
                 else 2 * s.lm_head_weights // shard)


def lm_head_gradient(spec: RunSpec, s, cb: int) -> int:
    """The LM head's weight gradient a full fine-tune makes in the loss's backward, alive with
    the logits' gradient: the new .grad (or the one added into an accumulated or kept buffer),
    and under ZeRO-2/3 the 16-bit gradient too large for a reduce bucket, whole until reduced.
    (FSDP's is the unsharded root's, in its working set.)"""
    par = spec.parallel
    if spec.method.kind != "full" or par.strategy == "fsdp":
        return 0
    width = cb if par.strategy == "deepspeed" else precision_bytes(spec)[2]
    return width * s.lm_head_weights


def _logprobs(spec: RunSpec, arch: Arch, cb: int) -> dict | None:
    """The log-prob terms of one micro-batch for the objectives tunepilot's loss takes
    log-probs for (everything but SFT and a classification head)."""
    if spec.objective.kind == "sft" or spec.model.task != "causal-lm":
        return None
    rows = spec.micro_batch_size * spec.objective.sequences_per_sample
    return logprob_bytes(arch, spec, cb, rows)


def _validation_phase(spec: RunSpec, arch: Arch, s: States, cb: int, sb: int) -> Phase:
    """The validation pass: a forward without gradients at the validation micro-batch. The
    model states stay (gradients were freed by zero_grad(set_to_none=True)); nothing is saved
    for backward; the transient is the larger of one layer's MLP intermediates (gate, up and
    their product, or fc1 and its activation) and the loss's (the logits, their fp32 upcast and
    the fp32 log-softmax, alive together, as the trace shows), plus FSDP's unsharded layers."""
    rows = spec.validation_micro_batch_size * spec.objective.sequences_per_sample
    tokens = rows * spec.sequence_length
    mlp = no_grad_layer_bytes(arch, cb, tokens)
    spec = variants.validation_spec(spec)  # Liger fuses its loss only while training
    log_softmax, _ = logits_bytes(arch, spec, cb, tokens)
    if variants.loss_bytes(arch, spec, cb, sb, tokens) is not None:
        log_softmax = 0  # a loss kernel keeps nothing without gradients
    loss = logits_forward_bytes(arch, spec, cb, tokens) + log_softmax
    if spec.objective.paired and spec.model.task == "causal-lm":  # the DPO loss, no gradient
        loss = logprob_bytes(arch, spec, cb, rows)["reference"]
    transient = max(mlp, loss) + s.unsharded  # the layers' transients are gone at the loss
    kept = s.grads if s.grads_persistent else 0  # a gradient buffer kept between steps
    out = kept_output_bytes(arch, spec, cb, spec.batch.positions_per_micro_batch) \
        if spec.output_kept == "to-next-forward" else 0  # the last step's output
    return Phase.make("validation", s.weights, s.master, kept, s.optim, out, transient,
                      s.buckets)


def checkpoint_phase(spec: RunSpec, s: States) -> Phase | None:
    """FSDP1's sharded checkpoint save (checkpoint.state_dict: sharded - torch's default
    ShardedStateDictConfig, as DCP's get_state_dict and HF Trainer's SHARDED_STATE_DICT use
    it): each unit is unsharded on the device in turn and every parameter's local chunk cloned
    there (torch/distributed/fsdp/_shard_utils.py: `chunks[rank].clone()`; "Setting
    offload_to_cpu here does not work") until the state dict is written - the rank's whole
    shard again, beside the resident states (CPU-offloaded ones too), with the root and a
    layer unsharded. FSDP2 and DeepSpeed save their shards in place."""
    par = spec.parallel
    if par.strategy != "fsdp" or par.fsdp_version != 1 or par.state_shards <= 1 or \
            spec.checkpoint.state_dict != "sharded":
        return None
    return Phase.make("checkpoint-save", s.weights, s.master, 0, s.optim, 0,
                      s.checkpoint_bytes, s.buckets)


def checkpoint_note(clone_bytes: int, sets_peak: bool) -> str:
    return (f"checkpoint save: FSDP1's sharded state dict holds {fmt_bytes(clone_bytes)} on the "
            "device while it builds (checkpoint.state_dict sharded) - each parameter's local "
            "chunk cloned there (torch's ShardedStateDictConfig ignores offload_to_cpu while it "
            "builds), the root and a layer unsharded" + ("; it sets the run's peak - checkpoint.state_dict: "
                                            "full (rank 0 to the CPU a unit at a time) avoids it"
                                            if sets_peak else ""))


def _rank_states(spec: RunSpec, arch: Arch, stack: str):
    """(the rank's view, its parameters, counts and states after the parallel strategy)."""
    view = rank_view(spec, arch)
    cb, _, _ = precision_bytes(view.step_spec)
    rank_params = split_params(view.states_arch, spec)
    counts = task_counts(view.states_arch, spec)
    s = model_states(spec, view.states_arch, stack, rank_params, counts)
    s = parallelize(spec, view.states_arch, s, counts, rank_params, cb)
    return view, rank_params, counts, s


def offloaded_bytes(spec: RunSpec, arch: Arch, stack: str = "cuda") -> int:
    """Bytes of model states one rank's DeepSpeed offload moves to host memory (the host plan)."""
    return _rank_states(spec, arch, stack)[3].host


def analytic_plan(spec: RunSpec, arch: Arch, stack: str = "cuda") -> MemoryPlan:
    """Plan one device's memory for the spec, for a card whose software stack is `stack`:
    the rank's slice of the model (tensor parallel), its share of the states (DDP, FSDP,
    ZeRO) and the step it computes (its tokens under context/sequence parallel, DeepSpeed's
    16-bit module) - plan/analytic/parallel.py."""
    view, rank_params, counts, s = _rank_states(spec, arch, stack)
    step = view.step_spec
    params = split_params(arch, spec)
    N = spec.parallel.world_size
    shard = spec.parallel.state_shards
    s.notes = view.notes + s.notes
    phases, largest = _timeline(step, view.step_arch, s)
    expandable = expandable_segments(spec, stack)
    if spec.model.implementation == "megatron":
        load_peak, stranded = megatron_load(spec, view.states_arch, step, counts, s,
                                            expandable=expandable)
        s.notes.append(megatron_load_note(spec, load_peak, stranded))
    else:
        load_peak, stranded = _load_peak(spec, counts, s, largest, shard), 0
    peak = max(phases, key=lambda p: p.total_bytes)
    notes = s.notes + _notes(spec, arch, stack, load_peak > peak.total_bytes)
    if peak.name == "validation" and variants.validation_spec(step) is not step:
        notes.append(LIGER_VALIDATION_NOTE)
    ck = next((p for p in phases if p.name == "checkpoint-save"), None)
    if ck is not None:
        notes.append(checkpoint_note(ck.temporary_bytes, peak is ck))
    notes.append(reserve_note(varied_shapes(spec), replayed=False, expandable=expandable,
                              asked_unsupported=stack if spec.allocator.expandable_segments
                              and not expandable else None))
    return MemoryPlan(
        fidelity="analytic", params=params,
        per_device=per_device_figures(phases, s.buckets, stack, N, load_peak,
                                      varied=varied_shapes(spec), expandable=expandable,
                                      stranded_bytes=stranded),
        phases=phases,
        peak_phase=peak.name if load_peak <= peak.total_bytes else "model-load",
        bytes_per_param=_bytes_per_param(
            rank_params, s, shard if spec.parallel.strategy == "fsdp" else 1),
        tokens_per_micro_batch=spec.batch.positions_per_micro_batch,
        tokens_per_optimizer_step=spec.batch.positions_per_step, world_size=N,
        strategy=spec.parallel.strategy, stack=stack, assumptions=notes)


LIGER_VALIDATION_NOTE = (
    "the validation pass sets the peak: Liger fuses its loss only while training - in eval "
    "mode its forward materialises the logits and the model's loss upcasts them to fp32; lower "
    "validation.micro_batch_size (per_device_eval_batch_size) or set validation.enabled: false")


def _notes(spec: RunSpec, arch: Arch, stack: str, load_sets_peak: bool) -> list[str]:
    notes = []
    if spec.gradient_accumulation_steps > 1:
        notes.append(f"gradient accumulation ({spec.gradient_accumulation_steps} micro-batches): "
                     "gradients of earlier micro-batches stay alive through later forwards")
    if load_sets_peak:
        why = ("Megatron's DDP copying the parameters into its buffers"
               if spec.model.implementation == "megatron" else
               "bf16 base loaded before quantization: method.quantize_on_load: false"
               if spec.method.kind == "qlora" and not spec.method.quantize_on_load else
               "transformers builds a quantized model without deepspeed.zero.Init, so "
               "DeepSpeed's engine moves the whole 4-bit model to every rank before ZeRO-3 "
               "partitions it" if spec.method.kind == "qlora" and
               spec.parallel.strategy == "deepspeed" and spec.parallel.deepspeed.stage == 3 else
               "the weights as they load - the whole model on every rank, or a unit at a "
               "time under FSDP and ZeRO-3 - and a second copy of the largest tensor or unit")
        notes.append(f"loading the model sets the peak, not the training step ({why})")
    if not arch.known_layout:
        notes.append(f"model_type {arch.model_type!r} has no known layer layout: parameter "
                     "counts are a llama-style estimate (use plan --trace for the real model)")
    impl = spec.model.implementation
    if impl != "transformers":
        notes.append({
            "litgpt": "model.implementation litgpt: its chunked cross-entropy, planned as a "
                      "chunked loss; LoRA on some of q, k, v keeps the adapters' output "
                      "(its zero_pad's index_copy)",
            "torchtune": "model.implementation torchtune: its layers and loss saved as "
                         "transformers' (chunked_loss: its chunked loss)",
            "torchtitan": "model.implementation torchtitan: its loss and layers saved as "
                          "transformers' (eager)",
            "megatron": "model.implementation megatron: fused bias-SwiGLU (saves 2 x i, not "
                        "3 x i) and its vocab-parallel cross-entropy (an fp32 softmax kept and "
                        "its gradient written in place: no log-softmax, no separate fp32 "
                        "gradient)",
        }[impl] + "; the trace runs transformers' code and stands in for it")
    from tunepilot.plan.analytic.activations import PYTHON_ACTIVATIONS, python_activation_saves

    if arch.hidden_act in PYTHON_ACTIVATIONS:
        extra = python_activation_saves(arch, spec)
        notes.append(f"activation {arch.hidden_act}: " + (
            f"transformers runs it as Python elementwise ops ({extra} more intermediate-sized "
            "tensors saved per layer)" if extra else
            f"{variants.fused_mlp(arch, spec)}'s fused GeGLU replaces it" if
            variants.fused_mlp(arch, spec) else
            f"{impl} calls the fused tanh GELU (its input saved only)"))
    if arch.hidden_act == "xielu":
        notes.append("activation xielu: planned as the xIELU CUDA kernel (nickjbrowning/XIELU, "
                     "which transformers calls when installed and axolotl recommends): its input "
                     "saved only; without it transformers' Python version keeps several "
                     "intermediate-sized tensors per layer more")
    if spec.torch_compile:
        notes.append("torch_compile: Inductor's partitioner recomputes pointwise ops - saved "
                     "activations x 0.8, MODELLED (the trace runs eager; it cannot compile on "
                     "fake tensors)")
    notes += lever_notes(spec)
    notes += loss_path_notes(spec)
    notes += objective_notes(spec, arch)
    if spec.model.task == "sequence-classification":
        notes.append(f"task sequence-classification: a {spec.model.num_labels}-label head on "
                     "the last token - no vocabulary logits")
    notes += variants.kernel_notes(arch, spec)
    notes += moe_plan.moe_notes(arch, spec, *precision_bytes(spec)[:2])
    opt_impl = default_optimizer_impl(spec, stack)
    if spec.optimizer.name in ("adamw", "paged_adamw", "sgd"):
        notes.append(f"optimizer step: {opt_impl} implementation "
                     + ("(one parameter-sized temporary)" if opt_impl == "foreach" else ""))
    notes += _optimizer_notes(spec)
    return notes


def _optimizer_notes(spec: RunSpec) -> list[str]:
    """What the plan assumes of a quantized or paged optimizer (resources/optimizers.yaml)."""
    from tunepilot.model.flops import optimizer_state_label
    from tunepilot.model.optimizers import is_paged, is_quantized, optimizer_info

    name = spec.optimizer.name
    out = []
    if is_quantized(name):
        out.append(f"optimizer {name} ({optimizer_info(name)['class']}): "
                   f"{optimizer_state_label(spec)}; tensors under "
                   f"{optimizer_info(name)['state']['min_elements']} elements keep full-precision "
                   "state; the step updates in place (no parameter-sized temporary)")
    if is_paged(name):
        out.append(f"optimizer {name}: its state is paged (CUDA managed memory, outside the "
                   "caching allocator): counted on the device while resident; under memory "
                   "pressure the driver moves it to host memory at a cost in step time")
    return out


def workspace_bytes(stack: str) -> int:
    """Library workspaces (cuBLAS/cuBLASLt) taken from the caching allocator on `stack`: part
    of the allocated peak (resources/runtime.yaml, measured)."""
    rt = runtime_constants()
    return int(rt["stacks"].get(stack, rt["stacks"]["cuda"])["library_workspace_bytes"])


def per_device_figures(phases: list[Phase], buckets: int, stack: str, world_size: int,
                       load_peak: int = 0, *, replay_slack_bytes: int | None = None,
                       varied: bool = False, expandable: bool = False,
                       stranded_bytes: int = 0) -> PerDevice:
    """The per_device block shared by the analytic and the traced plan: each component's largest
    size over the timeline; the allocated peak (the largest phase, or the model load when that
    is larger, plus the library workspaces taken from the caching allocator); the reserved peak
    (plan/reserve/core.py: the traced replay's slack, else the measured fixed-shape slack, plus the
    varied-shapes term), over the blocks the model load left cached that the step cannot reuse
    (`stranded_bytes`: plan/analytic/megatron_load.py); the runtime outside the allocator
    (context, and the collective library's buffers when world_size > 1)."""
    from tunepilot.plan.reserve.core import held_bytes, reserve

    rt = runtime_constants()
    st = rt["stacks"].get(stack, rt["stacks"]["cuda"])
    peak = max(phases, key=lambda p: p.total_bytes)
    allocated = max(peak.total_bytes, load_peak) + workspace_bytes(stack)
    transient = peak.total_bytes - peak.states_bytes
    held = held_bytes(allocated, peak.total_bytes + workspace_bytes(stack), stranded_bytes)
    reserved = reserve(held, transient, replay_slack_bytes=replay_slack_bytes,
                       varied=varied, expandable=expandable).reserved_bytes
    overhead = st["context_bytes"]
    if world_size > 1:
        overhead += st["collective_bytes_per_rank_group"]

    def largest(component: str) -> int:
        return max(getattr(p, f"{component}_bytes") for p in phases)

    return PerDevice(
        weights_bytes=largest("weights"), gradients_bytes=largest("gradients"),
        optimizer_bytes=largest("optimizer"), master_weights_bytes=largest("master_weights"),
        activations_bytes=largest("activations"), temporary_bytes=largest("temporary"),
        collective_buffers_bytes=buckets, allocated_peak_bytes=allocated,
        reserved_peak_bytes=reserved, runtime_overhead_bytes=overhead,
        device_peak_bytes=reserved + overhead, load_peak_bytes=load_peak,
        load_stranded_bytes=stranded_bytes)


def _load_peak(spec: RunSpec, counts: ParamCounts, s: States, largest_weight: int,
               shard: int) -> int:
    """The model-load peak (lesson 8: loading can set the peak). Quantize-on-load (transformers +
    bitsandbytes) holds the quantized model plus one bf16 tensor; quantize-after-load holds the
    whole bf16 base for a moment. Under FSDP (and ZeRO-3 with zero3_init: deepspeed.zero.Init
    partitions each module as it is built) the ranks load the model a unit at a time (rank-0
    or meta-device loading, as the FSDP recipes do: a unit materialised, flattened or chunked,
    sharded): the shards loaded so far - none on the device with CPU offload - plus two copies
    of the largest unit (a decoder layer or the root's embeddings and lm_head). ZeRO-0/1/2 (and
    ZeRO-3 without zero3_init) load the whole model on every rank, in the engine's dtype; so does
    ZeRO-3 under QLoRA: transformers builds a quantized model without deepspeed.zero.Init
    (modeling_utils: `is_deepspeed_zero3_enabled() and not is_quantized`) and DeepSpeed's engine
    moves the whole module to the device before stage 3 partitions it."""
    stored = s.frozen_bytes + s.trainable_bytes
    par = spec.parallel
    if par.strategy == "deepspeed":
        b16 = spec.precision.compute_bytes  # DeepSpeed's module: its 16-bit engine, or fp32
        stored = s.frozen_bytes + (s.trainable_bytes * b16) // spec.precision.parameter_bytes
        ds = par.deepspeed
        if ds.stage < 3 or not ds.zero3_init:
            return stored + 2 * largest_weight
        if spec.method.kind == "qlora":  # quantized weight by weight, then moved whole
            return stored
    if shard > 1:
        root = counts.embedding + counts.lm_head
        per_param = stored / max(counts.total, 1)
        unit = int(max(counts.per_layer, root) * per_param)
        offloaded = par.cpu_offload or (par.strategy == "deepspeed" and
                                        par.deepspeed.offload_param != "none")
        return (0 if offloaded else stored // shard) + 2 * unit
    if spec.method.kind == "qlora" and not spec.method.quantize_on_load:
        return 2 * counts.total
    return stored + 2 * largest_weight


def _bytes_per_param(params: ParamSplit, s: States, shard: int) -> dict[str, float]:
    """Bytes per parameter by component, per the parameters they belong to (the worked example)."""
    tr = max(params.trainable, 1)
    total = max(params.total, 1)
    return {
        "weights_per_param": s.weights * shard / total,
        "master_weights_per_trainable_param": s.master * shard / tr,
        "gradients_per_trainable_param": s.grads * shard / tr,
        "optimizer_per_trainable_param": s.optim * shard / tr,
        "model_states_per_param": (s.weights + s.master + s.grads + s.optim) * shard / total,
    }
