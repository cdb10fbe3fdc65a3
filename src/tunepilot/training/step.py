"""The training step every stage runs (the run is built by training/build.py's build_run).

One optimizer step is ``micro_step`` (forward + loss + backward) per micro-batch, then ``update``
(unscale, clip, optimizer step, zero_grad, schedule): the pilot times it, restore replays it,
the scaling worker runs it under DDP / FSDP, and the traced plan calls the same functions with
its tracker's windows in between.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from tunepilot.dataset import IGNORE_INDEX, useful_tokens
from tunepilot.errors import UserError
from tunepilot.model.build import output_head, trainable_parameters
from tunepilot.spec import CHUNKED_LOSS_TOKENS, LITGPT_LM_HEAD_CHUNK, RunSpec
from tunepilot.training.autocast import autocast_context  # noqa: F401 - also the step's

MAX_GRAD_NORM = 1.0  # gradient clipping as fine-tuning recipes default to it (HF Trainer, torchtune)

Batch = dict[str, torch.Tensor]


def compute_loss(model: torch.nn.Module, batch: Batch, spec: RunSpec,
                 num_items: torch.Tensor | float | None = None,
                 reference: torch.nn.Module | None = None) -> torch.Tensor:
    """Next-token cross-entropy (fp32 upcast, as HF does), summed over the batch's useful tokens
    and divided by `num_items` (default: this batch's useful tokens, i.e. the batch mean).

    chunked_loss: lm_head + cross-entropy per CHUNKED_LOSS_TOKENS tokens, each chunk
    checkpointed, so the (tokens, vocab) logits never exist all at once.
    Other objectives: the DPO family's loss (training/preference.py; ``reference``: the frozen copy of a
    full run) and GRPO/RLOO's (training/generation.py), over a rollout's micro-batch.
    """
    if spec.objective.kind != "sft" and spec.model.task == "causal-lm":
        return objective_loss(model, batch, spec, num_items, reference)
    if spec.objective.kind == "reward":
        from tunepilot.training.preference import reward_loss

        return reward_loss(model, batch, num_items)
    extra = {k: batch[k] for k in ("position_ids",) if k in batch}  # packed rows
    if spec.model.task == "sequence-classification":  # labels: one class per sequence
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                     labels=batch["labels"], **extra).loss
    if spec.litgpt_loss:
        return through_ddp(model, lambda m: litgpt_loss(m, batch, num_items, extra))
    if not spec.loss_is_chunked:
        return model_output(model, batch, spec, num_items, extra).loss
    return through_ddp(model, lambda m: chunked_loss(m, batch, num_items, extra))


def model_output(model: torch.nn.Module, batch: Batch, spec: RunSpec, num_items,
                 extra: dict | None = None):
    """The model's forward with its own loss, along spec.hf_loss_path: the installed
    transformers' loss, or the path of the release the run names (model.transformers_version) -
    the fp32 upcast kept in the output and the shifted logits copied (before 4.46), or the
    upcast and the copy inside the loss (4.46 to 4.48). The output (with ``loss``)."""
    extra = extra if extra is not None else {k: batch[k] for k in ("position_ids",) if k in batch}
    path = spec.hf_loss_path
    if path in ("current", "none"):
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                     labels=batch["labels"], **extra, **kwargs)
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), **extra)
    logits = out.logits.float()
    if path == "fp32-output":
        out.logits = logits  # the 16-bit logits die here; the output keeps the fp32 ones
    labels = batch["labels"].to(logits.device)
    shift_logits = logits[..., :-1, :].contiguous()  # the old loss's copy (alive to the end)
    shift_labels = labels[..., 1:].contiguous()
    loss = torch.nn.functional.cross_entropy(
        shift_logits.view(-1, shift_logits.shape[-1]), shift_labels.view(-1),
        ignore_index=IGNORE_INDEX, reduction="sum" if num_items is not None else "mean")
    out.loss = loss / num_items if num_items is not None else loss
    return out


def through_ddp(model: torch.nn.Module, fn):
    """fn(model) for a loss that calls the decoder body and lm_head itself; under
    DistributedDataParallel, run as the wrapper's forward (fn given the wrapped module), so DDP
    prepares its gradient all-reduce for the backward as for any forward - called apart, the
    submodules would skip it (and DDP forwards no attribute to find them)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return fn(model)
    inner = model.module
    own = inner.__dict__.get("forward")  # a forward some wrapper set on the instance, kept
    inner.forward = lambda: fn(inner)  # an instance attribute: DDP's forward calls it
    try:
        return model()
    finally:
        if own is None:
            del inner.forward
        else:
            inner.forward = own


def chunked_loss(model: torch.nn.Module, batch: Batch, num_items, extra: dict) -> torch.Tensor:
    """lm_head + cross-entropy per CHUNKED_LOSS_TOKENS tokens, each chunk checkpointed."""
    body, head = output_head(model)
    hidden = body(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                  **extra).last_hidden_state  # (batch, seq, hidden)
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = (y != IGNORE_INDEX).sum().clamp(min=1) if num_items is None else num_items

    def chunk_loss(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        logits = head(hc).float()
        return torch.nn.functional.cross_entropy(logits, yc, ignore_index=IGNORE_INDEX,
                                                 reduction="sum")

    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], CHUNKED_LOSS_TOKENS):
        sl = slice(start, start + CHUNKED_LOSS_TOKENS)
        total = total + checkpoint(chunk_loss, h[sl], y[sl], use_reentrant=False)
    return total / n


OWN_STEP_OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "simpo", "cpo", "kto", "reward", "grpo",
                       "rloo")
"""the objectives tunepilot's own step runs (the plan models every kind)"""


def objective_loss(model: torch.nn.Module, batch: Batch, spec: RunSpec, num_items,
                   reference: torch.nn.Module | None) -> torch.Tensor:
    o = spec.objective
    if o.paired:
        from tunepilot.training.preference import preference_loss

        return preference_loss(model, batch, spec, num_items, reference)
    if o.kind == "kto":
        from tunepilot.training.preference import kto_loss

        return kto_loss(model, batch, spec, num_items, reference)
    if o.kind in ("grpo", "rloo"):
        from tunepilot.training.generation import grpo_loss

        return grpo_loss(model, batch, spec, num_items, reference)
    raise UserError("objective.kind", f"{o.kind}: tunepilot's own training step runs "
                    f"{', '.join(OWN_STEP_OBJECTIVES)}.", "Plan it (`tunepilot plan` models "
                    f"{o.kind}), and measure your own run with TunepilotCallback in its trainer.")


def normalizer(batches: list[Batch], dev: torch.device, spec: RunSpec) -> tuple[torch.Tensor, int]:
    """What the step's loss is a mean over (all ranks), and the world size: pairs for the DPO
    family and a reward model (TRL averages the pair losses), rows for KTO, useful tokens
    otherwise (step_token_count)."""
    o = spec.objective
    if o.kind == "kto":
        return _summed_over_ranks(sum(b["input_ids"].shape[0] for b in batches), dev)
    if not o.paired:
        return step_token_count(batches, dev)
    return _summed_over_ranks(sum(b["input_ids"].shape[0] // 2 for b in batches), dev)


def litgpt_loss(model: torch.nn.Module, batch: Batch, num_items, extra: dict) -> torch.Tensor:
    """LitGPT's loss (lit_gpt/utils.py chunked_cross_entropy @8641822, the same in litgpt today):
    lm_head applied per 128 positions, cross-entropy per chunk in the logits' dtype
    (reduction="none"), the chunk losses concatenated. Nothing is recomputed: every chunk's
    logits stay referenced by the training loop's `logits` until the next step, and
    cross-entropy keeps its log-softmax per chunk - as the returned loss holds them here."""
    body, head = output_head(model)
    hidden = body(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                  **extra).last_hidden_state  # (batch, seq, hidden)
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    logits = [head(h) for h in hidden.split(LITGPT_LM_HEAD_CHUNK, dim=1)]
    losses = [torch.nn.functional.cross_entropy(lc.reshape(-1, lc.shape[-1]), yc.reshape(-1),
                                                ignore_index=IGNORE_INDEX, reduction="none")
              for lc, yc in zip(logits, labels.split(LITGPT_LM_HEAD_CHUNK, dim=1), strict=True)]
    n = (labels != IGNORE_INDEX).sum().clamp(min=1) if num_items is None else num_items
    loss = torch.cat(losses).sum() / n
    loss.litgpt_logits = logits  # LitGPT's loop holds them through backward
    return loss


def step_token_count(batches: list[Batch], dev: torch.device) -> tuple[torch.Tensor, int]:
    """(useful tokens of the whole optimizer step over all ranks, world size).

    Dividing every micro-batch's summed loss by this count makes the step's gradient the mean
    over the global batch's useful tokens however the samples are grouped into micro-batches and
    ranks - so 1 rank x 2 accumulation and 2 ranks x 1 compute the same update even when padding
    differs. DDP/FSDP average gradients over ranks, so each rank's loss is scaled by the world.
    """
    return _summed_over_ranks(sum(useful_tokens(b) for b in batches), dev)


def _summed_over_ranks(local: float, dev: torch.device) -> tuple[torch.Tensor, int]:
    """(this rank's count summed over every rank, at least 1; the world size)."""
    import torch.distributed as dist

    n = torch.tensor(float(local), device=dev)
    world = 1
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            dist.all_reduce(n)
    return n.clamp(min=1.0), world


def tokens_over_ranks(local: int, dev: torch.device) -> int:
    """This rank's useful tokens of a step summed over every rank: the run's progress
    (TrainState.useful_tokens_seen) is the global count, so a checkpoint's count is the same
    whichever rank writes it and whatever rank count resumes it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(local)
    n = torch.tensor(int(local), dtype=torch.int64, device=dev)
    dist.all_reduce(n)
    return int(n.item())


@dataclass
class StepStats:
    """One optimizer step: its loss (this rank's share of the step's token mean), its LR and
    gradient norm, and where the time went."""

    step: int
    loss: float
    lr: float
    useful_tokens: int
    padded_tokens: int
    wall_s: float = 0.0
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    grad_norm: float | None = None
    fingerprints: list[str] = field(default_factory=list)
    generation_s: float = 0.0
    """GRPO/RLOO: generating the step's completions (0: none generated this step)"""
    generated_tokens: int = 0


@dataclass
class TrainState:
    """Everything a checkpoint must hold to continue exactly."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object | None = None
    step: int = 0
    useful_tokens_seen: int = 0
    """over every rank (tokens_over_ranks)"""
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    """DDP: skips the gradient all-reduce on all but the last micro-batch"""
    reference: torch.nn.Module | None = None
    """the DPO family / GRPO reference of a full run: a frozen copy (LoRA: adapters off)"""
    pad_token_id: int = 0
    eos_token_id: int | None = None
    rollout: object = None
    """GRPO: the generation batch in use (reused num_iterations times)"""
    kept_output: object = None
    """loop_keeps_output: the last micro-batch's model output, as the run's loop keeps it"""
    kept_output_until: str = "none"
    """the spec's loop_keeps_output (update drops a through-backward output after the step)"""


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


_sync = sync


def forward_loss(state: TrainState, batch: Batch, spec: RunSpec, num_items) -> torch.Tensor:
    """Forward and loss of one micro-batch under the spec's autocast."""
    dt = next(state.model.parameters()).device.type
    with autocast_context(spec, dt):
        if spec.output_kept != "none":
            if spec.output_kept == "through-backward":
                state.kept_output = None  # dropped before this forward
            out = model_output(state.model, batch, spec, num_items)
            state.kept_output = out  # to-next-forward: the previous one dies only now
            state.kept_output_until = spec.output_kept
            return out.loss
        return compute_loss(state.model, batch, spec, num_items, state.reference)


def backward(state: TrainState, loss: torch.Tensor) -> None:
    """Backward of one micro-batch's loss (scaled under fp16)."""
    (state.scaler.scale(loss) if state.scaler is not None else loss).backward()


def update(state: TrainState) -> torch.Tensor:
    """The optimizer step after the micro-batches: unscale (fp16), clip to MAX_GRAD_NORM, step,
    zero_grad, advance the schedule. Returns the gradient norm before clipping (a tensor)."""
    opt = state.optimizer
    params = trainable_parameters(state.model)
    if state.scaler is not None:
        state.scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    if state.scaler is not None:
        state.scaler.step(opt)
        state.scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    state.scheduler.step()
    if state.kept_output_until == "through-backward":
        state.kept_output = None  # the loop's `output = None` after the step
    return norm


def train_step(state: TrainState, next_batch: Callable[[], Batch], spec: RunSpec, *,
               accumulation: int | None = None, split_timing: bool = False,
               fingerprint: Callable[[dict], str] | None = None,
               phase: Callable[[str], None] | None = None) -> StepStats:
    """One optimizer step over `accumulation` micro-batches (default: the spec's).

    `next_batch` is timed as data wait. `split_timing` synchronises the device between forward,
    backward and the optimizer step to split the time (cheap on CPU, a small cost on GPU).
    GRPO/RLOO: `next_batch` gives the step's prompts; generation runs first (training/generation.py;
    `phase` marks it for a memory tracker).
    """
    if spec.objective.generative:

        return generative_step(state, next_batch, spec, accumulation=accumulation,
                               split_timing=split_timing, fingerprint=fingerprint, phase=phase)
    model, opt = state.model, state.optimizer
    dev = next(model.parameters()).device
    accum = accumulation or spec.gradient_accumulation_steps
    model.train()
    stats = StepStats(step=state.step, loss=0.0, lr=opt.param_groups[0]["lr"], useful_tokens=0,
                      padded_tokens=0)
    t0 = time.perf_counter()
    batches = _fetch(next_batch, accum, stats, fingerprint)
    n_step, world = normalizer(batches, dev, spec)
    if spec.objective.kind == "kto":  # its KL estimate is the step's, not a micro-batch's
        _step_kl(state, batches, spec, dev)
    losses = [micro_step(state, batch, spec, n_step / world, stats, split_timing,
                         last=(i == accum - 1))
              for i, batch in enumerate(batches)]
    to = time.perf_counter()
    norm = update(state)
    _sync(dev.type)
    t1 = time.perf_counter()
    stats.optimizer_s = t1 - to
    stats.wall_s = t1 - t0
    stats.loss = float(torch.stack(losses).sum().float().item())  # this rank's share of the
    # step's token-mean loss (x world); summed over ranks / world it is the global token mean
    stats.grad_norm = float(norm)
    state.step += 1
    state.useful_tokens_seen += tokens_over_ranks(stats.useful_tokens, dev)
    return stats


def _step_kl(state: TrainState, batches: list[Batch], spec: RunSpec, dev) -> None:
    """KTO: the step's KL estimate (training/preference.py kto_kl) into every micro-batch."""
    from tunepilot.training.preference import kto_kl

    moved = [{k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in batches]
    with autocast_context(spec, dev.type):
        kl = kto_kl(state.model, moved, spec, state.reference)
    for b in batches:
        b["kto_kl"] = kl


def _fetch(next_batch: Callable[[], Batch], accum: int, stats: StepStats,
           fingerprint: Callable[[dict], str] | None) -> list[Batch]:
    """The step's micro-batches first: the loss is normalised by all of their useful tokens."""
    batches = []
    for _ in range(accum):
        tw = time.perf_counter()
        batch = next_batch()
        stats.data_wait_s += time.perf_counter() - tw
        if fingerprint is not None:
            stats.fingerprints.append(fingerprint(batch))
        stats.useful_tokens += useful_tokens(batch)
        stats.padded_tokens += int(batch["input_ids"].numel())
        batches.append(batch)
    return batches


def micro_step(state: TrainState, batch: Batch, spec: RunSpec, num_items, stats: StepStats,
               split_timing: bool, last: bool) -> torch.Tensor:
    """Forward + loss and backward of one micro-batch, timed into ``stats``."""
    dev = next(state.model.parameters()).device
    batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
    sync_ctx = state.no_sync() if (state.no_sync is not None and not last) else \
        contextlib.nullcontext()
    with sync_ctx:
        tf = time.perf_counter()
        loss = forward_loss(state, batch, spec, num_items)
        if split_timing:
            _sync(dev.type)
        tb = time.perf_counter()
        stats.forward_s += tb - tf
        backward(state, loss)
        if split_timing:
            _sync(dev.type)
        stats.backward_s += time.perf_counter() - tb
    return loss.detach()


def evaluate(model: torch.nn.Module, batches: Iterator[Batch], spec: RunSpec,
             reference: torch.nn.Module | None = None) -> tuple[float, int]:
    """Mean validation loss over the batches (no gradients) and the useful tokens seen (the
    DPO family: its loss on held-out pairs; GRPO/RLOO validate nothing here)."""
    dev = next(model.parameters()).device
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(dev) for k, v in batch.items()}
            with autocast_context(spec, dev.type):
                loss = compute_loss(model, batch, spec, reference=reference)
            k = useful_tokens(batch)
            total += float(loss.float()) * k
            n += k
    model.train()
    return (total / n if n else float("nan")), n


def generative_step(state, next_batch: Callable[[], dict], spec: RunSpec, *,
                    accumulation: int | None = None, split_timing: bool = False,
                    fingerprint: Callable[[dict], str] | None = None,
                    phase: Callable[[str], None] | None = None):
    """One GRPO/RLOO optimizer step: a generation batch (reused num_iterations times), then
    accumulation micro-batches of micro_batch_size completions and one update. ``phase`` marks
    "generation" and "step" for a memory tracker."""
    from tunepilot.training.generation import rollout

    model, opt = state.model, state.optimizer
    dev = next(model.parameters()).device
    accum = accumulation or spec.gradient_accumulation_steps
    stats = StepStats(step=state.step, loss=0.0, lr=opt.param_groups[0]["lr"], useful_tokens=0,
                      padded_tokens=0)
    t0 = time.perf_counter()
    r = state.rollout
    per_batch = -(-r.input_ids.shape[0] // spec.micro_batch_size) if r is not None else 0
    if r is None or r.uses + accum > per_batch * spec.objective.num_iterations:
        tw = time.perf_counter()
        prompts = {k: v.to(dev) for k, v in next_batch().items()}
        stats.data_wait_s += time.perf_counter() - tw
        if fingerprint is not None:
            stats.fingerprints.append(fingerprint(prompts))
        if phase is not None:
            phase("generation")
        tg = time.perf_counter()
        r = rollout(state, prompts, spec, pad_id=state.pad_token_id, eos_id=state.eos_token_id,
                    full_length=True)
        del prompts
        stats.generation_s = time.perf_counter() - tg
        stats.generated_tokens = r.generated_tokens
        state.rollout = r
        if phase is not None:
            phase("step")
    micro = r.micro_batches(spec.micro_batch_size)  # steps_per_generation of them, reused
    batches = [micro[(r.uses + i) % len(micro)] for i in range(accum)]  # num_iterations times
    r.uses += accum
    model.train()
    for b in batches:
        stats.useful_tokens += useful_tokens(b)
        stats.padded_tokens += int(b["input_ids"].numel())
    n_step, world = normalizer(batches, dev, spec)
    losses = [micro_step(state, b, spec, n_step / world, stats, split_timing,
                         last=(i == len(batches) - 1)) for i, b in enumerate(batches)]
    to = time.perf_counter()
    norm = update(state)
    sync(dev.type)
    t1 = time.perf_counter()
    stats.optimizer_s, stats.wall_s = t1 - to, t1 - t0
    stats.loss = float(torch.stack(losses).sum().float().item())
    stats.grad_norm = float(norm)
    state.step += 1
    state.useful_tokens_seen += tokens_over_ranks(stats.useful_tokens, dev)
    return stats
