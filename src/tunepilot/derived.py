"""Figures derived from tunepilot's own files alone - its code and its shipped data - kept
between processes in the user's cache directory: the time model's fit of the published runs,
which every quote needs and which costs ~60 ms of CPU to recompute (`benchmarks/plan_speed.py`
measures the start-up). An entry is keyed by every file of the installed package (its path,
size and modification time) and the caller's own key, so an edit, an upgrade or another
checkout recomputes it; a cache that cannot be read or written costs the time, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CACHE_ENV = "TUNEPILOT_CACHE"
PACKAGE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """$TUNEPILOT_CACHE, else $XDG_CACHE_HOME/tunepilot, else ~/.cache/tunepilot."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tunepilot"


@cache
def package_stamp() -> str:
    """A digest of every file of the package (relative path, size, mtime; bytecode left out)."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            st = os.stat(path)
            h.update(f"{os.path.relpath(path, PACKAGE)}\0{st.st_size}\0{st.st_mtime_ns}\n"
                     .encode())
    return h.hexdigest()


def cached(name: str, key: str, compute: Callable[[], T], dump: Callable[[T], Any],
           load: Callable[[Any], T]) -> T:
    """``load`` of the stored entry for (this package, ``key``), or ``compute()``, stored as
    ``dump``'s JSON for the next process."""
    digest = hashlib.sha256(f"{package_stamp()}\0{key}".encode()).hexdigest()[:32]
    path = cache_dir() / "derived" / f"{name}-{digest}.json"
    try:
        return load(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass  # absent, unreadable or of another shape: recompute
    value = compute()
    try:  # a whole file or none: written aside, then renamed over (processes may race)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dump(value), f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full disk: the next process computes it again
    return value
