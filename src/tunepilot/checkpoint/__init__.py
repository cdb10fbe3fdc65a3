"""Checkpoints (stage 3, with tunepilot.restore): the full training state, crash-safe and
verified.

    state       save_checkpoint / load_checkpoint, one rank or sharded over many (DCP)
    components  RNG streams, data position, model reference, exact JSON of state dicts
    manifest    the manifest: SHA-256, size, component and rank of every file; path safety
    verify      verification by file, component and rank; the verified read of a load
    dcp         DCP storage: raw tensor bytes hashed while written, read into place
    files       durable files: fsync, atomic directory swap, stale temporaries
    hf          HF Trainer checkpoint-N/ directories
    inspect     `tunepilot verify`: any checkpoint directory, loaded in a fresh process
    export      a run directory copied off the machine and verified there
Importing this package does not import torch.
"""

from tunepilot.checkpoint.components import (
    COMPONENTS,
    DATA,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    REQUIRED,
    RNG,
    SCALER,
    SCHEDULER,
    CheckpointError,
    data_position,
    rng_state,
    set_rng_state,
)
from tunepilot.checkpoint.manifest import MANIFEST, CheckpointManifest
from tunepilot.checkpoint.state import (
    CheckpointInfo,
    load_checkpoint,
    model_and_optimizer_state,
    save_checkpoint,
)
from tunepilot.checkpoint.verify import CheckpointProblem, verify_checkpoint


def read_manifest(path) -> CheckpointManifest:
    """The checkpoint's manifest (checked against its own digest and its shape)."""
    from pathlib import Path

    from tunepilot.checkpoint import manifest as mf

    manifest, problem = mf.read(Path(path))
    if problem is not None:
        p = CheckpointProblem("manifest", problem[0], problem[1])
        raise CheckpointError(str(p), component="manifest", file=problem[0], problems=[p])
    return manifest


__all__ = ["COMPONENTS", "DATA", "MANIFEST", "MODEL", "OPTIMIZER", "PROGRESS", "REQUIRED", "RNG",
           "SCALER", "SCHEDULER", "CheckpointError", "CheckpointInfo", "CheckpointManifest",
           "CheckpointProblem", "data_position", "load_checkpoint", "model_and_optimizer_state",
           "read_manifest", "rng_state", "save_checkpoint", "set_rng_state",
           "verify_checkpoint"]
