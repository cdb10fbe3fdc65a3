"""`tunepilot verify CHECKPOINT_DIR`: check a checkpoint without its spec.

A tunepilot checkpoint: the manifest (well-formed, paths inside the directory), every file's size
and SHA-256, every component present (per rank), and then every component *loaded in a fresh
process*: the DCP model and optimizer shards read into tensors of the shapes their metadata
declares, every JSON component parsed. An HF Trainer ``checkpoint-N/``: which of weights,
optimizer, scheduler, per-rank RNG and trainer state are there (checkpoint/hf.py), each loaded in
a fresh process (safetensors opened and every tensor read; ``*.pt``/``*.pth`` with
``torch.load(weights_only=True)``). Every problem names the file, the component and the rank.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.checkpoint.verify import CheckpointProblem


@dataclass
class ComponentStatus:
    name: str
    files: int
    bytes: int
    ok: bool
    status: str

    def to_dict(self) -> dict:
        return {"name": self.name, "files": self.files, "bytes": self.bytes, "ok": self.ok,
                "status": self.status}


@dataclass
class VerifyReport:
    path: str
    kind: str  # "tunepilot" | "hf-trainer" | "unknown"
    ok: bool
    problems: list[CheckpointProblem]
    layout: dict[str, list[str]] = field(default_factory=dict)
    step: int | None = None
    world_size: int | None = None
    files_checked: int = 0
    bytes_checked: int = 0
    loaded_in_fresh_process: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    hashes_checked: bool = False
    """every file was checked against a SHA-256 recorded at save time (a manifest)"""

    @property
    def resumable(self) -> bool:
        """Every component a resume needs is there and loads."""
        return self.ok

    @property
    def intact(self) -> bool:
        """No problem found *and* every file matched its recorded SHA-256: without a manifest a
        flipped byte that still loads cannot be seen, so a checkpoint is never called intact."""
        return self.ok and self.hashes_checked

    @property
    def components(self) -> list[ComponentStatus]:
        out = []
        root = Path(self.path)
        names = list(self.layout) + sorted({p.component for p in self.problems} -
                                           set(self.layout))
        for name in names:
            rels = self.layout.get(name, [])
            size = 0
            for rel in rels:
                f = root / rel
                if f.is_file():
                    size += f.stat().st_size
                elif f.is_dir():
                    size += sum(x.stat().st_size for x in f.rglob("*") if x.is_file())
            bad = [p for p in self.problems if p.component == name]
            out.append(ComponentStatus(name, len(rels), size, not bad,
                                       "ok" if not bad else bad[0].problem))
        return out

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "ok": self.ok,
                "intact": self.intact, "hashes_checked": self.hashes_checked,
                "resumable": self.resumable,
                "problems": [p.to_dict() for p in self.problems],
                "components": [c.to_dict() for c in self.components], "step": self.step,
                "world_size": self.world_size, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked,
                "loaded_in_fresh_process": self.loaded_in_fresh_process,
                "seconds": self.seconds, "notes": self.notes}


def inspect_checkpoint(path: str | Path, *, load: bool = True) -> VerifyReport:
    from tunepilot.checkpoint.hf import looks_like_hf_checkpoint
    from tunepilot.checkpoint.manifest import MANIFEST

    t0 = time.perf_counter()
    p = Path(path)
    if not p.is_dir():
        report = VerifyReport(str(p), "unknown", False, [CheckpointProblem(
            "checkpoint", None, f"{p} is not a directory")])
    elif (p / MANIFEST).is_file() or not looks_like_hf_checkpoint(p):
        report = _tunepilot(p, load)
    else:
        report = _hf(p, load)
    report.ok = not report.problems
    report.seconds = time.perf_counter() - t0
    return report


def _tunepilot(p: Path, load: bool) -> VerifyReport:
    from tunepilot.checkpoint.manifest import INTEGRITY_NOTE
    from tunepilot.checkpoint.verify import check_checkpoint

    manifest, problems = check_checkpoint(p)
    if manifest is None:
        return VerifyReport(str(p), "tunepilot", False, problems)
    report = VerifyReport(str(p), "tunepilot", False, problems,
                          layout={k: list(v) for k, v in manifest.components.items()},
                          step=manifest.step, world_size=manifest.world_size,
                          files_checked=len(manifest.files),
                          bytes_checked=sum(e.bytes for e in manifest.files.values()),
                          notes=[INTEGRITY_NOTE])
    report.hashes_checked = True
    if load and not report.problems:
        report.problems += _fresh_load(p, "tunepilot")
        report.loaded_in_fresh_process = True
    return report


def _hf(p: Path, load: bool) -> VerifyReport:
    from tunepilot.checkpoint.hf import HF_MANIFEST, hf_layout, hf_manifest_problems

    files, found = hf_layout(p)
    has_manifest, hashed = hf_manifest_problems(p)
    problems = [CheckpointProblem(c, f, msg, r) for c, f, msg, r in found + hashed]
    step = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        step = int(json.loads((p / "trainer_state.json").read_text())["global_step"])
    rels = [r for rs in files.values() for r in rs if (p / r).is_file()]
    report = VerifyReport(str(p), "hf-trainer", False, problems, layout=files, step=step,
                          world_size=max(1, len(files.get("rng", []))),
                          files_checked=len(rels),
                          bytes_checked=sum((p / r).stat().st_size for r in rels))
    report.hashes_checked = has_manifest and not any(x.component == "manifest"
                                                     for x in report.problems)
    if not has_manifest:
        report.notes.append(f"no {HF_MANIFEST} (TunepilotCallback writes one at each save): "
                            "every file is loaded, but nothing records what the bytes were, so "
                            "damage that still loads (a flipped byte in the weights or the "
                            "optimizer state) cannot be seen - not called intact")
    if load:
        report.problems += _fresh_load(p, "hf", rels)
        report.loaded_in_fresh_process = True
    return report


FRESH_LOAD_TIMEOUT_S = 3600.0


def _fresh_load(p: Path, kind: str, rels: list[str] | None = None) -> list[CheckpointProblem]:
    """Load every component in a new Python process; its problems, or one for a crash. The
    process is started the one way tunepilot starts children (proc/spawn.py): it dies with
    `verify`, even when `verify` is killed with SIGKILL."""
    import tempfile

    from tunepilot.proc.spawn import run_to_end

    cmd = [sys.executable, "-m", "tunepilot.checkpoint.inspect", kind, str(p),
           json.dumps(rels or [])]
    with tempfile.TemporaryDirectory(prefix="tunepilot-verify-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            code, timed_out = run_to_end(cmd, timeout_s=FRESH_LOAD_TIMEOUT_S, stdout=out,
                                         stderr=err, reaper=True)
        stdout = out_path.read_text(errors="replace")
        stderr = err_path.read_text(errors="replace")
    if timed_out:
        return [CheckpointProblem("checkpoint", None, "loading took over an hour (timed out)")]
    try:
        return [CheckpointProblem(**d) for d in json.loads(stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError, TypeError):
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        return [CheckpointProblem("checkpoint", None, f"the loading process failed (exit "
                                  f"{code}): {tail[0][:300]}")]


# --- in the fresh process ------------------------------------------------------------------
def _load_tunepilot(p: Path) -> list[dict]:
    from tunepilot.checkpoint.manifest import read

    manifest, _ = read(p)
    out = []
    for name, rels in manifest.components.items():
        dirs = sorted({r.split("/", 1)[0] for r in rels if "/" in r})
        for d in dirs:
            problem = _load_dcp(p / d, manifest.tensor_encoding)
            if problem:
                out.append({"component": name, "file": d, "problem": problem})
        for rel in rels:
            if rel.endswith(".json"):
                e = manifest.files.get(rel)
                problem = _load_json_component(p / rel, name)
                if problem:
                    out.append({"component": name, "file": rel, "rank": e.rank if e else None,
                                "problem": problem})
    return out


def _load_json_component(f: Path, component: str) -> str | None:
    """Parse a JSON component and check it has the shape a load needs; the RNG streams are
    set in this (throw-away) process, so torch and numpy check their byte lengths too."""
    from tunepilot.checkpoint.components import (
        DATA,
        RNG,
        SCHEDULER,
        CheckpointError,
        data_position_problem,
        set_rng_state,
    )
    from tunepilot.limits import Refused, load_json_capped

    try:
        saved = load_json_capped(f)
    except (OSError, Refused) as exc:
        return f"does not parse as JSON ({str(exc)[:120]})"
    if component == RNG:
        try:
            set_rng_state(saved)
        except CheckpointError as exc:
            return str(exc)
    if component == DATA:
        return data_position_problem(saved)
    if component == SCHEDULER:
        return _load_scheduler(saved)
    return None


def _load_scheduler(saved: object) -> str | None:
    """Load the saved state into a real LambdaLR over as many parameter groups as it has
    learning rates (the shape a resume loads it into)."""
    import torch

    from tunepilot.checkpoint.components import from_json

    if not isinstance(saved, dict) or not isinstance(saved.get("base_lrs"), list):
        return "is not an LR scheduler state"
    n = max(len(saved["base_lrs"]), 1)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    opt = torch.optim.SGD([{"params": [q]} for q in params], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda _s: 1.0] * n)
    try:
        sched.load_state_dict(from_json(saved))
    except Exception as exc:  # any refusal of the state by the scheduler is the finding
        return f"does not load into an LR scheduler ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def _load_dcp(directory: Path, encoding: str) -> str | None:
    """Read every tensor of a DCP directory into tensors of its metadata's shapes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tunepilot.checkpoint.state import RAW

    try:
        reader = dcp.FileSystemReader(directory)
        meta = reader.read_metadata()
        sd = {fqn: torch.empty(md.size, dtype=md.properties.dtype)
              for fqn, md in meta.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata)}
        if encoding == RAW:
            from tunepilot.checkpoint.dcp import RawReader

            reader = RawReader(directory, {})
        dcp.load(sd, storage_reader=reader, no_dist=True)
        return None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"cannot be loaded ({load_error(exc)})"


def load_error(exc: BaseException) -> str:
    """What a failed load says, in one line: DCP's CheckpointException quotes each rank's whole
    traceback in its text, so it is the rank's own exception that is named."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = next(iter(failures.items()))
        inner = pair[0] if isinstance(pair, tuple) else pair
        return f"rank {rank}: {load_error(inner)}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def _load_hf(p: Path, rels: list[str]) -> list[dict]:
    import torch

    from tunepilot.checkpoint.hf import component_of

    out = []
    for rel in rels:
        f = p / rel
        comp = component_of(rel)
        try:
            if rel.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                        st.get_tensor(key)
            elif rel.endswith((".pt", ".pth", ".bin")) and rel != "training_args.bin":
                _torch_load(torch, f)
            elif rel.endswith(".json"):
                json.loads(f.read_bytes())
        except Exception as exc:
            rank = None
            if rel.startswith("rng_state_"):
                rank = int(rel[len("rng_state_"):].split(".")[0])
            out.append({"component": comp, "file": rel, "rank": rank,
                        "problem": f"cannot be loaded ({load_error(exc)})"})
    return out


def _torch_load(torch, f: Path):
    """weights_only loading, with the numpy types HF's RNG files hold allowed."""
    try:
        from transformers.trainer_pt_utils import safe_globals
    except Exception:  # no transformers: plain weights_only
        return torch.load(f, map_location="cpu", weights_only=True)
    with safe_globals():
        return torch.load(f, map_location="cpu", weights_only=True)


def _child(argv: list[str]) -> None:
    kind, path, rels = argv[0], Path(argv[1]), json.loads(argv[2])
    problems = _load_tunepilot(path) if kind == "tunepilot" else _load_hf(path, rels)
    for d in problems:
        d.setdefault("rank", None)
    sys.stdout.write(json.dumps(problems) + "\n")


if __name__ == "__main__":
    _child(sys.argv[1:])
