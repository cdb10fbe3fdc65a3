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

from tunepilot.limits import MAX_CARDS, load_json_capped

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
                shards = sorted(set(load_json_capped(p)["weight_map"].values()))
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
        if ranks and max(ranks) >= MAX_CARDS:
            problems.append(("rng", f"rng_state_{max(ranks)}.pth", f"names rank {max(ranks):,}: "
                             f"more ranks than any run has ({MAX_CARDS:,})", max(ranks)))
            ranks = [r for r in ranks if r < MAX_CARDS]
        gaps = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []
        for r in gaps[:8]:
            problems.append(("rng", f"rng_state_{r}.pth", "is missing (other ranks have "
                             "theirs)", r))
        if len(gaps) > 8:
            problems.append(("rng", None, f"and {len(gaps) - 8:,} more ranks' rng_state files "
                             "are missing", None))
    files["trainer_state"] = []
    state = path / "trainer_state.json"
    if not state.is_file():
        problems.append(("trainer_state", "trainer_state.json", "is missing: the step, epoch "
                         "and data position are unknown", None))
    else:
        files["trainer_state"] = ["trainer_state.json"]
        try:
            body = load_json_capped(state)
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
    """One line per problem (empty: resumable as far as files go): the layout, and - when
    tunepilot's manifest is there - every listed file present at its recorded size (the SHA-256s
    are `tunepilot verify`'s: hashing every checkpoint at each resume would be slow)."""
    if not Path(path).is_dir():
        return [f"{path} is not a directory"]
    found = hf_layout(Path(path))[1] + hf_manifest_problems(Path(path), hashes=False)[1]
    return [f"{f or c}: {p}" for c, f, p, _ in found]


# --- the manifest tunepilot writes beside a checkpoint-N/ ---------------------------------------
#
#     checkpoint-N/tunepilot-manifest.json
#         {"format": "tunepilot-hf-checkpoint", "format_version": 1, "step": N,
#          "files": {rel: {"sha256", "bytes", "component"}}, "manifest_sha256": ...}
#
# Written by TunepilotCallback.on_save (the Trainer has finished writing the checkpoint when it
# calls on_save), checked by `tunepilot verify`. Like tunepilot's own manifest it is an unkeyed
# digest: it catches accidental damage (a flipped byte, a truncated or partly copied file, a
# file lost or added), not someone who edits a file and rehashes the manifest.

HF_MANIFEST = "tunepilot-manifest.json"
HF_FORMAT = "tunepilot-hf-checkpoint"
HF_FORMAT_VERSION = 1


def component_of(rel: str) -> str:
    """The resume component a file of a checkpoint-N/ belongs to."""
    if rel.startswith("rng_state"):
        return "rng"
    for c in ("optimizer", "scheduler", "scaler", "trainer_state"):
        if rel.startswith(c):
            return c
    if rel.startswith("global_step"):
        return "optimizer"  # DeepSpeed's partitioned optimizer state
    return "model" if rel.endswith((".safetensors", ".bin", ".json", ".pt")) else "other"


def rank_of(rel: str) -> int | None:
    m = _RNG.match(rel)
    return int(m.group(2)) if m and m.group(2) else None


def _files_on_disk(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.name != HF_MANIFEST
                  and not p.name.startswith(f".{HF_MANIFEST}"))


def write_hf_manifest(path: str | Path, step: int | None = None, *, world_size: int = 1,
                      wait_s: float = 60.0) -> Path:
    """Hash every file of a finished ``checkpoint-N/`` (in parallel threads) and write
    ``tunepilot-manifest.json`` beside them, atomically (temporary file, fsync, rename).

    On ``world_size`` > 1 rank 0 calls it when its own save is done; every rank then still
    writes its own ``rng_state_{R}.pth`` (the Trainer's last, non-collective write), so this
    waits up to ``wait_s`` for each of them to be there with a size that has stopped changing."""
    import os

    from tunepilot.checkpoint.files import fsync_dir, hash_files, write_synced
    from tunepilot.checkpoint.manifest import digest

    path = Path(path)
    if world_size > 1:
        _wait_for_rank_files(path, world_size, wait_s)
    rels = _files_on_disk(path)
    hashed = hash_files(path, rels)
    body = {"format": HF_FORMAT, "format_version": HF_FORMAT_VERSION, "step": step,
            "files": {rel: {"sha256": h, "bytes": n, "component": component_of(rel)}
                      for rel, (h, n) in hashed.items()}}
    body["manifest_sha256"] = digest(body)
    tmp = path / f".{HF_MANIFEST}.tmp-{os.getpid()}"
    write_synced(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    os.replace(tmp, path / HF_MANIFEST)
    fsync_dir(path)
    return path / HF_MANIFEST


def _wait_for_rank_files(path: Path, world_size: int, wait_s: float) -> None:
    import time

    want = [path / f"rng_state_{r}.pth" for r in range(world_size)]
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        sizes = [f.stat().st_size if f.is_file() else -1 for f in want]
        if min(sizes) > 0 and sizes == last:
            return
        last = sizes
        time.sleep(0.2)


Problem = tuple[str, str | None, str, int | None]  # (component, file, problem, rank)


def read_hf_manifest(path: Path) -> tuple[dict | None, list[Problem]]:
    """(the manifest, []) - or (None, []) when there is none, (None, [problem]) when it is
    damaged: not JSON, another format, not matching its own digest, or of the wrong shape."""
    from tunepilot.checkpoint.manifest import MAX_MANIFEST_BYTES, digest, safe_relative

    p = Path(path) / HF_MANIFEST
    if not p.exists():
        return None, []
    try:
        body = load_json_capped(p, MAX_MANIFEST_BYTES)
    except (OSError, ValueError) as exc:  # limits.Refused is a ValueError
        return None, [("manifest", HF_MANIFEST, f"cannot be read as JSON ({str(exc)[:100]})",
                       None)]
    if not isinstance(body, dict) or body.get("format") != HF_FORMAT or \
            body.get("format_version") != HF_FORMAT_VERSION:
        return None, [("manifest", HF_MANIFEST, f"is not a {HF_FORMAT} manifest version "
                       f"{HF_FORMAT_VERSION}", None)]
    if body.get("manifest_sha256") != digest(body):
        return None, [("manifest", HF_MANIFEST, "does not match its own digest (altered on "
                       "disk)", None)]
    files = body.get("files")
    try:
        ok = isinstance(files, dict) and all(
            safe_relative(rel) and isinstance(e, dict) and isinstance(e.get("sha256"), str)
            and isinstance(e.get("bytes"), int) for rel, e in files.items())
    except ValueError:
        ok = False
    if not ok or not (body.get("step") is None or isinstance(body.get("step"), int)):
        return None, [("manifest", HF_MANIFEST, "is not well-formed (files: {path: {sha256, "
                       "bytes}}, step: int)", None)]
    return body, []


def hf_manifest_problems(path: Path, *, hashes: bool = True) -> tuple[bool, list[Problem]]:
    """(a manifest is there, its problems): every listed file present with its size and (with
    ``hashes``) its SHA-256; no file added since; the step the same as trainer_state.json's."""
    from tunepilot.checkpoint.files import hash_files

    path = Path(path)
    body, problems = read_hf_manifest(path)
    if body is None:
        return bool(problems), problems
    listed: dict = body["files"]
    present = []
    for rel, e in sorted(listed.items()):
        f = path / rel
        comp = e.get("component") or component_of(rel)
        if not f.is_file():
            problems.append((comp, rel, "is missing (the manifest lists it)", rank_of(rel)))
        elif f.stat().st_size != e["bytes"]:
            problems.append((comp, rel, f"is {f.stat().st_size:,} bytes, the manifest says "
                             f"{e['bytes']:,} (truncated or rewritten)", rank_of(rel)))
        else:
            present.append(rel)
    if hashes:
        for rel, (sha, _) in sorted(hash_files(path, present).items()):
            e = listed[rel]
            if sha != e["sha256"]:
                problems.append((e.get("component") or component_of(rel), rel,
                                 f"sha256 {sha[:12]}... does not match the manifest's "
                                 f"{e['sha256'][:12]}... (altered on disk)", rank_of(rel)))
    for rel in _files_on_disk(path):
        if rel not in listed:
            problems.append((component_of(rel), rel, "is not in the manifest (added or replaced "
                             "after the save)", rank_of(rel)))
    step = _trainer_step(path)
    if body.get("step") is not None and step is not None and step != body["step"]:
        problems.append(("trainer_state", "trainer_state.json", f"says global_step {step}, the "
                         f"manifest step {body['step']}", None))
    return True, problems


def _trainer_step(path: Path) -> int | None:
    try:
        step = load_json_capped(path / "trainer_state.json")["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None
