"""The MFU a quote projects with when no pilot measured this run's throughput: the time model of
resources/throughput_model.yaml fitted on the published runs of resources/throughput_runs.yaml
(cost/calibration.py) - one MFU per implementation x card group x method x precision, each the
median of published runs normalised to one card, with the run's own checkpointing, compile and
card factors on top.

MFU counts model FLOPs only: recomputation is hardware FLOPs (HFU), so checkpointing lowers MFU
while the hardware stays as busy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.catalog import Card
from tunepilot.cost.throughput_model import (  # noqa: F401 - the time model's data, re-exported
    CardRow,
    Factor,
    KernelRow,
    ThroughputModel,
    card_family,
    throughput_model,
)
from tunepilot.results.figure import Figure


@dataclass(frozen=True)
class MfuEstimate:
    """The MFU of one card projected for a setting, with the cell and conversions behind it."""

    mfu: float
    projection: object  # calibration.Projection

    @property
    def basis_kind(self) -> str:
        return self.projection.kind

    @property
    def cell(self):
        return self.projection.route.cell


def estimate(implementation: str, card_id: str, method: str, activation_checkpointing: str,
             torch_compile: bool, precision: str = "bf16-mixed", *, width: float | None = None,
             attention_share: float = 0.0, model_parallel: bool = False) -> MfuEstimate:
    """One card's projected MFU for the setting (cost/calibration.py): ``width`` the hidden
    size one tensor-parallel rank computes (None: the width model's reference), and the
    attention's share of the FLOPs (an FP8 recipe leaves it at the BF16 peak)."""
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.calibration import Setting, estimate_setting, fp8_over_bf16

    card = load_catalog().get(card_id)
    p = estimate_setting(Setting(implementation, card_family(card_id), method, precision,
                                 activation_checkpointing, torch_compile, width=width,
                                 attention_share=attention_share,
                                 fp8_over_bf16=fp8_over_bf16(card),
                                 model_parallel=model_parallel), one_card=True)
    return MfuEstimate(p.mfu, p)


def shape_of(spec, arch, seq: float | None = None, layout: dict | None = None) -> dict:
    """The run's shape the time model reads: the width one rank computes (hidden / tensor
    parallel) and the attention's share of the training FLOPs at ``seq`` (default the spec's
    sequence length). ``layout`` (tensor, pipeline, context: a published RL row's training
    layout) also picks the model-parallel cells, whose published runs hold their tensor and
    context parallel communication; a spec's own tensor / context parallel keeps the
    data-parallel cells, its communication a term of its own (cost/comms.py)."""
    from tunepilot.model.flops import flops_per_token

    if arch is None:
        return {}
    degrees = {k: int((layout or {}).get(k) or getattr(spec.parallel, k, 1) or 1)
               for k in ("tensor", "pipeline", "context")}
    fpt = flops_per_token(arch, spec, seq)
    return {"width": arch.hidden_size / degrees["tensor"],
            "attention_share": fpt.attention / fpt.train,
            "model_parallel": layout is not None and
            degrees["tensor"] * degrees["pipeline"] * degrees["context"] > 1}


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


def _weakest(kinds: list[str]) -> str:
    """'published' only when every number used was published; else the weakest."""
    for k in ("assumed", "derived"):
        if k in kinds:
            return k
    return "published"


def mfu_for(spec, card: Card, arch=None, seq: float | None = None,
            layout: dict | None = None) -> Figure:
    """Model FLOP utilisation projected for the spec on one card of this kind (a fraction), with
    the published runs it rests on and every conversion from them (``seq``: the processed
    length, default the spec's; ``layout``: see shape_of)."""
    from tunepilot.model.arch import param_counts

    shape = shape_of(spec, arch, seq, layout)
    e = estimate(spec.model.implementation, card.id, spec.method.kind,
                 spec.activation_checkpointing, spec.torch_compile, spec.precision, **shape)
    kernels = kernel_factors(spec)
    product = 1.0
    for kf in kernels:  # each kernel's published (or assumed) speed effect, named below
        product *= kf.factor
    p = e.projection
    r, cell = p.route, p.route.cell
    mfu = min(e.mfu * product, throughput_model().mfu_ceiling)
    kind = _weakest([e.basis_kind] + [kf.kind for kf in kernels])
    size = f"{param_counts(arch).total / 1e9:.1f}B" if arch is not None else "this model"
    distance = (f"this run: {size} {spec.method.kind} at {spec.sequence_length} tokens on "
                f"{card.id}; the cell: {cell.label}, {len(cell.runs)} published run(s) "
                f"({', '.join(cell.runs)}), one-card MFU {cell.spread[0]:.3g}-{cell.spread[1]:.3g}")
    how = (f"{kind}: cell {cell.label} one-card MFU {cell.base:.3g} (median of "
           f"{len(cell.runs)} published runs, resources/throughput_runs.yaml)"
           + (f"; no {spec.model.implementation} run: {r.assumed}'s cells (assumed)"
              if r.assumed else "")
           + "".join(f"; {s.how}" for s in r.steps)
           + f" x checkpointing {p.factors['checkpointing']:g} x compile "
             f"{p.factors['torch_compile']:g} x card {p.factors['card']:g}"
           + (f" x width {p.factors['width']:.3g} (a rank {shape['width']:,.0f} wide, fitted: "
              "throughput_model.yaml width)" if shape else "")
           + (f" x FP8's attention at the BF16 peak {p.factors['fp8_attention']:.3g}"
              if p.factors["fp8_attention"] != 1 else "")
           + "".join(f" x {kf.name} {kf.factor:.3g} ({kf.kind}: {_short(kf.source)})"
                     for kf in kernels))
    return Figure.projected(mfu, "fraction", how, rests_on=", ".join(cell.runs),
                            distance=distance, kind=e.basis_kind, counted="MFU (model FLOPs; "
                            "recompute not counted)")
