"""Collective bus-bandwidth micro-benchmark, run under torchrun by the preflight.

    python -m torch.distributed.run --nproc-per-node N -m tunepilot.scaling.bench --out FILE

Conventions are those of nccl-tests (doc/PERFORMANCE.md there), so the numbers compare with
what vendors and clouds publish:

    algbw = S / t                    S = message size in bytes (all-gather: the gathered output)
    busbw = algbw * 2(n-1)/n         all-reduce (each rank sends and receives 2(n-1)/n of S)
    busbw = algbw * (n-1)/n          all-gather (each rank receives the n-1 shards it lacks)

t is the slowest rank's time for one call (a collective ends when its last rank does), the median
over the timed iterations. Message sizes default to the 25 MiB DDP gradient bucket
(DistributedDataParallel's bucket_cap_mb default) and 1 / 4 / 64 MiB around it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

MIB = 2**20
GB = 10**9
DDP_BUCKET_BYTES = 25 * MIB  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
DEFAULT_SIZES_BYTES = (1 * MIB, 4 * MIB, DDP_BUCKET_BYTES, 64 * MIB)
OPS = ("all_reduce", "all_gather")


def bus_factor(op: str, n: int) -> float:
    """The busbw / algbw factor of nccl-tests for `op` over n ranks."""
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(factors)}")
    return factors[op]


def algbw_bytes_per_s(size_bytes: int, time_s: float) -> float:
    return size_bytes / time_s


def busbw_bytes_per_s(op: str, size_bytes: int, time_s: float, n: int) -> float:
    return algbw_bytes_per_s(size_bytes, time_s) * bus_factor(op, n)


def row(op: str, size_bytes: int, time_s: float, n: int) -> dict:
    """One result row, bandwidths in GB/s (10^9 bytes per second, as nccl-tests prints)."""
    return {"op": op, "size_bytes": int(size_bytes), "ranks": n, "time_s": time_s,
            "algbw_gbps": algbw_bytes_per_s(size_bytes, time_s) / GB,
            "busbw_gbps": busbw_bytes_per_s(op, size_bytes, time_s, n) / GB}


def _time_op(fn, iters: int, warmup: int, sync, dist, device) -> float:
    """Median over iterations of the slowest rank's wall time for one call of fn()."""
    import torch

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt.item()))
    return statistics.median(times)


def run(sizes_bytes: list[int], iters: int, warmup: int) -> dict:
    """Benchmark both collectives at each size on the process group torchrun set up."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = os.environ.get("TUNEPILOT_SCALE_DEVICE", "cpu") == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)

        def sync():
            torch.cuda.synchronize()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

        def sync():
            return None
    n = dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    try:
        for size in sizes_bytes:
            numel = max(1, size // 4)  # float32 elements
            x = torch.ones(numel, dtype=torch.float32, device=device)
            t = _time_op(lambda x=x: dist.all_reduce(x), iters, warmup, sync, dist, device)
            rows.append(row("all_reduce", numel * 4, t, n))
            shard = torch.ones(max(1, numel // n), dtype=torch.float32, device=device)
            out = torch.empty(shard.numel() * n, dtype=torch.float32, device=device)
            t = _time_op(lambda o=out, s=shard: gather(o, s), iters, warmup, sync, dist, device)
            rows.append(row("all_gather", out.numel() * 4, t, n))
            del x, shard, out
    finally:
        backend = dist.get_backend()
        dist.destroy_process_group()
    return {"ranks": n, "backend": backend, "device": device.type, "iters": iters,
            "warmup": warmup, "rows": rows,
            "timing": "median over iterations of the slowest rank's time per call"}


def main(argv: list[str] | None = None) -> int:
    from tunepilot.proc.spawn import LAUNCHERS, die_with_parent

    die_with_parent(parent_runs=LAUNCHERS)  # torchrun gone (tunepilot killed): this rank goes too
    p = argparse.ArgumentParser(prog="python -m tunepilot.scaling.bench")
    p.add_argument("--out", required=True, help="JSON file local rank 0 of each node writes")
    p.add_argument("--sizes-bytes", default=",".join(str(s) for s in DEFAULT_SIZES_BYTES))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes_bytes.split(",") if s]
    result = run(sizes, a.iters, a.warmup)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one copy per node (all ranks agree)
        from tunepilot.store import write_json

        write_json(Path(a.out), result)
    print(f"[tunepilot bench] done: {len(result['rows'])} measurements", file=sys.stderr)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: see the note at the end of scaling/worker.py
