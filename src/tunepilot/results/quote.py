"""quote.json and compare.json: the cost of a fixed term and the cost per useful token.

Money is integer cents (line items, totals) or Decimal (rates per million tokens), written as
decimal strings in JSON; never a float.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import Field, computed_field, model_validator

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure
from tunepilot.results.host import HostFit
from tunepilot.results.spot import SpotQuote
from tunepilot.units import cents_to_usd


class _Derived(Model):
    """A model whose computed fields are written to JSON and ignored when read back."""

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, obj: Any) -> Any:
        names = set(cls.model_computed_fields)
        if isinstance(obj, dict) and names & set(obj):
            obj = {k: v for k, v in obj.items() if k not in names}
        return obj


class LineItem(Model):
    """One line of a bill: ``amount_cents`` is exact; quantity and unit price are Decimal text."""

    kind: str  # compute | discount | option | refund
    description: str
    quantity: str
    unit: str
    unit_price_usd: str
    amount_cents: int


class TermCost(_Derived):
    """The price of renting ``count`` cards for ``term_s``: line items in cents and their sum."""

    card_id: str
    count: int
    term_s: int
    billed_s: int
    discount_term: str | None
    discount_percent: str
    items: list[LineItem]

    @computed_field
    @property
    def total_cents(self) -> int:
        return sum(item.amount_cents for item in self.items)

    @computed_field
    @property
    def total_usd(self) -> str:
        return str(cents_to_usd(self.total_cents))


class TimeTerm(Model):
    """One term of the job's time: ``each`` x ``times`` = ``total`` (seconds)."""

    name: str
    times: int
    each: Figure
    total: Figure
    parts: list[TimeTerm] = Field(default_factory=list)
    """an RL objective's training, phase by phase (generation, weight sync, log-probs, reward,
    policy update: cost/rl_step.py), each over the job's generation batches; they add up to
    the term"""
    dominant: str | None = None
    """the part that takes the most time"""


class QuoteThroughput(Model):
    """The throughput a quote divides by: useful tokens/s of one card, the scaling efficiency of
    N, and their product."""

    useful_fraction: Figure
    """useful (supervised) tokens / token positions"""
    per_card: Figure
    """useful tokens/s of one card"""
    efficiency: Figure
    """N cards' throughput / (N x one card's), at the quote's global-batch rule"""
    total: Figure
    """useful tokens/s of the N cards"""

    def rows(self) -> list[tuple[str, Figure]]:
        return [(name, getattr(self, name)) for name in type(self).model_fields]


class BatchOnCards(Model):
    """The global-batch rule the quote (and the scaling test) holds across card counts."""

    global_batch_samples: int
    micro_batch_size: int
    accumulation_per_rank: int
    rule: str = ("the spec's global batch (micro_batch_size x gradient_accumulation_steps x "
                 "parallel.world_size) is held fixed on every card count; each card takes its "
                 "share as micro-batches x accumulation")
    note: str | None = None


class RunNumbers(Model):
    """The run in numbers at this card count (spec/batch.py), what the terms are made of: the
    quote prints it before them, as the plan prints its tokens per step."""

    sequences_per_sample: int
    """sequences through the policy per sample: 2 for a preference pair, else 1"""
    positions_per_micro_batch: int
    """token positions of one rank's micro-batch (padding included)"""
    positions_per_step: int
    """token positions of one optimizer step over every card"""
    useful_fraction: float
    """trained tokens / token positions (the throughput's useful fraction)"""
    useful_tokens_per_step: float
    optimizer_steps: int
    steps_per_epoch: int | None = None
    """optimizer steps of one epoch of the profiled dataset at this card count (None: no
    dataset profile)"""
    flops_per_step: Figure
    """training FLOPs of one optimizer step: FLOPs per token x positions per step"""
    mfu: Figure
    """the model FLOP utilisation one card's throughput implies (positions/s x FLOPs per token
    / the card's dense peak): training time = steps x FLOPs per step / (MFU x peak x cards x
    scaling efficiency)"""


class RunSource(Model):
    """The run directory a quote took measurements from."""

    path: str
    card_id: str | None
    device: str
    files: list[str]
    notes: list[str] = Field(default_factory=list)


class Quote(StageResult, _Derived):
    """A term of ``count`` x ``card_id``: the job's time, the term's cost, cost per useful token."""

    STAGE = "quote"
    spec_label: str
    card_id: str
    count: int
    strategy: str
    precision: str | None = None
    """the spec's precision (compare --precision ranks several)"""
    generation_layout: str | None = None
    """an RL objective's generation: vllm-colocate, vllm-server N (cards), transformers
    (compare ranks colocated and server layouts together)"""
    tight: str | None = None
    """why the run fits the card only with less free memory than the headroom asked (None: it
    has room); compare ranks tight runs below runs with room"""
    target_useful_tokens: float
    optimizer_steps: int
    tokens_per_step: int
    flops_per_token: Figure
    """training FLOPs per token (model/flops.py, the same function the pilot's MFU uses)"""
    throughput: QuoteThroughput
    batch: BatchOnCards | None = None
    run: RunNumbers | None = None
    """the run in numbers: positions, useful tokens and FLOPs per step, steps, MFU"""
    time_terms: list[TimeTerm]
    job_s: Figure
    term: TermCost
    finishes_in_term: bool
    margin_s: float
    margin_fraction: float
    useful_tokens_in_term: float
    shortest_term: TermCost
    shortest_term_steps: int
    cheapest_term: TermCost
    cost_per_million_term_usd: Decimal | None
    cost_per_million_job_usd: Decimal
    job_cost_usd: Decimal
    safety_margin: float
    pricing_source: str
    pricing_as_of: str
    run_dir: RunSource | None = None
    padding: dict[str, Any] | None = None
    """with a dataset profile: padding share of the term and what packing would save"""
    host: HostFit | None = None
    """the host plan at this card count against the offer's machine, and which resource binds"""
    spot: SpotQuote | None = None
    """the same job on spot capacity, interruptions priced (None: the offer has no spot rate)"""
    notes: list[str] = Field(default_factory=list)

    @computed_field
    @property
    def cost_basis(self) -> str:
        """The prices are the catalog's; the time they pay for is measured or projected."""
        return self.job_s.basis


class Refusal(Model):
    card: str
    reason: str


class Comparison(StageResult):
    """Every card x count that fits, cheapest per useful token first; and the cards refused."""

    STAGE = "compare"
    spec_label: str
    ranked_by: str = "cost_per_million_term_usd (cheapest covering term)"
    rows: list[Quote]
    refused: list[Refusal] = Field(default_factory=list)
    dropped: list[str] = Field(default_factory=list)
    """counts left out of the ranking, each with why"""
    assumptions: list[str] = Field(default_factory=list)
    precisions: list[str] = Field(default_factory=list)
    """the precisions ranked together (compare --precision), when more than the spec's"""
    layouts: list[str] = Field(default_factory=list)
    """an RL objective's generation layouts ranked together (colocated and on a server)"""
    run_dir: RunSource | None = None
