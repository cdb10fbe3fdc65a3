"""DCP storage for tunepilot checkpoints: tensors as raw bytes, hashed as they are written.

torch.distributed.checkpoint keeps its planning (which rank writes which chunk, resharding on
load) and its `.metadata`; only the storage layer differs from DCP's FileSystemWriter/Reader:

- write: each tensor chunk is written as its raw bytes (DCP's default wraps every tensor in its own
  torch.save zip), and the SHA-256 of each file is computed from the very buffers written, in the
  writer threads (no second pass over the file); the kernel starts writing each slice to disk
  as soon as it is written (sync_file_range), so the fsync of every file before `finish` finds
  little left to wait for.
- read: each chunk is read straight into the destination tensor when it is a whole, contiguous CPU
  tensor of the stored dtype (no temporary, no copy); otherwise into a temporary that DCP's
  narrowing then copies (resharding, GPU targets).

The load verifies each shard's SHA-256 first (checkpoint/state.py) and only then reads it into
the live tensors, so a damaged checkpoint is refused before the state is touched. A checkpoint written this way says so in
its manifest (`tensor_encoding: raw`); `load` reads that and picks the reader. If this torch lacks
the DCP internals used here, `raw_storage_available()` is False and the stock DCP storage is used.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tunepilot.checkpoint.files import start_writeback

try:  # DCP's storage-layer building blocks (stable since torch 2.2, but not public API)
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    _AVAILABLE = True
except ImportError:  # pragma: no cover - a torch that moved them: fall back to stock DCP storage
    _AVAILABLE = False
    FileSystemReader = FileSystemWriter = object  # type: ignore[misc,assignment]

_FILE_SUFFIX = ".distcp"
_SLICE_BYTES = 4 << 20  # write and hash in 4 MiB slices: the bytes are hashed while still in cache


def raw_storage_available() -> bool:
    return _AVAILABLE


class HashingRawWriter(FileSystemWriter):
    """DCP StorageWriter: raw tensor bytes, SHA-256 per file computed while writing, fsync."""

    def __init__(self, path: Path, thread_count: int = 1):
        super().__init__(path, single_file_per_rank=True, sync_files=True,
                         thread_count=thread_count)
        self.file_digests: dict[str, tuple[str, int]] = {}  # file name -> (sha256 hex, bytes)
        self._lock = threading.Lock()

    def write_data(self, plan, planner):
        prefix = plan.storage_data.prefix
        buckets = _buckets(plan.items, self.thread_count)
        jobs = [(f"{prefix}{i}{_FILE_SUFFIX}", items) for i, items in enumerate(buckets) if items]
        if len(jobs) > 1:
            with ThreadPoolExecutor(len(jobs)) as pool:
                results = [r for rs in pool.map(lambda j: self._write_file(*j, planner), jobs)
                           for r in rs]
        else:
            results = [r for j in jobs for r in self._write_file(*j, planner)]
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items, planner) -> list:
        h = hashlib.sha256()
        results = []
        offset = 0
        with open(Path(self.path) / name, "wb", buffering=0) as f:
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf = memoryview(data.getbuffer())
                else:
                    t = data.detach()
                    if t.device.type != "cpu":
                        t = t.to("cpu")
                    buf = _bytes_view(t.contiguous())
                for start in range(0, len(buf), _SLICE_BYTES):  # hash each slice while cached
                    piece = buf[start:start + _SLICE_BYTES]
                    _write_all(f, piece)
                    h.update(piece)
                    start_writeback(f.fileno(), offset + start, len(piece))
                results.append(WriteResult(index=item.index, size_in_bytes=len(buf),
                                           storage_data=_StorageInfo(name, offset, len(buf))))
                offset += len(buf)
            os.fsync(f.fileno())
        with self._lock:
            self.file_digests[name] = (h.hexdigest(), offset)
        return results


class RawReader(FileSystemReader):
    """DCP StorageReader for HashingRawWriter's files: reads chunks into the destination, from
    the files or from ``staged`` bytes already read (and hashed) by the caller."""

    def __init__(self, path: Path, staged: dict[str, bytes] | None = None,
                 thread_count: int = 1):
        super().__init__(path)
        self._staged = staged or {}
        self.thread_count = max(1, thread_count)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}  # (fqn, chunk offsets) -> (chunk sizes, dtype)
        for fqn, md in metadata.state_dict_metadata.items():
            for chunk in getattr(md, "chunks", None) or []:
                self._chunks[(fqn, tuple(chunk.offsets))] = (tuple(chunk.sizes),
                                                            md.properties.dtype)

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        def read_file(item) -> None:
            rel, reqs = item
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            staged = self._staged.get(rel)
            with (_MemFile(staged) if staged is not None else
                  open(Path(self.path) / rel, "rb", buffering=0)) as f:
                for req in reqs:
                    self._read_one(f, req, planner)

        threads = min(self.thread_count, len(per_file))
        if threads > 1:  # the files in parallel (readinto releases the GIL), as they were written
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read_file, per_file.items()))
        else:
            for item in per_file.items():
                read_file(item)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, f, req, planner) -> None:
        info = self.storage_data[req.storage_index]
        f.seek(info.offset)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(_read_exact(f, info.length)))
            return
        idx = req.storage_index
        sizes, dtype = self._chunks[(idx.fqn, tuple(idx.offset))]
        target = planner.resolve_tensor(req).detach()
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == sizes
        if whole and target.device.type == "cpu" and target.dtype == dtype and \
                target.is_contiguous() and tuple(target.shape) == sizes:
            _readinto_all(f, _bytes_view(target), info.length)
        else:
            tmp = torch.empty(sizes, dtype=dtype)
            _readinto_all(f, _bytes_view(tmp), info.length)
            target.copy_(narrow_tensor_by_index(tmp, req.storage_offsets, req.lengths))
        planner.commit_tensor(req, target)


class _MemFile:
    """A read-only file over bytes already in memory (no copy, unlike io.BytesIO of a
    bytearray)."""

    def __init__(self, data: bytes | bytearray):
        self._view = memoryview(data)
        self._pos = 0

    def __enter__(self) -> _MemFile:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def seek(self, pos: int) -> None:
        self._pos = pos

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self._view) - self._pos)
        buf[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _buckets(items, n: int) -> list[list]:
    """Split write items over n files of similar size (largest tensors first, greedy)."""
    if n <= 1:
        return [list(items)]
    out: list[list] = [[] for _ in range(n)]
    sizes = [0] * n
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((i for i in items if i.type != WriteItemType.BYTE_IO),
                          key=_item_bytes, reverse=True)
    for k, item in enumerate(byte_items):
        out[k % n].append(item)
    for item in tensor_items:
        j = sizes.index(min(sizes))
        out[j].append(item)
        sizes[j] += _item_bytes(item)
    return out


def _item_bytes(item) -> int:
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _write_all(f, buf: memoryview) -> None:
    while buf:
        n = f.write(buf)
        buf = buf[n:]


def _readinto_all(f, buf: memoryview, length: int) -> None:
    """Fill ``buf`` from ``f`` (a file, or the BytesIO of staged bytes)."""
    if len(buf) != length:
        raise ValueError(f"stored chunk is {length} bytes, the tensor needs {len(buf)}")
    got = 0
    while got < length:
        n = f.readinto(buf[got:])
        if not n:
            raise EOFError(f"file ends after {got} of {length} bytes of a chunk")
        got += n


def _read_exact(f, length: int) -> bytes:
    buf = bytearray(length)
    _readinto_all(f, memoryview(buf), length)
    return bytes(buf)
