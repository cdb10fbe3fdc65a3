"""The time model fitted on published runs: one MFU per cell - implementation x card group x
method x precision - the median of the cell's runs normalised to one card (throughput_model.yaml
explains the normalisation); a cell with no run is reached from the nearest fitted one through
ratios of cells fitted on both sides, each named.

Only the runs cost/runs.py does not hold out are fitted: the benchmark projects the held-out
ones with exactly the functions the quote uses (``estimate_setting``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache

from tunepilot.cost.assumptions import efficiency_parts
from tunepilot.spec.precision import Precision

# The dimensions of a cell (position in its key), and the order in which a missing cell borrows
# from a neighbour: the cheapest difference first.
DIMENSIONS = {"precision": 3, "layout": 4, "method": 2, "group": 1}
DP, MP = "data-parallel", "model-parallel"


@dataclass(frozen=True)
class Setting:
    """What the time model needs of a run, a published one or the spec being quoted."""

    implementation: str
    family: str
    method: str
    precision: str
    activation_checkpointing: str = "none"
    torch_compile: bool = False
    strategy: str = "single"
    count: int = 1
    nodes: int | None = None
    tokens_per_replica_step: float | None = None
    hardware: str | None = None
    peak_tflops: float | None = None
    """the card's dense BF16 peak (the scaling rule counts tokens in H100-equivalents)"""
    model_parallel: bool = False
    """tensor / pipeline / context parallel (a published run's; a spec is data parallel/FSDP)"""
    width: float | None = None
    """the hidden size one tensor-parallel rank computes (hidden / tensor parallel); None: the
    width model's reference"""
    pipeline_bubble: float = 0.0
    """the pipeline's idle share over its ideal time, (p - 1) / (v x m)"""
    attention_share: float = 0.0
    """the attention's share of the training FLOPs per token (model/flops.py)"""
    fp8_over_bf16: float = 2.0
    """the card's dense FP8 peak over its BF16 peak"""

    @property
    def precision_class(self) -> str:
        """bf16-mixed and bf16-true (and fp16, same peak) share cells; each FP8 recipe its own."""
        return Precision(self.precision).throughput_class

    @property
    def layout(self) -> str:
        return MP if self.model_parallel else DP


Key = tuple[str, str, str, str, str]  # implementation, group, method, precision class, layout


@dataclass(frozen=True)
class Cell:
    key: Key
    base: float  # median one-card MFU of its runs
    runs: tuple[str, ...]
    spread: tuple[float, float]  # lowest and highest base of its runs

    @property
    def label(self) -> str:
        return " x ".join(self.key)


@dataclass(frozen=True)
class Step:
    """One conversion on the way from a fitted cell to the cell asked for."""

    dimension: str
    factor: float
    how: str


@dataclass
class Route:
    cell: Cell
    steps: list[Step] = field(default_factory=list)
    assumed: str | None = None  # no run of the implementation: whose cells were used

    @property
    def factor(self) -> float:
        f = 1.0
        for s in self.steps:
            f *= s.factor
        return f


def group_of(family: str) -> str:
    from tunepilot.cost.throughput_model import throughput_model

    row = throughput_model().cards.get(family)
    return row.group if row else family


def card_factor(family: str) -> float:
    from tunepilot.cost.throughput_model import throughput_model

    row = throughput_model().cards.get(family)
    return row.factor if row else 1.0


WIDTH_CONSTANT: float | None = None
"""the width model's c in place of throughput_model.yaml's (throughput_accuracy.py --splits
refits it on each split's runs)"""


def run_factors(s: Setting, width_constant: float | None = None) -> dict[str, float]:
    """The factors between a run's MFU and its cell's one-card base (their product):
    checkpointing, compile, scaling, card and hardware as published or derived, the rank's
    width (``width_constant``: the width model's c, else throughput_model.yaml's), the
    pipeline's bubble, and an FP8 run's attention at the BF16 peak."""
    from tunepilot.cost.throughput_model import throughput_model

    tm = throughput_model()
    ac = tm.checkpointing.get(s.activation_checkpointing, tm.checkpointing["full"]).factor
    eff = efficiency_parts(s.strategy, s.count, s.nodes, s.tokens_per_replica_step,
                           s.peak_tflops)[0]
    hw = tm.hardware[s.hardware].factor if s.hardware else 1.0
    c = width_constant if width_constant is not None else WIDTH_CONSTANT if \
        WIDTH_CONSTANT is not None else tm.width.constant
    ref = tm.width.reference
    width = (1 + c / ref) / (1 + c / s.width) if s.width else 1.0
    fp8 = Precision(s.precision).is_fp8
    return {"checkpointing": ac, "torch_compile": tm.torch_compile.factor if s.torch_compile
            else 1.0, "scaling": eff, "card": card_factor(s.family), "hardware": hw,
            "width": width, "pipeline": 1 / (1 + s.pipeline_bubble),
            "fp8_attention": 1 / (1 + s.attention_share * (s.fp8_over_bf16 - 1)) if fp8
            else 1.0}


def _product(factors: dict[str, float]) -> float:
    p = 1.0
    for v in factors.values():
        p *= v
    return p


def setting_of_run(run, spec=None) -> Setting:
    """``spec``: the run's RunSpec where the caller has it (cost/runs.py run_spec)."""
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.runs import run_spec
    from tunepilot.cost.throughput_model import card_family
    from tunepilot.model.flops import flops_per_token

    card = load_catalog().get(run.card)
    arch = _arch(run.model)
    fpt = flops_per_token(arch, spec or run_spec(run), run.sequence_length)
    return Setting(run.implementation, card_family(run.card), run.method, run.precision,
                   run.activation_checkpointing, run.torch_compile, run.strategy, run.count,
                   run.nodes, run.tokens_per_replica_step, run.hardware,
                   card.peak_flops("bf16") / 1e12, run.replica_gpus > 1,
                   arch.hidden_size / run.tensor_parallel, run.pipeline_bubble,
                   fpt.attention / fpt.train, fp8_over_bf16(card))


def fp8_over_bf16(card) -> float:
    """The card's dense FP8 peak over its BF16 peak (2 on Hopper and CDNA3; 2 where it has
    none, unused then)."""
    fp8, bf16 = card.peak_flops("fp8"), card.peak_flops("bf16")
    return fp8 / bf16 if fp8 and bf16 else 2.0


@cache
def _arch(preset: str):
    from tunepilot.model.arch import Arch, load_preset

    return Arch.from_config(load_preset(preset))


def measured_mfu(run, spec=None) -> float:
    """A published run's MFU by MFU_RULE, on the catalog card it is projected on."""
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.runs import run_spec
    from tunepilot.model.flops import mfu

    spec = spec or run_spec(run)
    arch = _arch(run.model)
    peak = load_catalog().get(run.card).peak_flops(spec.precision.peak_key)
    return mfu(arch, spec, run.tokens_per_s_per_gpu, run.sequence_length, peak)


@dataclass
class Fit:
    cells: dict[Key, Cell]
    _ratios: dict[str, dict] = field(default_factory=dict, repr=False)

    def ratios(self, dimension: str) -> dict[tuple[str, str], list[tuple[float, str]]]:
        """(to, from) -> [(cell ratio, which cells)] over every pair of fitted cells that differ
        in ``dimension`` only (worked out once per fit)."""
        if dimension not in self._ratios:
            self._ratios[dimension] = self._pairs(dimension)
        return self._ratios[dimension]

    def _pairs(self, dimension: str) -> dict[tuple[str, str], list[tuple[float, str]]]:
        index = DIMENSIONS[dimension]
        out: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
        for a in self.cells.values():
            for b in self.cells.values():
                if a is b or a.key[index] == b.key[index]:
                    continue
                if all(a.key[i] == b.key[i] for i in range(5) if i != index):
                    out[(a.key[index], b.key[index])].append(
                        (a.base / b.base, f"{a.label} / {b.label}"))
        return out

    def ratio(self, dimension: str, to: str, frm: str, implementation: str | None = None
              ) -> Step | None:
        """The conversion of a cell's MFU from ``frm`` to ``to``: the median ratio of fitted
        cells that differ in that dimension only. A card group (a generation's speed-up is the
        stack's own) takes the implementation's own cells when it has them on both, else its
        published same-script pair (throughput_model.yaml generations:), else every
        implementation's cells."""
        pairs = self.ratios(dimension).get((to, frm))
        if dimension == "group" and implementation is not None:
            own = [(r, w) for r, w in pairs or [] if w.startswith(f"{implementation} x ")]
            if own:
                pairs = own
            else:
                published = generation_step(implementation, to, frm)
                if published is not None:
                    return published
        if not pairs:
            return None
        value = statistics.median(r for r, _ in pairs)
        return Step(dimension, value, f"{frm} -> {to} x{value:.3g} (derived: median of "
                    f"{len(pairs)} fitted cell ratio(s): " + "; ".join(w for _, w in pairs) + ")")


def generation_step(implementation: str, to: str, frm: str) -> Step | None:
    """The implementation's published card-generation ratio (throughput_model.yaml generations:,
    either way round), or None."""
    from tunepilot.cost.throughput_model import throughput_model

    for g in throughput_model().generations:
        if g.implementation != implementation or {g.to, g.frm} != {to, frm}:
            continue
        value = g.factor if g.to == to else 1 / g.factor
        return Step("group", value, f"{frm} -> {to} x{value:.3g} ({g.kind}: {implementation}'s "
                    f"own generation ratio, the same scripts on both from {len(g.runs)} published "
                    f"pair(s) {', '.join(g.runs)}: {g.source.split(': ', 1)[-1].split(' (')[0]})")
    return None


@cache
def fitted() -> Fit:
    """The cells of the runs that are not held out: derived from the shipped runs, catalog and
    presets alone, so kept between processes (tunepilot/derived.py) - a quote reads them, not
    the 127 published runs."""
    from tunepilot.cost.runs import HELD_OUT_RESIDUE
    from tunepilot.derived import cached

    return cached("time-model-fit", f"held-out residue {HELD_OUT_RESIDUE}", fit_cells,
                  _fit_json, _fit_of_json)


def _fit_json(fit: Fit) -> list:
    return [[list(c.key), c.base, list(c.runs), list(c.spread)] for c in fit.cells.values()]


def _fit_of_json(rows: list) -> Fit:
    cells = [Cell(tuple(map(str, k)), float(b), tuple(map(str, r)), (float(s[0]), float(s[1])))
             for k, b, r, s in rows]
    if not cells or any(len(c.key) != 5 for c in cells):
        raise ValueError("not a fit")
    return Fit({c.key: c for c in cells})


def refit() -> None:
    """Forget the fit (the held-out rule's residue changed: throughput_accuracy.py --splits)."""
    fitted.cache_clear()
    _fit_inputs.cache_clear()


@cache
def _fit_inputs() -> tuple[tuple[object, Setting, float], ...]:
    """(run, its setting, its measured MFU) of every run not held out."""
    from tunepilot.cost.runs import fit_runs, run_spec

    specs = [(r, run_spec(r)) for r in fit_runs()]
    return tuple((r, setting_of_run(r, s), measured_mfu(r, s)) for r, s in specs)


def fit_cells(width_constant: float | None = None) -> Fit:
    """The cells fitted on the runs that are not held out (``width_constant``: the width
    model's c to fit them with, else throughput_model.yaml's)."""
    bases: dict[Key, list[tuple[float, str]]] = defaultdict(list)
    for run, s, m in _fit_inputs():
        bases[key_of(s)].append((m / _product(run_factors(s, width_constant)), run.id))
    cells = {}
    for key, items in bases.items():
        values = [b for b, _ in items]
        cells[key] = Cell(key, statistics.median(values), tuple(i for _, i in items),
                          (min(values), max(values)))
    return Fit(cells)


def fit_error(width_constant: float) -> float:
    """The mean |log(projected / published MFU)| of the fitted runs with the width model's c
    at ``width_constant`` (what throughput_model.yaml's width.constant minimises)."""
    fit = fit_cells(width_constant)
    errors = [abs(math.log(estimate_setting(s, fit=fit, width_constant=width_constant).mfu / m))
              for _, s, m in _fit_inputs()]
    return statistics.fmean(errors)


def fit_width_constant(lo: float = 0.0, hi: float = 2000.0, step: float = 10.0) -> float:
    """The width model's c over [lo, hi] in ``step``s that minimises ``fit_error``."""
    grid = [lo + i * step for i in range(int((hi - lo) / step) + 1)]
    return min(grid, key=fit_error)


def key_of(s: Setting) -> Key:
    return (s.implementation, group_of(s.family), s.method, s.precision_class, s.layout)


def route(want: Key, fit: Fit | None = None) -> Route:
    """The fitted cell a setting's key is projected from, and the conversions to it."""
    from tunepilot.cost.throughput_model import throughput_model

    fit = fit or fitted()
    assumed = None
    if want[0] not in {k[0] for k in fit.cells}:
        assumed = throughput_model().default_implementation
        want = (assumed, *want[1:])
    best = None
    for key, cell in fit.cells.items():
        if key[0] != want[0]:
            continue
        steps = []
        for dim, i in DIMENSIONS.items():
            if key[i] != want[i]:
                step = fit.ratio(dim, want[i], key[i], want[0])
                if step is None:
                    steps = None
                    break
                steps.append(step)
        if steps is None:
            continue
        cost = sum(4 ** list(DIMENSIONS).index(s.dimension) for s in steps)
        rank = (cost, -len(cell.runs))
        if best is None or rank < best[0]:
            best = (rank, Route(cell, steps, assumed))
    if best is None:
        raise LookupError(f"no fitted cell reaches {' x '.join(want)}")
    return best[1]


@dataclass(frozen=True)
class Projection:
    mfu: float
    route: Route
    factors: dict[str, float]  # the setting's own (checkpointing, compile, scaling, card, hardware)

    @property
    def kind(self) -> str:
        if self.route.assumed:
            return "assumed"
        return "derived" if self.route.steps else "published"


def estimate_setting(s: Setting, *, one_card: bool = False, fit: Fit | None = None,
                     width_constant: float | None = None) -> Projection:
    """MFU projected for the setting: its cell's base x the conversions x its own factors
    (``one_card``: without the scaling factor, as the quote's per-card figure)."""
    from tunepilot.cost.throughput_model import throughput_model

    r = route(key_of(s), fit)
    factors = run_factors(s, width_constant)
    if one_card:
        factors["scaling"] = 1.0
    value = r.cell.base * r.factor * _product(factors)
    return Projection(min(value, throughput_model().mfu_ceiling), r, factors)


def fp8_speedup(implementation: str, family: str, method: str, precision: str,
                bf16_peak: float, fp8_peak: float, width: float | None = None,
                attention_share: float = 0.0) -> tuple[float, str]:
    """Tokens/s of an FP8 recipe over bf16 for the same run (a pilot measured in bf16 is quoted
    with it): the ratio of the two cells' MFU x the FP8 / BF16 dense peaks (the attention,
    ``attention_share`` of the FLOPs, stays at the BF16 peak)."""
    group = group_of(family)
    shape = {"width": width, "attention_share": attention_share,
             "fp8_over_bf16": fp8_peak / bf16_peak}
    fp8 = estimate_setting(Setting(implementation, family, method, precision, **shape),
                           one_card=True)
    bf16 = estimate_setting(Setting(implementation, family, method, "bf16-mixed", **shape),
                            one_card=True)
    value = fp8.mfu / bf16.mfu * fp8_peak / bf16_peak
    return value, (f"{precision} over bf16 x{value:.3g}: MFU {fp8.mfu:.3g} of the FP8 peak "
                   f"({fp8.route.cell.label}) / {bf16.mfu:.3g} of the BF16 peak "
                   f"({bf16.route.cell.label}) x {fp8_peak / 1e12:g}/{bf16_peak / 1e12:g} TFLOP/s "
                   f"on {group}")
