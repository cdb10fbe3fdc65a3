"""The spot term priced with its interruptions (cost/spot.py), beside the on-demand job.

Money is integer cents or Decimal rates, never a float; times are seconds (Figure, unit "s").
"""

from __future__ import annotations

from decimal import Decimal

from pydantic import Field

from tunepilot.results.base import Model
from tunepilot.results.figure import Figure


class SpotOutcome(Model):
    """One number of interruptions and what it costs: the run's hours and the bill."""

    quantile: float
    """the Poisson quantile of the interruptions (0.1, 0.5, 0.9)"""
    interruptions: int
    hours: float
    cost_cents: int


class SpotQuote(Model):
    """An interruption-aware spot term: the checkpoint interval that minimises the expected
    cost, the expected interruptions and lost work, the expected hours and cost with a spread,
    and the on-demand job beside it."""

    spot_usd_per_hour: Decimal
    """per card-hour"""
    spot_source: str
    on_demand_usd_per_hour: Decimal
    cards: int
    """the cards billed: the training cards and a vLLM server's, which an interruption stops too"""
    nodes: int
    rate_per_node_hour: Figure
    """interruptions per instance-hour (unit 1/h): the catalog's, the user's, or assumed"""
    rate_per_job_hour: Figure
    """nodes x the node's rate: any node reclaimed stops the job"""
    mtbi_s: Figure | None
    """mean time between the job's interruptions (None: a rate of 0)"""
    save_s: Figure
    """C: one checkpoint save (restore.json save_s where measured)"""
    restart: dict[str, Figure]
    """R's terms: provisioning, set-up, model load, checkpoint load, data skip"""
    restart_s: Figure
    interval_s: Figure
    """T: work between checkpoints"""
    interval_rule: str
    daly_interval_s: float | None = None
    """Daly's higher-order interval, for comparison"""
    interval_steps: int
    """T in optimizer steps at the quote's step time: checkpoint.every_steps for a spot run"""
    step_s: float
    checkpoints: int
    """checkpoint writes over the job at T"""
    work_s: Figure
    """B: the job with checkpoint writes every T and no interruption"""
    lost_per_interruption_s: Figure
    """T / 2 of work + R"""
    expected_interruptions: Figure
    expected_s: Figure
    """H = B / (1 - rate x lost): the run's expected wall time, interruptions included"""
    finishes: bool
    """False when the job is interrupted faster than it recovers (rate x lost >= 1)"""
    reason: str | None = None
    spread: list[SpotOutcome] = Field(default_factory=list)
    naive_cost_cents: int
    """the on-demand job's time x the spot rate: spot priced as if never interrupted"""
    expected_cost_cents: int | None
    on_demand_cost_cents: int
    """the same job at the on-demand rate (no term discount), billed the same way"""
    overhead_fraction: float | None
    """expected / naive - 1"""
    notes: list[str] = Field(default_factory=list)

    def outcome(self, quantile: float) -> SpotOutcome | None:
        return next((o for o in self.spread if o.quantile == quantile), None)
