"""The accelerator catalog: cards, their datasheet numbers, and (example) rental prices.

The numbers live in ``resources/catalog.yaml``, each with ``source`` and ``as_of``; this module only
reads and checks them. A user catalog (``--catalog FILE``) wins: a card there whose id or alias
names a shipped card replaces the keys it gives (mappings merged key by key; a ``pricing`` with
its own ``source`` is another offer: the shipped offer's host, spot and instance keys it omits are
dropped, and a ``host`` block is replaced whole), a new id is added, and ``replace: true``
replaces the shipped catalog entirely.

Each offer may say what machine it rents (``pricing.host``: host RAM, vCPUs, local disk of the
instance) and how often its spot capacity is reclaimed (``spot_interruptions_per_hour``, with
its source): the host plan (plan/host.py) and the spot quote (cost/spot.py) read them.

Money and percentages are ``Decimal``, read from quoted strings ("2.49"); a YAML float is refused
because it cannot hold cents exactly. Pure Python (pyyaml + pydantic): no heavy imports here.
"""

from __future__ import annotations

import difflib
import re
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from tunepilot.errors import UserError
from tunepilot.limits import MAX_CARDS, MAX_MEMORY_GB, MAX_TERM_HOURS, MAX_TFLOPS, MAX_USD
from tunepilot.resources import CATALOG_YAML
from tunepilot.units import cents_to_usd  # noqa: F401 - the one cents_to_usd, re-exported

DEFAULT_CATALOG_PATH = CATALOG_YAML
SCHEMA_VERSION = 1
PEAK_KEYS = ("bf16", "fp16", "fp8", "tf32", "fp32")
_MEMORY_TOLERANCE = 0.10  # memory_bytes may differ from memory_gb x 10^9 by this fraction
_LAYOUT_HINT = f"See the shipped catalog for the layout: {DEFAULT_CATALOG_PATH}"


def _decimal(value: Any) -> Decimal:
    """Money or a percentage: a quoted decimal string or an int; never a float."""
    if isinstance(value, float):
        raise ValueError(f'write it as a quoted decimal string "{value!r}", not the YAML float '
                         f"{value!r}: a float cannot hold money or percentages exactly")
    if isinstance(value, int) and not isinstance(value, bool):
        value = Decimal(value)
    elif isinstance(value, str):
        try:
            value = Decimal(value.strip())
        except InvalidOperation:
            raise ValueError(f'{value!r} is not a decimal number; write e.g. "2.49" '
                             "(no currency sign or unit)") from None
    if not isinstance(value, Decimal):
        raise ValueError(f'expected a quoted decimal string such as "2.49", got {value!r}')
    if not value.is_finite() or value < 0:
        raise ValueError(f"{value} is not a finite amount >= 0")
    if value > MAX_USD:
        raise ValueError(f"{value} is more than {MAX_USD:,} USD: a card-hour, an option's unit "
                         "or a percentage is priced far below that (a typo?)")
    return value


def _as_of(value: Any) -> Any:
    """``as_of`` as text: YAML reads an unquoted 2026-12-01 as a date."""
    return value.isoformat() if isinstance(value, date) else value


def check_rate(value: Any) -> float:
    """An interruption rate per instance-hour: a finite number in [0, 1). A rate of 1 or more
    per hour is an instance that lives under an hour on average: no spot term is priced on it."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected interruptions per instance-hour, a number in [0, 1), "
                         f"got {value!r}")
    try:
        rate = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of interruptions per instance-hour") \
            from None
    if not (0 <= rate < 1):  # also refuses nan and inf
        raise ValueError(f"{value!r} interruptions per instance-hour is outside [0, 1): give "
                         "the mean rate, e.g. 0.05 (one interruption per 20 instance-hours)")
    return rate


Money = Annotated[Decimal, BeforeValidator(_decimal)]
Percent = Annotated[Decimal, BeforeValidator(_decimal), Field(le=100)]
AsOf = Annotated[str, BeforeValidator(_as_of), Field(min_length=1)]


def usd_to_cents(usd: Decimal, *, rounding: str | None = None) -> int:
    """Whole US cents in ``usd``. Exact unless ``rounding`` (e.g. ``decimal.ROUND_HALF_UP``) is
    given: without it, an amount with a fraction of a cent raises ValueError."""
    if not isinstance(usd, Decimal):
        raise TypeError(f"usd_to_cents takes a Decimal, got {type(usd).__name__}")
    cents = usd.scaleb(2)
    whole = cents.to_integral_value(rounding=rounding)
    if rounding is None and whole != cents:
        raise ValueError(f"{usd} USD is not a whole number of cents; pass rounding= to round it")
    return int(whole)


def _tera(value: float) -> float:
    """x 10^12 without float fuzz (2.039 TB/s -> 2039000000000.0 B/s, not ...000.0002)."""
    return float(Decimal(repr(value)).scaleb(12))


def normalise_card_name(name: str) -> str:
    """Lowercase, letters and digits only: 'H100-SXM_80GB' -> 'h100sxm80gb'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Model):
    """Where the numbers named in ``what`` come from."""

    what: str = Field(min_length=1)
    source: str = Field(min_length=1)
    as_of: AsOf


class PeakTflops(_Model):
    """Dense (no 2:4 sparsity) peak TFLOP/s per precision; None where the card has no such unit."""

    bf16: float = Field(gt=0, le=MAX_TFLOPS, allow_inf_nan=False)
    fp16: float | None = Field(default=None, gt=0, le=MAX_TFLOPS, allow_inf_nan=False)
    fp8: float | None = Field(default=None, gt=0, le=MAX_TFLOPS, allow_inf_nan=False)
    tf32: float | None = Field(default=None, gt=0, le=MAX_TFLOPS, allow_inf_nan=False)
    fp32: float | None = Field(default=None, gt=0, le=MAX_TFLOPS, allow_inf_nan=False)


class ScaleUp(_Model):
    """The GPU-to-GPU link inside a node."""

    link: str
    bandwidth_gbps: float | None = Field(default=None, gt=0, le=1e7, allow_inf_nan=False)
    """GB/s per GPU, all links together"""
    notes: str | None = None
    busbw_gbps: float | None = Field(default=None, gt=0, le=1e7, allow_inf_nan=False)
    """measured NCCL/RCCL all-reduce bus bandwidth of a full node, GB/s: what a collective
    inside the node achieves (the time model's tensor/context-parallel and intra-node terms)"""
    busbw_source: str | None = None


class Fabric(_Model):
    """The network between the nodes of an offer (its instance type): what a collective that
    leaves the node runs over."""

    kind: Literal["infiniband", "efa", "roce", "tcp"]
    gbps_per_node: float = Field(gt=0, le=1e6)
    """line rate of the node's GPU-facing NICs together, Gb/s (10^9 bit/s)"""
    achieved_fraction: float = Field(gt=0, le=1)
    """the share of the line rate a large NCCL collective reaches per GPU (measured where said)"""
    latency_us: float = Field(gt=0, le=1e5)
    """a small collective across nodes, microseconds"""
    source: str = Field(min_length=1)
    as_of: AsOf

    def bytes_per_s_per_gpu(self, gpus_per_node: int) -> float:
        """Achieved bytes/s of one GPU's share of the node's NICs."""
        return self.gbps_per_node / 8 * 1e9 / max(gpus_per_node, 1) * self.achieved_fraction


class Term(_Model):
    """A reserved term: ``hours`` paid at ``discount_percent`` off the on-demand rate."""

    name: str = Field(min_length=1)
    hours: int = Field(gt=0, le=MAX_TERM_HOURS)
    discount_percent: Percent


class Cancellation(_Model):
    """Refund on cancelling a booking: full at least ``full_refund_before_h`` before the start
    (None: never), ``partial_refund_percent`` later but before it, then the after-start rate."""

    full_refund_before_h: float | None = Field(ge=0, le=MAX_TERM_HOURS, allow_inf_nan=False)
    partial_refund_percent: Percent
    after_start_refund_percent: Percent


class OptionPrice(_Model):
    """An add-on priced per ``unit`` (GB-month, GB, TB-month, hour)."""

    usd: Money
    unit: str = Field(min_length=1)


class HostOffer(_Model):
    """The machine a price rents: host RAM, vCPUs and local disk of one instance of
    ``accelerators`` cards. A node of k cards gets k / accelerators of it (the share a smaller
    instance of the same family offers, stated wherever it is used)."""

    ram_gib: float = Field(gt=0, le=1 << 20, allow_inf_nan=False)
    """host RAM of the instance, GiB (2^30 bytes), as the provider lists it"""
    accelerators: int = Field(ge=1, le=64)
    """the cards of the instance these figures are for"""
    vcpus: int | None = Field(default=None, ge=1, le=1 << 16)
    local_disk_gb: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)
    """local (instance-store / temp) disk, decimal GB; None: the table lists none"""
    instance_type: str | None = None
    source: str = Field(min_length=1)
    as_of: AsOf

    def ram_bytes(self, cards: int) -> int:
        """Host RAM of a node of ``cards`` cards: their share of the instance (bytes)."""
        return int(self.ram_gib * (1 << 30) * min(cards, self.accelerators) / self.accelerators)

    def disk_bytes(self, cards: int) -> int | None:
        """Local disk of a node of ``cards`` cards (their share; bytes), None if not listed."""
        if self.local_disk_gb is None:
            return None
        return int(self.local_disk_gb * 1e9 * min(cards, self.accelerators) / self.accelerators)


class Pricing(_Model):
    """How a card is rented: rate, billing granularity, terms, cancellation, add-ons."""

    on_demand_usd_per_hour: Money
    billing_increment_s: int = Field(gt=0, le=MAX_TERM_HOURS * 3600)  # usage rounds up to this
    minimum_charge_s: int = Field(ge=0, le=MAX_TERM_HOURS * 3600)
    terms: list[Term] = Field(default_factory=list)
    cancellation: Cancellation
    options: dict[str, OptionPrice] = Field(default_factory=dict)
    source: str = Field(min_length=1)
    as_of: AsOf
    spot_usd_per_hour: Money | None = None
    """an interruptible (spot/preemptible) rate, where the price table lists one"""
    spot_source: str | None = None
    instance_type: str | None = None
    """the instance the price is of (an imported price table), e.g. p5.48xlarge"""
    region: str | None = None
    instance_accelerators: int | None = Field(default=None, ge=1, le=1024)
    host: HostOffer | None = None
    """the instance's host RAM, vCPUs and local disk (None: not listed)"""
    fabric: Fabric | None = None
    """the network between its nodes (None: not listed; the time model then assumes the
    published multi-node runs' 400 Gb/s per GPU and says so)"""
    spot_interruptions_per_hour: Annotated[float, BeforeValidator(check_rate)] | None = None
    """interruptions per instance-hour of the spot offer, with ``spot_interruption_source``"""
    spot_interruption_source: str | None = None

    @model_validator(mode="after")
    def _rate_has_source(self) -> Pricing:
        if self.spot_interruptions_per_hour is not None and not self.spot_interruption_source:
            raise ValueError("spot_interruptions_per_hour needs spot_interruption_source: where "
                             "the rate comes from (a trace, the provider's advisor, your logs)")
        return self

    def term(self, name: str) -> Term:
        """The term called ``name`` (week, month, ...); UserError listing the known ones."""
        for term in self.terms:
            if term.name == name.strip().lower():
                return term
        known = ", ".join(t.name for t in self.terms) or "none (on-demand only)"
        raise UserError("term", f"no term {name!r} for this card.", f"Known terms: {known}.")


class Inventory(_Model):
    """How many of the card can be allocated."""

    count: int = Field(ge=0, le=MAX_CARDS)
    source: str = Field(min_length=1)


class Card(_Model):
    """One accelerator: datasheet numbers with ``sources``, pricing, inventory."""

    id: str
    aliases: list[str] = Field(default_factory=list)
    name: str
    vendor: str
    software_stack: Literal["cuda", "rocm"]
    memory_gb: float = Field(gt=0, le=MAX_MEMORY_GB, allow_inf_nan=False)  # decimal GB, as sold
    memory_bytes: int = Field(gt=0, le=int(MAX_MEMORY_GB * 1e9))  # default memory_gb x 10^9
    peak_tflops: PeakTflops
    hbm_bandwidth_tbps: float = Field(gt=0, le=1e4, allow_inf_nan=False)
    scale_up: ScaleUp
    tdp_w: int = Field(gt=0, le=1e6)
    host_link: Literal["pcie4", "pcie5"] | None = None
    """the card's host interface (x16): what an offloaded optimizer step and vLLM's sleep mode
    move state over (resources/step_model.yaml host_link: its achieved bandwidth)"""
    sources: list[Source] = Field(min_length=1)
    pricing: Pricing
    inventory: Inventory

    @model_validator(mode="before")
    @classmethod
    def _default_memory_bytes(cls, data: Any) -> Any:
        if isinstance(data, dict) and "memory_bytes" not in data:
            gb = data.get("memory_gb")
            ok = isinstance(gb, int | float) and not isinstance(gb, bool) and \
                0 < gb <= MAX_MEMORY_GB
            # out of range: memory_gb's own check names it (1 keeps a second error away)
            data = {**data, "memory_bytes": round(gb * 1e9) if ok else 1}
        return data

    @model_validator(mode="after")
    def _check(self) -> Card:
        for name in (self.id, *self.aliases):
            if not normalise_card_name(name):
                raise ValueError(f"card name {name!r} has no letters or digits")
        expected = self.memory_gb * 1e9
        if abs(self.memory_bytes - expected) > _MEMORY_TOLERANCE * expected:
            raise ValueError(f"memory_bytes {self.memory_bytes} does not match memory_gb "
                             f"{self.memory_gb:g} (decimal GB, {expected:.0f} bytes)")
        return self

    @property
    def capacity_bytes(self) -> int:
        """Memory as sold, in bytes (a process can use less: runtime context, ECC, driver)."""
        return self.memory_bytes

    @property
    def hbm_bandwidth_bytes_per_s(self) -> float:
        return _tera(self.hbm_bandwidth_tbps)

    def peak_flops(self, peak_key: str) -> float | None:
        """Dense peak FLOP/s of the tensor cores at ``peak_key`` (bf16, fp16, fp8, tf32, fp32: a
        run's spec.precision.peak_key); None if unsupported."""
        key = peak_key.strip().lower()
        if key not in PEAK_KEYS:
            raise UserError("precision", f"unknown peak precision {peak_key!r}.",
                            f"Known precisions: {', '.join(PEAK_KEYS)}.")
        tflops = getattr(self.peak_tflops, key)
        return None if tflops is None else _tera(tflops)


class Catalog(_Model):
    """The cards tunepilot can plan for; look one up with ``get``."""

    schema_version: Literal[1]
    as_of: AsOf | None = None
    note: str | None = None
    cards: list[Card] = Field(min_length=1)
    _index: dict[str, Card] = PrivateAttr(default_factory=dict)  # normalised id/alias -> card
    _paths: tuple[Path, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _build_index(self) -> Catalog:
        for card in self.cards:
            for name in (card.id, *card.aliases):
                other = self._index.setdefault(normalise_card_name(name), card)
                if other.id != card.id:
                    raise ValueError(f"card name {name!r} is used by both {other.id} and {card.id}")
        return self

    @property
    def paths(self) -> tuple[Path, ...]:
        """The files this catalog was read from, shipped first."""
        return self._paths

    def select(self, card_ids: list[str] | None) -> list[Card]:
        """The cards named (each looked up with ``get``), or every card when none is named."""
        return [self.get(c) for c in card_ids] if card_ids else list(self.cards)

    def get(self, card_id: str) -> Card:
        """The card named ``card_id``: its id or a declared alias, in any case and punctuation
        (``H100-SXM-80GB`` == ``h100-sxm-80gb``, ``H100_SXM`` == alias ``h100-sxm``). Nothing
        else: H20 and A10 are other GPUs than H200 and A100, so a prefix is not a match."""
        key = normalise_card_name(card_id)
        known = f"known cards: {', '.join(card.id for card in self.cards)}."
        if not key:
            raise UserError("card", "no card name given.", "K" + known[1:])
        if key in self._index:
            return self._index[key]
        close = difflib.get_close_matches(key, list(self._index), n=3, cutoff=0.6)
        close += [name for name in self._index if name.startswith(key) and name not in close]
        guesses = list(dict.fromkeys(self._index[name].id for name in close))
        hint = f"Did you mean {' or '.join(guesses)}? {known}" if guesses else "K" + known[1:]
        raise UserError("card", f"unknown card {_short(card_id)!r} (not a card id or alias of "
                        "this catalog).", hint + " A card of another catalog: add it with "
                        "--catalog FILE.")


class _UserCatalogFile(_Model):
    """A ``--catalog`` file before merging: its cards may be partial overrides."""

    schema_version: Literal[1] = 1
    replace: bool = False
    as_of: AsOf | None = None
    note: str | None = None
    cards: list[dict[str, Any]] = Field(min_length=1)


def load_catalog(path: Path | None = None) -> Catalog:
    """The shipped catalog, with the user catalog at ``path`` (if given) merged over it."""
    shipped = _shipped(DEFAULT_CATALOG_PATH)
    if path is None:
        return shipped
    path = Path(path)
    raw = _read_yaml(path)
    user = _validate(_UserCatalogFile, raw, path)
    if user.replace:
        fields = {k: v for k, v in raw.items() if k != "replace"}
        catalog = _validate(Catalog, {**fields, "schema_version": user.schema_version}, path)
        catalog._paths = (path,)
    else:
        catalog = _overlay(shipped, user, path)
        catalog._paths = (DEFAULT_CATALOG_PATH, path)
    return catalog


def _overlay(shipped: Catalog, user: _UserCatalogFile, path: Path) -> Catalog:
    """Shipped cards with the user's entries merged in (same position) or appended (new ids)."""
    cards = list(shipped.cards)
    position = {card.id: i for i, card in enumerate(cards)}
    overridden_by: dict[str, int] = {}
    for i, entry in enumerate(user.cards):
        card_id = entry.get("id")
        if not isinstance(card_id, str) or not normalise_card_name(card_id):
            raise UserError(f"catalog.cards[{i}].id", f"in {path}, every card needs an id.",
                            "E.g. id: h100-sxm-80gb (an alias such as h100 also works).")
        target = shipped._index.get(normalise_card_name(card_id))
        if target is None:
            cards.append(_validate(Card, entry, path, ("cards", i)))
            continue
        if target.id in overridden_by:
            raise UserError(f"catalog.cards[{i}].id", f"in {path}, cards[{overridden_by[target.id]}]"
                            f" and cards[{i}] both override {target.id}.", "Merge them into one.")
        overridden_by[target.id] = i
        merged = {**_deep_merge(target.model_dump(), entry), "id": target.id}
        _own_offer(merged, entry)
        if "memory_gb" in entry and "memory_bytes" not in entry:
            del merged["memory_bytes"]  # derive it from the user's memory_gb
        cards[position[target.id]] = _validate(Card, merged, path, ("cards", i))
    return _validate(Catalog, {"schema_version": SCHEMA_VERSION, "as_of": user.as_of or shipped.as_of,
                               "note": user.note or shipped.note, "cards": cards}, path)


# What describes one offer (the instance and its spot market): a user's pricing with its own
# ``source`` is another offer, so these never carry over from the shipped one.
_OFFER_KEYS = ("host", "spot_usd_per_hour", "spot_source", "spot_interruptions_per_hour",
               "spot_interruption_source", "instance_type", "region", "instance_accelerators",
               "fabric")


def _own_offer(merged: dict, entry: dict) -> None:
    """A user's ``pricing.host`` replaces the shipped one whole (no disk of another instance);
    a user's pricing with its own ``source`` keeps none of the shipped offer's keys it omits."""
    given = entry.get("pricing")
    if not isinstance(given, dict):
        return
    if "host" in given:
        merged["pricing"]["host"] = given["host"]
    if "source" in given:
        for key in _OFFER_KEYS:
            if key not in given:
                merged["pricing"][key] = None


def _deep_merge(base: dict, override: dict) -> dict:
    """``override`` over ``base``: mappings merged key by key (a partial override only needs the
    keys it changes), anything else replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


STALE_AFTER_DAYS = 30


def catalog_age_days(catalog: Catalog, today: date | None = None) -> int | None:
    """Days since the catalog's as_of (a date, or a YYYY-MM month: its first day)."""
    when = _parse_as_of(catalog.as_of)
    if when is None:
        return None
    return ((today or date.today()) - when).days


def _parse_as_of(text: str | None) -> date | None:
    if not text:
        return None
    for fmt_len, suffix in ((10, ""), (7, "-01")):
        try:
            return date.fromisoformat(str(text)[:fmt_len] + suffix)
        except ValueError:
            continue
    return None


def warn_if_stale(catalog: Catalog, today: date | None = None, stream=None) -> str | None:
    """A warning on stderr when the catalog in use is older than STALE_AFTER_DAYS; prices
    move. Returns the warning."""
    import sys

    age = catalog_age_days(catalog, today)
    if age is None or age <= STALE_AFTER_DAYS:
        return None
    text = (f"warning: the catalog's prices are {age} days old (as_of {catalog.as_of}): prices "
            "move; import current ones with `tunepilot catalog import` or pass --catalog")
    (stream or sys.stderr).write(text + "\n")
    return text


def _short(value: object, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SHIPPED: dict[tuple[str, int, int], Catalog] = {}


def _shipped(path: Path) -> Catalog:
    """The shipped catalog, read and validated once per process while its file is unchanged:
    the time model's fit asks for it once per published run (156 times a quote, 4 ms each).
    Its models are frozen, so one copy serves every caller."""
    try:
        st = path.stat()
    except OSError:
        st = None
    key = (str(path), st.st_mtime_ns, st.st_size) if st is not None else None
    if key is not None and key in _SHIPPED:
        return _SHIPPED[key]
    catalog = _validate(Catalog, _read_yaml(path), path)
    catalog._paths = (path,)
    _SHIPPED.clear()
    if key is not None:
        _SHIPPED[key] = catalog
    return catalog


def _read_yaml(path: Path) -> dict[str, Any]:
    if path != DEFAULT_CATALOG_PATH:  # a user's file: size, aliases and nesting bounded
        from tunepilot.spec.yaml_input import read_yaml_mapping

        try:
            return read_yaml_mapping(path, what="catalog")
        except UserError as exc:  # the same words, naming the catalog
            raise UserError("catalog", exc.message, exc.hint) from None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError("catalog", f"catalog file {str(path)!r} does not exist.",
                        "Check the path given to --catalog.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError("catalog", f"cannot read catalog file {str(path)!r}: {exc}.") from None
    try:  # libyaml's parser where PyYAML has it: the shipped catalog in 3 ms instead of 24
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError("catalog", f"catalog file {str(path)!r} is not valid YAML{where}: "
                        f"{problem}.", "Check the indentation and quoting there.") from None
    if data is None:
        raise UserError("catalog", f"catalog file {str(path)!r} is empty.", _LAYOUT_HINT)
    if not isinstance(data, dict):
        raise UserError("catalog", f"catalog file {str(path)!r} must be a YAML mapping with a "
                        f"cards: list, not {type(data).__name__}.", _LAYOUT_HINT)
    return data


def _validate(model: type[_Model], data: Any, path: Path, prefix: tuple = ()) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        _raise_invalid(exc, path, prefix)


def _raise_invalid(exc: ValidationError, path: Path, prefix: tuple) -> NoReturn:
    """One UserError: the first problem's field path as ``field``, the file, any other problems."""
    problems = [(_field_path((*prefix, *err["loc"])), _describe(err)) for err in exc.errors()]
    field, first = problems[0]
    message = f"{first} (in {path})."
    if len(problems) > 1:
        message += " Also " + "; ".join(f"{f}: {text}" for f, text in problems[1:6]) + "."
    hint = _LAYOUT_HINT
    if "YAML float" in first:
        hint = 'Quote money and percentages as strings, e.g. on_demand_usd_per_hour: "2.49".'
    raise UserError(field, message, hint) from None


def _field_path(loc: tuple) -> str:
    """('cards', 2, 'pricing', 'x') -> 'catalog.cards[2].pricing.x'."""
    return "catalog" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _describe(err: Any) -> str:
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] == "extra_forbidden":
        return "unknown field (check the spelling against the shipped catalog)"
    if err["type"] == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{err['msg']} (got {repr(err.get('input'))[:60]})"
