"""The whole dataset's length profile (`tunepilot data SPEC` -> data.json): how many samples and
tokens, how many of them are trained, the length distribution, what truncation cuts, and what
padding wastes at the spec's micro-batch - padded and packed - over one epoch in the order the
loader draws it (the sampler's own permutation for epoch 0).

Counts are **measured** (counted on the data), not estimated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tunepilot.errors import UserError
from tunepilot.results.data import Batching, Bin, DataProfile, Lengths
from tunepilot.results.figure import Figure
from tunepilot.spec import RunSpec

HISTOGRAM_BINS = 20


def profile_dataset(spec: RunSpec, vocab_size: int, base_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None) -> DataProfile:
    """Tokenize (or read from the cache) the spec's dataset and profile it."""
    from tunepilot.dataset.samples import EncodedSamples, build_dataset, pack

    t0 = time.perf_counter()
    unpacked = spec.with_changes(data=spec.data.model_copy(update={"packing": False}))
    samples, info = build_dataset(unpacked, vocab_size, base_dir, progress)
    S, mb, ga = spec.sequence_length, spec.micro_batch_size, spec.gradient_accumulation_steps
    shape = _objective_shape(spec, samples)
    if shape is not None:
        full, sup, cached, trunc, shape_note, total = shape
    elif isinstance(samples, EncodedSamples):
        enc = samples.encoded
        full, sup, cached = enc.lengths(), enc.supervised(S), enc.cached
    else:  # synthetic: every sample is sequence_length long and fully trained
        n = len(samples)
        full, sup, cached = np.full(n, S), np.full(n, S - 1), False
    if shape is None:
        trunc = np.minimum(full, S)
    if not spec.objective.generative and len(sup) and int(sup.sum()) == 0:
        cut = int((full > S).sum())
        why = (f"{cut:,} of them are longer than it, and what is cut off is the part the loss "
               "would train (the completions)" if cut else "every sample is too short to train "
               "a token (a sample of n tokens trains its n - 1 next tokens)")
        raise UserError("data", f"no token of the dataset's {len(full):,} samples is trained "
                        f"within sequence_length {S} (train_on {spec.data.supervise}): {why}. "
                        "A run of it learns nothing, and its cost per useful token is infinite.",
                        "Raise sequence_length, shorten the prompts, or set data.train_on: all."
                        if cut else "Check data.format and the field names.")
    rows = pack(trunc, S)
    row_len = np.asarray([trunc[r].sum() for r in rows], np.int64)
    row_sup = np.asarray([sup[r].sum() for r in rows], np.int64)
    what = "counted over the whole dataset"
    padded = _batching(trunc, sup, spec, "samples, each micro-batch padded to its longest",
                       *_rows(spec))
    out = DataProfile(
        spec_hash=spec.spec_hash(), source=info.source, path=info.path,
        format=spec.data.data_format, tokenizer=info.tokenizer, chat_template=info.chat_template,
        train_on=spec.data.supervise, sequence_length=S, micro_batch_size=mb,
        gradient_accumulation_steps=ga, world_size=spec.parallel.world_size,
        samples=len(full), skipped_rows=info.skipped_rows,
        tokens_total=Figure.measured(int(full.sum()), "tokens",
                                     f"{what}, after the chat template, before truncation"),
        tokens_supervised=Figure.measured(int(sup.sum()), "tokens",
                                          f"{what}: trained tokens (labels != -100) within "
                                          f"sequence_length {S}, as the loss counts them"),
        length=_lengths(full), truncated_samples=int((full > trunc).sum()),
        padded=padded,
        packed=padded if shape is not None else _batching(  # pairs and prompts do not pack
            row_len, row_sup, spec, f"rows of <= {S} tokens packed best-fit decreasing, each "
            "micro-batch padded to its longest row"),
        packing=spec.data.packing, content_sha256=info.content_sha256, cached=cached,
        seconds=Figure.measured(time.perf_counter() - t0, "s",
                                "reading from the cache" if cached else "tokenizing"),
        notes=list(info.notes))
    if shape is not None:
        out.notes.append(shape_note)
        out.tokens_total = Figure.measured(total, "tokens", f"{what}, after the chat template, "
                                           "before truncation (both replies of each pair)")
        if spec.objective.generative:
            out.tokens_supervised = Figure.projected(
                int(sup.sum()), "tokens", f"{spec.objective.generations} completions of "
                f"{_completion(spec):,} tokens per prompt (at full length: generated, not in "
                "the data)")
    lost = int(full.sum() - trunc.sum())
    if lost:
        out.notes.append(f"truncation at sequence_length {S} drops {lost:,} tokens of "
                         f"{out.truncated_samples:,} samples")
    return out


def _lengths(full: np.ndarray) -> Lengths:
    top = int(full.max())
    width = _nice(max(1, math.ceil(top / HISTOGRAM_BINS)))
    counts = np.bincount(full // width, minlength=top // width + 1)
    hist = [Bin(lo=int(i * width), hi=int((i + 1) * width), count=int(c))
            for i, c in enumerate(counts)]
    p50, p90, p99 = (int(np.percentile(full, q, method="higher")) for q in (50, 90, 99))
    return Lengths(p50=p50, p90=p90, p99=p99, max=top, mean=float(full.mean()), histogram=hist)


def _nice(x: int) -> int:
    """The smallest 1, 2 or 5 x 10^k not below x (bin widths a person can read)."""
    k = 10 ** int(math.floor(math.log10(x)))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= x)


def _completion(spec: RunSpec) -> int:
    from tunepilot.spec.objective import lengths

    return lengths(spec).completion


def _rows(spec: RunSpec) -> tuple[int, int, int]:
    """(items per micro-batch, policy rows per item, positions added per row): a pair is two
    rows; a prompt num_generations rows of prompt + completion, prompts_per_generation prompts
    per batch."""
    o, b = spec.objective, spec.batch
    items = b.loader_batch(b.own)
    if o.generative:
        return items, o.generations, _completion(spec)
    return items, b.sequences_per_sample, 0


def _objective_shape(spec: RunSpec, samples):
    """(lengths, supervised, cached, truncated lengths, note, tokens) of pairs and prompts: a pair is as
    long as its longer reply and trains both replies' completions; a prompt is cut at the
    prompt length and trains its generated completions. None for SFT samples."""
    from tunepilot.dataset.samples import PairSamples, PromptSamples

    S = spec.sequence_length
    if isinstance(samples, PairSamples):
        enc = samples.samples.encoded
        n, sup = enc.lengths(), enc.supervised(S)
        full = np.maximum(n[0::2], n[1::2])
        return (full, sup[0::2] + sup[1::2], enc.cached, np.minimum(full, S),
                f"{len(full):,} pairs: lengths are the longer reply's; each micro-batch runs "
                "2 x micro_batch_size sequences; trained tokens are both replies' completions",
                int(n.sum()))
    if isinstance(samples, PromptSamples):
        enc, o = samples.encoded, spec.objective
        full = enc.lengths()
        sup = np.full(len(full), o.generations * _completion(spec), np.int64)
        return (full, sup, enc.cached, np.minimum(full, samples.prompt_length),
                f"{len(full):,} prompts (lengths are the prompts'); each generates "
                f"{o.generations} completions of up to {_completion(spec):,} tokens",
                int(full.sum()))
    return None


def _batching(lengths: np.ndarray, supervised: np.ndarray, spec: RunSpec, how: str,
              mb: int | None = None, rows_per_item: int = 1, extra_per_row: int = 0
              ) -> Batching:
    """One epoch of micro-batches in the loader's order (the sampler's permutation of epoch 0,
    drop_last): positions, padding and supervised tokens (``rows_per_item`` policy rows per
    item - 2 for a pair, num_generations for a prompt - each ``extra_per_row`` longer: the
    generated completion); optimizer steps by the one epoch rule (spec/batch.py)."""
    import torch

    n, mb = len(lengths), mb or spec.micro_batch_size
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed)).numpy()
             if spec.data.shuffle else np.arange(n))
    nb = n // mb
    idx = order[: nb * mb].reshape(nb, mb)
    positions = int(((lengths[idx].max(axis=1) + extra_per_row) * mb * rows_per_item).sum()) \
        if nb else 0
    real = int((lengths[idx] + extra_per_row).sum()) * rows_per_item
    useful = int(supervised[idx].sum())
    return Batching(
        padding_fraction=Figure.measured(1 - real / positions if positions else None, "fraction",
                                         f"padded positions / all positions; {how}"),
        useful_fraction=Figure.measured(useful / positions if positions else None, "fraction",
                                        f"trained tokens / all positions; {how}"),
        items=n, positions=positions, steps_per_epoch=spec.batch.steps_per_epoch(n))
