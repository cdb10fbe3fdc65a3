"""Crash-safe checkpoints of the full training state, on one rank or sharded over many.

A checkpoint is a directory:

    CKPT/
      manifest.json         format, step, spec hash, world size, model reference, and the SHA-256,
                            size, component and rank of every file (checkpoint/manifest.py)
      model/                torch.distributed.checkpoint (DCP): LoRA = adapter weights only, full =
                            all; one shard file per rank (__R_*.distcp) + .metadata
      optimizer/            DCP: optimizer state keyed by parameter name (FSDP shards per rank)
      scheduler.json        LR scheduler state_dict (floats as JSON keep every bit: repr round-trips)
      scaler.json           GradScaler state (fp16-mixed only)
      rng.rank{R}.json      python `random`, numpy, torch CPU and CUDA generators of rank R
      data.rank{R}.json     rank R's DataStream position: epoch + StatefulDataLoader state
      progress.json         optimizer steps done and useful tokens seen

Writes are atomic: every rank writes into one temporary directory beside CKPT
(`.CKPT.tmp-PID-XXXX`, named by rank 0), each file hashed while it is written and fsynced; rank 0
writes the manifest and only then renames it into place (an atomic exchange with the previous
checkpoint where Linux offers renameat2(RENAME_EXCHANGE)). A process killed at any point - any
rank - leaves the previous checkpoint as it was; the next save removes the dead temporary.
Loading verifies every file it reads against the manifest while reading it, and refuses before
anything of the state is touched. A checkpoint saved by N ranks loads on N' ranks (DCP reshards
the tensors; each rank's RNG and data position are mapped, see load_checkpoint).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tunepilot.checkpoint import manifest as mf
from tunepilot.checkpoint.components import (
    DATA,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    SCALER,
    SCHEDULER,
    CheckpointError,
    check_model_reference,
    data_position,
    from_json,
    load_data_position,
    model_reference,
    per_rank_file,
    progress_problem,
    rng_state,
    set_rng_state,
    to_json,
)
from tunepilot.checkpoint.files import (
    HASH_THREADS,
    fsync_dir,
    hash_files,
    recover_interrupted_swap,
    remove_stale_temporaries,
    swap_into_place,
    temporary_beside,
    write_synced,
)
from tunepilot.checkpoint.verify import (
    check_files,
    manifest_or_problem,
    missing_components,
    read_verified,
)

if TYPE_CHECKING:
    from tunepilot.dataset import DataStream
    from tunepilot.spec import RunSpec
    from tunepilot.training.step import TrainState

RAW, TORCH_SAVE = "raw", "torch_save"  # how DCP stores tensors: see checkpoint/dcp.py
STAGE_MAX_FILE_BYTES = 4 << 20
"""Files up to this size (JSON, DCP metadata) are read once into memory and verified there; larger
ones (the tensor shards) are hashed with one small reused buffer and then read straight into the
live tensors. Staging them in fresh buffers instead costs a page fault per 4 KiB of state, which
on a virtual machine was 4-10x the time of the read itself (benchmarks/checkpoint_speed.py)."""


@dataclass
class CheckpointInfo:
    """What a save or load did: where, how many bytes, how long (fsync and checksums included)."""

    path: str
    step: int
    bytes: int
    seconds: float
    files: list[str]
    kind: str = "full"
    """full: every weight; lora: adapter weights only (the base is rebuilt from its reference)."""
    components: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    world_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj):
    """rank 0's ``obj`` on every rank (a no-op without a process group)."""
    _, world = rank_world()
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    _, world = rank_world()
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


# --- saving ------------------------------------------------------------------------------------


def save_checkpoint(path: Path, state: TrainState, stream: DataStream, spec: RunSpec,
                    extra: dict | None = None) -> CheckpointInfo:
    """Write the full training state to `path` atomically (every rank calls it when the run is
    distributed); the previous checkpoint there stays loadable until the new one is complete."""
    import_dcp()  # not part of the measured time: a run imports it once
    t0 = time.perf_counter()
    snap = snapshot(state, stream, spec, model_and_optimizer_state(state, spec))
    return write_snapshot(Path(path), snap, extra, t0)


@dataclass
class Snapshot:
    """What one rank's checkpoint holds, taken at one step: the model and optimizer state dicts
    (the live tensors, or copies for an asynchronous save) and the small JSON components."""

    state_dicts: tuple[dict, dict]
    json_files: dict[str, tuple[str, object, int | None]]
    step: int
    useful_tokens_seen: int
    model_ref: dict
    spec_hash: str


def snapshot(state: TrainState, stream: DataStream, spec: RunSpec,
             state_dicts: tuple[dict, dict]) -> Snapshot:
    rank, _ = rank_world()
    json_files = {per_rank_file(RNG, rank): (RNG, rng_state(), rank),
                  per_rank_file(DATA, rank): (DATA, data_position(stream), rank)}
    if rank == 0:
        json_files["scheduler.json"] = (SCHEDULER, to_json(state.scheduler.state_dict()), None)
        json_files["progress.json"] = (PROGRESS, {"step": state.step, "useful_tokens_seen":
                                                  state.useful_tokens_seen}, None)
        if state.scaler is not None:
            json_files["scaler.json"] = (SCALER, to_json(state.scaler.state_dict()), None)
    return Snapshot(state_dicts, json_files, state.step, state.useful_tokens_seen,
                    model_reference(state.model, spec), spec.spec_hash())


def write_snapshot(path: Path, snap: Snapshot, extra: dict | None, t0: float) -> CheckpointInfo:
    """The files of ``snap`` into a temporary beside ``path``, the manifest, the atomic swap."""
    rank, world = rank_world()
    tmp = _broadcast(_prepare_temporary(path) if rank == 0 else None)
    failure = None
    try:
        written = _write_components(tmp, snap, rank, _tensor_encoding())
    except CheckpointError as exc:
        failure, written = exc, None
    results = _gather((written, None if failure is None else str(failure)))
    errors = [e for _, e in results if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure or CheckpointError(f"another rank failed to write its shard: {errors[0]}",
                                         component=MODEL)
    manifest = None
    if rank == 0:
        manifest = _commit(tmp, path, [w for w, _ in results], snap, extra, world)
    manifest = _broadcast(manifest)
    return CheckpointInfo(str(path), snap.step, _total_bytes(manifest, path),
                          time.perf_counter() - t0, sorted([*manifest["files"], mf.MANIFEST]),
                          manifest["model"]["kind"], manifest["components"], world_size=world)


def _prepare_temporary(path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_interrupted_swap(path)
        remove_stale_temporaries(path)
        tmp = temporary_beside(path)
        tmp.mkdir()
    except OSError as exc:
        raise CheckpointError(_os_failure(exc, path.parent), component=MODEL) from None
    return tmp


def _write_components(tmp: Path, snap: Snapshot, rank: int, encoding: str
                      ) -> dict[str, tuple[str, str, int, int | None]]:
    """This rank's files in `tmp`: relative path -> (component, sha256, bytes, rank); the
    hashes are computed from the bytes as they are written."""
    import hashlib

    files: dict[str, tuple[str, str, int, int | None]] = {}
    for name, sd in zip((MODEL, OPTIMIZER), snap.state_dicts, strict=True):
        files.update(_write_dcp(tmp, name, sd, encoding, rank))
    for rel, (comp, obj, r) in snap.json_files.items():
        data = json.dumps(obj, indent=1).encode()
        try:
            write_synced(tmp / rel, data)
        except OSError as exc:
            raise CheckpointError(_os_failure(exc, tmp), component=comp, file=rel,
                                  rank=r) from None
        files[rel] = (comp, hashlib.sha256(data).hexdigest(), len(data), r)
    return files


def _write_dcp(tmp: Path, name: str, sd: dict, encoding: str, rank: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _, world = rank_world()
    if encoding == RAW:
        from tunepilot.checkpoint.dcp import HashingRawWriter

        writer = HashingRawWriter(tmp / name, thread_count=HASH_THREADS)
    else:
        writer = dcp.FileSystemWriter(tmp / name, sync_files=True, thread_count=HASH_THREADS)
    try:
        with _quiet_dcp():
            dcp.save(sd, storage_writer=writer, no_dist=world == 1)
    except (Exception, CheckpointException) as exc:  # DCP wraps OSError (disk full) in a
        # CheckpointException, which derives from BaseException, not Exception
        why = _describe(exc, tmp)
        intact = "" if "intact" in why else " The previous checkpoint is untouched."
        raise CheckpointError(f"writing the {name} state failed: {why}.{intact}",
                              component=name, file=name, rank=rank) from None
    out = {}
    digests = getattr(writer, "file_digests", {})
    for p in sorted((tmp / name).glob(f"__{rank}_*")):
        rel = f"{name}/{p.name}"
        sha, n = digests.get(p.name) or hash_files(tmp, [rel])[rel]
        out[rel] = (name, sha, n, rank)
    return out


def _commit(tmp: Path, path: Path, written: list[dict], snap: Snapshot, extra, world: int
            ) -> dict:
    """Rank 0: hash DCP's metadata files, write the manifest, fsync, swap into place."""
    files = {rel: v for w in written for rel, v in w.items()}
    try:
        for name in (MODEL, OPTIMIZER):
            meta = [f"{name}/{p.name}" for p in (tmp / name).iterdir() if p.is_file()
                    and f"{name}/{p.name}" not in files]
            for rel, (sha, n) in hash_files(tmp, meta).items():
                files[rel] = (name, sha, n, None)
        components: dict[str, list[str]] = {}
        for rel, (comp, *_rest) in sorted(files.items()):
            components.setdefault(comp, []).append(rel)
        manifest = {
            "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION,
            "tensor_encoding": _tensor_encoding(), "step": snap.step,
            "useful_tokens_seen": snap.useful_tokens_seen, "spec_hash": snap.spec_hash,
            "world_size": world, "model": snap.model_ref,
            "created_unix_s": time.time(), "torch_version": _torch_version(),
            "components": components,
            "files": {rel: {"sha256": sha, "bytes": n, "component": comp,
                            "rank": r if world > 1 else None}  # ranks only where there are many
                      for rel, (comp, sha, n, r) in files.items()},
            "extra": extra or {},
        }
        manifest["manifest_sha256"] = mf.digest(manifest)
        write_synced(tmp / mf.MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        for d in sorted({(tmp / rel).parent for rel in manifest["files"]}, reverse=True):
            fsync_dir(d)
        fsync_dir(tmp)
        swap_into_place(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_os_failure(exc, tmp.parent), component="manifest") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def model_and_optimizer_state(state: TrainState, spec: RunSpec) -> tuple[dict, dict]:
    """DCP state dicts keyed by parameter name (LoRA: trainable parameters only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(state.model, state.optimizer,
                          options=StateDictOptions(ignore_frozen_params=spec.method.is_lora))


# --- loading -----------------------------------------------------------------------------------


def load_checkpoint(path: Path, state: TrainState, stream: DataStream, spec: RunSpec
                    ) -> CheckpointInfo:
    """Verify and restore model, optimizer, scheduler, scaler, data position, progress and
    (last, so nothing after it draws from them) the RNG streams. Every rank of a distributed
    run calls it. On N' ranks a checkpoint of N ranks is resharded: rank r takes the RNG
    streams of rank r % N, and the data position of the same global sample (the samples every
    rank drew, spread over N' ranks)."""
    import_dcp()  # not part of the measured time: a run imports it once
    t0 = time.perf_counter()
    path = Path(path)
    rank, world = rank_world()
    if rank == 0:
        recover_interrupted_swap(path)
    manifest, staged, hashed = _verified(path, rank, world)
    notes = check_model_reference(manifest.model, state.model, spec)
    if manifest.spec_hash != spec.spec_hash():
        notes.append(f"written for spec hash {manifest.spec_hash[:12]}, loaded with spec hash "
                     f"{spec.spec_hash()[:12]}")
    if manifest.world_size != world:
        notes.append(f"resharded: saved by {manifest.world_size} rank(s), loaded on {world}")
    _load_model_and_optimizer(path, state, manifest, staged)
    _unchanged_since_hashed(path, manifest, hashed)
    _load_json_state(path, state, manifest, staged)
    source = rank % manifest.world_size
    load_data_position(_resharded_position(path, manifest, staged, rank, world), stream,
                       per_rank_file(DATA, source))
    set_rng_state(_json(path, staged, per_rank_file(RNG, source), RNG, source))
    return CheckpointInfo(str(path), state.step, _total_bytes(manifest.model_dump(), path),
                          time.perf_counter() - t0, sorted([*manifest.files, mf.MANIFEST]),
                          manifest.model["kind"], manifest.components, notes,
                          manifest.world_size)


def _my_files(manifest: mf.CheckpointManifest, rank: int, world: int) -> list[str]:
    """The files this rank verifies: its own, rank 0 the shared ones, and the files of ranks
    that no longer exist (resharding to fewer ranks) spread over the ranks that do."""
    def owner(e: mf.FileEntry) -> int:
        return 0 if e.rank is None else e.rank % world

    return [rel for rel, e in manifest.files.items() if owner(e) == rank]


def _verified(path: Path, rank: int, world: int):
    """The manifest, this rank's small files (read and verified) and the signatures of its large
    files (hashed; read later by DCP); CheckpointError (on every rank) naming the file,
    component and rank of every problem found on any rank."""
    manifest, problems = manifest_or_problem(path)
    staged: dict[str, bytearray] = {}
    hashed: dict[str, tuple] = {}
    if manifest is not None:
        problems = missing_components(manifest)
        mine = _my_files(manifest, rank, world)
        small = [r for r in mine if manifest.files[r].bytes <= STAGE_MAX_FILE_BYTES]
        large = [r for r in mine if r not in small]
        hashed = {r: _signature(path / r) for r in large}
        staged, found = read_verified(path, manifest, small)  # verify while reading
        problems += found + check_files(path, manifest, large)
    everyone = [p for ps in _gather(problems) for p in ps]
    if everyone:
        first = everyone[0]
        more = f" (and {len(everyone) - 1} more problems)" if len(everyone) > 1 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} failed verification: {first}{more}. "
                              "Nothing was loaded; use an earlier checkpoint.",
                              component=first.component, file=first.file, rank=first.rank,
                              problems=everyone)
    return manifest, staged, hashed


def _signature(p: Path) -> tuple | None:
    """What changes when anything writes to a file: inode, size, mtime and ctime (the last
    cannot be set from user space)."""
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _unchanged_since_hashed(path: Path, manifest, hashed: dict[str, tuple]) -> None:
    """The large files were hashed, then read into the state: refuse if one changed between."""
    for rel, sig in hashed.items():
        if _signature(path / rel) != sig:
            e = manifest.files[rel]
            raise CheckpointError(f"{rel} in {str(path)!r} changed on disk while it was being "
                                  "loaded; the state in memory is not that checkpoint. Load it "
                                  "again when nothing else writes to it.", component=e.component,
                                  file=rel, rank=e.rank)


def _load_model_and_optimizer(path: Path, state: TrainState, manifest, staged: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    lora = manifest.model["kind"] == "lora"
    _, world = rank_world()
    # get_state_dict gives the optimizer its state tensors (a zero-lr step) so DCP can fill them
    msd, osd = get_state_dict(state.model, state.optimizer,
                              options=StateDictOptions(ignore_frozen_params=lora))
    for name, sd in ((MODEL, msd), (OPTIMIZER, osd)):
        reader = _reader(path / name, manifest.tensor_encoding,
                         {rel.split("/", 1)[1]: b for rel, b in staged.items()
                          if rel.startswith(name + "/")})
        try:
            with _quiet_dcp():
                dcp.load(sd, storage_reader=reader, no_dist=world == 1)
        except (Exception, CheckpointException) as exc:  # DCP raises many kinds (its own
            # CheckpointException is a BaseException); all mean "this state does not fit"
            raise CheckpointError(f"the {name} state in {str(path)!r} does not fit this run's "
                                  f"{name}: {_describe(exc, path)}. Load it with the spec it was "
                                  "written for.", component=name, file=name) from None
    result = set_state_dict(state.model, state.optimizer, model_state_dict=msd,
                            optim_state_dict=osd,
                            options=StateDictOptions(ignore_frozen_params=lora, strict=not lora))
    if lora:
        frozen = {n for n, p in state.model.named_parameters() if not p.requires_grad}
        stray = [k for k in result.missing_keys if k not in frozen and "lora_" in k]
        if stray or result.unexpected_keys:
            raise CheckpointError(f"the adapter in {str(path)!r} does not match this model: "
                                  f"missing {stray[:3]}, unexpected {result.unexpected_keys[:3]}.",
                                  component=MODEL)


def _reader(directory: Path, encoding: str, staged: dict):
    if encoding == RAW:
        from tunepilot.checkpoint.dcp import RawReader

        return RawReader(directory, staged, thread_count=HASH_THREADS)
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(directory)


def _json(path: Path, staged: dict, rel: str, component: str, rank: int | None = None):
    try:
        data = staged[rel] if rel in staged else (path / rel).read_bytes()
        return json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(f"{rel} is missing from {str(path)!r}.", component=component,
                              file=rel, rank=rank) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{rel} in {str(path)!r} is not valid JSON ({exc}).",
                              component=component, file=rel, rank=rank) from None


def _load_json_state(path: Path, state: TrainState, manifest, staged: dict) -> None:
    saved = from_json(_json(path, staged, "scheduler.json", SCHEDULER))
    try:
        state.scheduler.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"scheduler state does not fit this scheduler: {exc}",
                              component=SCHEDULER, file="scheduler.json") from None
    has = SCALER in manifest.components
    if state.scaler is None and has:
        raise CheckpointError("the checkpoint holds GradScaler state (fp16-mixed) but this run "
                              "has no scaler.", component=SCALER, file="scaler.json")
    if state.scaler is not None and not has:
        raise CheckpointError("this run scales the loss (fp16-mixed) but the checkpoint has no "
                              "GradScaler state.", component=SCALER)
    if has:
        state.scaler.load_state_dict(from_json(_json(path, staged, "scaler.json", SCALER)))
    progress = _json(path, staged, "progress.json", PROGRESS)
    problem = progress_problem(progress, manifest.step, manifest.useful_tokens_seen)
    if problem:
        raise CheckpointError(f"progress.json in {str(path)!r} {problem}: the checkpoint does "
                              "not agree with itself. Use an earlier checkpoint.",
                              component=PROGRESS, file="progress.json")
    state.step = int(progress["step"])
    state.useful_tokens_seen = int(progress["useful_tokens_seen"])


def _resharded_position(path: Path, manifest, staged: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s data position. Same rank count: its own file. Another count: rank 0's
    file with the per-rank sample counts set so every rank resumes at the same global sample
    (each of N ranks drew k samples: N x k in all, k x N / N' each on N' ranks)."""
    saved_world = manifest.world_size
    own = _json(path, staged, per_rank_file(DATA, rank % saved_world), DATA, rank % saved_world)
    if saved_world == world:
        return own
    from tunepilot.checkpoint.components import samples_consumed

    drawn = [samples_consumed(_json(path, staged, per_rank_file(DATA, r), DATA, r))
             for r in range(saved_world)] if rank < saved_world else None
    total = sum(drawn) if drawn and None not in drawn else None
    if total is None or total % world:
        return own
    return _with_samples(own, total // world)


def _with_samples(saved: dict, samples: int) -> dict:
    """A data position with this rank's sample count replaced (StatefulDataLoader's keys)."""
    out = json.loads(json.dumps(saved))
    loader = out.get("stream", {}).get("loader") or {}
    it = loader.get("_sampler_iter_state") or {}
    old = it.get("samples_yielded") or 0
    batches = loader.get("_num_yielded")
    if old and batches:
        loader["_num_yielded"] = batches * samples // old
    it["samples_yielded"] = samples
    sampler = it.get("sampler_state") or {}
    if "yielded" in sampler:
        sampler["yielded"] = samples
    return out


# --- small helpers -----------------------------------------------------------------------------


def _os_failure(exc: OSError, where: Path) -> str:
    """What an OSError during a save means for the user."""
    from tunepilot.errors import os_error_kind

    kind, why = os_error_kind(exc)
    if kind == "full":
        return f"{why} in {where}; the previous checkpoint is intact. Free space or " \
               "checkpoint elsewhere (checkpoint.dir)"
    if kind == "unwritable":
        return f"{where} is {why}; the previous checkpoint is intact. Choose a writable " \
               "checkpoint.dir or --out"
    return f"{why} in {where}; the previous checkpoint is intact"


def _describe(exc: BaseException, where: Path) -> str:
    """DCP's CheckpointException hides the cause ('CheckpointException ranks:dict_keys([0])'):
    find the OSError (or first error) each rank raised and say what it means."""
    causes = []
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for rank, failure in failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            causes.append((rank, inner))
    else:
        causes.append((None, exc))
    for _rank, inner in causes:
        if isinstance(inner, OSError):
            return _os_failure(inner, where)
    rank, inner = causes[0]
    text = str(inner).strip().splitlines()
    first = text[0] if text else type(inner).__name__
    return f"{first}" + (f" (rank {rank})" if rank is not None else "")


def import_dcp() -> None:
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import tunepilot.checkpoint.dcp  # noqa: F401


def _tensor_encoding() -> str:
    from tunepilot.checkpoint.dcp import raw_storage_available

    return RAW if raw_storage_available() else TORCH_SAVE


def _total_bytes(manifest: dict, path: Path) -> int:
    """Bytes on disk: every listed file plus the manifest itself."""
    files = manifest["files"]
    size = sum((e["bytes"] if isinstance(e, dict) else e.bytes) for e in files.values())
    return size + (path / mf.MANIFEST).stat().st_size


class _quiet_dcp(warnings.catch_warnings):
    """DCP warns that it 'assumes a single process' on every call without a process group."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return self


def _torch_version() -> str:
    import torch

    return torch.__version__
