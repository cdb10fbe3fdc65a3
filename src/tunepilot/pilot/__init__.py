"""The pilot stage: real training steps of the run on the local device (CUDA, ROCm or CPU).

    from tunepilot.pilot import run_pilot, PilotOptions
    result = run_pilot(spec, "runs/my-run", PilotOptions(max_steps=50))   # a PilotResult

Modules: prepare (device, memory check, data, provenance), runner (the sequence), steps (one
instrumented step and the memory-probe step), probe (allocator, checkpoint write,
--find-max-batch), load (how busy the machine was), stats (percentiles, the stop rule),
assemble + residuals (pilot.json), provenance (manifest). Importing this package is cheap;
torch is imported by the modules that run steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PilotOptions", "run_pilot"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tunepilot.pilot import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'tunepilot.pilot' has no attribute {name!r}")
