"""An asynchronous checkpoint save: training continues once the state has been copied.

``save_checkpoint_async`` copies the model and optimizer tensors into staging buffers (CPU
memory kept from one save to the next, so only the first save pays for allocating it), takes the
small components (RNG streams, data position, scheduler, progress) at the same step, and hands
the writing - files, SHA-256, fsync, manifest, atomic swap - to a background thread. It returns
a ``PendingSave`` whose ``unblocked_s`` is the time the caller was held (the figure that matters
for step time); ``result()`` waits for the write and raises its CheckpointError if it failed. The
crash safety is the synchronous save's: until the swap, the previous checkpoint is the one on disk.

This is DCP's ``async_save`` idea (stage to CPU, write in a thread) on tunepilot's own storage
and commit; one process only (a distributed async save would need its own process group for the
commit's collectives).
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tunepilot.checkpoint.components import MODEL, CheckpointError
from tunepilot.checkpoint.state import (
    CheckpointInfo,
    import_dcp,
    model_and_optimizer_state,
    rank_world,
    snapshot,
    write_snapshot,
)

if TYPE_CHECKING:
    from tunepilot.dataset import DataStream
    from tunepilot.spec import RunSpec
    from tunepilot.training.step import TrainState

_EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="tunepilot-ckpt")
_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> staged copies
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> last PendingSave
_LOCK = threading.Lock()


class PendingSave:
    """A save in progress: ``unblocked_s`` now, ``result()`` when the files are in place."""

    def __init__(self, future: Future, unblocked_s: float, path: Path):
        self._future = future
        self.unblocked_s = unblocked_s
        self.path = path

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        return self._future.result(timeout)


def save_checkpoint_async(path: Path, state: TrainState, stream: DataStream, spec: RunSpec,
                          extra: dict | None = None) -> PendingSave:
    """Copy the state, return; the checkpoint is written and swapped into place behind."""
    _, world = rank_world()
    if world > 1:
        raise CheckpointError("an asynchronous save runs in one process; a distributed run "
                              "saves with save_checkpoint on every rank.", component=MODEL)
    import_dcp()
    with _LOCK:
        previous = _PENDING.get(state.model)
    if previous is not None:  # its staging buffers are about to be reused
        previous._future.exception()
    t0 = time.perf_counter()
    live = model_and_optimizer_state(state, spec)
    staged = _stage(state.model, live)
    snap = snapshot(state, stream, spec, staged)
    unblocked = time.perf_counter() - t0
    future = _EXECUTOR.submit(write_snapshot, Path(path), snap, extra, time.perf_counter())
    pending = PendingSave(future, unblocked, Path(path))
    with _LOCK:
        _PENDING[state.model] = pending
    return pending


def _stage(model, state_dicts: tuple[dict, dict]) -> tuple[dict, dict]:
    """Copies of the two state dicts in buffers reused from this model's previous save."""
    import torch

    with _LOCK:
        buffers = _STAGING.setdefault(model, {})

    def copy_tree(obj, key: tuple):
        if isinstance(obj, torch.Tensor):
            buf = buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
                buffers[key] = buf
            buf.copy_(obj.detach())
            return buf
        if isinstance(obj, dict):
            return {k: copy_tree(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy_tree(v, (*key, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    return copy_tree(state_dicts[0], ("model",)), copy_tree(state_dicts[1], ("optimizer",))
