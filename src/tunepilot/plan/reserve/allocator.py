"""The CUDA caching allocator, replayed: what a step's allocations reserve from the device.

The traced step gives every allocation and release in order (StorageTracker(log_events=True)).
`replay` runs them through the caching allocator's rules (c10/cuda/CUDACachingAllocator.cpp,
PyTorch 2.x, default PYTORCH_CUDA_ALLOC_CONF) and returns the peak of reserved memory - the sum
of the segments it obtained with cudaMalloc and keeps cached:

  sizes     a request is rounded up to 512 bytes (kMinBlockSize)
  pools     requests of up to 1 MiB (kSmallSize) come from the small pool, larger ones from the
            large pool; each pool is per CUDA stream
  segments  a new segment is 2 MiB (kSmallBuffer) for small requests, 20 MiB (kLargeBuffer) for
            1-10 MiB requests, else the request rounded up to 2 MiB (kRoundLarge)
  reuse     the smallest cached free block of the pool that fits (best fit; ties by address);
            it is split when the rest is >= 512 B (small pool) or > 1 MiB (large pool)
  release   a freed block merges with free neighbours in its segment; segments stay reserved
            (no empty_cache, no out-of-memory retry in a step that fits)

`expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) maps one growing
segment per stream and pool instead, in 2 MiB pages for the large pool and 2 MiB for the small:
reserved is then the peak of live bytes rounded to pages, per stream.

What it does not see: kernels' own workspaces (cuBLAS, cuDNN/flash attention scratch) and the
overlap of streams in time (the trace runs the streams' work in program order). No torch import.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: the segment for 1-10 MiB requests
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge
PAGE_BYTES = 2 << 20  # expandable segments map 2 MiB pages


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out for a request of `nbytes`."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(size: int) -> int:
    """The size of the segment cudaMalloc'd when no cached block fits a `size` block."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    __slots__ = ("seg", "offset", "size", "free", "prev", "next")

    def __init__(self, seg: int, offset: int, size: int):
        self.seg, self.offset, self.size = seg, offset, size
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.seg, self.offset)


@dataclass
class Replay:
    """The replay's figures (bytes)."""

    reserved_peak_bytes: int = 0
    allocated_peak_bytes: int = 0  # live blocks, as max_memory_allocated counts them
    num_segments: int = 0
    num_allocations: int = 0
    reserved_by_stream: dict[int, int] = field(default_factory=dict)

    @property
    def slack_bytes(self) -> int:
        return self.reserved_peak_bytes - self.allocated_peak_bytes


class CachingAllocator:
    """The caching allocator's block and segment bookkeeping (sizes only, no memory)."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self._free: dict[tuple[int, bool], list] = {}  # (stream, small) -> sorted free keys
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[int, tuple[_Block, tuple[int, bool]]] = {}
        self._segments = 0
        self.reserved = self.allocated = 0
        self.reserved_by_pool: dict[tuple[int, bool], int] = {}
        self.live_by_pool: dict[tuple[int, bool], int] = {}
        self.out = Replay()

    def malloc(self, ident: int, nbytes: int, stream: int = 0) -> None:
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE_BYTES)
        self.out.num_allocations += 1
        if self.expandable:
            self._live[ident] = (_Block(-1, 0, size), pool)
            self.live_by_pool[pool] = self.live_by_pool.get(pool, 0) + size
            pages = -(-self.live_by_pool[pool] // PAGE_BYTES) * PAGE_BYTES
            if pages > self.reserved_by_pool.get(pool, 0):
                self.reserved += pages - self.reserved_by_pool.get(pool, 0)
                self.reserved_by_pool[pool] = pages
        else:
            block = self._take(pool, size)  # may be larger than asked: an unsplit remainder
            self._live[ident] = (block, pool)
            size = block.size  # counted whole, as the allocator's allocated_bytes counts it
        self.allocated += size
        self.out.allocated_peak_bytes = max(self.out.allocated_peak_bytes, self.allocated)
        if self.reserved > self.out.reserved_peak_bytes:
            self.out.reserved_peak_bytes = self.reserved
            self.out.reserved_by_stream = {}
            for (s, _), b in self.reserved_by_pool.items():
                self.out.reserved_by_stream[s] = self.out.reserved_by_stream.get(s, 0) + b

    def free(self, ident: int) -> None:
        got = self._live.pop(ident, None)
        if got is None:
            return
        block, pool = got
        self.allocated -= block.size
        if self.expandable:
            self.live_by_pool[pool] -= block.size
            return
        block.free = True
        for other in (block.prev, block.next):  # merge with free neighbours
            if other is not None and other.free:
                self._unlist(pool, other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._list(pool, block)

    # --- the pools ----------------------------------------------------------------------------
    def _list(self, pool, block: _Block) -> None:
        k = block.key()
        self._blocks[k] = block
        bisect.insort(self._free.setdefault(pool, []), k)

    def _unlist(self, pool, block: _Block) -> None:
        k = block.key()
        keys = self._free[pool]
        del keys[bisect.bisect_left(keys, k)]
        del self._blocks[k]

    def _take(self, pool, size: int) -> _Block:
        keys = self._free.get(pool, [])
        i = bisect.bisect_left(keys, (size, -1, -1))
        if i < len(keys):
            block = self._blocks[keys[i]]
            self._unlist(pool, block)
        else:
            seg = segment_size(size)
            self._segments += 1
            self.out.num_segments = self._segments
            self.reserved += seg
            self.reserved_by_pool[pool] = self.reserved_by_pool.get(pool, 0) + seg
            block = _Block(self._segments, 0, seg)
        rest = block.size - size
        if rest >= MIN_BLOCK_BYTES if pool[1] else rest > SMALL_SIZE_BYTES:
            tail = _Block(block.seg, block.offset + size, rest)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._list(pool, tail)
        block.free = False
        return block


def replay(events, *, expandable_segments: bool = False) -> Replay:
    """Run an allocation log - (+1, id, bytes, stream) allocations and (-1, id, ...) releases,
    in order - through the caching allocator; its reserved and allocated peaks."""
    alloc = CachingAllocator(expandable_segments)
    for ev in events:
        if ev[0] > 0:
            alloc.malloc(ev[1], ev[2], ev[3])
        else:
            alloc.free(ev[1])
    return alloc.out
