"""The pilot stage: real training steps of the run on the local device (CUDA, ROCm or CPU).

    from tunepilot.pilot import run_pilot, PilotOptions
    result = run_pilot(spec, "runs/my-run", PilotOptions(max_steps=50))

Modules: device (probe, catalog card, memory sampler), runner (the pilot), steps (one
instrumented step), memtrack (live tensor bytes, --memory-limit), stats (percentiles, the stop
rule), results (pilot.json), provenance (manifest), render (terminal output). Importing this
package is cheap; torch is imported by the modules that run steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PilotOptions", "PilotResult", "default_run_dir", "run_pilot"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tunepilot.pilot import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'tunepilot.pilot' has no attribute {name!r}")
