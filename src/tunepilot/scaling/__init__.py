"""The scaling test: 1 rank vs N ranks under torchrun, DDP and FSDP2, at the same global batch.

    preflight.py  devices vs ranks, topology, NUMA placement, collective library, bus bandwidth
    topology.py   parsers of `nvidia-smi topo -m` and `rocm-smi --showtopo`
    bench.py      the all-reduce / all-gather bus-bandwidth micro-benchmark (a torchrun entry)
    launch.py     torchrun as a subprocess: timeout, whole-group teardown, the failed rank's log
    worker.py     the per-rank entry point (DDP / FSDP2 / the 1-rank baseline)
    runner.py     scale(): preflight, memory check, baseline, strategies
    analysis.py   summaries, the comparison with the baseline, the recommendation

Importing this package does not import torch (the worker, bench and probe do, when they run).
"""

from tunepilot.scaling.runner import scale

__all__ = ["scale"]
