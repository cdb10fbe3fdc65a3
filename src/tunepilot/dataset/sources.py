"""Where a dataset's rows come from: a JSONL file, a Parquet file, an Arrow file, or a
``datasets.save_to_disk`` directory (read with pyarrow, offline; ``datasets`` is not needed).

``locate`` finds the files and hashes their bytes (the cache key and the provenance) without
parsing them; ``read_rows`` parses them into (row number, row) pairs. Row numbers are 1-based:
JSONL line numbers, else the row's index + 1 - what an error message names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.resources import (
    TINY_CHAT,
    TINY_CHAT_TOKENIZER,
    TINY_PREFERENCE,
    TINY_PROMPTS,
    TINY_TEXT,
    TINY_TOKENIZER,
)
from tunepilot.spec import DataSpec

_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataFiles:
    """The files of one dataset and the SHA-256 of their bytes (in order)."""

    source: str
    path: Path
    files: tuple[Path, ...]
    size_bytes: int
    content_sha256: str
    tokenizer: Path

    @property
    def name(self) -> str:
        return self.path.name


def resolve(p: str | None, base_dir: Path | None) -> Path:
    """A spec path: as given when it exists, else relative to the spec's directory."""
    path = Path(p or "")
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return path


def locate(data: DataSpec, base_dir: Path | None = None) -> DataFiles:
    """The dataset's files (checked to exist) and their content hash."""
    if data.source == "tiny-text":
        path, tok = TINY_TEXT, TINY_TOKENIZER
    elif data.source == "tiny-chat":
        path, tok = TINY_CHAT, TINY_CHAT_TOKENIZER
    elif data.source in ("tiny-preference", "tiny-prompts"):
        path = TINY_PREFERENCE if data.source == "tiny-preference" else TINY_PROMPTS
        tok = TINY_CHAT_TOKENIZER
    else:
        path, tok = resolve(data.path, base_dir), resolve(data.tokenizer, base_dir)
    if not path.exists():
        raise UserError("data.path", f"dataset {str(path)!r} does not exist.",
                        _WHAT.get(data.source, "Give the path of a local dataset."))
    if not tok.exists():
        raise UserError("data.tokenizer", f"tokenizer {str(tok)!r} does not exist.",
                        "Give a local Hugging Face tokenizer directory (tokenizer.json).")
    files = _files(data, path)
    h = hashlib.sha256()
    size = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise UserError("data.path", f"cannot read {str(f)!r}: {exc.strerror or exc}.",
                            "Check the path and its permissions.") from None
    return DataFiles(data.source, path, tuple(files), size, h.hexdigest(), tok)


_WHAT = {
    "jsonl": "Give the path of a local .jsonl file (one JSON object per line) or a .json "
             "file holding one array of objects.",
    "parquet": "Give the path of a local .parquet file.",
    "arrow": "Give the path of a local .arrow file (Arrow IPC stream or file).",
    "hf-disk": "Give a directory written by datasets' save_to_disk (it holds state.json).",
}


def _files(data: DataSpec, path: Path) -> list[Path]:
    if data.source != "hf-disk":
        if path.is_dir():
            raise UserError("data.path", f"{str(path)!r} is a directory, not a "
                            f"{data.source} file.", "Use source: hf-disk for a save_to_disk "
                            "directory, or give the file's path.")
        _regular(path)
        return [path]
    if not path.is_dir():
        raise UserError("data.path", f"{str(path)!r} is not a directory.", _WHAT["hf-disk"])
    if (path / "dataset_dict.json").exists():  # a DatasetDict: one directory per split
        splits = _json(path / "dataset_dict.json").get("splits", [])
        if data.split not in splits:
            raise UserError("data.split", f"{path.name} has splits {splits}, not "
                            f"{data.split!r}.", "Set data.split to one of them.")
        path = path / data.split
    state = path / "state.json"
    if not state.exists():
        raise UserError("data.path", f"{str(path)!r} has no state.json: it is not a "
                        "save_to_disk directory.", _WHAT["hf-disk"])
    names = [f.get("filename") for f in _json(state).get("_data_files", [])
             if isinstance(f, dict)]
    files = [path / n for n in names if isinstance(n, str) and "/" not in n and ".." not in n]
    if not files or not all(f.is_file() for f in files):
        raise UserError("data.path", f"{state} lists data files that are missing.",
                        "Save the dataset again with save_to_disk.")
    return files


def _regular(path: Path) -> None:
    """A dataset file must be a regular file: a FIFO would block the read and /dev/zero never
    end it (both refused at once, naming the path)."""
    import stat

    from tunepilot.limits import file_kind

    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UserError("data.path", f"{str(path)!r} is {file_kind(mode)}, not a regular file.",
                        "Give the path of the dataset file itself.")


def _json(path: Path) -> dict:
    from tunepilot.limits import Refused, load_json_capped

    try:
        data = load_json_capped(path)
    except (OSError, Refused) as exc:
        raise UserError("data.path", f"{str(path)!r} is not readable JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise UserError("data.path", f"{str(path)!r} is not a JSON object.")
    return data


@dataclass
class Rows:
    """Parsed rows: (1-based row number, row) in file order, and the rows skipped."""

    rows: list[tuple[int, object]]
    skipped: int = 0
    skipped_examples: list[str] | None = None


def read_rows(files: DataFiles, data: DataSpec, columns: list[str]) -> Rows:
    """Every row (the first max_samples), with the columns the format needs."""
    if files.source in ("jsonl", "tiny-text", "tiny-chat", "tiny-preference", "tiny-prompts"):
        return _jsonl(files, data)
    table = _table(files, data, columns)
    limit = data.max_samples or table.num_rows
    values = {c: table.column(c).to_pylist()[:limit] for c in columns if c in
              table.column_names}
    n = min(limit, table.num_rows)
    return Rows([(i + 1, {c: v[i] for c, v in values.items()}) for i in range(n)])


def _json_array(files: DataFiles, data: DataSpec) -> Rows | None:
    """A .json file holding one array of rows (LLaMA-Factory's and Alpaca's layout)."""
    with open(files.path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if not head.startswith(b"["):
        return None
    try:
        items = json.loads(files.path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError("data.path", f"{files.name} is not valid JSON "
                        f"({getattr(exc, 'msg', exc)}).", "Fix the file, or write it as JSON "
                        "Lines (one object per line).") from None
    if not isinstance(items, list):
        return None
    items = items[: data.max_samples] if data.max_samples else items
    return Rows([(i + 1, row) for i, row in enumerate(items)])


def _jsonl(files: DataFiles, data: DataSpec) -> Rows:
    array = _json_array(files, data)
    if array is not None:
        return array
    out = Rows([], 0, [])
    limit = data.max_samples
    with open(files.path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if limit is not None and len(out.rows) >= limit:
                break
            line = raw.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
                problem = None if isinstance(row, dict) else "is not a JSON object"
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                row, problem = None, f"is not JSON ({getattr(exc, 'msg', exc)})"
            if problem is None:
                out.rows.append((n, row))
            elif data.skip_bad_rows:
                out.skipped += 1
                out.skipped_examples.append(f"line {n} {problem}")
            else:
                raise UserError("data.path", f"{files.name} line {n} {problem}.",
                                "Fix the line, or set data.skip_bad_rows: true to skip (and "
                                "count) rows that cannot be used.")
    return out


def _table(files: DataFiles, data: DataSpec, columns: list[str]):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("data.source", f"source {files.source!r} needs pyarrow, which is not "
                        "installed.", "pip install 'tunepilot[data]' (or pyarrow).") from None
    tables = []
    for f in files.files:
        try:
            if files.source == "parquet":
                have = pq.read_schema(f).names
                tables.append(pq.read_table(f, columns=[c for c in columns if c in have]))
            else:
                tables.append(_arrow(pa, f))
        except (pa.ArrowException, OSError, ValueError) as exc:
            kind = "Parquet" if files.source == "parquet" else "Arrow"
            raise UserError("data.path", f"{f.name} is not a readable {kind} file: "
                            f"{str(exc).splitlines()[0][:200]}.",
                            "Write it again (it may be truncated or of another format).") from None
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _arrow(pa, path: Path):
    """An Arrow IPC file: the stream format (what datasets writes), else the file format."""
    import pyarrow.ipc as ipc

    buf = pa.py_buffer(path.read_bytes())
    try:
        return ipc.open_stream(buf).read_all()
    except pa.ArrowInvalid:
        return ipc.open_file(buf).read_all()
