"""Every figure tunepilot reports carries its unit and whether it was measured or projected.

    {"value": 1234.5, "unit": "tokens/s", "measured": true}
A figure that could not be obtained on this machine is {"value": null, "unit": ..., "measured":
false, "unavailable": "why"} - never a made-up number.
"""

from __future__ import annotations

from typing import Any


def measured(value: Any, unit: str, **extra: Any) -> dict:
    return {"value": value, "unit": unit, "measured": True, **extra}


def projected(value: Any, unit: str, rule: str, **extra: Any) -> dict:
    return {"value": value, "unit": unit, "measured": False, "projection": rule, **extra}


def unavailable(unit: str, why: str) -> dict:
    return {"value": None, "unit": unit, "measured": False, "unavailable": why}


def value_of(fig: Any, default: Any = None) -> Any:
    """The value of a figure dict (or a bare number), or `default` when missing/unavailable."""
    if isinstance(fig, dict):
        v = fig.get("value")
        return default if v is None else v
    return default if fig is None else fig
