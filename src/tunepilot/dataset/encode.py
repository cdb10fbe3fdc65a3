"""Tokenizing the whole dataset once: rows -> text + trained character spans (formats.py) ->
token ids and a per-token "trained" mask, in flat numpy arrays, cached by content hash.

The text of a row is tokenized whole (``add_special_tokens=False``: a chat template writes its
own BOS/EOS), with the fast tokenizer's character offsets; a token is trained when its first
character lies in a trained span. The cache key covers the data's bytes, the tokenizer's files
and every data field that changes the tokens, so an edit to any of them re-tokenizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tunepilot.dataset.formats import Formatter, RowError
from tunepilot.dataset.sources import DataFiles, read_rows
from tunepilot.dataset.templates import resolve_template
from tunepilot.derived import cache_dir
from tunepilot.errors import UserError
from tunepilot.spec import DataSpec

CACHE_VERSION = 1
CHUNK_ROWS = 2048  # rows tokenized per batch call (bounded memory, progress every chunk)


@dataclass
class Encoded:
    """Every sample's token ids (untruncated) and which of them are trained."""

    ids: np.ndarray  # (total tokens,) int32
    trained: np.ndarray  # (total tokens,) bool: the label is kept (before the next-token shift)
    offsets: np.ndarray  # (samples + 1,) int64: sample i is ids[offsets[i]:offsets[i+1]]
    row_numbers: np.ndarray  # (samples,) int64: the 1-based source row of each sample
    skipped: int = 0
    template: str | None = None
    template_note: str | None = None  # said when a default template was chosen
    cached: bool = False

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def supervised(self, sequence_length: int) -> np.ndarray:
        """Trained tokens per sample once truncated to ``sequence_length``, counted as the loss
        counts them: positions 1.. (the first token has no prediction)."""
        cs = np.concatenate([[0], np.cumsum(self.trained, dtype=np.int64)])
        start = self.offsets[:-1]
        end = start + np.minimum(self.lengths(), sequence_length)
        return np.maximum(cs[end] - cs[np.minimum(start + 1, end)], 0)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError("data.tokenizer", f"cannot load a tokenizer from {str(path)!r}: "
                        f"{str(exc).splitlines()[0][:200]}",
                        "It must be a local tokenizer directory.") from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise UserError("data.tokenizer", f"{str(path)!r} is a slow (Python) tokenizer.",
                        "Give a directory with tokenizer.json (a fast tokenizer).")
    return tok


def encode(files: DataFiles, data: DataSpec, tok, *, base_dir: Path | None = None,
           progress: Callable[[int, int], None] | None = None) -> Encoded:
    """The dataset tokenized (from the cache when this data and tokenizer were seen before)."""
    template, note = (resolve_template(data.chat_template, tok, base_dir)
                      if data.data_format != "text" and not _plain(data) else (None, None))
    key = _cache_key(files, data, template.name if template else None)
    path = cache_dir() / "data" / f"{key}.npz"
    out = _load(path)
    if out is None:
        fmt = Formatter(data, template, tok.eos_token or "")
        out = _tokenize(read_rows(files, data, fmt.columns), fmt, tok, files, data, progress)
        out.template = template.name if template else None
        _store(path, out)
    out.template_note = note
    return out


def _plain(data: DataSpec) -> bool:
    """Plain prompt-completion rows need no template; preference and prompt rows may hold
    messages, so theirs is resolved (and used only for rows that do)."""
    return data.data_format == "prompt-completion" and data.chat_template is None


def _tokenize(rows, fmt: Formatter, tok, files: DataFiles, data: DataSpec,
              progress) -> Encoded:
    backend = tok.backend_tokenizer
    ids, trained, lengths, numbers = [], [], [], []
    skipped = rows.skipped
    total = len(rows.rows)
    if total == 0 and not skipped:
        raise UserError("data.path", f"{files.name} holds no samples.", "Add training samples.")
    for start in range(0, total, CHUNK_ROWS):
        texts, spans = [], []
        for number, row in rows.rows[start:start + CHUNK_ROWS]:
            try:
                parts = fmt.samples(row)
            except RowError as exc:
                if not data.skip_bad_rows:
                    raise UserError(f"data.{_field_key(fmt, exc.field)}",
                                    f"{files.name} row {number}: {exc.field} {exc.problem}.",
                                    "Fix the row, or set data.skip_bad_rows: true to skip "
                                    "(and count) rows that cannot be used.") from None
                skipped += 1
                continue
            if not all(text for text, _ in parts):
                skipped += 1
                continue
            bad = next((t for t, _ in parts if not _is_unicode(t)), None)
            if bad is not None:  # a lone surrogate ("\ud800" in the JSON): not text
                if not data.skip_bad_rows:
                    raise UserError("data.path", f"{files.name} row {number} holds a lone "
                                    "surrogate (an escape such as \\ud800 with no pair): it "
                                    "is not Unicode text and cannot be tokenized.",
                                    "Fix the row, or set data.skip_bad_rows: true to skip "
                                    "(and count) rows that cannot be used.")
                skipped += 1
                continue
            for text, sp in parts:  # a preference row: chosen, then rejected
                texts.append(text)
                spans.append(sp)
                numbers.append(number)
        whole = all(len(sp) == 1 and sp[0] == (0, len(t))
                    for t, sp in zip(texts, spans, strict=True))
        encs = backend.encode_batch(texts, add_special_tokens=False)
        for sp, enc in zip(spans, encs, strict=True):
            a = np.asarray(enc.ids, dtype=np.int32)
            ids.append(a)
            lengths.append(len(a))
            trained.append(np.ones(len(a), bool) if whole else _mask(enc.offsets, sp, len(a)))
        if progress:
            progress(min(start + CHUNK_ROWS, total), total)
    group = fmt.samples_per_row  # a row's samples are kept or dropped together
    keep = [i for i in range(0, len(lengths), group)
            if all(lengths[i + j] for j in range(group))]
    skipped += (len(lengths) - len(keep) * group) // group
    keep = [i + j for i in keep for j in range(group)]
    if not keep:
        raise UserError("data.path", f"every row of {files.name} tokenizes to nothing or could not be used.",
                        f"Check data.format ({data.data_format!r}) and the field names "
                        f"({', '.join(fmt.columns)}).")
    offsets = np.zeros(len(keep) + 1, np.int64)
    offsets[1:] = np.cumsum([lengths[i] for i in keep])
    return Encoded(np.concatenate([ids[i] for i in keep]),
                   np.concatenate([trained[i] for i in keep]), offsets,
                   np.asarray([numbers[i] for i in keep], np.int64), skipped)


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text a tokenizer takes: JSON can spell a lone surrogate
    (\\ud800), which Python keeps and UTF-8 (and the Rust tokenizers) cannot encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mask(offsets, spans, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, bool)
    starts = np.asarray(offsets, dtype=np.int64).reshape(n, 2)[:, 0]
    mask = np.zeros(n, bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return mask


def _field_key(fmt: Formatter, field: str) -> str:
    """The spec key that names a row's field (data.messages_field for messages[2].role)."""
    base = field.split("[")[0].split(".")[0]
    d = fmt.data
    for key in ("text_field", "prompt_field", "completion_field", "messages_field",
                "chosen_field", "rejected_field"):
        if getattr(d, key) == base:
            return key
    return "path"


def _cache_key(files: DataFiles, data: DataSpec, template: str | None) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, "content": files.content_sha256,
                         "data": data.model_dump(mode="json", exclude={"shuffle", "num_workers",
                                                                       "packing"}),
                         "template": template}, sort_keys=True).encode())
    for f in sorted(files.tokenizer.glob("*")) if files.tokenizer.is_dir() else []:
        if f.is_file() and f.stat().st_size < 64 << 20:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    if data.chat_template and Path(data.chat_template).is_file():
        h.update(Path(data.chat_template).read_bytes())
    return h.hexdigest()[:32]


def _load(path: Path) -> Encoded | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return Encoded(z["ids"], z["trained"], z["offsets"], z["rows"],
                           int(meta["skipped"]), meta["template"], cached=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None  # no cache entry, or a damaged one: tokenize again


def _store(path: Path, e: Encoded) -> None:
    """Best effort: a cache that cannot be written only costs the next run the tokenizing."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, ids=e.ids, trained=e.trained, offsets=e.offsets, rows=e.row_numbers,
                     meta=np.asarray(json.dumps({"skipped": e.skipped, "template": e.template})))
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
