"""Durable files for checkpoints: SHA-256 of files, fsync, and replacing a directory atomically.

No torch here (tunepilot.export and verify_checkpoint use it without importing torch).

A checkpoint directory is written as `.NAME.tmp-PID-XXXX` beside its final path, fsynced, then
swapped into place: with Linux's renameat2(RENAME_EXCHANGE) in one atomic step; elsewhere the old
directory is first renamed to `.NAME.old-PID-XXXX`, and `recover_interrupted_swap` puts it back if
the process died before the new one arrived. `remove_stale_temporaries` removes what a killed
save left behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # hashlib releases the GIL on large buffers
_HASH_CHUNK_BYTES = 8 << 20  # read size when hashing (8 MiB: large enough to run at memory speed)
_MANIFEST = "manifest.json"  # a directory holding one is complete (checkpoint.manifest)


def temporary_beside(path: Path) -> Path:
    """A fresh, unique temporary directory name next to `path` (same filesystem: rename works)."""
    return path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def hash_files(root: Path, rels: list[str]) -> dict[str, tuple[str, int]]:
    """{relative path: (sha256 hex, bytes)}, files hashed in parallel threads."""
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_file(root / r), rels), strict=True))


def sha256_file(p: Path) -> tuple[str, int]:
    """(hex digest, bytes) of a file, read in large chunks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buf)
    n = 0
    with open(p, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return h.hexdigest(), n


def swap_into_place(tmp: Path, path: Path) -> None:
    """Make `tmp` become `path` in one step; any previous checkpoint there is removed after."""
    if not path.exists():
        os.rename(tmp, path)
        fsync_dir(path.parent)
        return
    if _rename_exchange(tmp, path):  # now `tmp` holds the old checkpoint
        fsync_dir(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # No atomic exchange here: move the old one aside first; recover_interrupted_swap() undoes a crash between
    # the two renames (the old one is put back if the new one never arrived).
    old = path.parent / f".{path.name}{OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _rename_exchange(a: Path, b: Path) -> bool:
    """renameat2(RENAME_EXCHANGE): swap two paths atomically (Linux >= 3.15). False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def recover_interrupted_swap(path: Path) -> None:
    """Undo a save that died between moving the old checkpoint aside and renaming the new one in."""
    if path.exists() or not path.parent.is_dir():
        return
    olds = sorted(path.parent.glob(f".{path.name}{OLD_MARK}*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(olds):
        if (old / _MANIFEST).is_file():
            os.rename(old, path)
            fsync_dir(path.parent)
            return


def remove_stale_temporaries(path: Path) -> None:
    """Remove temporary directories left by saves whose process is gone (killed mid-write)."""
    for p in path.parent.glob(f".{path.name}{TMP_MARK}*"):
        pid = p.name[len(f".{path.name}{TMP_MARK}"):].split("-")[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    from tunepilot.proc.spawn import pid_alive

    if pid == os.getpid():
        return False  # our own leftovers are from an earlier, failed save
    return pid_alive(pid)


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes to disk now (Linux sync_file_range), so the
    fsync at the end of a file finds little left to do while the next slices are still being
    written and hashed. A no-op where the call does not exist; durability still comes from
    fsync."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def write_synced(p: Path, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
