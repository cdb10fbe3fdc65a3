"""The traced step's allocation log, replayed through the CUDA caching allocator's rules
(plan/reserve/allocator.py) for the reserved peak: as the device sees it - under FSDP CPU offload
without the states that live on the host, under FSDP1 after the recipes' unit-by-unit rank-0
initialisation (plan/trace/fsdp.py). Child side of the traced plan."""

from __future__ import annotations

from tunepilot.plan.reserve.allocator import replay
from tunepilot.plan.trace.fsdp import fsdp1_init_events, is_sharded
from tunepilot.plan.trace.tracker import MODEL_STATE, StorageTracker


def replayed(tracker: StorageTracker, spec, model, train_events: int,
             buffer_seqs: set[int]) -> dict | None:
    """The traced allocations (model, two steps, validation) replayed: the reserved peak with
    and without the validation pass (the log's first `train_events` entries), and with
    expandable segments."""
    events = tracker.events
    if not events:
        return None
    train_events = train_events or len(events)
    if is_sharded(spec) and spec.parallel.cpu_offload:
        events = offloaded_events(tracker, events, buffer_seqs)
        train_events = min(train_events, len(events))
    if is_sharded(spec) and spec.parallel.fsdp_version == 1:
        init, taken = fsdp1_init_events(model, tracker, spec.parallel.cpu_offload)
        kept = [e for e in events if not (e[0] > 0 and e[1] in taken)]
        train_events = len(init) + train_events - (len(events) - len(kept))
        events = init + kept
    train = replay(events[:train_events])
    whole = replay(events)
    expandable = replay(events, expandable_segments=True)
    return {"reserved_peak_bytes": whole.reserved_peak_bytes,
            "allocated_peak_bytes": whole.allocated_peak_bytes,
            "training_reserved_peak_bytes": train.reserved_peak_bytes,
            "training_allocated_peak_bytes": train.allocated_peak_bytes,
            "expandable_reserved_peak_bytes": expandable.reserved_peak_bytes,
            "num_segments": whole.num_segments, "num_allocations": whole.num_allocations,
            "reserved_by_stream": {str(k): v for k, v in whole.reserved_by_stream.items()}}


def offloaded_events(tracker: StorageTracker, events: list, buffer_seqs: set[int]) -> list:
    """The allocation log as the device sees it under CPU offload: without the sharded states
    (parameters other than buffers, gradients, optimizer state), which live on the host."""
    host = {rec.seq for rec in tracker.records()
            if rec.cat in MODEL_STATE and rec.seq not in buffer_seqs}
    return [e for e in events if e[1] < 0 or e[1] // 64 not in host]
