"""Training data: synthetic tokens, a local JSONL file with a local tokenizer, or the shipped tiny
text set - loaded through torchdata's StatefulDataLoader so the data position can be saved and
restored (sampler generator, epoch and cursor included).

A batch is a dict of (batch, seq) int64 tensors: input_ids, labels (-100 on padding) and
attention_mask, padded to the longest sample in the batch as training pads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunepilot.errors import UserError
from tunepilot.resources import TINY_DIR
from tunepilot.spec import RunSpec

IGNORE_INDEX = -100
SYNTHETIC_SAMPLES = 1 << 16  # a synthetic epoch; samples are generated on demand from their index


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token ids of exactly `seq_len`, reproducible per index (no padding: all useful)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, num_samples: int = SYNTHETIC_SAMPLES):
        self.vocab_size, self.seq_len, self.seed, self.num_samples = vocab_size, seq_len, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        return torch.randint(0, self.vocab_size, (self.seq_len,), generator=g).tolist()

    def lengths(self) -> list[int]:
        return [self.seq_len] * min(self.num_samples, 1)  # all equal: any sample is longest


class TokenizedTexts(torch.utils.data.Dataset):
    """Pre-tokenized samples (lists of ids), truncated to the sequence length."""

    def __init__(self, samples: list[list[int]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> list[int]:
        return self.samples[i]

    def lengths(self) -> list[int]:
        return [len(s) for s in self.samples]


@dataclass
class DataInfo:
    """What the data stage found, recorded in the pilot result and manifest."""

    source: str
    num_samples: int
    vocab_size: int
    pad_token_id: int
    path: str | None = None
    size_bytes: int | None = None
    content_sha256: str | None = None
    tokenizer: str | None = None
    truncated_samples: int = 0
    longest_sample_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def provenance(self) -> dict:
        """What the manifest records of the data (a result can be traced to its bytes)."""
        return {"source": self.source, "path": self.path, "size_bytes": self.size_bytes,
                "content_sha256": self.content_sha256, "tokenizer": self.tokenizer,
                "num_samples": self.num_samples}


def build_dataset(spec: RunSpec, vocab_size: int, base_dir: Path | None = None
                  ) -> tuple[torch.utils.data.Dataset, DataInfo]:
    """The spec's dataset and what was found in it."""
    d = spec.data
    if d.source == "synthetic":
        ds = SyntheticTokens(vocab_size, spec.sequence_length, spec.seed)
        return ds, DataInfo("synthetic", len(ds), vocab_size, 0,
                            longest_sample_tokens=spec.sequence_length)
    if d.source == "tiny-text":
        path, tok = TINY_DIR / "train.jsonl", TINY_DIR / "tokenizer"
    else:
        path, tok = _resolve(d.path, base_dir), _resolve(d.tokenizer, base_dir)
    return _tokenize_jsonl(spec, path, tok, vocab_size)


def _resolve(p: str | None, base_dir: Path | None) -> Path:
    path = Path(p or "")
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return path


def _tokenize_jsonl(spec: RunSpec, path: Path, tok_dir: Path, vocab_size: int
                    ) -> tuple[TokenizedTexts, DataInfo]:
    if not path.is_file():
        raise UserError("data.path", f"dataset file {str(path)!r} does not exist.",
                        "Give the path of a local .jsonl file, one JSON object per line.")
    if not tok_dir.exists():
        raise UserError("data.tokenizer", f"tokenizer {str(tok_dir)!r} does not exist.",
                        "Give a local Hugging Face tokenizer directory (tokenizer.json).")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError("data.tokenizer", f"cannot load a tokenizer from {str(tok_dir)!r}: "
                        f"{str(exc).splitlines()[0]}", "It must be a local tokenizer directory."
                        ) from None
    raw = path.read_bytes()
    texts = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError("data.path", f"{path.name} line {n} is not JSON: {exc.msg}.") from None
        field_name = spec.data.text_field
        if not isinstance(row, dict) or not isinstance(row.get(field_name), str):
            raise UserError("data.text_field", f"{path.name} line {n} has no string field "
                            f"{field_name!r}.", "Set data.text_field to the key holding the text.")
        texts.append(row[field_name])
    if not texts:
        raise UserError("data.path", f"{path.name} holds no samples.", "Add training samples.")
    if len(tok) > vocab_size:
        raise UserError("data.tokenizer", f"the tokenizer has {len(tok)} tokens but the model's "
                        f"vocabulary has {vocab_size}.", "Use the model's own tokenizer.")
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    S = spec.sequence_length
    truncated = sum(1 for s in ids if len(s) > S)
    samples = [s[:S] for s in ids if s]
    if not samples:
        raise UserError("data.path", f"every sample of {path.name} tokenizes to nothing.",
                        f"Check data.text_field ({spec.data.text_field!r}) names the text.")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    info = DataInfo(spec.data.source, len(samples), vocab_size, int(pad), path=str(path),
                    size_bytes=len(raw), content_sha256=hashlib.sha256(raw).hexdigest(),
                    tokenizer=str(tok_dir), truncated_samples=truncated,
                    longest_sample_tokens=max(len(s) for s in samples))
    if truncated:
        info.notes.append(f"{truncated} of {len(ids)} samples were longer than sequence_length "
                          f"{S} and were truncated to it (training does the same)")
    return TokenizedTexts(samples), info


def collate(samples: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest sample: labels are -100 on padding, so padding is never a useful token."""
    longest = max(len(s) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((B, longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((B, longest), dtype=torch.long)
    for b, s in enumerate(samples):
        t = torch.tensor(s, dtype=torch.long)
        input_ids[b, : len(s)] = t
        labels[b, : len(s)] = t
        mask[b, : len(s)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


class _Collate:
    """Picklable collate_fn (worker processes)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[list[int]]) -> dict[str, torch.Tensor]:
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
    """The worst case: the micro_batch_size longest samples, padded as training pads them."""
    lengths = dataset.lengths() if hasattr(dataset, "lengths") else [len(dataset[i]) for i in
                                                                      range(len(dataset))]
    if isinstance(dataset, SyntheticTokens):
        idx = list(range(micro_batch_size))
    else:
        idx = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:micro_batch_size]
        while len(idx) < micro_batch_size:  # fewer samples than a batch: repeat the longest
            idx.append(idx[0])
    return collate([dataset[i] for i in idx], info.pad_token_id)


def useful_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding target tokens: labels after the one-token shift that are not ignored."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def batch_fingerprint(batch: dict[str, torch.Tensor]) -> str:
    """SHA-256 (16 hex) of a batch's ids and labels: equal fingerprints = the same data."""
    h = hashlib.sha256()
    for key in ("input_ids", "labels"):
        t = batch[key].detach().to("cpu").contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
