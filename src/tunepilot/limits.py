"""Bounds on what tunepilot reads from a file or a flag it did not write itself: how many
accelerators a count may name, how large and how deeply nested a small file may be, and a reader
that only ever reads a regular file (a FIFO, a device or /dev/zero behind a symlink is refused
at once instead of blocking or filling memory).

One bound per kind of count, used by everything that reads one:
    MAX_CARDS   accelerators in one quote, booking, launch or checkpoint's world (ranks)
    MAX_DEPTH   nesting of a spec, a trainer's config, a DeepSpeed config, a JSON result
No heavy imports here.
"""

from __future__ import annotations

import json
import os
import stat
from decimal import Decimal
from pathlib import Path
from typing import Any

# The largest single training jobs published run on tens of thousands of accelerators (Meta's
# Llama 3 405B: 16,384 H100s; clusters of about 100,000 GPUs were built in 2024). 2^17 = 131,072
# is past all of them: a larger count is a typo or a forged file, and would make a loop over
# ranks (or a price) absurd.
MAX_CARDS = 1 << 17
MAX_DEPTH = 64  # a spec, a trainer's config or a DeepSpeed config nests a handful of levels
MAX_SMALL_FILE_BYTES = 64 << 20  # a manifest, a JSON component or a stage result
# A card's facts as a catalog file states them: far past any accelerator sold (the largest have
# ~288 GB of HBM, ~10 PFLOP/s dense FP8); past them a number is a typo and would overflow the
# arithmetic built on it. A price past MAX_USD a card-hour (or an option's unit) likewise.
MAX_MEMORY_GB = 1e6
MAX_TFLOPS = 1e6
MAX_TERM_HOURS = 10 * 365 * 24
MAX_USD = Decimal(10**6)


class Refused(ValueError):
    """A file that is not a regular file, or is larger than the reader allows (the message
    says which, without the path: callers name the file their own way)."""


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def file_kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_capped(path: str | Path, limit_bytes: int = MAX_SMALL_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit_bytes`` of them. Opened without
    blocking (a FIFO with no writer returns at once) and checked with fstat on the very file
    opened; Refused for anything else, OSError (FileNotFoundError, ...) as the system says."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit_bytes:
            raise Refused(f"is {st.st_size:,} bytes, more than the {limit_bytes:,} this file "
                          "can be")
        chunks, got = [], 0
        while got <= limit_bytes:
            chunk = os.read(fd, min(1 << 20, limit_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit_bytes:  # it grew while being read
            raise Refused(f"is more than the {limit_bytes:,} bytes this file can be")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_head(path: str | Path, limit_bytes: int) -> bytes:
    """The first ``limit_bytes`` of the regular file ``path`` (a peek at a dataset's first row);
    Refused for anything but a regular file, without blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"is {file_kind(st.st_mode)}, not a regular file")
        return os.read(fd, limit_bytes)
    finally:
        os.close(fd)


def depth_exceeds(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON/YAML) nests lists/mappings more than ``limit`` deep;
    iterative, so a hostile document cannot exhaust the stack here."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return False


def load_json_capped(path: str | Path, limit_bytes: int = MAX_SMALL_FILE_BYTES,
                     max_depth: int = MAX_DEPTH) -> Any:
    """A small JSON file, read with read_capped: Refused for a file too large, not regular,
    nested more than ``max_depth`` deep, or not JSON (the reason in the message)."""
    data = read_capped(path, limit_bytes)
    try:
        value = json.loads(data)
    except RecursionError:
        raise Refused(f"is nested more than {max_depth} levels deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(f"is not valid JSON ({str(exc)[:120]})") from None
    if depth_exceeds(value, max_depth):
        raise Refused(f"is nested more than {max_depth} levels deep")
    return value


def check_cards(count: object, field: str = "count") -> int:
    """A count of accelerators from a flag or a file: a whole number from 1 to MAX_CARDS, or
    a UserError naming ``field``."""
    from tunepilot.errors import UserError

    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CARDS:
        raise UserError(field, f"must be a whole number of cards from 1 to {MAX_CARDS:,}, got "
                        f"{str(count)[:40]}.", "E.g. --count 1 or --count 8; more cards than "
                        "any cluster has built is a typo.")
    return count
