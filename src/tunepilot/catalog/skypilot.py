"""SkyPilot: its price tables as a tunepilot catalog, and a task that pilots on the rented card.

``import_vms_csv``: a SkyPilot catalog CSV (``vms.csv``: InstanceType, AcceleratorName,
AcceleratorCount, vCPUs, MemoryGiB, GpuInfo, Price, SpotPrice, Region, AvailabilityZone - in
any column order: read by name) -> a partial override catalog: per card the on-demand price per
card-hour = Price / AcceleratorCount in the cheapest region (or ``region``), the spot price the
same way on its own line, the instance type and region recorded. Card facts (memory, peaks)
stay tunepilot's own: GpuInfo is checked against them and known traps are warned about (an H200
listed at 80 GB; a TotalGpuMemoryInMiB that is per GPU). Accelerators tunepilot has no facts for
are listed as unknown with what is missing - never invented.

``task_yaml``: a SkyPilot task running the staged pilot on CARD:N (see launch.py).
"""

from __future__ import annotations

import ast
import csv
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

from tunepilot.errors import UserError

NEEDED = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "Region")
# SkyPilot accelerator names -> tunepilot card ids (exact: SkyPilot's "A100" is the 40 GB card)
SKY_TO_CARD = {"A100-80GB": "a100-sxm-80gb", "H100": "h100-sxm-80gb",
               "H100-MEGA": "h100-sxm-80gb", "H100-80GB": "h100-sxm-80gb",
               "H200": "h200-sxm-141gb", "MI300X": "mi300x-192gb"}
CARD_TO_SKY = {"a100-sxm-80gb": "A100-80GB", "h100-sxm-80gb": "H100", "h200-sxm-141gb": "H200",
               "mi300x-192gb": "MI300X"}
_MIB = 1 << 20


@dataclass
class _Offer:
    card_id: str
    per_card: Decimal
    spot_per_card: Decimal | None
    instance: str
    region: str
    count: int


@dataclass
class CatalogImport:
    source: str
    as_of: str
    cards: list[dict]
    unknown: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rows: int = 0
    skipped_rows: int = 0

    def to_dict(self) -> dict:
        return {"source": self.source, "as_of": self.as_of, "cards": self.cards,
                "unknown": self.unknown, "warnings": self.warnings, "rows": self.rows,
                "skipped_rows": self.skipped_rows}


def _money(raw: str, row: int, column: str) -> Decimal | None:
    text = (raw or "").strip()
    if not text:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise UserError(f"row {row}: {column}", f"{text[:40]!r} is not a number.",
                        "Fix the CSV (prices are USD per instance-hour).") from None
    if not value.is_finite() or value < 0:
        raise UserError(f"row {row}: {column}", f"{text[:40]!r} is not a price >= 0.")
    return value


def _count(raw: str, row: int) -> int:
    try:
        n = float((raw or "").strip())
    except ValueError:
        raise UserError(f"row {row}: AcceleratorCount", f"{raw[:40]!r} is not a number.") \
            from None
    if n < 1 or n != int(n):
        raise UserError(f"row {row}: AcceleratorCount", f"{raw!r} is not a whole count >= 1.",
                        "A row with accelerators needs at least one; drop the row or fix it.")
    return int(n)


def import_vms_csv(path: Path, *, region: str | None = None, as_of: str | None = None,
                   catalog=None) -> CatalogImport:
    from tunepilot.catalog import load_catalog

    catalog = catalog or load_catalog()
    path = Path(path)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8-sig")
    except OSError as exc:
        raise UserError("FILE", f"{path} cannot be read ({exc.strerror or exc}).") from None
    except UnicodeDecodeError:
        raise UserError("FILE", f"{path} is not UTF-8 text (a SkyPilot vms.csv is).") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in NEEDED if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError("FILE", f"{path.name} has no column {', '.join(missing)}.",
                        f"A SkyPilot catalog CSV (vms.csv) has {', '.join(NEEDED)}, ... - "
                        "columns are read by name in any order.")
    offers: dict[str, list[_Offer]] = {}
    unknown: dict[str, dict] = {}
    warnings: list[str] = []
    rows = skipped = 0
    for i, r in enumerate(reader, start=2):  # row 1 is the header
        rows += 1
        name = (r.get("AcceleratorName") or "").strip()
        if not name:
            skipped += 1  # a CPU-only instance
            continue
        if region and (r.get("Region") or "").strip() != region:
            continue
        count = _count(r.get("AcceleratorCount", ""), i)
        price = _money(r.get("Price", ""), i, "Price")
        spot = _money(r.get("SpotPrice", ""), i, "SpotPrice") if "SpotPrice" in r else None
        card_id = SKY_TO_CARD.get(name)
        if card_id is None:
            unknown.setdefault(name, {"accelerator": name, "instances": set(),
                                      "missing": _missing_facts(name)})
            unknown[name]["instances"].add((r.get("InstanceType") or "").strip())
            continue
        _check_gpu_info(r.get("GpuInfo"), name, catalog.get(card_id), warnings)
        if price is None and spot is None:
            skipped += 1
            continue
        offers.setdefault(card_id, []).append(_Offer(
            card_id, price / count if price is not None else None,
            spot / count if spot is not None else None, (r.get("InstanceType") or "").strip(),
            (r.get("Region") or "").strip(), count))
    if region and not offers and not unknown:
        raise UserError("--region", f"no accelerator rows in region {region!r} of {path.name}.")
    when = as_of or datetime.fromtimestamp(path.stat().st_mtime, UTC).date().isoformat()
    digest = hashlib.sha256(raw).hexdigest()[:12]
    source = f"SkyPilot catalog {path.name} (sha256 {digest}), imported by tunepilot"
    cards = [_card_entry(card_id, rows_, source, when) for card_id, rows_ in sorted(offers.items())]
    return CatalogImport(str(path), when, [c for c in cards if c],
                         [{**u, "instances": sorted(u["instances"])} for u in unknown.values()],
                         list(dict.fromkeys(warnings)), rows, skipped)


def _missing_facts(name: str) -> str:
    return (f"tunepilot has no card facts for {name!r} (memory, dense peak FLOP/s, HBM "
            "bandwidth, scale-up link): add the card with its datasheet sources in --catalog")


def _card_entry(card_id: str, offers: list[_Offer], source: str, when: str) -> dict | None:
    priced = [o for o in offers if o.per_card is not None]
    if not priced:
        return None
    best = min(priced, key=lambda o: (o.per_card, o.region, o.instance))
    pricing: dict = {"on_demand_usd_per_hour": _fmt(best.per_card),
                     "instance_type": best.instance, "region": best.region,
                     "instance_accelerators": best.count,
                     "source": f"{source}: {best.instance} in {best.region}, Price / "
                               f"{best.count} accelerators (the cheapest region)",
                     "as_of": when}
    spots = [o for o in offers if o.spot_per_card is not None and o.region == best.region]
    spots = spots or [o for o in offers if o.spot_per_card is not None]
    if spots:
        s = min(spots, key=lambda o: o.spot_per_card)
        pricing["spot_usd_per_hour"] = _fmt(s.spot_per_card)
        pricing["spot_source"] = f"{source}: SpotPrice of {s.instance} in {s.region} / {s.count}"
    return {"id": card_id, "pricing": pricing}


def _fmt(d: Decimal) -> str:
    q = d.quantize(Decimal("0.000001")).normalize()
    return format(q, "f")


def _check_gpu_info(raw: str | None, name: str, card, warnings: list[str]) -> None:
    """Warn where the table's GPU memory disagrees with the card's facts (known traps)."""
    if not raw:
        return
    try:
        info = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        warnings.append(f"{name}: GpuInfo is not readable ({raw[:60]!r}); card facts used")
        return
    if not isinstance(info, dict):
        return
    gpus = info.get("Gpus") or []
    per = gpus[0].get("MemoryInfo", {}).get("SizeInMiB") if gpus and isinstance(gpus[0], dict) \
        else None
    count = gpus[0].get("Count") if gpus and isinstance(gpus[0], dict) else None
    if isinstance(per, int | float) and per > 0:
        listed, real = per * _MIB, card.memory_bytes
        if abs(listed - real) > 0.05 * real:
            warnings.append(f"{name}: the table lists {per:,.0f} MiB per GPU; {card.id} has "
                            f"{real // _MIB:,} MiB ({card.memory_gb:g} GB): the table is wrong "
                            "there, tunepilot's card facts are used")
    total = info.get("TotalGpuMemoryInMiB")
    if isinstance(total, int | float) and isinstance(per, int | float) and \
            isinstance(count, int | float) and count > 1 and abs(total - per) < 1:
        warnings.append(f"{name}: TotalGpuMemoryInMiB ({total:,.0f}) is per GPU here, not the "
                        f"total of {count:g} GPUs")


def write_catalog(result: CatalogImport, out: Path) -> None:
    import yaml

    from tunepilot.store import atomic_write_bytes

    head = [f"# imported by `tunepilot catalog import --from skypilot` from {result.source}",
            "# a partial override catalog: pass it as --catalog; card facts stay tunepilot's own"]
    head += [f"# warning: {w}" for w in result.warnings]
    head += [f"# unknown accelerator {u['accelerator']}: {u['missing']}" for u in result.unknown]
    body = {"schema_version": 1, "as_of": result.as_of,
            "note": f"prices from {result.source}", "cards": result.cards}
    atomic_write_bytes(out, ("\n".join(head) + "\n" +
                             yaml.safe_dump(body, sort_keys=False)).encode())
