"""The traced step (the child side of the traced plan): two optimizer steps of the spec's real
training step - tunepilot.training.step's build_run, forward_loss, backward and update - on fake CPU
tensors under a StorageTracker, the peaks of step 2 by phase.

Run as ``python -m tunepilot.plan.trace.step JOB RESULT`` (tunepilot.proc.child): an abort inside
PyTorch becomes the parent's fallback reason, never a crash of the CLI. ``trace_step`` is also
called in-process by the fake-vs-real test and the GPU check (``fake=False``).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from tunepilot.plan.trace.fsdp import (
    fake_process_group,
    fsdp1_on_fake_tensors,
    is_sharded,
    mark_unsharded,
    packed_nf4,
    release_fake_process_group,
    shard_traced,
)
from tunepilot.plan.trace.kernel_standins import flash_with_sinks, megatron_loss, xielu_kernels
from tunepilot.plan.trace.messages import TraceJob, TraceResult
from tunepilot.plan.trace.replay import replayed
from tunepilot.plan.trace.routing import balanced_routing
from tunepilot.plan.trace.standins import (
    CudaAutocastInRecompute,
    CudaAutocastRules,
    QuantizedAdamStandIn,
    ScalerStandIn,
    cuda_dropout,
    emulate_nf4,
    fused_attention_dropout,
    to_fake,
    unpacked_sequences,
)
from tunepilot.plan.trace.tracker import (
    CUDA_BLOCK_BYTES,
    FSDP1_STREAM_OF_LABEL,
    StorageTracker,
    round_block,
)
from tunepilot.spec import RunSpec

# a micro-batch's peak may grow by the detached loss train_step keeps (one 512-byte block)
ACCUMULATION_TOLERANCE_BYTES = 4 * CUDA_BLOCK_BYTES
STEP2_MICRO_BATCHES = 3  # micro-batches traced in step 2 (1: no grads yet; 2, 3: accumulating)


@dataclass
class _Traced:
    """What one trace builds: the run, the tracker and what the trace saw."""

    spec: RunSpec
    run: object
    tracker: StorageTracker
    dev: torch.device
    fake_mode: object | None
    notes: list[str] = field(default_factory=list)
    nf4: dict = field(default_factory=dict)
    impl: str = "for-loop"
    losses: list = field(default_factory=list)
    train_events: int = 0  # allocation-log entries of the training steps (before validation)
    counts: dict = field(default_factory=dict)  # parameter counts before sharding
    buffer_seqs: set = field(default_factory=set)  # the tracker's records of the buffers
    optimizer_spans: list = field(default_factory=list)  # allocation-log ranges of the steps


def _build_spec(spec: RunSpec, notes: list[str]) -> RunSpec:
    """QLoRA is built as LoRA on a 16-bit base whose linears become NF4 stand-ins."""
    if spec.method.kind != "qlora":
        return spec
    if is_sharded(spec):
        notes.append("QLoRA under FSDP: bitsandbytes is CUDA-only, so each quantized linear is "
                     "traced as its packed 4-bit storage (bnb_4bit_quant_storage "
                     f"{spec.quant_storage_dtype}), sharded with the layer, and its absmax "
                     "constants, whole on every rank; each matmul dequantises a weight-sized "
                     "bf16 temporary in forward and again in backward, as bitsandbytes does")
    else:
        notes.append("QLoRA: bitsandbytes is CUDA-only, so the NF4 base is traced as "
                     f"{spec.frozen_base_dtype} frozen linears counted at NF4 size (codes + "
                     f"absmax{' with double quantization' if spec.method.double_quant else ''}"
                     "), each matmul dequantising a weight-sized bf16 temporary as "
                     "bitsandbytes does; the rest (LoRA, activations, optimizer) is traced")
    method = dict(spec.method.model_dump(), kind="lora", base_dtype=spec.frozen_base_dtype)
    return spec.with_changes(method=method)


def _optimizer_factory(t: _Traced, stack: str):
    """The spec's optimizer as the target card runs it: PyTorch's default implementation there,
    bitsandbytes optimizers as a stand-in holding the same state."""
    from tunepilot.model.build import trainable_parameters
    from tunepilot.model.flops import default_optimizer_impl
    from tunepilot.model.optimizers import optimizer_info
    from tunepilot.training.build import build_optimizer

    o = t.spec.optimizer
    lib = optimizer_info(o.name)["library"]
    if lib in ("bitsandbytes", "torchao"):
        t.notes.append(f"optimizer {o.name}: {lib}'s optimizer traced with a stand-in holding "
                       "the same state tensors (resources/optimizers.yaml), updated in place")
        t.impl = lib
        return lambda _s, model: QuantizedAdamStandIn(trainable_parameters(model), o.name, o.lr)
    if o.name not in ("adamw", "sgd"):
        return build_optimizer
    t.impl = o.impl or default_optimizer_impl(t.spec, stack)
    t.notes.append(f"optimizer step: {o.name} {t.impl} implementation "
                   f"({'the spec' if o.impl else 'PyTorch default on ' + stack})")
    with_impl = t.spec.with_changes(optimizer=dict(o.model_dump(), impl=t.impl))
    return lambda _s, model: build_optimizer(with_impl, model)


def build_traced(spec: RunSpec, config: dict, stack: str, *, fake: bool, device: str
                 ) -> _Traced:
    """The spec's run as tunepilot.training.step builds it: on meta then fake CPU tensors (fake), or
    real tensors on `device`; QLoRA's linears as NF4 stand-ins."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunepilot.training.build import build_run

    dev = torch.device("cpu" if fake else device)
    t = _Traced(spec, None, StorageTracker(log_events=True), dev,
                FakeTensorMode() if fake else None)  # its dispatch cache: layers 2..L are free

    sharded = is_sharded(spec)
    mesh = fake_process_group(spec.parallel.world_size) if sharded else None

    def prepare(model):
        fused_activations(model, spec, t.notes)
        megatron_loss(model, spec, t.notes)
        xielu_kernels(model, t.notes)
        kernel_standins(model, spec, config, t.notes)
        if sharded:  # counted whole, before the 4-bit packing and the sharding
            t.counts = model_counts(model)
        if sharded and spec.method.kind == "qlora":
            packed_nf4(model, spec)
        if t.fake_mode is not None:
            balanced_routing(model, t.notes)
            to_fake(model, t.fake_mode)
        if spec.method.kind == "qlora" and not sharded:
            t.nf4 = emulate_nf4(model, spec)
        if sharded:
            with t.fake_mode or contextlib.nullcontext():
                model = shard_traced(model, spec, mesh, t.notes)
        return model, None

    def prepare_reference(model):  # the frozen copy of a full run's DPO/GRPO reference
        if t.fake_mode is not None:
            balanced_routing(model, [])
            to_fake(model, t.fake_mode)
        if sharded:  # sharded like the policy
            with t.fake_mode or contextlib.nullcontext():
                model = shard_traced(model, spec, mesh, [])
        return model, None

    factory = _optimizer_factory(t, stack)
    bspec = _build_spec(spec, t.notes)
    t.run = build_run(bspec, "meta" if fake else dev, total_steps=2, config=config, data=False,
                      prepare=prepare, optimizer=factory, prepare_reference=prepare_reference)
    t.run.spec = spec
    if spec.precision.needs_grad_scaler:  # GradScaler's inf check reads values fake tensors lack
        with t.fake_mode or contextlib.nullcontext():
            t.run.state.scaler = ScalerStandIn(dev)
    return t


def fused_activations(model, spec: RunSpec, notes: list[str]) -> int:
    """LitGPT, torchtune, torchtitan and Megatron call the fused tanh GELU where transformers
    runs NewGELU / FastGELU as Python elementwise ops (which save several intermediates): the
    trace of those implementations swaps the modules so it saves what their code saves."""
    if spec.model.implementation == "transformers":
        return 0
    from transformers.activations import FastGELUActivation, NewGELUActivation

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, NewGELUActivation | FastGELUActivation):
                setattr(module, name, torch.nn.GELU(approximate="tanh"))
                swapped += 1
    if swapped:
        notes.append(f"model.implementation {spec.model.implementation}: {swapped} Python GELU "
                     "modules of transformers' code traced as the fused tanh GELU it calls")
    return swapped


def kernel_standins(model, spec: RunSpec, config: dict, notes: list[str]) -> int:
    """The spec's GPU kernels as PyTorch stand-ins that save what they save
    (plan/trace/kernel_standins.py); attention implementations the CPU cannot run, said."""
    if spec.kernels.attention in ("flash-attention-2", "flash-attention-3", "flex"):
        notes.append(f"attention {spec.kernels.attention}: a GPU kernel; traced as SDPA's flash "
                     "kernel, which saves the same (q, k, v, output, fp32 logsumexp)")
    flash_with_sinks(model, spec, notes)
    if not spec.kernels.any:
        return 0
    from tunepilot.model.arch import Arch
    from tunepilot.plan.trace.kernel_standins import apply_kernel_standins

    return apply_kernel_standins(model, spec, Arch.from_config(config), notes)


def register_model(tracker: StorageTracker, model, spec, nf4: dict, reference=None,
                   counts: dict | None = None) -> dict:
    """Register parameters and buffers (a sharded model's local shards) and a DPO/GRPO
    reference copy's; return the model's figures: counts (`counts`, taken before sharding,
    when given), bytes as held here."""
    mixed = spec.precision.mixed
    rows, seen = [], set()
    trainable_bytes = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        cat = "master_weights" if (p.requires_grad and mixed) else "weights"
        parts = nf4.get(id(p))
        tracker.register(p, cat, parts)
        local = getattr(p, "_local_tensor", p)  # a DTensor's shard on this rank
        nbytes = sum(parts) if parts else local.numel() * local.element_size()
        rows.append([int(local.shape[0]) if local.dim() else 1, int(nbytes),
                     bool(p.requires_grad)])
        if p.requires_grad:
            trainable_bytes += round_block(nbytes)
    buffers = {}
    for b in model.buffers():
        tracker.register(b, "weights")
        buffers[id(b)] = round_block(b.numel() * b.element_size())
    info = {**(counts or model_counts(model)), "trainable_bytes": trainable_bytes,
            "param_rows": rows, "buffer_bytes": sum(buffers.values()),
            "buffer_seqs": buffer_seqs(tracker, model)}
    if reference is not None:  # a frozen copy: weights, sharded like the policy under FSDP
        for p in reference.parameters():
            tracker.register(p, "weights")
            local = getattr(p, "_local_tensor", p)
            rows.append([int(local.shape[0]) if local.dim() else 1,
                         local.numel() * local.element_size(), False])
            info["total_params"] += p.numel()
            info["total_base_numel"] += p.numel()
    return info


def buffer_seqs(tracker: StorageTracker, model) -> list[int]:
    """The tracker's record numbers of the model's buffers (FSDP keeps them on the device)."""
    out = []
    for b in model.buffers():
        rec = tracker.record_of(b)
        if rec is not None:
            out.append(rec.seq)
    return out


def model_counts(model) -> dict:
    """Parameter counts of the (unsharded) model: total, trainable, one decoder layer's, the
    rest's (the decoder layers: the ModuleList holding the most parameters - model.layers,
    gpt_neox.layers, transformer.h, ... whatever the architecture calls it)."""
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() for p in params)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=[])
    layer_numel = sum(p.numel() for p in layers[0].parameters()) if len(layers) else 0
    in_layers = sum(p.numel() for lyr in layers for p in lyr.parameters())
    return {"total_params": total,
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "layer_numel": layer_numel, "root_numel": total - in_layers,
            "total_base_numel": total}


def _micro_step(t: _Traced, prefix: str, mask, num_items) -> None:
    """One micro-batch: forward + loss (a window), backward (a window), as train_step does."""
    from tunepilot.training.step import backward, forward_loss

    spec, tr = t.spec, t.tracker
    w = tr.open_window(prefix + "forward")
    tr.begin_forward()
    batch = _batch(t, spec.micro_batch_size, mask is not None)
    loss = forward_loss(t.run.state, batch, spec, num_items)
    tr.end_forward()
    tr.close_window(w)
    w = tr.open_window(prefix + "backward")
    backward(t.run.state, loss)
    t.losses.append(loss.detach())  # train_step keeps each micro-batch's detached loss
    del loss, batch
    tr.close_window(w)


def _batch(t: _Traced, rows: int, padded: bool) -> dict:
    """Random token ids of ``rows`` samples with their labels: next-token labels (the ids; a
    pair's chosen and rejected rows, their prompt not trained; a rollout's completions with
    advantages and, for beta > 0, their reference log-probs), or one class per sequence for
    sequence-classification."""
    from tunepilot.spec.objective import lengths

    spec, o = t.spec, t.spec.objective
    ln = lengths(spec)
    rows *= o.sequences_per_sample
    vocab = int(t.run.model.config.vocab_size)
    ids = torch.randint(0, vocab, (rows, ln.sequence), device=t.dev)
    mask = torch.ones(rows, ln.sequence, dtype=torch.long, device=t.dev) if padded else None
    if spec.model.task == "sequence-classification":
        labels = torch.randint(0, spec.model.num_labels, (rows,), device=t.dev)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    labels = ids.clone()
    if o.kind != "sft":
        labels[:, : ln.prompt] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if o.generative:
        batch["advantages"] = torch.randn(rows, device=t.dev)
        if o.needs_reference:
            batch["ref_logps"] = torch.randn(rows, ln.completion, device=t.dev)
        if o.num_iterations > 1:
            batch["old_logps"] = torch.randn(rows, ln.completion, device=t.dev)
    return {k: v for k, v in batch.items() if v is not None}


def _rollout_windows(t: _Traced, padded: bool) -> None:
    """GRPO/RLOO before the policy update: generation (transformers' KV cache: prefill the
    prompts, the cache grown to prompt + completion, one decode step - the largest the cache
    gets), then the reference's (beta > 0) and the old policy's (num_iterations > 1) forwards
    without gradient, one micro-batch (they all have its shape)."""
    from tunepilot.training.preference import reference_token_logps, token_logps
    from tunepilot.training.step import autocast_context

    spec, tr, o = t.spec, t.tracker, t.spec.objective
    w = tr.open_window("generation")
    if o.generation.backend == "transformers":
        _trace_generation(t, padded)
    tr.close_window(w)
    from tunepilot.spec.objective import lengths

    c = lengths(spec).completion
    for name, needed in (("reference-forward", o.needs_reference),
                         ("old-logprobs", o.num_iterations > 1)):
        if not needed:
            continue
        w = tr.open_window(name)
        batch = _batch(t, spec.micro_batch_size, padded)
        with autocast_context(spec, t.dev.type):
            if name == "reference-forward":
                out = reference_token_logps(t.run.model, batch, spec, t.run.state.reference, c)
            else:
                with torch.no_grad():
                    out = token_logps(t.run.model, batch, spec, keep=c)[0]
        del out, batch
        tr.close_window(w)


def _trace_generation(t: _Traced, padded: bool) -> None:
    from transformers import DynamicCache

    from tunepilot.spec.objective import generation_batch, lengths
    from tunepilot.training.autocast import autocast_context, autocast_dtype

    spec, model = t.spec, t.run.model
    ln, g = lengths(spec), generation_batch(spec)
    cfg = model.config
    vocab = int(cfg.vocab_size)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    dtype = autocast_dtype(spec) or next(model.parameters()).dtype
    model.eval()
    with torch.no_grad(), autocast_context(spec, t.dev.type), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache (5.x)
        prompts = torch.randint(0, vocab, (g, ln.prompt), device=t.dev)
        mask = torch.ones(g, ln.prompt, dtype=torch.long, device=t.dev) if padded else None
        cache = DynamicCache(config=cfg)
        out = model(input_ids=prompts, attention_mask=mask, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        del out
        grow = torch.zeros(g, heads, ln.completion - 1, head_dim, dtype=dtype, device=t.dev)
        for i in range(int(cfg.num_hidden_layers)):  # the tokens decoded before the last one
            cache.update(grow, grow, i)
        del grow
        nxt = torch.randint(0, vocab, (g, 1), device=t.dev)
        mask = torch.ones(g, ln.sequence, dtype=torch.long, device=t.dev) if padded else None
        out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1)  # sampling at temperature 1
        del out, probs, cache
    model.train()


def _optimizer_step(t: _Traced) -> None:
    from tunepilot.training.step import update

    w, start = t.tracker.open_window("optimizer-step"), len(t.tracker.events or [])
    for p in t.run.state.model.parameters():  # FSDP1 sets flat gradients without the hook
        if p.grad is not None:
            t.tracker.classify(p.grad, "gradients")
    update(t.run.state)
    for st in t.run.state.optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t.tracker.classify(v, "optimizer")
    t.losses.clear()
    t.optimizer_spans.append((start, len(t.tracker.events or [])))
    t.tracker.close_window(w)


def _batch_mask(t: _Traced):
    """Synthetic batches have no padding: transformers drops an all-ones mask (a data check fake
    tensors cannot answer) and runs causal SDPA with native GQA, so pass none. Text data may pad:
    keep a mask, which takes transformers' padded path (a 4-D additive mask, repeated K/V heads)
    - the worst case the pilot's longest batch measures."""
    spec = t.spec
    padded = (spec.data.source != "synthetic" and not getattr(spec.data, "packing", False)) \
        or spec.objective.kind != "sft" and spec.data.source != "synthetic"
    t.notes.append("batches: " + ("padded text: attention mask kept (transformers' padded "
                                  "path: 4-D mask, K/V heads repeated)" if padded else
                                  "no padding: causal SDPA, no mask, native GQA"))
    if not padded:
        return None
    return torch.ones(spec.micro_batch_size, spec.sequence_length, dtype=torch.long, device=t.dev)


def _run_two_steps(t: _Traced) -> tuple[int, object, dict]:
    """Step 1 (creates the optimizer state), then step 2 with up to STEP2_MICRO_BATCHES
    micro-batches; (number of peaks of step 1, step 2's window, the CUDA allocator's peaks)."""
    spec, tr, state = t.spec, t.tracker, t.run.state
    micro2 = min(spec.gradient_accumulation_steps, STEP2_MICRO_BATCHES)
    for p in (q for q in state.model.parameters() if q.requires_grad):
        p.register_post_accumulate_grad_hook(lambda q: tr.classify(q.grad, "gradients"))
    mask = _batch_mask(t)
    num_items = torch.full((), float(spec.batch.positions_per_micro_batch *
                                     spec.gradient_accumulation_steps), device=t.dev)
    state.model.train()
    cuda = t.dev.type == "cuda"
    allocator: dict = {}
    generative = spec.objective.generative
    sharded = is_sharded(spec)
    fsdp1 = sharded and spec.parallel.fsdp_version == 1
    fsdp1_fake = fsdp1 and t.fake_mode is not None
    if fsdp1:
        tr.stream_of_label = FSDP1_STREAM_OF_LABEL
    with tr, tr.saved_tensors_hooks(), \
            tr.track_resizes() if sharded else contextlib.nullcontext(), \
            fsdp1_on_fake_tensors(fsdp1_fake):
        step1 = tr.open_window("step 1")
        if generative:
            _rollout_windows(t, mask is not None)
        _micro_step(t, "", mask, num_items)
        _optimizer_step(t)
        tr.close_window(step1)
        n_step1 = len(tr.peaks)
        if sharded:
            mark_unsharded(state.model, tr)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step2 = tr.open_window("step 2")
        if generative:
            _rollout_windows(t, mask is not None)
        for i in range(micro2):
            _micro_step(t, f"micro {i + 1} " if micro2 > 1 else "", mask, num_items)
        _optimizer_step(t)
        tr.close_window(step2)
        if cuda:
            torch.cuda.synchronize()
            allocator = {"cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                         "cuda_max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
        t.train_events = len(tr.events or [])
        if not generative and t.spec.validation.enabled:  # GRPO/RLOO validate by generating
            _validation_pass(t, mask)
    return n_step1, step2, allocator


def _validation_pass(t: _Traced, mask) -> None:
    """One validation batch as training.evaluate runs it: eval mode, no gradients, the
    validation micro-batch (the optimizer state stays; the gradients were freed)."""
    from tunepilot.training.step import autocast_context, compute_loss

    spec = t.spec
    b = spec.validation_micro_batch_size
    batch = _batch(t, b, mask is not None)
    w = t.tracker.open_window("validation")
    t.run.model.eval()
    with torch.no_grad(), autocast_context(spec, t.dev.type):
        loss = compute_loss(t.run.model, batch, spec, reference=t.run.state.reference)
    del loss, batch
    t.run.model.train()
    t.tracker.close_window(w)


def trace_step(spec: RunSpec, config: dict, stack: str, *, fake: bool = True,
               device: str = "cpu", rank_step: bool = False) -> TraceResult:
    """Two optimizer steps of the spec under a StorageTracker; the peaks of step 2, by phase.
    `fake=False`: on real tensors on `device` (the fake-vs-real test; the GPU check, which also
    records the allocator's peak). `rank_step`: also replay without the optimizer steps."""
    try:
        return _trace_step(spec, config, stack, fake, device, rank_step)
    finally:
        if is_sharded(spec):
            release_fake_process_group()


def _trace_step(spec: RunSpec, config: dict, stack: str, fake: bool, device: str,
                rank_step: bool = False) -> TraceResult:
    import transformers

    t0 = time.perf_counter()
    t = build_traced(spec, config, stack, fake=fake, device=device)
    # tracing on the CPU for a GPU: apply CUDA autocast's float32 op list (CPU autocast's differs)
    cuda_rules = spec.precision.mixed and t.dev.type == "cpu" and stack != "cpu"
    if cuda_rules:
        t.notes.append("autocast: CUDA's rules (its float32 op list: layer_norm, softmax, pow, "
                       "exp, sum, ... run in fp32) applied to the CPU trace")
    packing = unpacked_sequences() if fake and not getattr(spec.data, "packing", False) \
        else contextlib.nullcontext()
    with t.fake_mode or contextlib.nullcontext(), packing, \
            CudaAutocastRules() if cuda_rules else contextlib.nullcontext(), \
            CudaAutocastInRecompute() if cuda_rules else contextlib.nullcontext(), \
            cuda_dropout() if t.dev.type == "cpu" and stack != "cpu" else \
            contextlib.nullcontext(), _attention_dropout(t):
        info = register_model(t.tracker, t.run.model, spec, t.nf4, t.run.state.reference,
                              t.counts or None)
        t.buffer_seqs = set(info.pop("buffer_seqs"))
        n_step1, step2, allocator = _run_two_steps(t)
        attention, kernel = attention_path(t.tracker)
    out = _summary(t, n_step1, step2, attention, kernel, fake)
    where = f"{'fake' if fake else 'real'} {t.dev.type.upper()} tensors"
    out["notes"].insert(0, f"traced: the training step on {where}, transformers "
                        f"{transformers.__version__}, torch {torch.__version__}, 2 optimizer "
                        "steps, peak of step 2; attention " + attention.split(":")[0])
    out.update(model=info, allocator=replayed(t.tracker, t.spec, t.run.model, t.train_events,
                                         t.buffer_seqs, t.optimizer_spans if rank_step else ()),
               world_size=spec.parallel.world_size,
               strategy=spec.parallel.strategy,
               fsdp_version=spec.parallel.fsdp_version if is_sharded(spec) else None,
               child_wall_s=round(time.perf_counter() - t0, 2),
               child_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               traced_on=f"{where}, torch {torch.__version__}", **allocator)
    return TraceResult.model_validate(out)


def _summary(t: _Traced, n_step1: int, step2, attention: str, kernel: str, fake: bool) -> dict:
    tr, spec = t.tracker, t.spec
    phases = [p for p in tr.peaks[n_step1:] if p is not step2]
    micro2 = min(spec.gradient_accumulation_steps, STEP2_MICRO_BATCHES)
    micro_peaks = [max(p.peak_bytes for p in phases if p.name.startswith(f"micro {i + 1} "))
                   for i in range(micro2)] if micro2 > 1 else []
    growth = max(0, micro_peaks[2] - micro_peaks[1]) if len(micro_peaks) > 2 else 0
    if spec.gradient_accumulation_steps > 1:
        peaks = ", ".join(f"{b / 2**30:.2f}" for b in micro_peaks)
        t.notes.append(f"gradient accumulation: step 2 traced {micro2} of "
                       f"{spec.gradient_accumulation_steps} micro-batches (peaks {peaks} GiB); "
                       "from the second on a micro-batch repeats the same allocations "
                       f"(+{growth} B each: the detached loss train_step keeps)")
    return {
        "phases": [p.to_dict() for p in phases], "peak_bytes": step2.peak_bytes,
        "peak_raw_bytes": step2.peak_raw_bytes, "saved_bytes_at_peak": step2.saved_bytes,
        "step1_peak_bytes": tr.peaks[n_step1 - 1].peak_bytes,
        "micro_batch_peaks_bytes": micro_peaks,
        "accumulation_peak_stable": growth <= ACCUMULATION_TOLERANCE_BYTES,
        "accumulation_growth_bytes_per_micro_batch": growth, "attention_path": attention,
        "attention_kernel": kernel, "optimizer_impl": t.impl, "num_ops": tr.num_ops,
        "notes": t.notes,
    }


def _attention_dropout(t: _Traced):
    """The GPU kernels' fused attention dropout (standins.fused_attention_dropout), said when
    the model has any."""
    cfg = t.run.model.config
    p = float(getattr(cfg, "attention_dropout", 0) or getattr(cfg, "attn_pdrop", 0) or 0)
    if p == 0 or t.spec.kernels.attention == "eager":
        return contextlib.nullcontext()
    t.notes.append(f"attention dropout {p:g}: inside {t.spec.kernels.attention}'s fused kernel "
                   "on the GPU (the mask regenerated from the RNG state, never stored); traced "
                   "without it, as the CPU kernels have no fused dropout (their math path would "
                   "keep an s x s matrix and mask per head)")
    return fused_attention_dropout()


def attention_path(tracker: StorageTracker) -> tuple[str, str]:
    names = {str(f) for f in tracker.ops_seen}
    kernels = sorted(n for n in names if "scaled_dot_product" in n)
    if any("flash_attention_for_cpu" in n for n in kernels):
        return ("sdpa-flash: the CPU flash kernel (saves output + logsumexp), as CUDA flash / "
                "memory-efficient attention on the target card; no s x s matrix", kernels[0])
    if kernels:
        return f"sdpa kernel {kernels[0]}", kernels[0]
    return ("sdpa-math or eager attention: an s x s attention matrix per head is saved "
            "(the target card's flash kernel would not)", "math")


def handle(job: TraceJob) -> TraceResult:
    """The child's work: trace the job's spec on fake tensors."""
    return trace_step(RunSpec.model_validate(job.spec), job.config, job.stack, fake=True,
                      rank_step=job.rank_step)


if __name__ == "__main__":
    from tunepilot.proc.child import child_main

    sys.exit(child_main(handle, TraceJob))
