"""The DPO family's loss in tunepilot's own training step, as TRL computes it.

    log-probs    TRL's selective_log_softmax (trl/trainer/utils.py): the labels' log-probs of
                 the logits, row by row (a log_softmax per row in 16 bit, a logsumexp per row in
                 fp32) - the path of TRL before its fused LM head (1.x) and of axolotl's and
                 LLaMA-Factory's DPO. With chunked_loss the head and the log-softmax run per
                 CHUNKED_LOSS_TOKENS positions, recomputed in backward (TRL 1.x's fused head
                 never holds the logits either).
    pairs        chosen and rejected concatenated into one forward of 2 x micro_batch rows
                 (TRL's concatenated_forward), the completion tokens summed per sequence
    reference    after the policy's forward, with no gradient: the base with the LoRA adapters
                 disabled (PEFT's disable_adapter), or the frozen copy (TrainState.reference)
    losses       sigmoid (DPO), ipo (length-normalised, as TRL), hinge; simpo and cpo (TRL's
                 CPOTrainer, no reference); orpo (NLL + the odds-ratio term)
    kto          TRL's KTOTrainer (loss_type kto): unpaired rows, each desirable or not; the
                 KL estimate is the data's mismatched rows (each prompt with the completion of
                 the row before it, TRL's _get_kl_dataset) through the policy and the reference,
                 without gradient, clamped at 0 - averaged over the optimizer step's rows on
                 every rank (TRL averages per micro-batch over the ranks: the same estimate
                 from more rows, and one that N ranks and one rank with accumulation agree on)
    reward       TRL's RewardTrainer: a sequence-classification head scores chosen and
                 rejected, -log sigmoid(r_chosen - r_rejected)
The loss of a micro-batch is the sum over its pairs (KTO: rows) divided by ``num_items`` (the
step's pairs or rows), so accumulation and ranks give the mean over the global batch.
Importing this imports torch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tunepilot.dataset import IGNORE_INDEX
from tunepilot.errors import UserError
from tunepilot.spec import CHUNKED_LOSS_TOKENS, RunSpec

# TRL's CPOConfig defaults (trl/experimental/cpo/cpo_config.py, TRL 1.16)
SIMPO_GAMMA = 0.5
CPO_ALPHA = 1.0
# TRL's KTOConfig defaults (trl/trainer/kto_config.py): desirable_weight, undesirable_weight
KTO_DESIRABLE_WEIGHT = 1.0
KTO_UNDESIRABLE_WEIGHT = 1.0


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits).gather(index), as TRL's selective_log_softmax computes it: row by row
    to bound the peak (16-bit logits: a log_softmax per row; fp32: a logsumexp per row)."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse
    rows = [F.log_softmax(row_logits, dim=-1).gather(-1, row_index.unsqueeze(-1)).squeeze(-1)
            for row_logits, row_index in zip(logits, index, strict=True)]
    return torch.stack(rows)


def token_logps(model: torch.nn.Module, batch: dict, spec: RunSpec,
                keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probs of the labels, their mask), (rows, positions - 1) or the last
    ``keep`` positions (GRPO keeps the completion's). Labels -100 count 0."""
    labels = batch["labels"][:, 1:]
    if keep is not None:
        labels = labels[:, -keep:]
    mask = labels != IGNORE_INDEX
    index = labels.clamp(min=0)
    if spec.loss_is_chunked:
        from tunepilot.training.step import through_ddp

        logps = through_ddp(model, lambda m: _chunked_logps(m, batch, index, keep))
        return logps * mask, mask
    kwargs = {"logits_to_keep": keep + 1} if keep is not None else {}
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                **kwargs)
    logits = out.logits[:, :-1]  # (rows, positions, vocab): position t predicts token t+1
    del out
    return selective_log_softmax(logits, index) * mask, mask


def _chunked_logps(model, batch: dict, index: torch.Tensor, keep: int | None) -> torch.Tensor:
    """The head and the log-softmax per CHUNKED_LOSS_TOKENS positions, checkpointed."""
    from torch.utils.checkpoint import checkpoint

    from tunepilot.model.build import output_head

    body, head = output_head(model)
    hidden = body(input_ids=batch["input_ids"],
                  attention_mask=batch.get("attention_mask")).last_hidden_state[:, :-1]
    if keep is not None:
        hidden = hidden[:, -keep:]
    rows, n, width = hidden.shape
    h, y = hidden.reshape(-1, width), index.reshape(-1)

    def chunk(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return selective_log_softmax(head(hc).unsqueeze(0), yc.unsqueeze(0)).squeeze(0)

    parts = [checkpoint(chunk, h[i:i + CHUNKED_LOSS_TOKENS], y[i:i + CHUNKED_LOSS_TOKENS],
                        use_reentrant=False) for i in range(0, h.shape[0], CHUNKED_LOSS_TOKENS)]
    return torch.cat(parts).reshape(rows, n)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DistributedDataParallel wrapper holds (DDP forwards no attribute - not
    PEFT's disable_adapter, not generate - and a forward without gradient needs none of its
    hooks); any other model as it is: FSDP2 keeps the module's own class, and FSDP1's wrapper
    forwards attributes and must run its own forward (it gathers the parameters)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def reference_off(model: torch.nn.Module, reference: torch.nn.Module | None):
    """(the model to run, its context) for the reference forward: the frozen copy, or the LoRA
    model with its adapters disabled (under DDP, the wrapped module's)."""
    if reference is not None:
        return reference, contextlib.nullcontext()
    inner = unwrapped(model)
    if hasattr(inner, "disable_adapter"):
        return inner, inner.disable_adapter()
    raise RuntimeError("a reference forward needs LoRA adapters to disable or a frozen copy")


def reference_token_logps(model, batch: dict, spec: RunSpec, reference=None,
                          keep: int | None = None) -> torch.Tensor:
    """The reference's per-token log-probs, without gradient."""
    ref, ctx = reference_off(model, reference)
    with torch.no_grad(), ctx:
        logps, _ = token_logps(ref, batch, spec, keep)
    return logps


def preference_loss(model: torch.nn.Module, batch: dict, spec: RunSpec, num_items=None,
                    reference: torch.nn.Module | None = None) -> torch.Tensor:
    """The micro-batch's DPO-family loss: ``batch`` holds the chosen rows then the rejected rows
    (2 x pairs), labels -100 on prompt and padding."""
    o = spec.objective
    pairs = batch["input_ids"].shape[0] // 2
    if o.concatenate_pairs:
        logps, mask = token_logps(model, batch, spec)
    else:  # chosen and rejected in two forwards (both graphs alive until the loss)
        halves = [token_logps(model, {k: v[s] for k, v in batch.items()}, spec)
                  for s in (slice(0, pairs), slice(pairs, None))]
        logps, mask = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    seq, n_tok = logps.sum(-1), mask.sum(-1).clamp(min=1)
    ref = None
    if o.needs_reference:
        if "ref_logps" in batch:  # precomputed with the data
            ref = batch["ref_logps"]
        else:
            ref = reference_token_logps(model, batch, spec, reference).sum(-1)
    per_pair = _pair_losses(o, seq, n_tok, ref, pairs)
    denom = num_items if num_items is not None else pairs
    return per_pair.sum() / denom


def _pair_losses(o, seq: torch.Tensor, n_tok: torch.Tensor, ref: torch.Tensor | None,
                 pairs: int) -> torch.Tensor:
    beta, kind = o.effective_beta, o.effective_loss_type
    chosen, rejected = seq[:pairs], seq[pairs:]
    if kind in ("sigmoid", "ipo", "hinge") and ref is not None:
        c_ratio, r_ratio = chosen - ref[:pairs], rejected - ref[pairs:]
        if kind == "ipo":  # TRL normalises by the completion tokens
            delta = c_ratio / n_tok[:pairs] - r_ratio / n_tok[pairs:]
            return (delta - 1 / (2 * beta)) ** 2
        if kind == "hinge":
            return torch.relu(1 - beta * (c_ratio - r_ratio))
        return -F.logsigmoid(beta * (c_ratio - r_ratio))
    avg_c, avg_r = chosen / n_tok[:pairs], rejected / n_tok[pairs:]
    nll = -avg_c
    if kind == "simpo":
        return -F.logsigmoid(beta * (avg_c - avg_r) - SIMPO_GAMMA)
    if kind == "orpo":  # ORPO: NLL of chosen + beta * -log sigmoid(log odds ratio)
        log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c).clamp(max=1 - 1e-6))
                                      - torch.log1p(-torch.exp(avg_r).clamp(max=1 - 1e-6)))
        return nll - beta * F.logsigmoid(log_odds)
    # cpo (sigmoid without a reference) + the behaviour-cloning NLL of chosen
    return -F.logsigmoid(beta * (chosen - rejected)) + CPO_ALPHA * nll


def reward_loss(model: torch.nn.Module, batch: dict, num_items=None) -> torch.Tensor:
    """The micro-batch's reward-model loss (TRL's RewardTrainer, no margin): the scalar head
    on chosen then rejected rows, -log sigmoid(r_chosen - r_rejected) summed over the pairs."""
    pairs = batch["input_ids"].shape[0] // 2
    rewards = model(input_ids=batch["input_ids"],
                    attention_mask=batch.get("attention_mask")).logits.squeeze(-1).float()
    per_pair = -F.logsigmoid(rewards[:pairs] - rewards[pairs:])
    return per_pair.sum() / (num_items if num_items is not None else pairs)


def mismatched(batch: dict) -> dict:
    """KTO's KL rows of a batch: each row's prompt with another row's completion (the data
    builds them: tunepilot.dataset's UnpairedRows, as TRL's _get_kl_dataset)."""
    return {k.removeprefix("kl_"): v for k, v in batch.items() if k.startswith("kl_")}


def kto_loss(model: torch.nn.Module, batch: dict, spec: RunSpec, num_items=None,
             reference: torch.nn.Module | None = None) -> torch.Tensor:
    """The micro-batch's KTO loss (TRL's kto_loss, loss_type kto), summed over its rows."""
    o = spec.objective
    if o.effective_loss_type != "kto":
        raise UserError("objective.loss_type", f"{o.loss_type!r}: tunepilot's own step runs "
                        "KTO's loss_type kto.", "Remove objective.loss_type (plan the variant "
                        "with `tunepilot plan`; its memory is the same).")
    beta = o.effective_beta
    logps, _ = token_logps(model, batch, spec)
    ref = reference_token_logps(model, batch, spec, reference).sum(-1)
    kl = batch["kto_kl"] if "kto_kl" in batch else kto_kl(model, [batch], spec, reference)
    ratio = logps.sum(-1) - ref
    losses = torch.where(batch["desirable"],
                         KTO_DESIRABLE_WEIGHT * (1 - torch.sigmoid(beta * (ratio - kl))),
                         KTO_UNDESIRABLE_WEIGHT * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses.sum() / (num_items if num_items is not None else losses.shape[0])


def kto_kl(model: torch.nn.Module, batches: list[dict], spec: RunSpec,
           reference: torch.nn.Module | None = None) -> torch.Tensor:
    """KTO's KL estimate over ``batches`` (an optimizer step's micro-batches) on every rank:
    the mean over their mismatched rows of policy - reference log-probs, no gradient, clamped
    at 0 (a 0-d fp32 tensor)."""
    import torch.distributed as dist

    total, rows = None, 0
    for batch in batches:
        kl_batch = mismatched(batch)
        with torch.no_grad():
            policy = token_logps(unwrapped(model), kl_batch, spec)[0].sum(-1)
        ref = reference_token_logps(model, kl_batch, spec, reference).sum(-1)
        part = (policy - ref).float().sum()
        total = part if total is None else total + part
        rows += kl_batch["input_ids"].shape[0]
    both = torch.stack([total, torch.tensor(float(rows), device=total.device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(both)  # SUM over the ranks
    return (both[0] / both[1].clamp(min=1)).clamp(min=0).detach()
