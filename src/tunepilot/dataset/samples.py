"""The datasets the loader draws from, and what was found in the data.

    SyntheticTokens  random ids of exactly sequence_length, reproducible per index
    EncodedSamples   the tokenized dataset (encode.py), each sample truncated to sequence_length
    PackedRows       several samples per row of at most sequence_length tokens (best-fit
                     decreasing, as TRL's BFD packing), position ids restarting per sample
    PairSamples      preference rows: (chosen ids, chosen labels, rejected ids, rejected
                     labels), each truncated to sequence_length (TRL's keep_start)
    PromptSamples    prompt-only rows (generation): (prompt ids,), the last max_prompt_length
                     tokens kept
    ScoredPairs      a reward model's pairs: every token of chosen and rejected is scored
                     (TRL's RewardTrainer reads the whole sequence), so none is masked
    UnpairedRows     KTO's rows: (ids, labels, desirable, kl ids, kl labels) - a preference
                     pair unpaired into its chosen (desirable) and rejected (undesirable) reply,
                     as TRL's unpair_preference_dataset does (prompt-completion rows are
                     desirable), and the row's KL row: its prompt with the completion of the row
                     before it in its chunk of micro_batch_size rows (TRL's _get_kl_dataset,
                     mapped over the dataset in chunks of the per-device batch)
    SyntheticPairs / SyntheticPrompts / SyntheticUnpaired   random pairs / prompts / KTO rows
An item is (input_ids, labels) - or (input_ids, labels, position_ids) for a packed row - as
int64 numpy arrays; labels are -100 where nothing is trained; a KTO row adds its flag and its
KL row.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tunepilot.errors import UserError
from tunepilot.spec import RunSpec

IGNORE_INDEX = -100
SYNTHETIC_SAMPLES = 1 << 16  # a synthetic epoch; samples are generated on demand from their index


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token ids of exactly `seq_len`, reproducible per index (no padding: all useful)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int,
                 num_samples: int = SYNTHETIC_SAMPLES):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g).numpy()
        return ids, ids.copy()

    def lengths(self) -> np.ndarray:
        return np.full(min(self.num_samples, 1), self.seq_len)  # all equal: any is longest


class EncodedSamples(torch.utils.data.Dataset):
    """The tokenized samples, truncated to the sequence length (as training truncates)."""

    def __init__(self, encoded, sequence_length: int):
        self.encoded = encoded
        self.sequence_length = sequence_length
        self._lengths = np.minimum(encoded.lengths(), sequence_length)

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int):
        a = int(self.encoded.offsets[i])
        n = int(self._lengths[i])
        ids = self.encoded.ids[a:a + n].astype(np.int64)
        return ids, np.where(self.encoded.trained[a:a + n], ids, IGNORE_INDEX)

    def lengths(self) -> np.ndarray:
        return self._lengths


class PackedRows(torch.utils.data.Dataset):
    """Rows of packed samples: a sample's first label is -100 (it would be predicted from the
    sample before it) and its position ids start at 0, so attention stays within the sample."""

    def __init__(self, samples: EncodedSamples, rows: list[list[int]]):
        self.samples, self.rows = samples, rows
        lengths = samples.lengths()
        self._lengths = np.asarray([int(lengths[r].sum()) for r in rows], np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int):
        parts = [self.samples[i] for i in self.rows[r]]
        ids = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        starts = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
        labels[starts] = IGNORE_INDEX
        positions = np.concatenate([np.arange(len(p[0])) for p in parts])
        return ids, labels, positions

    def lengths(self) -> np.ndarray:
        return self._lengths


class PairSamples(torch.utils.data.Dataset):
    """Preference pairs: encoded samples 2i (chosen) and 2i+1 (rejected)."""

    def __init__(self, samples: EncodedSamples):
        self.samples = samples
        n = samples.lengths()
        self._lengths = np.maximum(n[0::2], n[1::2])  # a pair is as long as its longer reply

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int):
        return (*self.samples[2 * i], *self.samples[2 * i + 1])

    def lengths(self) -> np.ndarray:
        return self._lengths


class ScoredPairs(torch.utils.data.Dataset):
    """A reward model's pairs: the pairs of ``pairs`` with every token labelled (scored)."""

    def __init__(self, pairs: torch.utils.data.Dataset):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        chosen, _, rejected, _ = self.pairs[i]
        return chosen, chosen.copy(), rejected, rejected.copy()

    def lengths(self) -> np.ndarray:
        return self.pairs.lengths()


class UnpairedRows(torch.utils.data.Dataset):
    """KTO's rows: encoded sample i with its flag (``pairs``: 2i chosen = desirable, 2i+1
    rejected = undesirable; otherwise every row desirable) and its KL row."""

    def __init__(self, samples: EncodedSamples, pairs: bool, chunk: int):
        self.samples, self.pairs, self.chunk = samples, pairs, chunk

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        ids, labels = self.samples[i]
        other_ids, other_labels = self.samples[kl_partner(i, len(self), self.chunk)]
        return (ids, labels, bool(i % 2 == 0 or not self.pairs),
                *kl_row(ids, labels, other_ids, other_labels, self.samples.sequence_length))

    def lengths(self) -> np.ndarray:
        return self.samples.lengths()


def kl_partner(i: int, n: int, chunk: int) -> int:
    """The row whose completion row i's KL row takes: the one before it in its chunk of
    ``chunk`` rows, the chunk's last for its first (TRL's rotation by one)."""
    start = (i // chunk) * chunk
    end = min(start + chunk, n)
    return end - 1 if i == start else i - 1


def kl_row(ids, labels, other_ids, other_labels, max_len: int):
    """(ids, labels) of a prompt with another row's completion, cut to ``max_len``."""
    prompt = ids[labels == IGNORE_INDEX]
    completion = other_ids[other_labels != IGNORE_INDEX]
    row = np.concatenate([prompt, completion])[:max_len].astype(np.int64)
    lab = row.copy()
    lab[: len(prompt)] = IGNORE_INDEX
    return row, lab


class PromptSamples(torch.utils.data.Dataset):
    """Prompt-only rows, the last ``prompt_length`` tokens of each kept (generation continues
    from the end of the prompt)."""

    def __init__(self, encoded, prompt_length: int):
        self.encoded, self.prompt_length = encoded, prompt_length
        self._lengths = np.minimum(encoded.lengths(), prompt_length)

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int):
        b = int(self.encoded.offsets[i + 1])
        return (self.encoded.ids[b - int(self._lengths[i]):b].astype(np.int64),)

    def lengths(self) -> np.ndarray:
        return self._lengths


class SyntheticPairs(SyntheticTokens):
    """Random pairs: chosen and rejected of exactly seq_len tokens, the first ``prompt``
    shared and not trained."""

    def __init__(self, vocab_size: int, seq_len: int, prompt: int, seed: int):
        super().__init__(vocab_size, seq_len, seed)
        self.prompt = prompt

    def __getitem__(self, i: int):
        chosen, _ = super().__getitem__(2 * i)
        rejected, _ = super().__getitem__(2 * i + 1)
        rejected[: self.prompt] = chosen[: self.prompt]
        out = []
        for ids in (chosen, rejected):
            labels = ids.copy()
            labels[: self.prompt] = IGNORE_INDEX
            out += [ids, labels]
        return tuple(out)


class SyntheticPrompts(SyntheticTokens):
    """Random prompts of exactly ``prompt`` tokens."""

    def __getitem__(self, i: int):
        ids, _ = super().__getitem__(i)
        return (ids,)


class SyntheticUnpaired(SyntheticTokens):
    """Random KTO rows of exactly seq_len tokens, the first ``prompt`` not trained; even
    indices desirable, odd ones undesirable; KL rows as UnpairedRows makes them."""

    def __init__(self, vocab_size: int, seq_len: int, prompt: int, seed: int, chunk: int):
        super().__init__(vocab_size, seq_len, seed)
        self.prompt, self.chunk = prompt, chunk

    def _row(self, i: int):
        ids, labels = super().__getitem__(i)
        labels[: self.prompt] = IGNORE_INDEX
        return ids, labels

    def __getitem__(self, i: int):
        ids, labels = self._row(i)
        other = self._row(kl_partner(i, len(self), self.chunk))
        return (ids, labels, bool(i % 2 == 0), *kl_row(ids, labels, *other, self.seq_len))


def pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sample, longest first, into the fullest row it still fits."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
            rows[r].append(i)
        else:
            room, r = capacity, len(rows)
            rows.append([i])
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


@dataclass
class DataInfo:
    """What the data stage found, recorded in the pilot result and manifest."""

    source: str
    num_samples: int
    vocab_size: int
    pad_token_id: int
    path: str | None = None
    eos_token_id: int | None = None
    """what ends a generated completion (None: synthetic data, completions run to full length)"""
    size_bytes: int | None = None
    content_sha256: str | None = None
    tokenizer: str | None = None
    truncated_samples: int = 0
    longest_sample_tokens: int = 0
    format: str = "text"
    train_on: str = "all"
    chat_template: str | None = None
    packing: bool = False
    packed_rows: int | None = None
    skipped_rows: int = 0
    notes: list[str] = field(default_factory=list)

    def provenance(self) -> dict:
        """What the manifest records of the data (a result can be traced to its bytes)."""
        return {"source": self.source, "path": self.path, "size_bytes": self.size_bytes,
                "content_sha256": self.content_sha256, "tokenizer": self.tokenizer,
                "num_samples": self.num_samples, "format": self.format,
                "train_on": self.train_on, "chat_template": self.chat_template,
                "packing": self.packing, "skipped_rows": self.skipped_rows}


def build_dataset(spec: RunSpec, vocab_size: int, base_dir: Path | None = None,
                  progress: Callable[[int, int], None] | None = None
                  ) -> tuple[torch.utils.data.Dataset, DataInfo]:
    """The spec's dataset (packed rows when data.packing) and what was found in it."""
    d = spec.data
    if d.source == "synthetic":
        ds = _synthetic(spec, vocab_size)
        info = DataInfo("synthetic", len(ds), vocab_size, 0,
                        longest_sample_tokens=spec.sequence_length, format=_kind(spec))
        if d.packing:
            info.notes.append("synthetic samples fill the sequence length: packing changes "
                              "nothing")
        return ds, info
    from tunepilot.dataset.encode import encode, load_tokenizer
    from tunepilot.dataset.sources import locate

    files = locate(d, base_dir)
    tok = load_tokenizer(files.tokenizer)
    if len(tok) > vocab_size:
        raise UserError("data.tokenizer", f"the tokenizer has {len(tok)} tokens but the model's "
                        f"vocabulary has {vocab_size}.", "Use the model's own tokenizer.")
    enc = encode(files, d, tok, base_dir=base_dir, progress=progress)
    samples = EncodedSamples(enc, spec.sequence_length)
    S = spec.sequence_length
    full = enc.lengths()
    truncated = int((full > S).sum())
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    info = DataInfo(d.source, len(samples), vocab_size, int(pad), path=str(files.path),
                    eos_token_id=tok.eos_token_id,
                    size_bytes=files.size_bytes, content_sha256=files.content_sha256,
                    tokenizer=str(files.tokenizer), truncated_samples=truncated,
                    longest_sample_tokens=int(samples.lengths().max()), format=d.data_format,
                    train_on=d.supervise, chat_template=enc.template, packing=d.packing,
                    skipped_rows=enc.skipped)
    if enc.template_note:
        info.notes.append(enc.template_note)
    if truncated:
        info.notes.append(f"{truncated} of {len(samples)} samples were longer than "
                          f"sequence_length {S} and were truncated to it (training does the same)")
    if enc.skipped:
        info.notes.append(f"{enc.skipped} rows were skipped (data.skip_bad_rows)")
    if spec.objective.kind == "kto":
        return _unpaired(spec, samples, info)
    if spec.data.data_format in ("preference", "prompt"):
        return _objective_samples(spec, enc, samples, info)
    if not d.packing:
        return samples, info
    rows = pack(samples.lengths(), S)
    info.packed_rows = len(rows)
    return PackedRows(samples, rows), info


def _kind(spec: RunSpec) -> str:
    o = spec.objective
    return "preference" if o.paired else ("prompt" if o.generative else "text")


def _synthetic(spec: RunSpec, vocab_size: int) -> torch.utils.data.Dataset:
    """Random tokens of the objective's shape at full length: samples, pairs or prompts."""
    from tunepilot.spec.objective import lengths

    ln = lengths(spec)
    if spec.objective.kind == "reward":
        return ScoredPairs(SyntheticPairs(vocab_size, ln.sequence, ln.prompt, spec.seed))
    if spec.objective.paired:
        return SyntheticPairs(vocab_size, ln.sequence, ln.prompt, spec.seed)
    if spec.objective.kind == "kto":
        return SyntheticUnpaired(vocab_size, ln.sequence, ln.prompt, spec.seed,
                                 spec.micro_batch_size)
    if spec.objective.generative:
        return SyntheticPrompts(vocab_size, ln.prompt, spec.seed)
    return SyntheticTokens(vocab_size, spec.sequence_length, spec.seed)


def _objective_samples(spec: RunSpec, enc, samples: EncodedSamples, info: DataInfo):
    """Pairs (two encoded samples each) or prompts (truncated to the prompt length)."""
    from tunepilot.spec.objective import lengths

    if spec.data.data_format == "preference":
        ds = PairSamples(samples)
        info.num_samples = len(ds)
        info.notes.append(f"{len(ds)} preference pairs: each micro-batch runs its chosen and "
                          "rejected replies (2 x micro_batch_size sequences)")
        if spec.objective.kind == "reward":
            ds = ScoredPairs(ds)
            info.notes.append("a reward model scores whole sequences: every token of chosen "
                              "and rejected counts as trained")
    else:
        p = lengths(spec).prompt
        ds = PromptSamples(enc, p)
        info.truncated_samples = int((enc.lengths() > p).sum())
        info.longest_sample_tokens = int(ds.lengths().max())
        info.notes = [n for n in info.notes if "truncated" not in n]
        if info.truncated_samples:
            info.notes.append(f"{info.truncated_samples} prompts were longer than the prompt "
                              f"length {p} and keep their last {p} tokens")
    if spec.data.packing:
        info.notes.append("packing applies to SFT rows; pairs and prompts are padded")
    return ds, info


def _unpaired(spec: RunSpec, samples: EncodedSamples, info: DataInfo):
    """KTO's rows from preference pairs (unpaired) or prompt-completion rows (all desirable)."""
    pairs = spec.data.data_format == "preference"
    ds = UnpairedRows(samples, pairs, spec.micro_batch_size)
    info.num_samples = len(ds)
    info.notes.append(
        f"{len(ds)} KTO rows: each preference pair unpaired into a desirable (chosen) and an "
        "undesirable (rejected) row, as TRL's unpair_preference_dataset" if pairs else
        f"{len(ds)} KTO rows, all desirable: prompt-completion rows carry no label (TRL's KTO "
        "reads a 'label' column; give preference rows to train undesirable ones)")
    if spec.data.packing:
        info.notes.append("packing applies to SFT rows; KTO rows are padded")
    return ds, info
