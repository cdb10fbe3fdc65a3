"""Term quotes: how long the job needs on N cards, what the term costs, and the cost per useful token.

Time the job needs = set-up + model load + training (target useful tokens / useful tokens/s at that
card and count) + validation passes (spec.validation.every_steps) + checkpoint writes
(spec.checkpoint.every_steps) + the final export. Each term is **measured** when the run directory
(``--from RUN_DIR``) holds a measurement made on *this* card, else **projected** by a stated rule:

- useful tokens/s of one card, measured on another catalog card M: step time on the target =
  measured x (f x peakM/peakT + (1-f) x hbmM/hbmT), f = ``compute_bound_fraction`` (dense FLOP/s
  ratio for the compute-bound share, HBM bandwidth ratio for the memory-bound share);
- with no usable measurement: tokens/s = MFU_assumed x dense peak / FLOPs per token, FLOPs per
  token = 6 N_trainable + 4 N_frozen + 12 L H Q T (PaLM, appendix B; frozen weights skip the
  weight-gradient matmul; N counts matmul weights: the input embedding lookup is not one);
- N cards: N x scaling efficiency x one card, efficiency measured by ``scale.json`` on this card
  (exact when its nproc is N) or assumed (``cost_model.yaml``);
- provisioning (before tunepilot's process starts on the rented cluster) is always assumed;
- set-up, model load, checkpoint write and export are machine-bound: measured on another card, or
  on a device that is not a catalog card (a CPU pilot), they are carried over unchanged
  (projected). A CPU pilot's throughput and validation pass are compute-bound and not carried (a
  CPU has no catalog peak to scale by). Sizes (checkpoint bytes, the useful-token fraction) are
  properties of the run, not the machine: measured anywhere, they stay measured.
Every assumption comes from ``data/cost_model.yaml`` with its source. The term's price (billed
time, term discount, options, in integer cents) is ``tunepilot.pricing``.

Run-directory keys read (every file and key optional; a missing one makes that term projected and
the quote says so). A value is a number or ``{"value": x, "unit": ..., "measured": true}``:
  manifest.json  spec_hash; device.{kind, name, card_id}
  pilot.json     spec_hash; device.card_id (if manifest lacks it);
                 throughput.useful_tokens_per_s, throughput.padded_tokens_per_s;
                 timings.{setup_s, model_load_s, validation_pass_s, checkpoint_write_s,
                 checkpoint_bytes}
  restore.json   save_s, load_s, checkpoint_bytes
  scale.json     strategies.{ddp,fsdp}.{nproc, efficiency, useful_tokens_per_s}
  export.json    bytes, seconds, bytes_per_s
A manifest (or pilot) spec_hash that differs from the spec's is a UserError: the measurements are
of another run. Money is Decimal or integer cents, never a float.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tunepilot.catalog import Card, Catalog, load_catalog
from tunepilot.errors import UserError
from tunepilot.pricing import TermCost, check_count, parse_options, term_cost
from tunepilot.spec import RunSpec

COST_MODEL_PATH = Path(__file__).parent / "data" / "cost_model.yaml"
MEASURED, PROJECTED = "measured", "projected"
COMPARE_COUNTS = (1, 2, 4, 8)
SOURCE_CHECKPOINT_BYTES_PER_PARAM = 2  # 16-bit weights, as Hugging Face ships Llama-class models
_PEAK_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}
_USD_PER_M = Decimal("0.0001")  # cost per million useful tokens is shown to 1/100 of a cent


@cache
def cost_model() -> dict:
    """The assumptions of ``data/cost_model.yaml`` (each with source and as_of)."""
    return yaml.safe_load(COST_MODEL_PATH.read_text(encoding="utf-8"))


def _assumed(key: str) -> float:
    return float(cost_model()[key]["value"])


@dataclass(frozen=True)
class Figure:
    """A number with its unit, whether it was measured or projected, and how it was obtained."""

    value: float
    unit: str
    basis: str  # "measured" | "projected"
    how: str

    def to_dict(self) -> dict:
        return asdict(self)


def _all_measured(*figures: Figure | None) -> str:
    return MEASURED if all(f is None or f.basis == MEASURED for f in figures) else PROJECTED


# --- run directory -----------------------------------------------------------------------------


def _num(obj: Any) -> float | None:
    """A non-negative finite number, bare or as {"value": x}; None when absent or not measured."""
    if isinstance(obj, dict):
        if obj.get("measured") is False:
            return None
        obj = obj.get("value")
    if isinstance(obj, bool) or not isinstance(obj, int | float):
        return None
    return float(obj) if math.isfinite(obj) and obj >= 0 else None


def _get(data: dict, *keys: str) -> Any:
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


@dataclass
class RunMeasurements:
    """What a run directory measured, and on which device."""

    path: Path
    card_id: str | None  # the catalog card the measurements were made on; None: not a catalog card
    device: str
    files: dict[str, dict]
    notes: list[str] = field(default_factory=list)

    def value(self, file: str, *keys: str) -> float | None:
        return _num(_get(self.files.get(file, {}), *keys))

    def to_dict(self) -> dict:
        return {"path": str(self.path), "card_id": self.card_id, "device": self.device,
                "files": sorted(self.files), "notes": self.notes}


RUN_FILES = ("manifest", "pilot", "restore", "scale", "export")


def read_run_dir(path: Path | str, spec: RunSpec, catalog: Catalog) -> RunMeasurements:
    """Read the stage results in ``path``; UserError when they belong to another spec."""
    path = Path(path)
    if not path.is_dir():
        raise UserError("from", f"run directory {str(path)!r} does not exist or is not a directory.",
                        "Pass the --out directory of `tunepilot pilot`.")
    files: dict[str, dict] = {}
    notes: list[str] = []
    for name in RUN_FILES:
        file = path / f"{name}.json"
        if not file.exists():
            notes.append(f"no {file.name}: its terms are projected")
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError("from", f"{file} is not readable JSON: {exc}.",
                            "Re-run the stage that wrote it.") from None
        files[name] = data if isinstance(data, dict) else {}
    want = spec.spec_hash()
    hashes = {n: files[n].get("spec_hash") for n in files if files[n].get("spec_hash")}
    for name, got in hashes.items():
        if got != want:
            raise UserError("from", f"{path}/{name}.json was made for another spec (spec_hash "
                            f"{str(got)[:12]}..., this spec is {want[:12]}...).",
                            "Pass the run directory of this spec, or re-run the pilot for it.")
    if not hashes:
        notes.append("no spec_hash in the run directory: its measurements cannot be tied to this "
                     "spec and are not used")
        files = {}
    device = _get(files, "manifest", "device") or _get(files, "pilot", "device") or {}
    device = device if isinstance(device, dict) else {}
    raw_card = device.get("card_id") if isinstance(device, dict) else None
    name = (device.get("name") or device.get("kind") or "unknown device") if device else "unknown"
    card_id = None
    if raw_card:
        try:
            card_id = catalog.get(str(raw_card)).id
        except UserError:
            notes.append(f"measured on {raw_card!r}, which is not a catalog card")
    elif files:
        notes.append(f"measured on {name}, not a catalog card: throughput and validation are "
                     "projected from FLOPs; its machine-bound timings are carried over (projected) "
                     "and its sizes used as measured")
    return RunMeasurements(path, card_id, str(name), files, notes)


# --- the run's arithmetic ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunFacts:
    """The per-token FLOPs and byte counts of the spec (from the arch and the plan's params)."""

    train_flops_per_token: float
    forward_flops_per_token: float
    flops_formula: str
    checkpoint_bytes: int
    load_bytes: int


def run_facts(spec: RunSpec, arch: Any, params: Any) -> RunFacts:
    from tunepilot.arch import param_counts

    counts = param_counts(arch)
    lookup = 0 if arch.tied_embeddings else counts.embedding  # a lookup, not a matmul
    trainable = params.trainable - (lookup if not spec.method.is_lora else 0)
    frozen = max(params.frozen - lookup, 0) if spec.method.is_lora else 0
    attn = 12 * arch.num_layers * arch.num_heads * arch.head_dim * spec.sequence_length
    train = 6 * trainable + 4 * frozen + attn
    forward = 2 * (trainable + frozen) + attn / 3
    formula = (f"6 x {trainable:,} trainable + 4 x {frozen:,} frozen + 12 x {arch.num_layers} x "
               f"{arch.num_heads} x {arch.head_dim} x {spec.sequence_length} attention = "
               f"{train:.4g} FLOPs/token (PaLM appendix B)")
    full_bytes = 2 if spec.precision == "bf16-true" and not spec.method.is_lora else 4
    state = {"adamw": 8, "adamw_8bit": 2, "paged_adamw": 8, "paged_adamw_8bit": 2, "sgd": 0,
             "adafactor": 4}[spec.optimizer.name]  # bytes of optimizer state per fp32 element
    if spec.optimizer_state_dtype == "bf16" and state in (8, 4):
        state //= 2
    ckpt = params.trainable * (full_bytes + state)
    per_param = 4 if spec.precision == "fp32" else SOURCE_CHECKPOINT_BYTES_PER_PARAM
    return RunFacts(float(train), float(forward), formula, int(ckpt),
                    int((params.frozen if spec.method.is_lora else params.total) * per_param))


def _efficiency_assumed(strategy: str, count: int) -> float:
    table = cost_model()["scaling_efficiency_assumed"]
    keys = sorted(int(k) for k in table[strategy])
    for k in keys:
        if count <= k:
            return float(table[strategy][k])
    return float(table["beyond"])


@dataclass
class _Ctx:
    spec: RunSpec
    catalog: Catalog
    facts: RunFacts
    fit: dict[str, dict]  # card id -> plan row
    run: RunMeasurements | None
    method_kind: str


def _machine(ctx: _Ctx, card: Card, file: str, keys: tuple[str, ...], unit: str, what: str
             ) -> Figure | None:
    """A machine-bound measurement: measured on this card; carried over unchanged (projected)
    from another card or a device that is not a catalog card (a CPU pilot)."""
    run = ctx.run
    value = run.value(file, *keys) if run else None
    if value is None or run is None:
        return None
    where = f"{file}.json {'.'.join(keys)}"
    if run.card_id == card.id:
        return Figure(value, unit, MEASURED, f"{what}: {where} on {card.id}")
    return Figure(value, unit, PROJECTED, f"{what}: {where} measured on {run.card_id or run.device}"
                  ", carried over unchanged (machine-bound, not card-bound)")


def _size(ctx: _Ctx, sources: tuple[tuple[str, tuple[str, ...]], ...]) -> float | None:
    for file, keys in sources:
        if ctx.run and (v := ctx.run.value(file, *keys)) is not None:
            return v
    return None


def _export_rate(ctx: _Ctx, card: Card) -> Figure | None:
    """export.json bytes_per_s (or bytes / seconds), as a machine-bound figure."""
    rate = _machine(ctx, card, "export", ("bytes_per_s",), "B/s", "export bandwidth")
    if rate is None and ctx.run and (b := ctx.run.value("export", "bytes")) and (
            s := ctx.run.value("export", "seconds")):
        base = _machine(ctx, card, "export", ("seconds",), "s", "export bytes / seconds")
        rate = base and Figure(b / s, "B/s", base.basis, base.how)
    return rate


def _useful_fraction(ctx: _Ctx) -> Figure:
    useful = ctx.run.value("pilot", "throughput", "useful_tokens_per_s") if ctx.run else None
    padded = ctx.run.value("pilot", "throughput", "padded_tokens_per_s") if ctx.run else None
    if useful and padded:
        return Figure(min(useful / padded, 1.0), "fraction", MEASURED,
                      "pilot.json useful / padded tokens per s (a property of the data)")
    if ctx.spec.data.source == "synthetic":
        return Figure(1.0, "fraction", PROJECTED, "synthetic data has no padding")
    return Figure(1.0, "fraction", PROJECTED, "assumed no padding: the pilot measures it")


def _per_card_throughput(ctx: _Ctx, card: Card, useful: Figure) -> Figure:
    """Useful tokens/s of one card of this kind (as if the run fitted on one)."""
    key = "bf16" if ctx.spec.method.kind == "qlora" else _PEAK_KEY[ctx.spec.precision]
    peak = card.peak_flops(key)
    if peak is None:
        raise UserError("card", f"{card.id} has no {key} peak in the catalog.", None)
    run = ctx.run
    measured = run.value("pilot", "throughput", "useful_tokens_per_s") if run else None
    if measured and run and run.card_id == card.id:
        return Figure(measured, "tokens/s", MEASURED,
                      f"pilot.json throughput.useful_tokens_per_s on {card.id}")
    if measured and run and run.card_id is not None:
        m = ctx.catalog.get(run.card_id)
        f = _assumed("compute_bound_fraction")
        m_peak = m.peak_flops(key) or peak
        ratio = f * m_peak / peak + (1 - f) * m.hbm_bandwidth_tbps / card.hbm_bandwidth_tbps
        return Figure(measured / ratio, "tokens/s", PROJECTED,
                      f"{measured:,.0f} tokens/s measured on {m.id}; step time x ({f:g} x "
                      f"{key} peak {m_peak / 1e12:g}/{peak / 1e12:g} + {1 - f:g} x HBM "
                      f"{m.hbm_bandwidth_tbps:g}/{card.hbm_bandwidth_tbps:g}) (compute_bound_"
                      "fraction assumed)")
    mfu = float(cost_model()["mfu_assumed"]["by_method"][ctx.method_kind])
    tps = mfu * peak / ctx.facts.train_flops_per_token * useful.value
    return Figure(tps, "tokens/s", PROJECTED,
                  f"MFU {mfu:g} (assumed, cost_model.yaml mfu_assumed.{ctx.method_kind}) x dense "
                  f"{key} peak {peak / 1e12:g} TFLOP/s / {ctx.facts.flops_formula}"
                  + (f" x useful fraction {useful.value:.3g}" if useful.value < 1 else ""))


def _scaled(ctx: _Ctx, card: Card, count: int, strategy: str, one: Figure
            ) -> tuple[Figure, Figure]:
    """(efficiency, total useful tokens/s) of ``count`` cards."""
    if count == 1:
        return Figure(1.0, "fraction", one.basis, "one card: no scaling"), one
    run = ctx.run
    entry = _get(run.files.get("scale", {}), "strategies", strategy) if run else None
    same_card = run is not None and run.card_id == card.id
    nproc = _num(_get(entry, "nproc")) if isinstance(entry, dict) else None
    eff = _num(_get(entry, "efficiency")) if isinstance(entry, dict) else None
    tps = _num(_get(entry, "useful_tokens_per_s")) if isinstance(entry, dict) else None
    if same_card and nproc == count and tps:
        e = Figure(eff if eff is not None else tps / (count * one.value), "fraction", MEASURED,
                   f"scale.json strategies.{strategy} at nproc={count} on {card.id}")
        return e, Figure(tps, "tokens/s", MEASURED, e.how)
    if same_card and eff is not None and nproc:
        e = Figure(eff, "fraction", PROJECTED, f"scale.json strategies.{strategy}.efficiency "
                   f"measured at nproc={nproc:g} on {card.id}, applied at {count}")
    else:
        e = Figure(_efficiency_assumed(strategy, count), "fraction", PROJECTED,
                   f"assumed {strategy} efficiency at {count} cards (cost_model.yaml "
                   "scaling_efficiency_assumed)")
    return e, Figure(count * e.value * one.value, "tokens/s", PROJECTED,
                     f"{count} x efficiency {e.value:.3g} x {one.value:,.0f} tokens/s per card")


def _strategy(ctx: _Ctx, card: Card, count: int) -> str | None:
    """The parallel strategy the quote assumes, or None when the run does not fit at ``count``."""
    need = ctx.fit[card.id]["devices_needed"]
    ddp_ok = need.get("ddp") == 1
    fsdp_ok = need.get("fsdp") is not None and count >= need["fsdp"]
    wanted = ctx.spec.parallel.strategy
    if count == 1:
        return "single" if ddp_ok else None
    if wanted == "fsdp" and fsdp_ok:
        return "fsdp"
    return "ddp" if ddp_ok else ("fsdp" if fsdp_ok else None)


def _does_not_fit(ctx: _Ctx, card: Card, count: int) -> str:
    row = ctx.fit[card.id]
    need = row["devices_needed"].get("fsdp")
    gib = 2**30
    head = (f"device peak {row['device_peak_bytes'] / gib:,.1f} GiB on a card of "
            f"{row['capacity_bytes'] / gib:,.1f} GiB leaves {row['headroom_fraction']:.0%} free")
    if need is None:
        return (f"the run does not fit {card.id} at any card count: {head}, and FSDP does not "
                "shrink the per-rank activations; see `tunepilot plan` (activation_checkpointing "
                "or a smaller micro_batch_size)")
    return (f"the run does not fit {count} x {card.id}: {head}; FSDP needs at least {need} cards")


# --- the quote ---------------------------------------------------------------------------------


@dataclass
class TimeTerm:
    """One term of the job's time: ``each`` x ``times`` = ``total`` (seconds)."""

    name: str
    times: int
    each: Figure
    total: Figure

    def to_dict(self) -> dict:
        return {"name": self.name, "times": self.times, "each": self.each.to_dict(),
                "total": self.total.to_dict()}


@dataclass
class Quote:
    """A term of ``count`` x ``card_id``: the job's time, the term's cost, cost per useful token."""

    spec_label: str
    spec_hash: str
    card_id: str
    count: int
    strategy: str
    target_useful_tokens: float
    optimizer_steps: int
    tokens_per_step: int
    throughput: dict[str, Figure]
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
    run_dir: dict | None
    notes: list[str]

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["throughput"] = {k: f.to_dict() for k, f in self.throughput.items()}
        d["time_terms"] = [t.to_dict() for t in self.time_terms]
        d["job_s"] = self.job_s.to_dict()
        for k in ("term", "shortest_term", "cheapest_term"):
            d[k] = getattr(self, k).to_dict()
        for k in ("cost_per_million_term_usd", "cost_per_million_job_usd", "job_cost_usd"):
            d[k] = None if d[k] is None else str(d[k])
        # the prices are the catalog's; the time they pay for is measured or projected
        d["cost_basis"] = self.job_s.basis
        return d


def _context(spec: RunSpec, catalog: Catalog, run_dir: Path | str | None, card_ids: list[str] | None,
             base_dir: Path | None) -> _Ctx:
    from tunepilot.memory.plan import make_plan, resolve_arch

    run = read_run_dir(run_dir, spec, catalog) if run_dir is not None else None
    arch = resolve_arch(spec, base_dir)
    wanted = card_ids and [catalog.get(c).id for c in card_ids] or [c.id for c in catalog.cards]
    staged = _staged_plan(run_dir, spec)
    if staged is not None and all(c in staged[1] for c in wanted):
        params, fit = staged  # the plan the staged pilot gated on (traced when it could)
    else:
        plan = make_plan(spec, catalog=catalog, card_ids=card_ids, arch=arch, base_dir=base_dir)
        params, fit = plan.params, {row["card"]: row for row in plan.cards}
    facts = run_facts(spec, arch, params)
    return _Ctx(spec, catalog, facts, fit, run, spec.method.kind)


def _staged_plan(run_dir: Path | str | None, spec: RunSpec):
    """(params, fit rows by card) from RUN_DIR/plan.json when it is this spec's, else None."""
    if run_dir is None:
        return None
    from tunepilot.memory.analytic import ParamSplit
    from tunepilot.store import RunDir

    run = RunDir(run_dir)
    if not run.stage_done("plan", spec.spec_hash()):
        return None
    plan = run.read("plan")
    return ParamSplit(**plan["params"]), {row["card"]: row for row in plan["cards"]}


def _job(ctx: _Ctx, card: Card, count: int, strategy: str):
    spec, facts, run = ctx.spec, ctx.facts, ctx.run
    useful = _useful_fraction(ctx)
    one = _per_card_throughput(ctx, card, useful)
    eff, total = _scaled(ctx, card, count, strategy, one)
    tokens_per_step = spec.tokens_per_micro_batch * spec.gradient_accumulation_steps * count
    target = spec.target.useful_tokens
    steps = math.ceil(target / (tokens_per_step * useful.value))
    ckpt = _size(ctx, (("restore", ("checkpoint_bytes",)), ("pilot", ("timings", "checkpoint_bytes"))))
    ckpt_bytes = Figure(ckpt, "bytes", MEASURED, "checkpoint_bytes from the run directory") if (
        ckpt is not None) else Figure(facts.checkpoint_bytes, "bytes", PROJECTED,
                                      "trainable parameters x (weight + optimizer-state bytes)")

    def bw(key: str) -> float:
        return _assumed(key)

    terms: list[TimeTerm] = []

    def add(name: str, times: int, each: Figure) -> None:
        terms.append(TimeTerm(name, times, each, Figure(each.value * times, "s", each.basis,
                                                        f"{times} x {each.value:,.1f} s")))

    add("provisioning", 1, Figure(bw("provisioning_s"), "s", PROJECTED, "assumed (cost_model."
                                  "yaml provisioning_s): happens on the rented cluster, no stage "
                                  "measures it"))
    add("set-up", 1, _machine(ctx, card, "pilot", ("timings", "setup_s"), "s", "set-up")
        or Figure(bw("process_setup_s"), "s", PROJECTED, "assumed (cost_model.yaml "
                  "process_setup_s)"))
    load = _machine(ctx, card, "pilot", ("timings", "model_load_s"), "s", "load")
    if load is not None and spec.model.weights == "random":
        load = Figure(load.value, "s", load.basis, load.how + " (random weights, as the spec says; "
                      "reading pretrained weights takes longer)")
    add("model load", 1, load
        or Figure(facts.load_bytes / bw("model_load_bytes_per_s"), "s", PROJECTED,
                  f"{facts.load_bytes / 1e9:,.2f} GB of weights / assumed "
                  f"{bw('model_load_bytes_per_s') / 1e9:g} GB/s (model_load_bytes_per_s)"))
    add("training", 1, Figure(target / total.value, "s", total.basis,
                              f"{target:,.0f} useful tokens / {total.value:,.0f} tokens/s"))
    val_runs = steps // spec.validation.every_steps
    val = _machine(ctx, card, "pilot", ("timings", "validation_pass_s"), "s", "validation pass")
    if val is not None and run and run.card_id is None:
        val = None  # compute-bound, and a CPU has no catalog peak to scale it by
    elif val is not None and val.basis == PROJECTED and run and run.card_id:
        m_one = _per_card_throughput(ctx, ctx.catalog.get(run.card_id), useful)
        val = Figure(val.value * m_one.value / one.value, "s", PROJECTED,
                     f"validation pass measured on {run.card_id}, scaled by the per-card "
                     "throughput ratio")
    if val is None:
        vt = spec.validation.num_batches * spec.tokens_per_micro_batch
        val = Figure(vt * facts.forward_flops_per_token / facts.train_flops_per_token / one.value,
                     "s", PROJECTED, f"{vt:,} tokens forward only (forward/training FLOPs "
                     f"{facts.forward_flops_per_token / facts.train_flops_per_token:.2f}) at the "
                     "per-card rate; each rank runs num_batches")
    add("validation", val_runs, val)
    saves = steps // spec.checkpoint.every_steps
    write = _machine(ctx, card, "restore", ("save_s",), "s", "checkpoint save") or _machine(
        ctx, card, "pilot", ("timings", "checkpoint_write_s"), "s", "checkpoint write")
    add("checkpoint writes", saves, write or Figure(
        ckpt_bytes.value / bw("checkpoint_write_bytes_per_s"), "s", PROJECTED,
        f"{ckpt_bytes.value / 1e9:,.3g} GB ({ckpt_bytes.basis}) / assumed "
        f"{bw('checkpoint_write_bytes_per_s') / 1e9:g} GB/s"))
    rate = _export_rate(ctx, card)
    export_each = Figure(ckpt_bytes.value / rate.value, "s", _all_measured(rate, ckpt_bytes),
                         f"{ckpt_bytes.value / 1e9:,.3g} GB / {rate.how}") if rate and rate.value \
        else Figure(ckpt_bytes.value / bw("export_bytes_per_s"), "s", PROJECTED,
                    f"{ckpt_bytes.value / 1e9:,.3g} GB ({ckpt_bytes.basis}) / assumed "
                    f"{bw('export_bytes_per_s') / 1e9:g} GB/s (export_bytes_per_s)")
    add("export", 1, export_each)
    job_s = sum(t.total.value for t in terms)
    job = Figure(job_s, "s", _all_measured(*(t.total for t in terms)), "sum of the terms")
    throughput = {"useful_fraction": useful, "per_card": one, "efficiency": eff, "total": total}
    return throughput, terms, job, steps, tokens_per_step, ckpt_bytes


def _cost_per_million(cents: int | Decimal, tokens: float) -> Decimal | None:
    if tokens <= 0:
        return None
    usd = Decimal(cents) / 100 * Decimal(10**6) / Decimal(repr(float(tokens)))
    return usd.quantize(_USD_PER_M, rounding=ROUND_HALF_UP)


def _build(ctx: _Ctx, card: Card, count: int, term_s: int | None, options: dict[str, Decimal]
           ) -> Quote:
    strategy = _strategy(ctx, card, count)
    if strategy is None:
        raise UserError("card", _does_not_fit(ctx, card, count) + ".",
                        "Pick a card and count from `tunepilot compare SPEC`.")
    throughput, terms, job, steps, tps, _ = _job(ctx, card, count, strategy)
    margin = _assumed("safety_margin")
    step = card.pricing.billing_increment_s
    n_steps = math.ceil(job.value * (1 + margin) / step)
    shortest = term_cost(card, count, max(n_steps * step, 1), options)
    candidates = [shortest] + [term_cost(card, count, t.hours * 3600, options)
                               for t in card.pricing.terms if t.hours * 3600 > shortest.term_s]
    cheapest = min(candidates, key=lambda c: (c.total_cents, c.term_s))
    term = term_cost(card, count, term_s, options) if term_s is not None else cheapest
    target = ctx.spec.target.useful_tokens
    fixed = sum(t.total.value for t in terms
                if t.name in ("provisioning", "set-up", "model load", "export"))
    share = min(1.0, max(0.0, (term.term_s - fixed) / max(job.value - fixed, 1e-9)))
    in_term = target * share
    disc = Decimal(term.discount_percent) / 100
    job_cost = (count * Decimal(repr(job.value)) / 3600 * card.pricing.on_demand_usd_per_hour
                * (1 - disc))
    notes = []
    if count > card.inventory.count:
        notes.append(f"the local inventory has {card.inventory.count} x {card.id}; "
                     "`tunepilot book` will refuse more")
    if term.term_s < job.value:
        notes.append(f"the term is {(job.value - term.term_s) / 3600:,.1f} h short: it delivers "
                     f"{share:.0%} of the target")
    return Quote(
        ctx.spec.label, ctx.spec.spec_hash(), card.id, count, strategy, target, steps, tps,
        throughput, terms, job, term, term.term_s >= job.value, term.term_s - job.value,
        (term.term_s - job.value) / job.value, in_term, shortest, n_steps, cheapest,
        _cost_per_million(term.total_cents, in_term),
        _cost_per_million(job_cost * 100, target) or Decimal(0),
        job_cost.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP), margin,
        card.pricing.source, card.pricing.as_of,
        ctx.run.to_dict() if ctx.run else None, notes + (ctx.run.notes if ctx.run else []))


def quote(spec: RunSpec, *, card_id: str, count: int, term_s: int | None,
          options: list[str] | None = None, run_dir: Path | str | None = None,
          catalog: Catalog | None = None, base_dir: Path | None = None) -> Quote:
    """Quote ``count`` x ``card_id`` for ``term_s`` seconds (None: the cheapest covering term)."""
    catalog = catalog or load_catalog()
    card = catalog.get(card_id)
    check_count(count)
    if term_s is not None and term_s <= 0:
        raise UserError("hours", f"the term must be longer than 0 s, got {term_s}.")
    opts = parse_options(card, options)
    ctx = _context(spec, catalog, run_dir, [card.id], base_dir)
    return _build(ctx, card, count, term_s, opts)


@dataclass
class Comparison:
    """Every card x count that fits, cheapest per useful token first; and the cards refused."""

    spec_label: str
    spec_hash: str
    rows: list[Quote]
    refused: list[dict]
    run_dir: dict | None

    def to_dict(self) -> dict:
        return {"spec_label": self.spec_label, "spec_hash": self.spec_hash,
                "ranked_by": "cost_per_million_term_usd (cheapest covering term)",
                "rows": [q.to_dict() for q in self.rows], "refused": self.refused,
                "run_dir": self.run_dir}


def compare(spec: RunSpec, *, run_dir: Path | str | None = None, catalog: Catalog | None = None,
            base_dir: Path | None = None) -> Comparison:
    """Quote every fitting card x count (1, 2, 4, 8 and the fewest FSDP needs) on its cheapest
    covering term and rank by cost per million useful tokens."""
    catalog = catalog or load_catalog()
    ctx = _context(spec, catalog, run_dir, None, base_dir)
    rows, refused = [], []
    for card in catalog.cards:
        need = ctx.fit[card.id]["devices_needed"]
        least = 1 if need.get("ddp") == 1 else need.get("fsdp")
        if least is None:
            refused.append({"card": card.id, "reason": _does_not_fit(ctx, card, 1)})
            continue
        counts = sorted({c for c in (*COMPARE_COUNTS, least, 2 * least)
                         if least <= c <= max(COMPARE_COUNTS[-1], 2 * least)})
        for count in counts:
            rows.append(_build(ctx, card, count, None, {}))
    rows.sort(key=lambda q: (q.cost_per_million_term_usd is None,
                             q.cost_per_million_term_usd or 0, q.job_s.value))
    return Comparison(spec.label, spec.spec_hash(), rows, refused,
                      ctx.run.to_dict() if ctx.run else None)
