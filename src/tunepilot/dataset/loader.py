"""Micro-batches: collation (padded, or packed rows with position ids), the StatefulDataLoader
whose position a checkpoint saves, and the worst-case batch the pilot runs first.

A padded batch is input_ids, labels (-100 on padding and untrained tokens) and attention_mask,
(batch, longest) int64. A packed batch has position_ids instead of attention_mask: transformers
then masks attention per packed sample (masking_utils' packed-sequence detection).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tunepilot.dataset.samples import IGNORE_INDEX, DataInfo, PackedRows, SyntheticTokens
from tunepilot.errors import UserError
from tunepilot.spec import RunSpec


def collate(samples: list, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest item: labels are -100 on padding, so padding is never a useful token.
    Pairs (4-tuples) become the chosen rows then the rejected rows (TRL's concatenated batch);
    prompts (1-tuples) are left-padded, nothing trained (generation continues from the end); KTO
    rows (5-tuples) add ``desirable`` (bool per row) and their KL rows as ``kl_*``."""
    width = len(samples[0])
    if width == 4:
        samples = [s[:2] for s in samples] + [s[2:] for s in samples]
    elif width == 1:
        return _left_padded([s[0] for s in samples], pad_token_id)
    elif width == 5:  # KTO rows: (ids, labels, desirable, KL ids, KL labels)
        kl = collate([s[3:] for s in samples], pad_token_id)
        return {**collate([s[:2] for s in samples], pad_token_id),
                "desirable": torch.tensor([s[2] for s in samples], dtype=torch.bool),
                **{f"kl_{k}": v for k, v in kl.items()}}
    longest = max(len(s[0]) for s in samples)
    B = len(samples)
    packed = len(samples[0]) == 3
    input_ids = torch.full((B, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((B, longest), IGNORE_INDEX, dtype=torch.long)
    extra = torch.zeros((B, longest), dtype=torch.long)  # attention mask, or position ids
    for b, s in enumerate(samples):
        n = len(s[0])
        input_ids[b, :n] = torch.as_tensor(np.asarray(s[0]), dtype=torch.long)
        labels[b, :n] = torch.as_tensor(np.asarray(s[1]), dtype=torch.long)
        if packed:  # padding continues as its own position run (its own attention block)
            extra[b, :n] = torch.as_tensor(np.asarray(s[2]), dtype=torch.long)
            extra[b, n:] = torch.arange(longest - n)
        else:
            extra[b, :n] = 1
    key = "position_ids" if packed else "attention_mask"
    return {"input_ids": input_ids, "labels": labels, key: extra}


def _left_padded(prompts: list, pad_token_id: int) -> dict[str, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for b, p in enumerate(prompts):
        n = len(p)
        ids[b, longest - n:] = torch.as_tensor(np.asarray(p), dtype=torch.long)
        mask[b, longest - n:] = 1
    return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX),
            "attention_mask": mask}


class _Collate:
    """Picklable collate_fn (worker processes)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list) -> dict[str, torch.Tensor]:
        return collate(samples, self.pad_token_id)


def make_loader(spec: RunSpec, dataset, info: DataInfo, *, micro_batch_size: int | None = None,
                rank: int = 0, world_size: int = 1, seed: int | None = None):
    """A StatefulDataLoader over the dataset; with world_size > 1 each rank reads its own shard
    (StatefulDistributedSampler), so all ranks together see the single-device order."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    seed = spec.seed if seed is None else seed
    sampler = StatefulDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                         shuffle=spec.data.shuffle, seed=seed, drop_last=True)
    return StatefulDataLoader(dataset, batch_size=micro_batch_size or spec.micro_batch_size,
                              sampler=sampler, collate_fn=_Collate(info.pad_token_id),
                              num_workers=spec.data.num_workers, drop_last=True)


class DataStream:
    """Endless micro-batches over epochs, with a checkpointable position."""

    def __init__(self, loader):
        self.loader = loader
        self.epoch = 0
        self._it = None

    @property
    def iterator_open(self) -> bool:
        """Whether an epoch's iterator is open (opening one draws from torch's global RNG)."""
        return self._it is not None

    def _open(self) -> None:
        self.loader.sampler.set_epoch(self.epoch)
        self._it = iter(self.loader)

    def next(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._open()
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = None
        self._open()
        try:  # a fresh epoch that yields nothing would loop forever
            return next(self._it)
        except StopIteration:
            raise UserError("micro_batch_size", f"an epoch of {len(self.loader.dataset)} "
                            "samples yields no full micro-batch on this rank (drop_last).",
                            "Use a smaller micro_batch_size, fewer ranks, or more data.") from None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict, *, open_iterator: bool = False) -> None:
        """Resume at a saved position. ``open_iterator``: the saving run had the epoch's
        iterator open, so open it now (it draws a base seed from torch's global RNG, which the
        caller restores afterwards)."""
        self.epoch = int(state["epoch"])
        self.loader.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        self._it = None
        if open_iterator:
            self._open()
        # torchdata 0.11's StatefulDistributedSampler holds a loaded position in `next_yielded`
        # and reports `yielded` = 0 until the first batch is drawn, so a checkpoint saved right
        # after a resume (before any step) would restart the epoch. Report the real position.
        sampler = getattr(self.loader, "sampler", None)
        pending = getattr(sampler, "next_yielded", None)
        if pending is not None:
            sampler.yielded = pending


def longest_batch(dataset, info: DataInfo, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The worst case: the micro_batch_size longest items of the whole dataset (samples, or
    packed rows), padded as training pads them."""
    if isinstance(dataset, SyntheticTokens):
        idx = list(range(micro_batch_size))
    else:
        lengths = np.asarray(dataset.lengths())
        idx = np.argsort(-lengths, kind="stable")[:micro_batch_size].tolist()
        while len(idx) < micro_batch_size:  # fewer items than a batch: repeat the longest
            idx.append(idx[0])
    return collate([dataset[i] for i in idx], info.pad_token_id)


def is_packed(dataset) -> bool:
    return isinstance(dataset, PackedRows)


def trained_positions(labels: torch.Tensor) -> torch.Tensor:
    """The one rule of useful tokens, counted where the labels are (a 0-d tensor: no device
    sync): labels after the one-token shift that are not ignored (padding and, under
    completions-only training, prompt tokens are not useful)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def useful_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Trained target tokens of a batch (trained_positions)."""
    return int(trained_positions(batch["labels"]))


def batch_fingerprint(batch: dict[str, torch.Tensor]) -> str:
    """SHA-256 (16 hex) of a batch's ids and labels: equal fingerprints = the same data."""
    h = hashlib.sha256()
    for key in ("input_ids", "labels"):
        t = batch[key].detach().to("cpu").contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
