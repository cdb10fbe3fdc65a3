"""What every quote of one spec shares (QuoteContext): the spec, its architecture and FLOPs per
token, the plan's fit table, what a run directory measured, the dataset's profile - and the
arithmetic of the target on N cards (spec/batch.py's rules: positions per step, the epoch rule).
Built once per spec by ``context``; the quote, compare and the throughput helpers read it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tunepilot.catalog import Catalog
from tunepilot.cost.measurements import RunMeasurements, read_run_dir
from tunepilot.model.arch import Arch
from tunepilot.model.flops import FlopsPerToken, checkpoint_bytes, flops_per_token, load_bytes
from tunepilot.results.data import DataProfile
from tunepilot.results.figure import Figure
from tunepilot.results.plan import CardFit, MemoryPlan, ParamSplit
from tunepilot.spec import RunSpec


@dataclass
class QuoteContext:
    """What every quote of one spec shares: the arithmetic, the fit, the measurements."""

    spec: RunSpec
    catalog: Catalog
    arch: Arch
    params: ParamSplit
    flops: FlopsPerToken
    fit: dict[str, CardFit]  # card id -> plan row
    run: RunMeasurements | None
    profile: DataProfile | None = None
    """the dataset's length profile (tunepilot data), when there is one"""

    @property
    def checkpoint_bytes(self) -> int:
        """Trainable weights in their dtype + optimizer state (model/flops.py, the plan's rule)."""
        return checkpoint_bytes(self.arch, self.spec, self.params.trainable)

    def target(self, count: int, useful: Figure) -> tuple[float, int]:
        """(useful tokens the term must deliver, optimizer steps) on ``count`` cards: the
        spec's tokens; epochs x the supervised tokens of one epoch (the dataset's profile, else
        target.dataset_tokens); or target.steps x the tokens of a step x the useful fraction."""
        t = self.spec.target
        per_step = self.spec.batch.positions_per_step_on(count) * useful.value
        if t.steps is not None:
            return t.steps * per_step, t.steps
        tokens = (t.epochs * self.profile.tokens_supervised.value
                  if t.epochs is not None and self.profile is not None else t.useful_tokens)
        return tokens, self.epoch_steps(count) or math.ceil(tokens / per_step)

    def epoch_steps(self, count: int) -> int | None:
        """Optimizer steps of the spec's epochs on ``count`` ranks (from the profile's items),
        as the loader draws them (spec/batch.py: the one epoch rule); at least one."""
        if self.spec.target.epochs is None or self.profile is None:
            return None
        return max(1, self.spec.batch.steps_for_epochs(self.spec.target.epochs,
                                                       self.profile.used.items, count))

    def steps_per_epoch(self, count: int) -> int | None:
        """Optimizer steps of one epoch of the profiled dataset on ``count`` ranks."""
        if self.profile is None:
            return None
        return self.spec.batch.steps_per_epoch(self.profile.used.items, count)

    @property
    def load_bytes(self) -> int:
        """The pretrained checkpoint the run loads (model/flops.py load_bytes, the host plan's)."""
        return load_bytes(self.arch, self.spec)


def context(spec: RunSpec, catalog: Catalog, run_dir: Path | str | None,
            card_ids: list[str] | None, base_dir: Path | None) -> QuoteContext:
    """The context of every quote of ``spec``: the gated plan of RUN_DIR when it fits the cards
    asked, else the analytic plan now."""
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.api import make_plan

    run = read_run_dir(run_dir, spec, catalog) if run_dir is not None else None
    arch = resolve_arch(spec, base_dir)
    wanted = [c.id for c in catalog.select(card_ids)]
    staged = _staged_plan(run_dir, spec)
    if staged is not None and all(staged.card(c) for c in wanted):
        params, fit = staged.params, {c.card: c for c in staged.cards}  # the gated plan
    else:
        plan = make_plan(spec, catalog=catalog, card_ids=card_ids, arch=arch, base_dir=base_dir)
        params, fit = plan.params, {c.card: c for c in plan.cards}
    return QuoteContext(spec, catalog, arch, params, flops_per_token(arch, spec), fit, run,
                        _profile(run_dir, spec, arch, base_dir))


def _staged_plan(run_dir: Path | str | None, spec: RunSpec) -> MemoryPlan | None:
    """RUN_DIR/plan.json when it is this spec's (the plan the staged pilot gated on)."""
    if run_dir is None:
        return None
    from tunepilot.store import RunDir

    run = RunDir(run_dir)
    return run.read_if(MemoryPlan) if run.stage_done("plan", spec.spec_hash()) else None


def _profile(run_dir: Path | str | None, spec: RunSpec, arch: Arch, base_dir: Path | None
             ) -> DataProfile | None:
    """RUN_DIR/data.json when it is this spec's; else, for a target in epochs of a dataset, the
    profile made now (tokenized once, then read from the cache)."""
    if run_dir is not None:
        from tunepilot.store import RunDir

        run = RunDir(run_dir)
        if run.stage_done("data", spec.spec_hash()):
            found = run.read_if(DataProfile)
            if found is not None:
                return found
    if spec.target.epochs is None or spec.target.dataset_tokens is not None or \
            spec.data.source == "synthetic":
        return None
    from tunepilot.dataset.profile import profile_dataset

    return profile_dataset(spec, arch.vocab_size, base_dir)
