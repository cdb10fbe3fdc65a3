"""data.json: the whole dataset's length profile (`tunepilot data SPEC`), read by the pilot (its
worst batch) and the quote (useful tokens per epoch, padding)."""

from __future__ import annotations

from pydantic import Field

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure


class Bin(Model):
    lo: int
    """tokens, inclusive"""
    hi: int
    """tokens, exclusive"""
    count: int


class Lengths(Model):
    """Sample lengths in tokens (after the chat template, before truncation)."""

    p50: int
    p90: int
    p99: int
    max: int
    mean: float
    histogram: list[Bin]


class Batching(Model):
    """One way of cutting the dataset into micro-batches, and what it wastes."""

    padding_fraction: Figure
    """padded positions / all positions of the micro-batches"""
    useful_fraction: Figure
    """supervised tokens / all positions (what the quote divides cost by)"""
    items: int
    """what the loader draws from: samples (padded) or packed rows"""
    positions: int
    """token positions of one epoch's micro-batches (on one device)"""
    steps_per_epoch: int
    """optimizer steps of one epoch at the spec's ranks, as the loader draws it (drop_last;
    spec/batch.py steps_per_epoch)"""

    @property
    def mean_padded_length(self) -> float | None:
        """Token positions per item: the mean length a micro-batch row is padded to."""
        return self.positions / self.items if self.items else None


class DataProfile(StageResult):
    STAGE = "data"
    source: str
    path: str | None
    format: str
    tokenizer: str | None
    chat_template: str | None = None
    """which template rendered the messages: the tokenizer's own, or a named default"""
    train_on: str
    sequence_length: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int = 1
    """the ranks steps_per_epoch is counted on (the spec's parallel.world_size)"""
    samples: int
    skipped_rows: int = 0
    tokens_total: Figure
    tokens_supervised: Figure
    length: Lengths
    truncated_samples: int
    padded: Batching
    packed: Batching
    packing: bool
    """whether the spec trains packed"""
    content_sha256: str | None = None
    seconds: Figure | None = None
    cached: bool = False
    notes: list[str] = Field(default_factory=list)

    @property
    def used(self) -> Batching:
        """The batching the spec trains with."""
        return self.packed if self.packing else self.padded

    def useful_fraction_figure(self, spec) -> Figure:
        b = self.used
        if b.useful_fraction.value is None:  # the loader draws no whole micro-batch
            from tunepilot.errors import UserError

            unit = ("pair" if self.format == "preference" else "sample") + \
                ("s" if self.samples != 1 else "")
            raise UserError(
                "micro_batch_size",
                f"the dataset ({self.samples:,} {unit} after skipping bad rows) fills no whole "
                f"micro-batch of {self.micro_batch_size} x {self.world_size} rank(s): the loader "
                "drops the incomplete one, so an epoch trains nothing.",
                "lower micro_batch_size (or the ranks), or give the dataset more samples, and "
                "run `tunepilot data` again")
        return Figure.measured(b.useful_fraction.value, "fraction",
                               f"dataset profile (tunepilot data): trained tokens / token "
                               f"positions of the {'packed' if self.packing else 'padded'} "
                               f"micro-batches over the whole dataset ({self.samples:,} samples)")

    def padding_summary(self, training_s: Figure) -> dict:
        """Of the training time, what pays for padded positions, and what packing would save."""
        pad = self.used.padding_fraction
        saving = None
        if not self.packing and self.packed.positions and self.padded.positions:
            saving = 1 - self.packed.positions / self.padded.positions
        return {
            "trained_on": "packed" if self.packing else "padded",
            "padding_fraction": pad.to_dict(),
            "padding_s": Figure.projected(
                training_s.value * (pad.value or 0), "s",
                f"training time x padding fraction {pad.value or 0:.3g} (the step time is "
                "spent on every position alike)").to_dict(),
            "packing_would_cut_positions_by": None if saving is None else Figure.projected(
                saving, "fraction", "1 - packed / padded token positions per epoch (dataset "
                "profile); the training time falls about as much").to_dict(),
        }
