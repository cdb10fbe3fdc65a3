"""Crash-safe checkpoints of the full training state, verified before they are loaded.

A checkpoint is a directory:

    CKPT/
      manifest.json         format, step, spec hash, model reference, SHA-256 and size of every file
      model/                torch.distributed.checkpoint (DCP): LoRA = adapter weights only, full = all
      optimizer/            DCP: optimizer state keyed by parameter name (FSDP shards load the same way)
      scheduler.json        LR scheduler state_dict (floats as JSON keep every bit: repr round-trips)
      scaler.json           GradScaler state (fp16-mixed only)
      rng.rank0.json        python `random`, numpy, torch CPU and every CUDA device's generator
      data.rank0.json       DataStream position: epoch + StatefulDataLoader state (sampler included)
      progress.json         optimizer steps done and useful tokens seen

Writes are atomic: everything goes into a temporary directory beside CKPT (`.CKPT.tmp-PID-XXXX`),
every file and directory is fsynced, and only then is it renamed into place (an atomic exchange with
the previous checkpoint where Linux offers renameat2(RENAME_EXCHANGE)). A process killed at any
point leaves the previous checkpoint as it was; the next save removes the dead process's temporary
directory. Loading verifies every checksum first and names the file and component that fails.

LoRA checkpoints hold the adapter only, with a reference to the base (preset/config, revision,
weights, seed and the SHA-256 of its config); loading refuses a base whose config differs.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunepilot.checkpoint_io import (
    HASH_THREADS,
    fsync_dir,
    hash_files,
    recover_interrupted_swap,
    remove_stale_temporaries,
    sha256_file,
    swap_into_place,
    temporary_beside,
    write_synced,
)
from tunepilot.errors import TunepilotError

if TYPE_CHECKING:
    import torch

    from tunepilot.data import DataStream
    from tunepilot.spec import RunSpec
    from tunepilot.training import TrainState

FORMAT = "tunepilot-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# component names (state keys are constants: the verdicts and the tests name them)
MODEL, OPTIMIZER, SCHEDULER, SCALER = "model", "optimizer", "scheduler", "grad_scaler"
RNG, DATA, PROGRESS = "rng", "data_position", "progress"
COMPONENTS = (MODEL, OPTIMIZER, SCHEDULER, SCALER, RNG, DATA, PROGRESS)
REQUIRED = (MODEL, OPTIMIZER, SCHEDULER, RNG, DATA, PROGRESS)  # grad_scaler only under fp16

RAW, TORCH_SAVE = "raw", "torch_save"  # how DCP stores tensors: see tunepilot.checkpoint_dcp
# drop these from the config hash: they name the copy or the library, not the architecture
_CONFIG_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


class CheckpointError(TunepilotError):
    """A checkpoint that cannot be written or loaded; names the component and file at fault."""

    def __init__(self, message: str, *, component: str | None = None, file: str | None = None,
                 problems: list[CheckpointProblem] | None = None):
        self.component = component
        self.file = file
        self.problems = list(problems or [])
        super().__init__(message)

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "message": str(self), "component": self.component,
                "file": self.file, "problems": [p.to_dict() for p in self.problems]}


@dataclass
class CheckpointProblem:
    """One thing wrong with a checkpoint on disk."""

    component: str
    file: str | None
    problem: str

    def __str__(self) -> str:
        where = f"{self.file} ({self.component})" if self.file else self.component
        return f"{where}: {self.problem}"

    def to_dict(self) -> dict:
        return asdict(self)


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

    def to_dict(self) -> dict:
        return asdict(self)


# --- public API --------------------------------------------------------------------------------


def save_checkpoint(path: Path, state: TrainState, stream: DataStream, spec: RunSpec,
                    extra: dict | None = None) -> CheckpointInfo:
    """Write the full training state to `path` atomically; the previous checkpoint there (if any)
    stays loadable until the new one is complete and synced."""
    _import_dcp()  # not part of the measured time: a run imports it once
    t0 = time.perf_counter()
    path = Path(path)
    rank, world = _rank_world()
    if world > 1:
        raise CheckpointError(
            f"save_checkpoint runs in one process, but torch.distributed has {world} ranks.",
            component=MODEL)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_swap(path)
    remove_stale_temporaries(path)
    tmp = temporary_beside(path)
    tmp.mkdir()
    try:
        encoding = _tensor_encoding()
        components, known = _write_components(tmp, state, stream, spec, rank, encoding)
        rels = [f for files in components.values() for f in files]
        entries = {**known, **hash_files(tmp, [r for r in rels if r not in known])}
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "tensor_encoding": encoding,
            "step": state.step, "useful_tokens_seen": state.useful_tokens_seen,
            "spec_hash": spec.spec_hash(), "world_size": world,
            "model": model_reference(state.model, spec),
            "created_unix_s": time.time(), "torch_version": _torch_version(),
            "components": components,
            "files": {rel: {"sha256": sha, "bytes": n, "component": comp}
                      for comp, files in components.items() for rel in files
                      for sha, n in [entries[rel]]},
            "extra": extra or {},
        }
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        write_synced(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        for d in sorted({(tmp / rel).parent for rel in manifest["files"]}, reverse=True):
            fsync_dir(d)
        fsync_dir(tmp)
        swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(str(path), state.step, _total_bytes(path, manifest),
                          time.perf_counter() - t0, sorted([*manifest["files"], MANIFEST]),
                          manifest["model"]["kind"], components)


def load_checkpoint(path: Path, state: TrainState, stream: DataStream, spec: RunSpec
                    ) -> CheckpointInfo:
    """Verify every checksum, then restore model, optimizer, scheduler, scaler, data position,
    progress and (last, so nothing after it draws from them) the RNG streams."""
    _import_dcp()  # not part of the measured time: a run imports it once
    t0 = time.perf_counter()
    path = Path(path)
    recover_interrupted_swap(path)
    manifest, problems = _check(path)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} failed verification: {first}{more}. "
                              "Nothing was loaded; use an earlier checkpoint.",
                              component=first.component, file=first.file, problems=problems)
    notes = _check_model_reference(manifest, state.model, spec)
    if manifest["spec_hash"] != spec.spec_hash():
        notes.append(f"written for spec hash {manifest['spec_hash'][:12]}, loaded with spec hash "
                     f"{spec.spec_hash()[:12]}")
    rank, _ = _rank_world()
    _load_model_and_optimizer(path, state, manifest)
    _load_scheduler(path, state)
    _load_scaler(path, state, manifest)
    progress = _read_json(path, "progress.json", PROGRESS)
    state.step = int(progress["step"])
    state.useful_tokens_seen = int(progress["useful_tokens_seen"])
    _load_data_position(path, stream, rank)
    _load_rng(path, rank)
    return CheckpointInfo(str(path), state.step, _total_bytes(path, manifest),
                          time.perf_counter() - t0, sorted([*manifest["files"], MANIFEST]),
                          manifest["model"]["kind"], manifest["components"], notes)


def verify_checkpoint(path: Path) -> list[CheckpointProblem]:
    """Every problem with the checkpoint on disk (missing, truncated or altered files, a damaged
    manifest, a missing component); an empty list means it is intact."""
    path = Path(path)
    recover_interrupted_swap(path)
    return _check(path)[1]


def read_manifest(path: Path) -> dict:
    """The checkpoint's manifest (checked against its own digest)."""
    manifest, problem = _read_manifest(Path(path))
    if problem is not None:
        raise CheckpointError(str(problem), component=problem.component, file=problem.file,
                              problems=[problem])
    return manifest


# --- what is saved -----------------------------------------------------------------------------


def model_reference(model: torch.nn.Module, spec: RunSpec) -> dict:
    """full/lora, and the base model this state belongs to (for LoRA the base is not saved)."""
    m = spec.model
    ref: dict[str, Any] = {
        "kind": "lora" if spec.method.is_lora else "full",
        "base": {"preset": m.preset, "config": m.config, "revision": m.revision,
                 "weights": m.weights, "seed": spec.seed if m.weights == "random" else None,
                 "config_sha256": config_sha256(model)},
    }
    if spec.method.is_lora:
        ref["adapter"] = {"rank": spec.method.lora_rank, "alpha": spec.method.lora_alpha,
                          "targets": spec.method.lora_targets, "method": spec.method.kind}
    return ref


def config_sha256(model: torch.nn.Module) -> str | None:
    """SHA-256 of the model's Hugging Face config (canonical JSON), None for a plain module."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return None
    data = {k: v for k, v in to_dict().items() if k not in _CONFIG_VOLATILE_KEYS}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def model_and_optimizer_state(state: TrainState, spec: RunSpec) -> tuple[dict, dict]:
    """DCP state dicts keyed by parameter name (LoRA: trainable parameters only)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(state.model, state.optimizer, options=_sd_options(spec))


def rng_state() -> dict:
    """Every RNG stream training draws from, as JSON (torch states as hex bytes)."""
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch_cpu": torch.get_rng_state().numpy().tobytes().hex(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(saved: dict) -> None:
    import numpy as np
    import torch

    py = saved["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = saved["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_bytes_tensor(saved["torch_cpu"]))
    cuda = saved.get("cuda") or []
    if cuda:
        if not torch.cuda.is_available():
            raise CheckpointError(f"the checkpoint holds RNG state for {len(cuda)} CUDA devices "
                                  "but this process has none.", component=RNG)
        if len(cuda) > torch.cuda.device_count():
            raise CheckpointError(f"the checkpoint holds RNG state for {len(cuda)} CUDA devices "
                                  f"but this process sees {torch.cuda.device_count()}.",
                                  component=RNG)
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(_bytes_tensor(s), i)


def data_position(stream: DataStream) -> dict:
    """The stream's position: epoch + loader state, and whether an epoch's iterator was open."""
    return {"stream": _to_json(stream.state_dict()), "iterator_open": _iterator_open(stream)}


def _write_components(tmp: Path, state: TrainState, stream: DataStream, spec: RunSpec, rank: int,
                      encoding: str) -> tuple[dict[str, list[str]], dict[str, tuple[str, int]]]:
    """Write each component's files into `tmp`: (component -> files (relative paths), the
    SHA-256 and size of the files whose hash was computed while they were written)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    msd, osd = model_and_optimizer_state(state, spec)
    components: dict[str, list[str]] = {}
    known: dict[str, tuple[str, int]] = {}
    for name, sd in ((MODEL, msd), (OPTIMIZER, osd)):
        if encoding == RAW:
            from tunepilot.checkpoint_dcp import HashingRawWriter

            writer = HashingRawWriter(tmp / name, thread_count=HASH_THREADS)
        else:
            writer = dcp.FileSystemWriter(tmp / name, sync_files=True, thread_count=HASH_THREADS)
        try:
            with _quiet_dcp():
                dcp.save(sd, storage_writer=writer, no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP wraps OSError (disk full) in a
            # CheckpointException, which derives from BaseException, not Exception
            raise CheckpointError(f"writing the {name} state to {str(tmp)!r} failed: "
                                  f"{_first_line(exc)}. The previous checkpoint is untouched.",
                                  component=name, file=name) from None
        for file, digest in getattr(writer, "file_digests", {}).items():
            known[f"{name}/{file}"] = digest
        components[name] = sorted(str(p.relative_to(tmp)) for p in (tmp / name).rglob("*")
                                  if p.is_file())
    json_files = {
        SCHEDULER: ("scheduler.json", _to_json(state.scheduler.state_dict())),
        RNG: (f"rng.rank{rank}.json", rng_state()),
        DATA: (f"data.rank{rank}.json", data_position(stream)),
        PROGRESS: ("progress.json", {"step": state.step,
                                     "useful_tokens_seen": state.useful_tokens_seen}),
    }
    if state.scaler is not None:
        json_files[SCALER] = ("scaler.json", _to_json(state.scaler.state_dict()))
    for comp, (name, obj) in json_files.items():
        data = json.dumps(obj, indent=1).encode()
        write_synced(tmp / name, data)
        components[comp] = [name]
        known[name] = (hashlib.sha256(data).hexdigest(), len(data))
    return components, known


# --- what is loaded ----------------------------------------------------------------------------


def _load_model_and_optimizer(path: Path, state: TrainState, manifest: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    lora = manifest["model"]["kind"] == "lora"
    options = StateDictOptions(ignore_frozen_params=lora)
    # get_state_dict gives the optimizer its state tensors (a zero-lr step) so DCP can fill them
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state.model, state.optimizer, options=options)
    raw = manifest.get("tensor_encoding", TORCH_SAVE) == RAW
    for name, sd in ((MODEL, msd), (OPTIMIZER, osd)):
        if raw:
            from tunepilot.checkpoint_dcp import RawReader

            reader = RawReader(path / name)
        else:
            reader = dcp.FileSystemReader(path / name)
        try:
            with _quiet_dcp():
                dcp.load(sd, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP raises many kinds (its own
            # CheckpointException is a BaseException); all mean "this state does not fit"
            raise CheckpointError(f"the {name} state in {str(path)!r} does not fit this run's "
                                  f"{name}: {_first_line(exc)}. Load it with the spec it was "
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


def _load_scheduler(path: Path, state: TrainState) -> None:
    saved = _from_json(_read_json(path, "scheduler.json", SCHEDULER))
    try:
        state.scheduler.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"scheduler state does not fit this scheduler: {exc}",
                              component=SCHEDULER, file="scheduler.json") from None


def _load_scaler(path: Path, state: TrainState, manifest: dict) -> None:
    has = SCALER in manifest["components"]
    if state.scaler is None and has:
        raise CheckpointError("the checkpoint holds GradScaler state (fp16-mixed) but this run "
                              "has no scaler.", component=SCALER, file="scaler.json")
    if state.scaler is not None and not has:
        raise CheckpointError("this run scales the loss (fp16-mixed) but the checkpoint has no "
                              "GradScaler state.", component=SCALER)
    if has:
        state.scaler.load_state_dict(_from_json(_read_json(path, "scaler.json", SCALER)))


def _load_data_position(path: Path, stream: DataStream, rank: int) -> None:
    saved = _read_json(path, f"data.rank{rank}.json", DATA)
    try:
        stream.load_state_dict(_from_json(saved["stream"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"data position does not fit this data loader: {exc}",
                              component=DATA, file=f"data.rank{rank}.json") from None
    if saved.get("iterator_open"):
        # Opening an epoch's iterator draws a base seed from torch's global RNG. The saving run
        # had it open already, so open it now, before the RNG streams are restored.
        _open_iterator(stream)
    # torchdata 0.11's StatefulDistributedSampler holds a loaded position in `next_yielded` and
    # reports `yielded` = 0 until the first batch is drawn, so a checkpoint saved right after a
    # resume (before any step) would restart the epoch from sample 0. Report the real position.
    sampler = getattr(stream.loader, "sampler", None)
    pending = getattr(sampler, "next_yielded", None)
    if pending is not None:
        sampler.yielded = pending


def _load_rng(path: Path, rank: int) -> None:
    set_rng_state(_read_json(path, f"rng.rank{rank}.json", RNG))


def _check_model_reference(manifest: dict, model: torch.nn.Module, spec: RunSpec) -> list[str]:
    saved = manifest["model"]
    here = model_reference(model, spec)
    if saved["kind"] != here["kind"]:
        raise CheckpointError(f"the checkpoint is a {saved['kind']} fine-tune but this run is "
                              f"{here['kind']}.", component=MODEL)
    notes = []
    a, b = saved["base"], here["base"]
    if a.get("config_sha256") and b.get("config_sha256") and \
            a["config_sha256"] != b["config_sha256"]:
        raise CheckpointError(
            f"the checkpoint was trained on a base model with config sha256 "
            f"{a['config_sha256'][:12]} but this run builds {b['config_sha256'][:12]} "
            f"({b.get('preset') or b.get('config')}).", component=MODEL)
    for key in ("revision", "weights", "seed"):
        if a.get(key) != b.get(key):
            if saved["kind"] == "lora":
                raise CheckpointError(f"the adapter was trained on base {key} {a.get(key)!r} but "
                                      f"this run's base has {b.get(key)!r}.", component=MODEL)
            notes.append(f"base {key} was {a.get(key)!r}, now {b.get(key)!r}")
    return notes


# --- verification ------------------------------------------------------------------------------


def _check(path: Path) -> tuple[dict, list[CheckpointProblem]]:
    if not path.is_dir():
        return {}, [CheckpointProblem("manifest", None, f"no checkpoint directory at {path}")]
    manifest, problem = _read_manifest(path)
    if problem is not None:
        return manifest, [problem]
    problems = [CheckpointProblem(c, None, "component missing from the checkpoint")
                for c in REQUIRED if not manifest["components"].get(c)]
    files = manifest["files"]

    def one(rel: str) -> CheckpointProblem | None:
        entry = files[rel]
        comp = entry.get("component", "?")
        p = path / rel
        if not p.is_file():
            return CheckpointProblem(comp, rel, "file is missing")
        size = p.stat().st_size
        if size != entry["bytes"]:
            return CheckpointProblem(comp, rel, f"is {size:,} bytes, the manifest says "
                                     f"{entry['bytes']:,} (truncated or rewritten)")
        sha = sha256_file(p)[0]
        if sha != entry["sha256"]:
            return CheckpointProblem(comp, rel, f"sha256 {sha[:12]}... does not match the "
                                     f"manifest's {entry['sha256'][:12]}... (altered on disk)")
        return None

    # largest first, so the threads finish together
    order = sorted(files, key=lambda r: -files[r]["bytes"])
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        found = list(pool.map(one, order))
    bad = {p.file: p for p in found if p is not None}
    problems += [bad[rel] for rel in sorted(files) if rel in bad]  # report in a stable order
    return manifest, problems


def _read_manifest(path: Path) -> tuple[dict, CheckpointProblem | None]:
    p = path / MANIFEST
    try:
        manifest = json.loads(p.read_bytes())
    except FileNotFoundError:
        return {}, CheckpointProblem("manifest", MANIFEST, "is missing (an incomplete checkpoint)")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return {}, CheckpointProblem("manifest", MANIFEST, f"is not valid JSON ({exc})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return {}, CheckpointProblem("manifest", MANIFEST, f"is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        return {}, CheckpointProblem("manifest", MANIFEST, f"format version "
                                     f"{manifest.get('format_version')} (this tunepilot reads "
                                     f"{FORMAT_VERSION})")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        return {}, CheckpointProblem("manifest", MANIFEST, "does not match its own digest "
                                     "(altered on disk)")
    return manifest, None


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def _read_json(path: Path, rel: str, component: str) -> Any:
    try:
        return json.loads((path / rel).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{rel} is missing from {str(path)!r}.", component=component,
                              file=rel) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{rel} in {str(path)!r} is not valid JSON ({exc}).",
                              component=component, file=rel) from None


# --- small helpers -----------------------------------------------------------------------------


def _import_dcp() -> None:
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import tunepilot.checkpoint_dcp  # noqa: F401


def _tensor_encoding() -> str:
    from tunepilot.checkpoint_dcp import raw_storage_available

    return RAW if raw_storage_available() else TORCH_SAVE


def _total_bytes(path: Path, manifest: dict) -> int:
    """Bytes on disk: every listed file plus the manifest itself."""
    return sum(e["bytes"] for e in manifest["files"].values()) + (path / MANIFEST).stat().st_size


def _sd_options(spec: RunSpec):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=spec.method.is_lora)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _quiet_dcp(warnings.catch_warnings):
    """DCP warns that it 'assumes a single process' on every call without a process group."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return self


def _iterator_open(stream: DataStream) -> bool:
    return getattr(stream, "_it", None) is not None


def _open_iterator(stream: DataStream) -> None:
    # DataStream.next() opens the iterator lazily with exactly these two calls
    stream.loader.sampler.set_epoch(stream.epoch)
    stream._it = iter(stream.loader)


def _bytes_tensor(hex_str: str):
    import torch

    return torch.frombuffer(bytearray(bytes.fromhex(hex_str)), dtype=torch.uint8).clone()


def _to_json(obj: Any) -> Any:
    """State dicts as JSON: tensors tagged with dtype, shape and hex bytes; tuples as lists."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "hex": t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()}
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_json(v) for v in obj]
    return obj


def _from_json(obj: Any) -> Any:
    import torch

    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["__tensor__"])
            raw = _bytes_tensor(obj["hex"])
            return raw.view(dtype).reshape(obj["shape"]).clone()
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _torch_version() -> str:
    import torch

    return torch.__version__
