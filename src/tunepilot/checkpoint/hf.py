"""HF Trainer ``checkpoint-N/`` directories: what a resume needs, and which of it is there.

    model         model.safetensors | adapter_model.safetensors | sharded *.safetensors + index
                  (pytorch_model.bin / adapter_model.bin: the older format)
    optimizer     optimizer.pt (FSDP/DeepSpeed: an optimizer_0/ or global_step*/ directory)
    scheduler     scheduler.pt: without it the LR schedule restarts at step 0 on resume
    rng           rng_state.pth (one process) or rng_state_{R}.pth (one per rank): without them
                  dropout masks and data order differ from the run that was interrupted
    trainer_state trainer_state.json: global_step, epoch, log history, best checkpoint
    scaler        scaler.pt (fp16 runs; optional)
No torch here: presence, sizes and JSON only. Loading is checkpoint/inspect.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_RNG = re.compile(r"^rng_state(_(\d+))?\.pth$")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin",
                "adapter_model.bin")


def looks_like_hf_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / "trainer_state.json").is_file()
                              or bool(re.match(r"^checkpoint-\d+$", path.name)))


def weight_files(path: Path) -> list[str]:
    """The model weight files: single, adapter, or the shards an index names."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        p = path / index
        if p.is_file():
            try:
                shards = sorted(set(json.loads(p.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return [index]
            return [index, *shards]
    return [f for f in WEIGHT_FILES if (path / f).is_file()]


def rng_files(path: Path) -> list[str]:
    found = [p.name for p in path.iterdir() if _RNG.match(p.name)]
    return sorted(found, key=lambda n: int(_RNG.match(n).group(2) or -1))


def hf_layout(path: Path) -> tuple[dict[str, list[str]], list[tuple[str, str | None, str,
                                                                       int | None]]]:
    """({component: [files]}, [(component, file, problem, rank)]) of a checkpoint-N dir."""
    files: dict[str, list[str]] = {}
    problems: list[tuple[str, str | None, str, int | None]] = []
    weights = weight_files(path)
    files["model"] = weights
    if not weights:
        problems.append(("model", None, "no model weights (model.safetensors, "
                         "adapter_model.safetensors, or a sharded index)", None))
    for rel in weights:
        if not (path / rel).is_file():
            problems.append(("model", rel, "is named by the index but missing", None))
    opt = [n for n in ("optimizer.pt", "optimizer.bin") if (path / n).is_file()]
    opt += [p.name for p in path.iterdir() if p.is_dir() and
            (p.name.startswith("optimizer") or p.name.startswith("global_step"))]
    files["optimizer"] = opt
    if not opt:
        problems.append(("optimizer", "optimizer.pt", "is missing: the optimizer state (Adam "
                         "moments) restarts from zero on resume", None))
    files["scheduler"] = ["scheduler.pt"] if (path / "scheduler.pt").is_file() else []
    if not files["scheduler"]:
        problems.append(("scheduler", "scheduler.pt", "is missing: the learning-rate schedule "
                         "restarts at step 0 on resume", None))
    rngs = rng_files(path)
    files["rng"] = rngs
    if not rngs:
        problems.append(("rng", "rng_state.pth", "is missing: dropout and data order after "
                         "the resume differ from the interrupted run", None))
    else:
        ranks = [int(_RNG.match(n).group(2)) for n in rngs if _RNG.match(n).group(2)]
        for r in sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []:
            problems.append(("rng", f"rng_state_{r}.pth", "is missing (other ranks have "
                             "theirs)", r))
    files["trainer_state"] = []
    state = path / "trainer_state.json"
    if not state.is_file():
        problems.append(("trainer_state", "trainer_state.json", "is missing: the step, epoch "
                         "and data position are unknown", None))
    else:
        files["trainer_state"] = ["trainer_state.json"]
        try:
            body = json.loads(state.read_text())
            if not isinstance(body.get("global_step"), int):
                problems.append(("trainer_state", "trainer_state.json", "has no integer "
                                 "global_step", None))
        except (OSError, ValueError, AttributeError) as exc:
            problems.append(("trainer_state", "trainer_state.json",
                             f"is not valid JSON ({str(exc)[:100]})", None))
    if (path / "scaler.pt").is_file():
        files["scaler"] = ["scaler.pt"]
    for comp, rels in files.items():
        for rel in rels:
            p = path / rel
            if p.is_file() and p.stat().st_size == 0:
                problems.append((comp, rel, "is empty (0 bytes)", None))
    return files, problems


def hf_checkpoint_problems(path: Path) -> list[str]:
    """One line per problem (empty: resumable as far as files go)."""
    if not Path(path).is_dir():
        return [f"{path} is not a directory"]
    return [f"{f or c}: {p}" for c, f, p, _ in hf_layout(Path(path))[1]]
