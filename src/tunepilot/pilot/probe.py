"""The pilot's probes: the memory-probe step, the allocator's counters, one timed checkpoint
write, and --find-max-batch (the largest micro-batch whose full steps complete)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from tunepilot.dataset import longest_batch
from tunepilot.errors import TunepilotError
from tunepilot.pilot.measurements import CheckpointWrite, StepRecord
from tunepilot.pilot.steps import (
    InstrumentedStep,
    free_memory,
    optimizer_state_complete,
    probe_step_memory,
)
from tunepilot.plan.search import largest_passing
from tunepilot.plan.trace.tracker import StorageTracker, state_tensors, tensor_bytes
from tunepilot.training.build import make_state

MAX_SEARCH_MICRO_BATCH = 4096  # --find-max-batch stops doubling here
CPU_SEARCH_RAM_FRACTION = 0.8  # on CPU the search caps tensors at 80% of free RAM: the OS
# kills a process that runs out of RAM (no exception to catch), so the search must stop first
DISK_MARGIN = 1.2  # a checkpoint write needs this much more free disk than the state's bytes


def probe_step(s) -> StepRecord:
    """Warm-up step 2 on the longest batch under the tracker: memory by component."""
    s.tracker.adopt(s.longest_batch.values())
    probe = InstrumentedStep(s.pilot_spec, s.device_type, tracker=s.tracker, sharded=s.sharded)
    rec, mem = probe_step_memory(s.run.state, lambda: s.longest_batch, s.pilot_spec, s.tracker,
                                 probe)
    s.step_memory = mem
    if mem.generation_peak_bytes is not None:
        s.m.generation_peak_bytes = mem.generation_peak_bytes
        g = s.pilot_spec.objective.generation
        s.m.generation_how = "transformers' generate (KV cache)" + (
            "" if g.backend == "transformers" else f"; the spec's {g.backend} needs a GPU and "
            "vLLM: its generation is not measured here (the plan computes its reserve)")
    s.log(f"memory probe step: {mem}")
    return rec


def reset_allocator_peak(s, segment: str) -> None:
    if not s.gpu:
        return
    _note_allocator(s, segment)
    torch.cuda.reset_peak_memory_stats()


def _note_allocator(s, segment: str) -> None:
    s.m.allocator.note_segment(segment, torch.cuda.max_memory_allocated(),
                               torch.cuda.max_memory_reserved())


def read_allocator(s) -> None:
    if s.tracker is not None:
        s.tracked_peak_bytes = s.tracker.peak_bytes
    if not s.gpu:
        return
    _note_allocator(s, "steady")
    stats = torch.cuda.memory_stats()
    s.m.allocator.num_alloc_retries = int(stats.get("num_alloc_retries", 0))
    s.m.allocator.num_ooms = int(stats.get("num_ooms", 0))


def checkpoint_probe(s) -> None:
    """One write of the full training state, timed (then removed: it is a probe)."""
    from tunepilot.checkpoint.state import model_and_optimizer_state, save_checkpoint

    s.progress("checkpoint write", 0, None)
    parent = s.run_dir / "checkpoints"
    parent.mkdir(parents=True, exist_ok=True)
    msd, osd = model_and_optimizer_state(s.run.state, s.pilot_spec)  # LoRA: adapters only
    need = tensor_bytes(t for sd in (msd, osd) for t in _tensors_in(sd))
    need = int(s.agree_max(need)) * s.world_size  # a sharded state: every rank's shard
    free = shutil.disk_usage(parent).free
    if s.agree_max(float(need * DISK_MARGIN > free)):  # the ranks write together, or none
        s.m.checkpoint = CheckpointWrite(unavailable=f"not enough free disk in {parent}: the "
                                         f"state is about {need:,} bytes, {free:,} free")
        return
    tmp = Path(s.options.probe_dir) if s.sharded else \
        Path(tempfile.mkdtemp(prefix=".pilot-probe-", dir=parent))
    try:
        s.sync()
        t0 = time.perf_counter()
        info = save_checkpoint(tmp / "ckpt", s.run.state, s.run.stream, s.pilot_spec,
                               extra={"written_by": "tunepilot pilot (timing probe)"})
        s.m.checkpoint = CheckpointWrite(
            seconds=time.perf_counter() - t0, nbytes=int(info.bytes), files=len(info.files),
            kind=info.kind, method="tunepilot.checkpoint.save_checkpoint (the format the run "
                                   "writes: atomic, fsynced, checksummed)")
    except (OSError, TunepilotError) as exc:  # a failed write is a finding, not a crash
        s.m.checkpoint = CheckpointWrite(unavailable=f"the checkpoint write failed: {exc}")
        s.m.notes.append(s.m.checkpoint.unavailable)
    finally:
        if s.sharded:
            import torch.distributed as dist

            dist.barrier()  # every rank's files are written before rank 0 removes them
        if s.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    s.log(f"checkpoint write: {s.m.checkpoint}")


def _tensors_in(obj):
    """Every tensor in a nested state dict."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors_in(v)


def _search_limit(s, base: StorageTracker) -> tuple[int | None, str | None]:
    limit = s.options.memory_limit_bytes
    if limit is not None:
        return limit, f"--memory-limit {limit:,} bytes"
    if s.gpu:
        return None, "the device's memory"
    import psutil

    limit = base.live_bytes + int(CPU_SEARCH_RAM_FRACTION * psutil.virtual_memory().available)
    return limit, (f"{CPU_SEARCH_RAM_FRACTION:.0%} of the RAM free at the start of the search "
                   f"({limit:,} bytes of tensors): running out of RAM kills the process instead "
                   "of raising")


def find_max_batch(s) -> None:
    """--find-max-batch: the largest micro-batch whose full steps on the longest batches
    complete; the model is kept, gradients and activations are freed between tries."""
    spec, run = s.pilot_spec, s.run
    s.progress("find max micro-batch", 0, None)
    free_memory(run.model)
    if not optimizer_state_complete(run.state):
        run.state = make_state(spec, run.model, 3)
    base = StorageTracker(1, device_type=s.device_type)
    base.adopt(state_tensors(run.model, run.state.optimizer))
    limit, limit_note = _search_limit(s, base)
    accum = min(spec.gradient_accumulation_steps, 2)  # >= 2 micro-batches all cost the same
    peaks: dict[int, int] = {}
    t0 = time.perf_counter()

    def ok(b: int) -> bool:
        s.progress("find max micro-batch", b, None)
        lb = longest_batch(run.dataset, s.data_info, b)
        tracker = StorageTracker(1, limit_bytes=limit, device_type=s.device_type)
        tracker.adopt(state_tensors(run.model, run.state.optimizer))
        tracker.adopt(lb.values())
        step = InstrumentedStep(spec, s.device_type, tracker=tracker)
        try:
            for _ in range(1 if optimizer_state_complete(run.state) else 2):
                step(run.state, lambda: lb, accumulation=accum)
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        finally:
            peaks[b] = tracker.peak_bytes
            del tracker, step
            lb = None  # noqa: F841 - frees the batch before the next try
            free_memory(run.model)
        s.log(f"find-max-batch: micro_batch {b} {'fits' if fits else 'does not fit'} "
              f"(tracked peak {peaks[b]:,} bytes)")
        return fits

    fitted = s.does_not_fit is None
    best, tries = largest_passing(ok, MAX_SEARCH_MICRO_BATCH,
                                  known_ok=spec.micro_batch_size if fitted else None,
                                  known_bad=None if fitted else spec.micro_batch_size)
    s.search = {"max_micro_batch": best, "limit": limit_note, "accumulation_tried": accum,
                "tries": [{"micro_batch_size": b, "fits": f, "tracked_peak_bytes": peaks.get(b)}
                          for b, f in tries],
                "seconds": time.perf_counter() - t0,
                "capped": bool(best >= MAX_SEARCH_MICRO_BATCH // 2 and all(f for _, f in tries)),
                "sequence_length": s.longest["sequence_length"] if s.longest else None}
