"""Verifying a checkpoint on disk: the manifest, every file's size and SHA-256, every component
present (per rank for sharded checkpoints) - each problem named by file, component and rank.

``read_verified`` is the fast path of a load: it reads the files into memory in parallel
threads, hashing the very bytes it read, so a load verifies while it reads and refuses before
anything of the state is touched. No torch here.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tunepilot.checkpoint import manifest as mf
from tunepilot.checkpoint.components import PER_RANK, REQUIRED, per_rank_file
from tunepilot.checkpoint.files import HASH_THREADS, recover_interrupted_swap, sha256_file

_READ_CHUNK = 8 << 20


@dataclass
class CheckpointProblem:
    """One thing wrong with a checkpoint on disk."""

    component: str
    file: str | None
    problem: str
    rank: int | None = None

    def __str__(self) -> str:
        where = f"{self.file} ({self.component}" if self.file else f"({self.component}"
        where += f", rank {self.rank})" if self.rank is not None else ")"
        return f"{where}: {self.problem}"

    def to_dict(self) -> dict:
        return asdict(self)


def manifest_or_problem(path: Path) -> tuple[mf.CheckpointManifest | None,
                                             list[CheckpointProblem]]:
    if not path.is_dir():
        return None, [CheckpointProblem("manifest", None, f"no checkpoint directory at {path}")]
    manifest, problem = mf.read(path)
    if problem is not None:
        return None, [CheckpointProblem("manifest", problem[0], problem[1])]
    return manifest, []


_RANKS_NAMED = 8  # missing per-rank files named one by one; the rest counted


def missing_components(manifest: mf.CheckpointManifest) -> list[CheckpointProblem]:
    """Required components absent from the manifest (per-rank ones for every rank: the first
    few named, the rest counted - world_size is bounded, the list of problems too)."""
    out = [CheckpointProblem(c, None, "component missing from the checkpoint")
           for c in REQUIRED if c not in PER_RANK and not manifest.components.get(c)]
    for c in PER_RANK:
        missing = [r for r in range(manifest.world_size)
                   if per_rank_file(c, r) not in manifest.files]
        out += [CheckpointProblem(c, per_rank_file(c, r), "is not in the manifest", r)
                for r in missing[:_RANKS_NAMED]]
        if len(missing) > _RANKS_NAMED:
            out.append(CheckpointProblem(c, None, f"and {len(missing) - _RANKS_NAMED:,} more "
                                         f"ranks' files are not in the manifest (world_size "
                                         f"{manifest.world_size:,})"))
    return out


def _check_one(path: Path, rel: str, entry: mf.FileEntry) -> CheckpointProblem | None:
    import stat

    from tunepilot.limits import file_kind

    p = path / rel
    try:
        st = p.stat()
    except OSError:
        return CheckpointProblem(entry.component, rel, "file is missing", entry.rank)
    if not stat.S_ISREG(st.st_mode):
        return CheckpointProblem(entry.component, rel, f"is {file_kind(st.st_mode)}, not a "
                                 "regular file", entry.rank)
    size = st.st_size
    if size != entry.bytes:
        return CheckpointProblem(entry.component, rel, f"is {size:,} bytes, the manifest says "
                                 f"{entry.bytes:,} (truncated or rewritten)", entry.rank)
    sha = sha256_file(p)[0]
    if sha != entry.sha256:
        return _altered(rel, entry, sha)
    return None


def _altered(rel: str, entry: mf.FileEntry, sha: str) -> CheckpointProblem:
    return CheckpointProblem(entry.component, rel, f"sha256 {sha[:12]}... does not match the "
                             f"manifest's {entry.sha256[:12]}... (altered on disk)", entry.rank)


def check_files(path: Path, manifest: mf.CheckpointManifest, rels: list[str] | None = None
                ) -> list[CheckpointProblem]:
    """Size and SHA-256 of the files ``rels`` (default all), hashed in parallel threads."""
    files = manifest.files
    rels = list(files) if rels is None else rels
    order = sorted(rels, key=lambda r: -files[r].bytes)  # largest first: threads end together
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        found = list(pool.map(lambda r: _check_one(path, r, files[r]), order))
    bad = {p.file: p for p in found if p is not None}
    return [bad[rel] for rel in sorted(rels) if rel in bad]  # a stable order


def verify_checkpoint(path: Path) -> list[CheckpointProblem]:
    """Every problem with the checkpoint on disk (missing, truncated or altered files, a damaged
    manifest, a missing component); an empty list means it is intact."""
    path = Path(path)
    recover_interrupted_swap(path)
    manifest, problems = manifest_or_problem(path)
    if manifest is None:
        return problems
    return missing_components(manifest) + check_files(path, manifest)


def check_checkpoint(path: Path) -> tuple[mf.CheckpointManifest | None,
                                           list[CheckpointProblem]]:
    """Everything `verify` checks short of loading the state in a fresh process - the
    manifest, every file's size and SHA-256, every component present, nothing added, and the
    JSON components' shapes against the manifest (progress, scheduler) - the one check `verify`
    and `export` share, so export refuses whatever verify rejects. No torch."""
    path = Path(path)
    manifest, problems = manifest_or_problem(path)
    if manifest is None:
        return None, problems
    problems = missing_components(manifest) + check_files(path, manifest)
    return manifest, problems + unlisted(path, manifest) + json_components(path, manifest)


def unlisted(p: Path, manifest: mf.CheckpointManifest) -> list[CheckpointProblem]:
    """Files the manifest does not list (added after the save: not verified, not loaded)."""
    dirs = {rel.split("/", 1)[0]: e.component for rel, e in manifest.files.items() if "/" in rel}
    out = []
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p).as_posix()
        if rel == mf.MANIFEST or rel in manifest.files or f.is_dir():
            continue
        out.append(CheckpointProblem(dirs.get(rel.split("/", 1)[0], "checkpoint"), rel,
                                     "is not in the manifest (added after the save: not "
                                     "verified, not loaded)"))
    return out


def json_components(p: Path, manifest: mf.CheckpointManifest) -> list[CheckpointProblem]:
    """progress.json and scheduler.json read (size-capped, regular files only) and checked
    against the manifest's step and token count: a scheduler state that is not one (`[1, 2]`)
    is named here, before anything calls the checkpoint resumable."""
    from tunepilot.checkpoint.components import (
        PROGRESS,
        SCHEDULER,
        progress_problem,
        scheduler_state_problem,
    )
    from tunepilot.limits import Refused, load_json_capped

    out = []
    for rel, component, check in (
            ("progress.json", PROGRESS, lambda d: progress_problem(
                d, manifest.step, manifest.useful_tokens_seen)),
            ("scheduler.json", SCHEDULER, scheduler_state_problem)):
        if rel not in manifest.files:
            continue
        try:
            problem = check(load_json_capped(p / rel))
        except OSError:
            continue  # missing or unreadable: the size and hash check names it
        except Refused as exc:
            problem = f"cannot be read as its JSON state: {exc}"
        if problem:
            out.append(CheckpointProblem(component, rel, problem))
    return out


def _read_one(path: Path, rel: str, entry: mf.FileEntry) -> tuple[bytearray | None,
                                                                  CheckpointProblem | None]:
    p = path / rel
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return None, CheckpointProblem(entry.component, rel, "file is missing", entry.rank)
    if size != entry.bytes:
        return None, CheckpointProblem(entry.component, rel, f"is {size:,} bytes, the manifest "
                                       f"says {entry.bytes:,} (truncated or rewritten)",
                                       entry.rank)
    buf = bytearray(size)
    view = memoryview(buf)
    h = hashlib.sha256()
    got = 0
    with open(p, "rb", buffering=0) as f:
        while got < size:
            n = f.readinto(view[got:got + _READ_CHUNK])
            if not n:
                break
            h.update(view[got:got + n])  # hash the bytes while they are in cache
            got += n
    if got != size or h.hexdigest() != entry.sha256:
        return None, _altered(rel, entry, h.hexdigest())
    return buf, None


def read_verified(path: Path, manifest: mf.CheckpointManifest, rels: list[str]
                  ) -> tuple[dict[str, bytearray], list[CheckpointProblem]]:
    """The bytes of ``rels``, read in parallel and verified against the manifest as they are
    read; (contents, problems) - use the contents only when problems is empty."""
    files = manifest.files
    order = sorted(rels, key=lambda r: -files[r].bytes)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        found = list(pool.map(lambda r: _read_one(path, r, files[r]), order))
    data = {rel: b for rel, (b, _) in zip(order, found, strict=True) if b is not None}
    bad = {p.file: p for _, p in found if p is not None}
    return data, [bad[rel] for rel in sorted(rels) if rel in bad]
