"""Export a run directory off the machine, verified: local NVMe is scratch and the term ends.

`export_run(RUN_DIR, DEST)` copies every file of the run (checkpoints, stage results, manifest,
logs) to any fsspec URL - a local path or file://, memory:// (tests), s3:// / gs:// / az:// when
s3fs / gcsfs / adlfs is installed - and then reads each file back from the destination to check
its SHA-256. A file already at the destination with the right SHA-256 is skipped, so a second run
resumes an interrupted upload; a file there with the wrong size or hash is copied again.

Before anything leaves, each checkpoint is checked as `verify` checks it - the manifest, sizes
and SHA-256, components, files added after the save, the JSON components' shapes, and (when all
of that holds) every component loaded in a fresh process (checkpoint/inspect.py): whatever
`verify` rejects is refused rather than exported. A local destination inside the run directory is refused (the next export would copy
the copy).

RUN_DIR/export.json (and DEST/export.json, last) records `bytes`, `seconds`, `bytes_per_s`
(figures), what was copied or skipped, and the SHA-256 of every file, so whoever downloads the
run can verify it.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from tunepilot.checkpoint.files import OLD_MARK, TMP_MARK, sha256_file
from tunepilot.errors import TunepilotError, UserError
from tunepilot.model.flops import EXPORT_RULE
from tunepilot.results.export import ExportedFile, ExportResult
from tunepilot.results.figure import Figure
from tunepilot.store import MANIFEST, RunDir

EXPORT = "export.json"
_CHUNK_BYTES = 8 << 20  # copy and hash in 8 MiB pieces: bounded memory for any file size
_PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
                      "abfs": "adlfs", "abfss": "adlfs", "hf": "huggingface_hub"}


class ExportError(TunepilotError):
    """Files that did not arrive intact at the destination (named)."""


def _result(source: str, dest: str, files: list[ExportedFile], seconds: float,
            copy_seconds: float, previous: Figure | None, notes: list[str]) -> ExportResult:
    """export.json: bytes, seconds, bytes_per_s (figures) and every file's SHA-256."""
    copied = sum(f.bytes for f in files if f.action != "skipped")
    total = sum(f.bytes for f in files)
    if copied and copy_seconds > 0:
        rate = Figure.measured(copied / copy_seconds, "B/s",
                               rule="bytes copied / seconds copying and reading them back")
    elif previous is not None:
        rate = Figure.measured(previous.value, "B/s", previous.how, from_previous_export=True)
    else:
        rate = Figure.missing("B/s", "every file was already at the destination")
    return ExportResult(
        dest=dest, source=source,
        bytes=Figure.measured(total, "bytes", what="run directory, all at the destination"),
        seconds=Figure.measured(seconds, "s", what="wall time of this export, hashing and "
                                "read-back verification included"),
        bytes_per_s=rate, bytes_copied=Figure.measured(copied, "bytes"),
        bytes_skipped=Figure.measured(total - copied, "bytes"),
        files_copied=sum(f.action == "copied" for f in files),
        files_recopied=sum(f.action == "recopied" for f in files),
        files_skipped=sum(f.action == "skipped" for f in files), files=files, notes=notes)


def export_run(run_dir: Path | str, dest: str, *, storage_options: dict | None = None
               ) -> ExportResult:
    """Copy RUN_DIR to DEST, verify every file there, skip what is already there intact."""
    t0 = time.perf_counter()
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise UserError("RUN_DIR", f"{str(run.path)!r} is not a directory.",
                        "Give the run directory a stage wrote (e.g. runs/<spec>-<hash>).")
    fs, root = _filesystem(dest, storage_options or {})
    _refuse_inside(run.path, fs, root, dest)
    notes = []
    if not (run.path / MANIFEST).exists():
        notes.append("the run directory has no manifest.json")
    previous = _previous_rate(run, dest)
    rels = _run_files(run.path)
    _check_local_checkpoints(run.path, rels)
    files, failures, copy_s = [], [], 0.0
    for rel in rels:
        entry, spent, problem = _export_one_or_stop(fs, run.path / rel, _join(root, rel), rel,
                                                    dest, len(files), len(rels))
        files.append(entry)
        copy_s += spent
        if problem:
            failures.append(problem)
    if failures:
        raise ExportError(f"{len(failures)} file(s) did not arrive intact at {dest}: "
                          + "; ".join(failures[:5]) + ". Run the export again (it resumes).")
    result = _result(str(run.path), dest, files, time.perf_counter() - t0, copy_s, previous,
                     notes)
    n, ckpt_bytes = _checkpoints(run.path, files)
    result.checkpoints = n
    result.checkpoint_bytes = Figure.measured(ckpt_bytes, "bytes", what=EXPORT_RULE)
    result.spec_hash = run.manifest().spec_hash
    run.write(result)
    # last: the manifest (write_stage just updated it) and export.json itself, verified too
    for rel in (MANIFEST, EXPORT):
        _, _, problem = _export_one_or_stop(fs, run.path / rel, _join(root, rel), rel, dest,
                                            len(rels), len(rels))
        if problem:
            raise ExportError(f"{problem}. Run the export again (it resumes).")
    return result


def _export_one_or_stop(fs, src: Path, dst: str, rel: str, dest: str, done: int, total: int
                        ) -> tuple[ExportedFile, float, str | None]:
    """_export_one; a destination that cannot take the file (full, not writable, gone) ends
    the export with a message naming the file - the run directory is not touched."""
    from tunepilot.errors import os_error_kind

    try:
        return _export_one(fs, src, dst, rel)
    except OSError as exc:
        kind, why = os_error_kind(exc)
        why = why.replace("the disk is", "the destination is") if kind == "full" else \
            (f"the destination is {why}" if kind == "unwritable" else why)
        fix = {"full": "Free space there or export elsewhere",
               "unwritable": "Export to a location you can write"}.get(kind,
                                                                       "Check the destination")
        raise ExportError(f"export to {dest} stopped at {rel} ({done} of {total} files "
                          f"done): {why}. {fix}, then run the export again: it resumes, and "
                          "files already there intact are skipped. The run directory is "
                          "unchanged.") from None


def _export_one(fs, src: Path, dst: str, rel: str) -> tuple[ExportedFile, float, str | None]:
    """Skip, copy or recopy one file; (entry, seconds spent copying, problem or None)."""
    size = src.stat().st_size
    there = _remote_size(fs, dst)
    action = "copied"
    if there is not None:
        if there == size:
            sha_local = sha256_file(src)[0]
            if _sha256_remote(fs, dst) == sha_local:
                return ExportedFile(path=rel, bytes=size, sha256=sha_local,
                                    action="skipped"), 0.0, None
        action = "recopied"
    t = time.perf_counter()
    sha_local = _copy(fs, src, dst)
    got = _sha256_remote(fs, dst)
    if got != sha_local:  # once more: a transient fault, or a file that changed under us
        sha_local = _copy(fs, src, dst)
        got = _sha256_remote(fs, dst)
    spent = time.perf_counter() - t
    problem = None if got == sha_local else (f"{rel}: sha256 at the destination {got[:12]}... "
                                             f"!= source {sha_local[:12]}...")
    return ExportedFile(path=rel, bytes=size, sha256=sha_local, action=action), spent, problem


def _copy(fs, src: Path, dst: str) -> str:
    """Stream src to dst, hashing what is sent; the SHA-256 of the bytes sent."""
    parent = dst.rsplit("/", 1)[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    h = hashlib.sha256()
    with open(src, "rb") as f, fs.open(dst, "wb") as out:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def _sha256_remote(fs, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _remote_size(fs, path: str) -> int | None:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") == "directory":
        raise UserError("DEST", f"{path!r} at the destination is a directory where the run has "
                        "a file.", "Export to an empty location or a previous export of this run.")
    return int(info["size"])


def _run_files(root: Path) -> list[str]:
    """Every file of the run, relative, in a stable order; temporaries of an interrupted save
    (.NAME.tmp-*, .NAME.old-*) and the files written last are left out."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") and (TMP_MARK in part or OLD_MARK in part)
                                  for part in rel.parts):
            continue
        if str(rel) in (MANIFEST, EXPORT) or rel.name.startswith(f".{EXPORT}."):
            continue
        out.append(rel.as_posix())
    return out


def _refuse_inside(run: Path, fs, root: str, dest: str) -> None:
    """A local destination that is the run directory or inside it: the export would copy into
    what it exports, and the next one would export the copy."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return
    here, there = run.resolve(), Path(root or ".").resolve()
    if there == here or there.is_relative_to(here):
        raise UserError("DEST", f"{dest!r} is inside the run directory {str(run)!r}: the "
                        "export would copy the run into itself.",
                        "Export to a path outside the run directory.")


def _checkpoint_dirs(root: Path, rels: list[str]) -> list[Path]:
    """The checkpoint directories among the run's files: one DCP wrote into (model/.metadata)
    or one holding a checkpoint manifest."""
    dirs = {root / rel.rsplit("/", 2)[0] for rel in rels
            if rel.endswith("/.metadata") and rel.count("/") >= 2}
    dirs |= {root / rel.rsplit("/", 1)[0] for rel in rels if rel.endswith("/manifest.json")
             and _is_checkpoint_manifest(root / rel)}
    return sorted(d for d in dirs if (d / "model").is_dir() or (d / "manifest.json").exists())


def _checkpoints(root: Path, files: list[ExportedFile]) -> tuple[int, int]:
    """(checkpoints, their bytes) among the exported files: what model/flops.py export_bytes
    projects (EXPORT_RULE) - the rest is the stage results and logs."""
    dirs = [d.relative_to(root).as_posix() + "/" for d in
            _checkpoint_dirs(root, [f.path for f in files])]
    return len(dirs), sum(f.bytes for f in files if any(f.path.startswith(d) for d in dirs))


def _check_local_checkpoints(root: Path, rels: list[str]) -> None:
    """Refuse to export a checkpoint `verify` rejects - the same checks, its fresh load included:
    files that no longer match the manifest, a missing or damaged manifest, files added after
    the save, a state of the wrong shape or one that does not load (a re-sealed forgery)."""
    from tunepilot.checkpoint.inspect import inspect_checkpoint

    for ckpt in _checkpoint_dirs(root, rels):
        problems = inspect_checkpoint(ckpt, load=True).problems
        if problems:
            raise ExportError(f"checkpoint {str(ckpt)!r} is damaged on the local disk: "
                              + "; ".join(str(p) for p in problems[:3])
                              + (f" (and {len(problems) - 3} more)" if len(problems) > 3
                                 else "")
                              + ". Nothing was exported; `tunepilot verify` it, re-save it or "
                              "remove it first.")


def _is_checkpoint_manifest(p: Path) -> bool:
    """A manifest.json of a checkpoint (not a run directory's own manifest)."""
    from tunepilot.checkpoint.manifest import FORMAT, MAX_MANIFEST_BYTES
    from tunepilot.limits import Refused, load_json_capped

    try:
        body = load_json_capped(p, MAX_MANIFEST_BYTES)
    except (OSError, Refused):
        return True  # unreadable: checked (and refused) as a checkpoint
    return isinstance(body, dict) and body.get("format") == FORMAT


def _previous_rate(run: RunDir, dest: str) -> Figure | None:
    """The throughput a previous export to the same destination measured (for a run that now
    finds everything there already)."""
    prev = run.read_if(ExportResult)
    if prev is None or prev.dest != dest or prev.bytes_per_s.value is None:
        return None
    return prev.bytes_per_s


def _filesystem(dest: str, storage_options: dict):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(dest, **storage_options)
    except (ImportError, ValueError) as exc:
        protocol = dest.split("://", 1)[0] if "://" in dest else "file"
        package = _PROTOCOL_PACKAGES.get(protocol)
        hint = f"Install {package} (pip install {package}) for {protocol}:// URLs." if package \
            else "Use a local path, file://, or an fsspec URL whose package is installed."
        raise UserError("DEST", f"cannot open {dest!r}: {exc}", hint) from None
    return fs, root.rstrip("/")


def _join(root: str, rel: str) -> str:
    return f"{root}/{rel}" if root else rel
