"""The MFU a quote assumes when no pilot measured this run's throughput."""

from __future__ import annotations

from tunepilot.catalog import Card
from tunepilot.cost.assumptions import cost_model
from tunepilot.results.figure import Figure


def mfu_for(spec, card: Card, arch) -> Figure:
    """Model FLOP utilisation assumed for the spec on the card (a projected fraction)."""
    kind = spec.method.kind
    mfu = float(cost_model()["mfu_assumed"]["by_method"][kind])
    return Figure.projected(mfu, "fraction", f"assumed, cost_model.yaml mfu_assumed.{kind}")
