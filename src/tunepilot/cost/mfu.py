"""The MFU a quote projects with when no pilot measured this run's throughput: the throughput
model of resources/throughput_model.yaml - by implementation, card family, method, activation
checkpointing and torch.compile, each value a published measurement re-expressed in tunepilot's
FLOP count (or derived / assumed, and said so).

A published row is normalised to one card, no checkpointing, no compile (dividing by the
scaling efficiency at its GPU count and by its checkpointing and compile factors); the run's MFU
is that base times the run's own factors. MFU counts model FLOPs only: recomputation is hardware
FLOPs (HFU), so checkpointing lowers MFU while the hardware stays as busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tunepilot.catalog import Card
from tunepilot.cost.assumptions import efficiency_assumed
from tunepilot.results.figure import Figure

FAMILIES = ("a100", "h100", "h200", "mi300x")
MFU_CEILING = 0.70  # no published dense BF16 training MFU above about 0.7 (a transfer chain's cap)
Kind = Literal["published", "derived", "assumed"]


class _Read(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RowAt(_Read):
    """The settings a published row was measured at."""

    model: str
    sequence_length: int
    count: int = 1
    strategy: str = "single"
    activation_checkpointing: str = "none"
    torch_compile: bool = False


class MeasuredRow(_Read):
    implementation: str
    card_family: str
    kind: Kind
    mfu: float = Field(gt=0, lt=1)
    at: RowAt
    source: str
    as_of: str


class Factor(_Read):
    factor: float = Field(gt=0)
    kind: Kind | None = None
    source: str | None = None


class KernelRow(_Read):
    """A kernel's or adapter variant's throughput multiplier (throughput_model.yaml kernels:)."""

    factor: float = Field(gt=0)
    kind: Kind
    source: str
    as_of: str
    applies_to: list[str] = Field(default_factory=list)


class ThroughputModel(_Read):
    """resources/throughput_model.yaml, validated once when first read."""

    schema_version: int
    as_of: str
    measurements: list[MeasuredRow]
    family_transfer: dict[str, Factor]
    checkpointing: dict[str, Factor]
    torch_compile: Factor
    method: dict[str, Factor]
    default_implementation: str
    kernels: dict[str, KernelRow] = Field(default_factory=dict)


@cache
def throughput_model() -> ThroughputModel:
    from tunepilot.resources import THROUGHPUT_MODEL_YAML

    return ThroughputModel.model_validate(
        yaml.safe_load(THROUGHPUT_MODEL_YAML.read_text(encoding="utf-8")))


def card_family(card_id: str) -> str:
    for f in FAMILIES:
        if card_id.startswith(f):
            return f
    return card_id.split("-")[0]


@dataclass(frozen=True)
class MfuEstimate:
    mfu: float
    base: float
    row: MeasuredRow
    factors: dict[str, float]
    kinds: list[str]  # published / derived / assumed of every number used
    transfer: str | None

    @property
    def basis_kind(self) -> str:
        """'published' only when every number used was published; else the weakest."""
        for k in ("assumed", "derived"):
            if k in self.kinds:
                return k
        return "published"


def _scaling(strategy: str, count: int) -> float:
    if count <= 1 or strategy == "single":
        return 1.0
    return efficiency_assumed("fsdp" if strategy == "fsdp" else "ddp", count)


def _row_base(row: MeasuredRow, tm: ThroughputModel) -> float:
    at = row.at
    ac = tm.checkpointing[at.activation_checkpointing].factor
    comp = tm.torch_compile.factor if at.torch_compile else 1.0
    return row.mfu / (_scaling(at.strategy, at.count) * ac * comp)


def _find(impl: str, family: str, tm: ThroughputModel
          ) -> tuple[MeasuredRow | None, float, str | None, list[str]]:
    rows = tm.measurements
    exact = [r for r in rows if r.implementation == impl and r.card_family == family]
    if exact:
        return exact[0], 1.0, None, [exact[0].kind]
    transfer = tm.family_transfer
    for r in (r for r in rows if r.implementation == impl):
        key = f"{family}_from_{r.card_family}"
        t = transfer.get(key)
        if t is None and family == "mi300x" and r.card_family == "a100":
            a, m = transfer["h100_from_a100"], transfer["mi300x_from_h100"]
            return r, a.factor * m.factor, "mi300x_from_h100 x h100_from_a100", \
                [r.kind, a.kind, m.kind]
        if t is None and family == "mi300x" and r.card_family == "h100":
            t = transfer["mi300x_from_h100"]
        if t is not None:
            return r, t.factor, key, [r.kind, t.kind]
    return None, 1.0, None, []


def estimate(implementation: str, card_id: str, method: str, activation_checkpointing: str,
             torch_compile: bool) -> MfuEstimate:
    tm = throughput_model()
    family = card_family(card_id)
    row, transfer, how, kinds = _find(implementation, family, tm)
    if row is None:
        row, transfer, how, kinds = _find(tm.default_implementation, family, tm)
        kinds = kinds + ["assumed"]
        how = (how + "; " if how else "") + \
            f"no {implementation} row: {tm.default_implementation}'s"
    ac = tm.checkpointing.get(activation_checkpointing, tm.checkpointing["full"])
    comp = tm.torch_compile.factor if torch_compile else 1.0
    m = tm.method[method]
    base = _row_base(row, tm) * transfer
    factors = {"checkpointing": ac.factor, "torch_compile": comp, "method": m.factor}
    kinds += [f.kind for f in (ac, m) if f.kind]
    if torch_compile:
        kinds.append(tm.torch_compile.kind)
    mfu = min(base * ac.factor * comp * m.factor, MFU_CEILING)
    return MfuEstimate(mfu, base, row, factors, kinds, how)


@dataclass(frozen=True)
class LeverFactor:
    """A lever the pilot ran without (it measures the plain step) and what it does to speed."""

    lever: str
    factor: float
    kind: str
    source: str


def pilot_lever_factors(spec) -> list[LeverFactor]:
    """The speed factors of the spec's levers that tunepilot's pilot turns off (pilot/prepare.py
    without_modelled_levers, without_gpu_kernels): a quote that starts from a pilot's measured
    throughput multiplies by them, and says so. Levers with no published speed effect count
    1.0, said too."""
    tm = throughput_model()
    out = []
    if spec.torch_compile:
        c = tm.torch_compile
        out.append(LeverFactor("torch_compile", c.factor, c.kind or "assumed", c.source or ""))
    if spec.optimizer_in_backward:
        out.append(LeverFactor("optimizer_in_backward", 1.0, "assumed",
                               "the same FLOPs, stepped earlier: no speed effect counted"))
    if spec.activation_offloading:
        out.append(LeverFactor("activation_offloading", 1.0, "assumed",
                               "copies overlap compute in torchtune's implementation: no speed "
                               "effect counted"))
    out += [LeverFactor(kf.name, kf.factor, kf.kind, kf.source) for kf in kernel_factors(spec)
            if not kf.pilot_runs_it]
    return out


def _short(source: str) -> str:
    """A source's first words: the repository or paper it rests on."""
    text = source.removeprefix("DERIVED: ").removeprefix("ASSUMED: ")
    return text.split(":")[0].split(" (")[0].strip()


@dataclass(frozen=True)
class KernelFactor:
    """One kernel's or adapter variant's throughput multiplier, as the time model has it."""

    name: str
    factor: float
    kind: str  # published / derived / assumed
    source: str
    pilot_runs_it: bool  # the CPU/GPU pilot builds it (DoRA, eager, ...), or leaves it out


def kernel_factors(spec) -> list[KernelFactor]:
    """The speed factors of the kernels and adapter variants the spec turns on
    (throughput_model.yaml kernels:), each with its kind and source."""
    tm = throughput_model().kernels
    k, m = spec.kernels, spec.method
    out: list[KernelFactor] = []

    def add(key: str, name: str, scale: float = 1.0, kind: str | None = None,
            pilot: bool = False) -> None:
        row = tm[key]
        factor = 1.0 + (row.factor - 1.0) * scale
        out.append(KernelFactor(name, factor, kind or row.kind, row.source, pilot))

    default = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")
    liger = [x for x in k.liger if x in tm["liger"].applies_to]
    if liger and not k.unsloth:
        share = sum(x in liger or (x == "swiglu" and "geglu" in liger) for x in default) / 4
        add("liger", f"liger {'+'.join(liger)}", share, None if share == 1 else "assumed")
    if "cross_entropy" in k.liger:
        add("liger_cross_entropy", "liger cross_entropy")
    for key in ("cut_cross_entropy", "unsloth", "unsloth_gradient_checkpointing",
                "transformer_engine"):
        if getattr(k, key):
            add(key, key)
    if k.attention == "eager":
        add("attention_eager", "attention eager", pilot=True)
    elif k.attention in tm["attention_flash"].applies_to:
        add("attention_flash", f"attention {k.attention}")
    if m.is_lora:
        for key, on in (("dora", m.dora), ("rslora", m.rslora),
                        ("modules_to_save", bool(m.modules_to_save))):
            if on:
                add(key, key, pilot=True)
    return out


def mfu_for(spec, card: Card, arch=None) -> Figure:
    """Model FLOP utilisation projected for the spec on one card of this kind (a fraction), with
    the published measurement it rests on and how far this run is from it."""
    from tunepilot.model.arch import param_counts

    e = estimate(spec.model.implementation, card.id, spec.method.kind,
                 spec.activation_checkpointing, spec.torch_compile)
    kernels = kernel_factors(spec)
    if kernels:  # each kernel's published (or assumed) speed effect, named in the projection
        product = 1.0
        for kf in kernels:
            product *= kf.factor
        e = MfuEstimate(min(e.mfu * product, MFU_CEILING), e.base, e.row,
                        dict(e.factors, kernels=product), e.kinds + [kf.kind for kf in kernels],
                        e.transfer)
    at = e.row.at
    size = f"{param_counts(arch).total / 1e9:.1f}B" if arch is not None else "this model"
    distance = (f"this run: {size} at {spec.sequence_length} tokens on {card.id}; the "
                f"measurement: {at.model} at {at.sequence_length} tokens on "
                f"{at.count} x {e.row.card_family}")
    how = (f"{e.basis_kind}: {e.row.implementation} on {e.row.card_family} "
           f"{e.row.mfu:.3g} MFU ({e.row.source.split(':')[0].strip()}) -> one card "
           f"{e.base:.3g}" + (f" via {e.transfer}" if e.transfer else "")
           + f" x checkpointing {e.factors['checkpointing']:g} x compile "
             f"{e.factors['torch_compile']:g} x {spec.method.kind} {e.factors['method']:g}"
           + "".join(f" x {kf.name} {kf.factor:.3g} ({kf.kind}: {_short(kf.source)})"
                     for kf in kernels))
    return Figure.projected(e.mfu, "fraction", how, rests_on=e.row.source,
                            distance=distance, kind=e.basis_kind, counted="MFU (model FLOPs; "
                            "recompute not counted)")
