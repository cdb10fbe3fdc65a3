"""The caching allocator's reserve over the allocated peak: a model, not a fixed ratio.

  traced plan    the traced allocations replayed through the caching allocator's rules
                 (plan/reserve/allocator.py): its reserved peak minus its allocated peak is the slack
                 (segment rounding, blocks cached for one size that a later size cannot use -
                 mostly the loss's logits, which come in a few large sizes)
  analytic plan  the slack the replay and the card show for fixed-shape steps: a fraction of
                 the allocated peak, at most a cap (resources/runtime.yaml, measured)
  varied shapes  batches padded to their own longest sample (a text dataset without packing):
                 every new length allocates activation-sized blocks of a new size, and the cache
                 keeps the old ones - the reserve grows by about the step's transient memory
                 (activations and temporaries at the peak) times a measured factor, unless
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (one growing segment: no
                 stranded blocks), which the note says
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reserve:
    """The reserved peak and how it was reached."""

    reserved_bytes: int
    slack_bytes: int  # over the allocated peak, fixed-shape part
    varied_shapes_bytes: int  # the extra reserve of varied batch shapes
    how: str


def allocator_constants() -> dict:
    from tunepilot.resources import runtime_constants

    return runtime_constants()["allocator"]


def varied_shapes(spec) -> bool:
    """Batches of varied shape: a text dataset padded per batch (not packed, not synthetic)."""
    return spec.data.source != "synthetic" and not getattr(spec.data, "packing", False)


def expandable_segments(spec, stack: str) -> bool:
    """Whether the card's allocator runs with expandable segments: the spec asks for them
    (allocator.expandable_segments) and the stack has them (runtime.yaml stacks.<stack>.
    expandable_segments: CUDA since PyTorch 2.1; ROCm from 7.0)."""
    from tunepilot.resources import runtime_constants

    asked = bool(getattr(getattr(spec, "allocator", None), "expandable_segments", False))
    st = runtime_constants()["stacks"].get(stack, {})
    return asked and bool(st.get("expandable_segments", {}).get("supported", False))


def held_bytes(allocated_bytes: int, step_bytes: int, stranded_bytes: int) -> int:
    """What the reserve is taken over: the allocated peak, or the step with the blocks a model
    load left cached that it cannot reuse (plan/analytic/megatron_load.py), whichever is more."""
    return max(allocated_bytes, step_bytes + stranded_bytes)


def reserve(allocated_bytes: int, transient_bytes: int, *, replay_slack_bytes: int | None = None,
            varied: bool = False, expandable: bool = False) -> Reserve:
    """The reserved peak for an allocated peak of `allocated_bytes` of which `transient_bytes`
    are activations and temporaries; `replay_slack_bytes` from the traced replay (under
    `expandable` segments, the expandable replay's), else the analytic slack; `varied` batch
    shapes add their fragmentation. Expandable segments map pages as a segment grows (2 MiB
    small pool, 20 MiB large; c10/cuda/CUDACachingAllocator.cpp Note [Expandable Segments]):
    no block is stranded, so the analytic plan adds nothing and varied shapes add nothing."""
    c = allocator_constants()
    if expandable:
        slack = max(0, replay_slack_bytes or 0)
        how = ("expandable segments: " + ("the traced allocations replayed with pages mapped "
                                          "on demand" if replay_slack_bytes is not None else
                                          "pages mapped on demand, no stranded blocks"))
        return Reserve(allocated_bytes + slack, slack, 0, how)
    if replay_slack_bytes is not None:
        slack = max(0, replay_slack_bytes)
        how = "the traced allocations replayed through the caching allocator's rules"
    else:
        slack = min(int(allocated_bytes * c["slack_fraction"]), int(c["slack_cap_bytes"]))
        how = (f"allocated x {c['slack_fraction']:.2%}, at most "
               f"{c['slack_cap_bytes'] / 2**30:.2f} GiB (measured fixed-shape slack)")
    extra = int(max(0, transient_bytes) * c["varied_shapes_transient_factor"]) if varied else 0
    if extra:
        how += (f"; + {c['varied_shapes_transient_factor']:g} x the transient memory for batches "
                "of varied length (the cache keeps blocks of every length it has seen; "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids most of it)")
    return Reserve(allocated_bytes + slack + extra, slack, extra, how)


def reserve_note(varied: bool, *, replayed: bool, expandable: bool = False,
                 asked_unsupported: str | None = None) -> str:
    """The plan's line about its reserve (`asked_unsupported`: the stack where the spec's
    expandable segments are not available)."""
    c = allocator_constants()
    if expandable:
        return ("reserved: expandable segments (allocator.expandable_segments) - "
                + ("the traced allocations replayed with pages mapped on demand" if replayed
                   else "allocated + nothing: pages are mapped as segments grow, no block is "
                   "stranded") + "; cuBLAS/hipBLAS workspaces in allocated (runtime.yaml)")
    base = ("reserved: the traced allocations replayed through the CUDA caching allocator's "
            "rules (segment sizes, best-fit reuse, splitting)" if replayed else
            f"reserved: allocated + {c['slack_fraction']:.2%}, at most "
            f"{c['slack_cap_bytes'] / 2**30:.2f} GiB (measured fixed-shape slack)")
    if varied:
        base += (f"; batches of varied length add {c['varied_shapes_transient_factor']:g} x the "
                 "peak's activations and temporaries (blocks cached for lengths seen before; "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids most of it)")
    if asked_unsupported:
        base += (f"; allocator.expandable_segments is not available on {asked_unsupported} "
                 "(ROCm before 7.0 accepts the setting and ignores it): planned with the "
                 "caching allocator's segments")
    return base + "; cuBLAS workspaces in allocated (resources/runtime.yaml)"


def reserved_on_card(reserved_bytes: int, allocated_bytes: int, usable_bytes: int) -> int:
    """The reserve on a card with `usable_bytes` for the allocator: when cudaMalloc fails, the
    caching allocator releases its cached free blocks and retries before it raises, so a step
    whose allocated peak fits never reserves more than the card has (the published peaks of
    runs sized to fill a card sit there)."""
    if allocated_bytes > usable_bytes:
        return reserved_bytes
    return min(reserved_bytes, usable_bytes)
