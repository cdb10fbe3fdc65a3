"""The run's batch in numbers - the one rule every stage calls (plan, pilot, scale, quote, the
data view, the host plan and the report): the global batch on W ranks, token positions per
micro-batch and per optimizer step, useful tokens per step and optimizer steps per epoch.

    positions per sample   = sequence_length x sequences per sample (2 for a preference pair:
                             chosen and rejected both run through the policy; 1 otherwise - a
                             generative sample is one completion of prompt + completion)
    global batch G         = micro_batch_size x gradient_accumulation_steps x parallel ranks,
                             held whatever the card count (``on``)
    positions per step     = G x positions per sample (padding included: the card computes it)
    useful tokens per step = positions per step x the useful fraction (trained tokens / positions,
                             measured by the pilot or the data profile)
    steps per epoch        = what the loader draws (dataset/loader.py make_loader): each of W
                             ranks reads floor(items / W) items (the distributed sampler's
                             drop_last) in floor(that / loader batch) batches (the loader's
                             drop_last); accumulation micro-batches make a step, and the stream
                             carries a partial step into the next epoch (DataStream)

A generative objective (GRPO, RLOO) draws prompts: one loader batch of prompts is one generation
batch, trained as steps_per_generation micro-batches, each num_iterations times (TRL's
generate_every).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tunepilot.errors import UserError

if TYPE_CHECKING:
    from tunepilot.spec.run import RunSpec


@dataclass(frozen=True)
class BatchSplit:
    """The global batch on W ranks: W x micro_batch_size x accumulation = global_samples."""

    global_samples: int
    world_size: int
    micro_batch_size: int
    accumulation: int
    positions_per_sample: int
    """token positions through the policy per sample (sequence_length x sequences per sample)"""
    note: str | None = None

    @property
    def positions_per_micro_batch(self) -> int:
        """Token positions of one rank's micro-batch (padding included)."""
        return self.micro_batch_size * self.positions_per_sample

    @property
    def positions_per_step(self) -> int:
        """Token positions of one optimizer step over every rank (padding included)."""
        return self.global_samples * self.positions_per_sample

    def useful_tokens_per_step(self, useful_fraction: float) -> float:
        """Trained tokens of one optimizer step: its positions x the useful fraction."""
        return self.positions_per_step * useful_fraction


class Batch:
    """The spec's batch arithmetic (``spec.batch``)."""

    __slots__ = ("spec",)

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    @property
    def sequences_per_sample(self) -> int:
        """Sequences through the policy per sample: 2 for a pair, else 1."""
        return self.spec.objective.sequences_per_sample

    @property
    def positions_per_sample(self) -> int:
        return self.spec.sequence_length * self.sequences_per_sample

    @property
    def global_samples(self) -> int:
        """Samples per optimizer step over the spec's data-parallel ranks (G): the tensor- and
        context-parallel ranks of one replica share its samples."""
        s = self.spec
        return s.micro_batch_size * s.gradient_accumulation_steps * s.parallel.data_parallel

    @property
    def positions_per_micro_batch(self) -> int:
        """Token positions through the policy per micro-batch at the spec's layout: a pair is
        two sequences (chosen and rejected), a generative micro-batch counts completions."""
        return self.spec.micro_batch_size * self.positions_per_sample

    @property
    def positions_per_step(self) -> int:
        """Token positions per optimizer step at the spec's layout (padding included)."""
        return self.global_samples * self.positions_per_sample

    @property
    def own(self) -> BatchSplit:
        """The split at the spec's own (data-parallel) rank count."""
        return self.on(self.spec.parallel.data_parallel)

    def on(self, world_size: int, *, exact: bool = True) -> BatchSplit:
        """The global batch G held on ``world_size`` ranks, each taking G / W samples as
        micro-batch m (the spec's, or the largest divisor of G / W under it) x accumulation a.
        A G that W does not divide is refused (``exact``: the scaling test) or rounded up to
        whole micro-batches per rank, said in the note (the quote)."""
        s, g, pps = self.spec, self.global_samples, self.positions_per_sample
        m0 = s.micro_batch_size
        if g % world_size == 0:
            per_rank = g // world_size
            micro = max(m for m in range(1, min(m0, per_rank) + 1) if per_rank % m == 0)
            note = None if micro == m0 else (
                f"micro-batch per rank is {micro}, not the spec's {m0}: {world_size} ranks hold "
                f"{g} samples as {per_rank} each")
            return BatchSplit(g, world_size, micro, per_rank // micro, pps, note)
        if exact:
            raise UserError("--nproc", f"the spec's global batch of {g} samples (micro_batch_size "
                            f"{m0} x gradient_accumulation_steps {s.gradient_accumulation_steps}"
                            f" x {s.parallel.world_size} device(s)) cannot be split evenly over "
                            f"{world_size} ranks, so the global batch could not be held equal.",
                            f"Use a rank count that divides {g}, or set "
                            f"gradient_accumulation_steps to a multiple of {world_size}.")
        accumulation = -(-g // (m0 * world_size))
        grown = m0 * accumulation * world_size
        return BatchSplit(grown, world_size, m0, accumulation, pps,
                          f"{world_size} cards do not divide the global batch of {g} samples: "
                          f"each takes {accumulation} micro-batches of {m0}, {grown} samples per "
                          "step")

    def positions_per_step_on(self, world_size: int) -> int:
        """Token positions per optimizer step on ``world_size`` ranks (the quote's rule: the
        global batch rounded up to whole micro-batches where W does not divide it)."""
        return self.on(world_size, exact=False).positions_per_step

    # --- epochs -----------------------------------------------------------------------------
    def loader_batch(self, split: BatchSplit) -> int:
        """Items one rank's loader draws at a time: the micro-batch's samples, or for a
        generative objective the prompts of one generation batch (prompts_per_generation)."""
        o = self.spec.objective
        if not o.generative:
            return split.micro_batch_size
        per_generation = o.steps_per_generation or split.accumulation
        return max(1, split.micro_batch_size * per_generation // o.generations)

    def micro_steps_per_loader_batch(self, split: BatchSplit) -> int:
        """Micro-batches trained per loader batch: 1, or a generation batch's
        steps_per_generation micro-batches each num_iterations times."""
        o = self.spec.objective
        if not o.generative:
            return 1
        return (o.steps_per_generation or split.accumulation) * o.num_iterations

    def loader_batches_per_epoch(self, items: int, split: BatchSplit) -> int:
        """Batches one rank's loader yields per epoch: floor(floor(items / W) / batch), the
        sampler's and the loader's drop_last (dataset/loader.py make_loader)."""
        return (items // split.world_size) // self.loader_batch(split)

    def steps_for_epochs(self, epochs: float, items: int, world_size: int) -> int:
        """Optimizer steps that train ``epochs`` epochs of ``items`` on ``world_size`` ranks
        (the stream carries a partial accumulation into the next epoch): floor(epochs x loader
        batches x micro-batches per loader batch / accumulation). 0 when ``epochs`` of data do
        not fill one step."""
        split = self.on(world_size, exact=False)
        micro = int(epochs * self.loader_batches_per_epoch(items, split)) * \
            self.micro_steps_per_loader_batch(split)
        return micro // split.accumulation

    def steps_per_epoch(self, items: int, world_size: int | None = None) -> int:
        """Optimizer steps of one epoch of ``items`` on ``world_size`` ranks (default: the
        spec's), as the loader draws it: what `tunepilot data`, the quote and the report show."""
        return self.steps_for_epochs(1, items, world_size or self.spec.parallel.world_size)
