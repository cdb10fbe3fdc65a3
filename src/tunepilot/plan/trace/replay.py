"""The traced step's allocation log, replayed through the CUDA caching allocator's rules
(plan/reserve/allocator.py) for the reserved peak: as the device sees it - under FSDP CPU offload
without the states that live on the host, under FSDP1 after the recipes' unit-by-unit rank-0
initialisation (plan/trace/fsdp.py), under DeepSpeed without the single device's optimizer step
(the rank steps its own partition). Child side of the traced plan."""

from __future__ import annotations

from tunepilot.plan.reserve.allocator import replay
from tunepilot.plan.trace.fsdp import fsdp1_init_events, is_sharded
from tunepilot.plan.trace.tracker import MODEL_STATE, StorageTracker


def replayed(tracker: StorageTracker, spec, model, train_events: int,
             buffer_seqs: set[int], optimizer_spans: list[tuple[int, int]] = ()) -> dict | None:
    """The traced allocations (model, two steps, validation) replayed: the reserved peak with
    and without the validation pass (the log's first `train_events` entries), and with
    expandable segments; and the log without the optimizer steps (`optimizer_spans`: their
    ranges of the log), as a DeepSpeed rank's allocator sees the step (rank_step_events)."""
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
    rank_step = {}
    if optimizer_spans and not is_sharded(spec):
        kept = rank_step_events(events, optimizer_spans)
        rs, rx = replay(kept), replay(kept, expandable_segments=True)
        rank_step = {"reserved_peak_bytes": rs.reserved_peak_bytes,
                     "allocated_peak_bytes": rs.allocated_peak_bytes,
                     "expandable_reserved_peak_bytes": rx.reserved_peak_bytes}
    return {"reserved_peak_bytes": whole.reserved_peak_bytes,
            "allocated_peak_bytes": whole.allocated_peak_bytes,
            "training_reserved_peak_bytes": train.reserved_peak_bytes,
            "training_allocated_peak_bytes": train.allocated_peak_bytes,
            "expandable_reserved_peak_bytes": expandable.reserved_peak_bytes,
            "num_segments": whole.num_segments, "num_allocations": whole.num_allocations,
            "reserved_by_stream": {str(k): v for k, v in whole.reserved_by_stream.items()},
            "rank_step": rank_step}


def offloaded_events(tracker: StorageTracker, events: list, buffer_seqs: set[int]) -> list:
    """The allocation log as the device sees it under CPU offload: without the sharded states
    (parameters other than buffers, gradients, optimizer state), which live on the host."""
    host = {rec.seq for rec in tracker.records()
            if rec.cat in MODEL_STATE and rec.seq not in buffer_seqs}
    return [e for e in events if e[1] < 0 or e[1] // 64 not in host]


def rank_step_events(events: list, spans: list[tuple[int, int]]) -> list:
    """The allocation log without what the single device's optimizer steps allocated (and its
    frees). Under DeepSpeed a rank steps its own fp32 partition - one
    sub_group_size slice at a time under ZeRO-3 (stage3.py _optimizer_step) - not the whole
    16-bit model the trace stepped: a foreach AdamW's model-sized temporaries would leave
    segments in the replay that the rank never makes. The rank's step temporaries are in the
    plan's optimizer phase (plan/trace/parallel.py zero_on_trace)."""
    dropped = {e[1] for a, b in spans for e in events[a:b] if e[0] > 0}
    return [e for e in events if e[1] not in dropped]
