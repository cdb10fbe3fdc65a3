"""The caching allocator replay (plan/reserve/allocator.py) and the reserve model (plan/reserve/core.py).

The replay follows c10/cuda/CUDACachingAllocator.cpp's rules; these tests check each rule on a
hand-made allocation log, then the model's arithmetic. No torch needed.
"""

from __future__ import annotations

import pytest

from tunepilot.plan.reserve.allocator import (
    LARGE_BUFFER_BYTES,
    SMALL_BUFFER_BYTES,
    replay,
    round_size,
    segment_size,
)
from tunepilot.plan.reserve.core import reserve, varied_shapes
from tunepilot.spec import spec_from_dict

MIB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_by_size_class():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(4096) == SMALL_BUFFER_BYTES  # <= 1 MiB: a 2 MiB small-pool segment
    assert segment_size(3 * MIB) == LARGE_BUFFER_BYTES  # 1-10 MiB: a 20 MiB segment
    assert segment_size(11 * MIB + 1) == 12 * MIB  # >= 10 MiB: rounded up to 2 MiB


def test_small_requests_share_one_segment():
    r = replay([[1, i, 1000, 0] for i in range(100)])  # 100 x 1 KiB blocks
    assert r.num_segments == 1 and r.reserved_peak_bytes == SMALL_BUFFER_BYTES
    assert r.allocated_peak_bytes == 100 * 1024


def test_a_freed_block_is_reused_and_split_for_a_smaller_request():
    events = [[1, 1, 100 * MIB, 0], [-1, 1, 0, 0], [1, 2, 60 * MIB, 0], [1, 3, 30 * MIB, 0]]
    r = replay(events)
    assert r.num_segments == 1 and r.reserved_peak_bytes == 100 * MIB


def test_a_larger_request_cannot_use_smaller_cached_blocks_fragmentation():
    # two 40 MiB blocks freed, then one 60 MiB request: 80 MiB cached, yet a new segment
    events = [[1, 1, 40 * MIB, 0], [1, 2, 40 * MIB, 0], [-1, 1, 0, 0], [-1, 2, 0, 0],
              [1, 3, 60 * MIB, 0]]
    r = replay(events)
    assert r.reserved_peak_bytes == 140 * MIB and r.allocated_peak_bytes == 80 * MIB
    assert replay(events, expandable_segments=True).reserved_peak_bytes == 80 * MIB


def test_neighbouring_free_blocks_merge_within_a_segment():
    events = [[1, 1, 100 * MIB, 0], [-1, 1, 0, 0], [1, 2, 50 * MIB, 0], [1, 3, 50 * MIB, 0],
              [-1, 2, 0, 0], [-1, 3, 0, 0], [1, 4, 100 * MIB, 0]]
    assert replay(events).reserved_peak_bytes == 100 * MIB  # 50 + 50 merged back into 100


def test_streams_keep_their_own_pools():
    events = [[1, 1, 64 * MIB, 1], [-1, 1, 0, 0], [1, 2, 64 * MIB, 0]]
    r = replay(events)
    assert r.reserved_peak_bytes == 128 * MIB and r.reserved_by_stream == {0: 64 * MIB,
                                                                           1: 64 * MIB}


def test_a_whole_unsplit_block_counts_as_allocated():
    # a 21 MiB request gets a 22 MiB segment; the 1 MiB rest is not split off (large pool:
    # only a rest over 1 MiB is), so max_memory_allocated counts 22 MiB
    assert replay([[1, 1, 21 * MIB, 0]]).allocated_peak_bytes == 22 * MIB
    assert replay([[1, 1, 20 * MIB, 0]]).allocated_peak_bytes == 20 * MIB


def test_reserve_uses_the_replayed_slack_else_the_measured_fraction_up_to_its_cap():
    gib = 1 << 30
    traced = reserve(30 * gib, 10 * gib, replay_slack_bytes=gib)
    assert traced.reserved_bytes == 31 * gib and "replayed" in traced.how
    small, large = reserve(4 * gib, gib), reserve(60 * gib, gib)
    assert small.slack_bytes == pytest.approx(4 * gib * 0.0565, rel=1e-6)  # runtime.yaml
    assert large.slack_bytes == int(1.5 * gib)  # the cap


def test_varied_lengths_add_the_transient_memory_and_name_the_fix():
    gib = 1 << 30
    fixed = reserve(37 * gib, 28 * gib)
    varied = reserve(37 * gib, 28 * gib, varied=True)
    assert varied.reserved_bytes - fixed.reserved_bytes == 28 * gib  # factor 1.0, measured
    assert "expandable_segments" in varied.how


def test_text_data_without_packing_has_varied_shapes():
    base = {"model": {"preset": "tiny"}}
    assert not varied_shapes(spec_from_dict(base))
    assert varied_shapes(spec_from_dict(dict(base, data={"source": "tiny-text"})))
    assert not varied_shapes(spec_from_dict(dict(base, data={"source": "tiny-text",
                                                             "packing": True})))


def _stepped_log() -> tuple[list, list]:
    """Step 1's activation, its optimizer step (a foreach AdamW's two model-sized temporaries
    and a kept state), then step 2's activation: the log and the optimizer step's span."""
    log = [[1, 1, 150 * MIB, 0], [-1, 1, 0, 0]]
    start = len(log)
    log += [[1, 2, 100 * MIB, 0], [1, 3, 100 * MIB, 0], [1, 4, 10 * MIB, 0],
            [-1, 2, 0, 0], [-1, 3, 0, 0]]
    span = (start, len(log))
    log += [[1, 5, 150 * MIB, 0], [-1, 5, 0, 0]]
    return log, [span]


def test_a_deepspeed_rank_replays_the_step_without_the_single_devices_optimizer_step():
    from tunepilot.plan.trace.replay import rank_step_events

    log, spans = _stepped_log()
    whole = replay(log)
    # the temporaries' segments stay cached beside the activation's
    assert whole.reserved_peak_bytes - whole.allocated_peak_bytes >= 150 * MIB
    rank = replay(rank_step_events(log, spans))
    assert [e[1] for e in rank_step_events(log, spans)] == [1, 1, 5, 5]
    assert rank.reserved_peak_bytes - rank.allocated_peak_bytes == 0


def test_the_traced_plans_slack_is_the_rank_steps_only_under_deepspeed():
    from types import SimpleNamespace

    from tunepilot.plan.trace.core import replay_slack
    from tunepilot.plan.trace.messages import TracedAllocator

    a = TracedAllocator(reserved_peak_bytes=350 * MIB, allocated_peak_bytes=200 * MIB,
                        training_reserved_peak_bytes=350 * MIB,
                        training_allocated_peak_bytes=200 * MIB,
                        expandable_reserved_peak_bytes=210 * MIB, num_segments=4,
                        num_allocations=5,
                        rank_step={"reserved_peak_bytes": 160 * MIB,
                                   "allocated_peak_bytes": 150 * MIB,
                                   "expandable_reserved_peak_bytes": 152 * MIB})
    raw = SimpleNamespace(allocator=a)
    model = {"model": {"preset": "tiny"}, "method": {"kind": "full"}}
    ds = spec_from_dict(dict(model, parallel={"strategy": "deepspeed", "devices": 2,
                                              "deepspeed": {"stage": 2}}))
    ddp = spec_from_dict(dict(model, parallel={"strategy": "ddp", "devices": 2}))
    assert replay_slack(ds, raw, False)[0] == 10 * MIB
    assert replay_slack(ds, raw, True)[0] == 2 * MIB
    assert replay_slack(ddp, raw, False)[0] == 150 * MIB  # a DDP rank steps the whole model
    assert replay_slack(ddp, SimpleNamespace(allocator=None), False) == (None, None)
