"""decision.json: the staged pilot's gates and its one decision."""

from __future__ import annotations

from pydantic import Field

from tunepilot.results.base import Model, StageResult
from tunepilot.results.quote import Quote


class Gate(Model):
    """One stage's verdict: passed | failed | skipped (not needed here); reused (earlier run)."""

    stage: str
    status: str
    summary: str
    reused: bool = False


class Decision(StageResult):
    STAGE = "decision"
    run_dir: str
    spec_label: str
    ready: bool = False
    decision: str = ""
    gates: list[Gate] = Field(default_factory=list)
    quote: Quote | None = None
    warnings: list[str] = Field(default_factory=list)
