"""GRPO / RLOO in tunepilot's own training step: generation, then the policy update, as TRL's
GRPOTrainer computes them (trl/trainer/grpo_trainer.py).

    generation   transformers' generate with a KV cache (the pilot's backend: vLLM needs a GPU
                 and its own process memory, which the plan computes), num_generations
                 completions per prompt, sampled at temperature 1; the worst case (warm-up on
                 the longest prompts) generates every completion to max_completion_length
    rewards      the pilot's stand-in: the share of a completion's tokens that also appear in
                 its prompt (a real function of the completion, cheap; the user's reward
                 functions cost their own time, not the policy's memory)
    advantages   GRPO: (r - group mean) / (group std + 1e-4) (scale_rewards "group");
                 RLOO: r - the mean of the group's other completions
    reference    beta > 0: the reference's per-token log-probs of the completions, without
                 gradient, one micro-batch at a time (TRL's _get_per_token_logps_and_entropies)
    loss         per token: -min(ratio A, clip(ratio, 1-eps, 1+eps) A) + beta KL(k3), the ratio
                 against the generation-time log-probs (detached: one iteration per batch);
                 dapo (TRL 1.16's default) sums over the step's completion tokens, grpo averages
                 per sequence, bnpo per micro-batch
One tunepilot step = one optimizer update over gradient_accumulation_steps micro-batches of a
generation batch (micro_batch_size x steps_per_generation completions, generated when the last
one is used up): with steps_per_generation = gradient_accumulation_steps (TRL's default) every
step generates; num_iterations > 1 reuses each batch that many times (its old log-probs
computed once, without gradient). Importing this imports torch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tunepilot.dataset import IGNORE_INDEX
from tunepilot.spec import RunSpec
from tunepilot.spec.objective import lengths
from tunepilot.training.preference import reference_token_logps, token_logps, unwrapped

CLIP_EPSILON = 0.2  # GRPOConfig.epsilon (TRL 1.16)
ADVANTAGE_EPS = 1e-4  # TRL: advantages / (std + 1e-4)

Phase = Callable[[str], None]


@dataclass
class Rollout:
    """One generation batch: prompts + completions, ready for the policy update."""

    input_ids: torch.Tensor  # (completions, prompt + completion), prompts left-padded
    attention_mask: torch.Tensor
    labels: torch.Tensor  # -100 on the prompt and after a completion's EOS
    advantages: torch.Tensor  # (completions,)
    old_logps: torch.Tensor | None = None  # (completions, completion) when iterations > 1
    ref_logps: torch.Tensor | None = None
    generated_tokens: int = 0
    generation_s: float = 0.0
    uses: int = 0
    """micro-batches trained on it so far (steps_per_generation x num_iterations in all)"""

    def micro_batches(self, rows: int) -> list[dict]:
        out = []
        for i in range(0, self.input_ids.shape[0], rows):
            s = slice(i, i + rows)
            b = {"input_ids": self.input_ids[s], "attention_mask": self.attention_mask[s],
                 "labels": self.labels[s], "advantages": self.advantages[s]}
            if self.old_logps is not None:
                b["old_logps"] = self.old_logps[s]
            if self.ref_logps is not None:
                b["ref_logps"] = self.ref_logps[s]
            out.append(b)
        return out


def generate(model: torch.nn.Module, prompts: dict, spec: RunSpec, *, pad_id: int,
             eos_id: int | None, full_length: bool = False) -> tuple[torch.Tensor, float]:
    """num_generations completions of every prompt (transformers' generate, KV cache on):
    (prompt + completion ids, seconds). ``full_length``: no early stop (the worst case)."""
    from tunepilot.training.autocast import autocast_context

    n = spec.objective.generations
    c = lengths(spec).completion
    ids = prompts["input_ids"].repeat_interleave(n, dim=0)
    mask = prompts["attention_mask"].repeat_interleave(n, dim=0)
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad(), autocast_context(spec, dev.type), generating(model) as gen:
        out = gen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=c,
                             min_new_tokens=c if full_length else None, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, use_cache=True,
                             pad_token_id=pad_id, eos_token_id=eos_id)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.train(was_training)
    short = ids.shape[1] + c - out.shape[1]  # every row stopped early: pad to the full length
    if short > 0:
        out = torch.nn.functional.pad(out, (0, short), value=pad_id if eos_id is None else eos_id)
    return out, seconds


@contextlib.contextmanager
def generating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The module whose ``generate`` to call, with what its wrapper must gather around it.

    DDP: the wrapped module (every rank holds the whole model). FSDP1: the root's own
    parameters (embeddings, final norm, lm_head) gathered with summon_full_params(recurse=False),
    as TRL's GRPOTrainer does; each nested unit (decoder layer) gathers its own in its forward.
    FSDP2: ``generate`` registered as a forward method of the root (register_fsdp_forward_method),
    so the root's pre-/post-forward hooks gather and free its parameters around the whole call
    (PEFT's and transformers' generate never call the root's forward). transformers sees the
    FSDP modules and keeps every rank decoding until all are done (synced_gpus)."""
    inner = unwrapped(model)
    if inner is not model:  # DDP
        yield inner
        return
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            yield model.module
        return
    if isinstance(model, FSDPModule) and not getattr(model, "_tunepilot_generate", False):
        register_fsdp_forward_method(model, "generate")
        model._tunepilot_generate = True
    yield model


def completion_labels(seqs: torch.Tensor, prompt_len: int, eos_id: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, attention mask) of generated sequences: the prompt is not trained, nor anything
    after a completion's first EOS (which is trained, as TRL's completion mask keeps it)."""
    comp = seqs[:, prompt_len:]
    keep = torch.ones_like(comp, dtype=torch.bool)
    if eos_id is not None:
        is_eos = comp == eos_id
        after = torch.cumsum(is_eos.int(), dim=1) - is_eos.int() > 0
        keep = ~after
    labels = torch.full_like(seqs, IGNORE_INDEX)
    labels[:, prompt_len:] = torch.where(keep, comp, torch.full_like(comp, IGNORE_INDEX))
    return labels, keep


def stand_in_rewards(seqs: torch.Tensor, prompt_len: int, keep: torch.Tensor) -> torch.Tensor:
    """The pilot's reward: the share of each completion's tokens found in its prompt."""
    out = []
    for row, k in zip(seqs, keep, strict=True):
        prompt = set(row[:prompt_len].tolist())
        comp = row[prompt_len:][k].tolist()
        out.append(sum(t in prompt for t in comp) / max(len(comp), 1))
    return torch.tensor(out, dtype=torch.float32, device=seqs.device)


def advantages(rewards: torch.Tensor, group: int, kind: str) -> torch.Tensor:
    r = rewards.view(-1, group)
    if kind == "rloo":  # leave-one-out baseline
        base = (r.sum(1, keepdim=True) - r) / max(group - 1, 1)
        return (r - base).reshape(-1)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADVANTAGE_EPS)).reshape(-1)


def rollout(state, prompts: dict, spec: RunSpec, *, pad_id: int, eos_id: int | None,
            full_length: bool = False) -> Rollout:
    """Generate, score and (for beta > 0 or several iterations) run the no-gradient forwards."""
    model = state.model
    seqs, seconds = generate(model, prompts, spec, pad_id=pad_id, eos_id=eos_id,
                             full_length=full_length)
    p = prompts["input_ids"].shape[1]
    labels, keep = completion_labels(seqs, p, eos_id)
    mask = torch.cat([prompts["attention_mask"].repeat_interleave(
        spec.objective.generations, dim=0), keep.long()], dim=1)
    adv = advantages(stand_in_rewards(seqs, p, keep), spec.objective.generations,
                     spec.objective.kind)
    r = Rollout(seqs, mask, labels, adv, generated_tokens=int(keep.sum()), generation_s=seconds)
    c = seqs.shape[1] - p
    o = spec.objective
    if o.needs_reference or o.num_iterations > 1:
        from tunepilot.training.autocast import autocast_context

        olds, refs = [], []
        dev = seqs.device.type
        for mb in r.micro_batches(spec.micro_batch_size):
            with autocast_context(spec, dev):
                if o.needs_reference:
                    refs.append(reference_token_logps(model, mb, spec, state.reference, keep=c))
                if o.num_iterations > 1:
                    with torch.no_grad():
                        olds.append(token_logps(model, mb, spec, keep=c)[0])
        r.ref_logps = torch.cat(refs) if refs else None
        r.old_logps = torch.cat(olds) if olds else None
    return r


def grpo_loss(model: torch.nn.Module, batch: dict, spec: RunSpec, num_items=None,
              reference=None) -> torch.Tensor:
    """The micro-batch's GRPO/RLOO loss over its completion tokens (TRL's per-token loss)."""
    o = spec.objective
    c = lengths(spec).completion  # rollouts are padded to it (labels -100 after EOS)
    logps, mask = token_logps(model, batch, spec, keep=c)
    old = batch.get("old_logps")
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    adv = batch["advantages"].unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP_EPSILON,
                                                    1 + CLIP_EPSILON) * adv)
    if o.needs_reference:
        ref = batch.get("ref_logps")
        if ref is None:
            ref = reference_token_logps(model, batch, spec, reference, keep=c)
        d = ref - logps
        per_token = per_token + o.effective_beta * (torch.exp(d) - d - 1)
    per_token = per_token * mask
    kind = o.effective_loss_type
    if kind == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif kind == "bnpo":
        loss = per_token.sum() / mask.sum().clamp(min=1)
    else:  # dapo (TRL's default), dr_grpo, rloo: over the step's completion tokens
        loss = per_token.sum() / (num_items if num_items is not None else mask.sum().clamp(min=1))
    return loss
