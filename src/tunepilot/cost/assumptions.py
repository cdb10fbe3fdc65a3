"""The cost model's assumptions (resources/cost_model.yaml): what a quote falls back on when no
stage measured a term. Every figure taken from here is marked projected and names its key."""

from __future__ import annotations

from functools import cache

import yaml

from tunepilot.resources import COST_MODEL_YAML


@cache
def cost_model() -> dict:
    """The assumptions of ``resources/cost_model.yaml`` (each with source and as_of)."""
    return yaml.safe_load(COST_MODEL_YAML.read_text(encoding="utf-8"))


def assumed(key: str) -> float:
    return float(cost_model()[key]["value"])


def efficiency_assumed(strategy: str, count: int) -> float:
    """Scaling efficiency of ``count`` cards under ``strategy`` (the next larger key's value;
    ``beyond`` past the largest, i.e. several nodes over the network)."""
    table = cost_model()["scaling_efficiency_assumed"]
    keys = sorted(int(k) for k in table[strategy])
    for k in keys:
        if count <= k:
            return float(table[strategy][k])
    return float(table["beyond"])
