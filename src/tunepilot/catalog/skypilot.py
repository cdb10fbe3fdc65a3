"""SkyPilot: its price tables as a tunepilot catalog, and a task that pilots on the rented card.

``import_vms_csv``: a SkyPilot catalog CSV (``vms.csv``: InstanceType, AcceleratorName,
AcceleratorCount, vCPUs, MemoryGiB, GpuInfo, Price, SpotPrice, Region, AvailabilityZone - in
any column order: read by name) -> a partial override catalog: per card the on-demand price per
card-hour = Price / AcceleratorCount in the cheapest region (or ``region``), the spot price the
same way on its own line, the instance type and region recorded, and the instance's host RAM
(MemoryGiB) and vCPUs as its ``host`` (the table has no local disk). Card facts (memory, peaks)
stay tunepilot's own: GpuInfo is checked against them and known traps are warned about (an H200
listed at 80 GB; a TotalGpuMemoryInMiB that is per GPU). Accelerators tunepilot has no facts for
are listed as unknown with what is missing - never invented.

``task_yaml``: a SkyPilot task running the staged pilot on CARD:N (see launch.py).
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import math
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
    host_gib: float | None = None  # MemoryGiB: host RAM of the instance
    vcpus: int | None = None


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


# Bounds of a plausible row: the largest GPU instances carry 8-16 accelerators and cost about
# $100 per instance-hour on demand (AWS p5en.48xlarge, 2025 price list); a count or price far
# beyond these is a damaged table, not an offer.
MAX_TABLE_BYTES = 1 << 30  # SkyPilot's largest vms.csv (AWS) is tens of MB
MAX_ACCELERATORS_PER_INSTANCE = 1024
MAX_USD_PER_INSTANCE_HOUR = Decimal(100_000)


def _money(raw: str | None, row: int, column: str) -> Decimal | None:
    text = (raw or "").strip()
    if not text:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise UserError(f"row {row}: {column}", f"{text[:40]!r} is not a number.",
                        "Fix the CSV (prices are USD per instance-hour).") from None
    if not value.is_finite() or value <= 0:
        raise UserError(f"row {row}: {column}", f"{text[:40]!r} is not a price > 0.",
                        "A free accelerator is a damaged row: leave the cell empty where there "
                        "is no price, or fix it (USD per instance-hour).")
    if value > MAX_USD_PER_INSTANCE_HOUR:
        raise UserError(f"row {row}: {column}", f"{text[:40]!r} is not a plausible price "
                        f"(over ${MAX_USD_PER_INSTANCE_HOUR:,} per instance-hour).",
                        "Fix the CSV (prices are USD per instance-hour).")
    return value


def _count(raw: str | None, row: int) -> int:
    text = (raw or "").strip()
    try:
        n = Decimal(text)
    except InvalidOperation:
        n = Decimal("NaN")
    if not n.is_finite() or n != n.to_integral_value() or not \
            1 <= n <= MAX_ACCELERATORS_PER_INSTANCE:
        raise UserError(f"row {row}: AcceleratorCount", f"{text[:40]!r} is not a whole count "
                        f"between 1 and {MAX_ACCELERATORS_PER_INSTANCE:,}.",
                        "A row with accelerators needs at least one; drop the row or fix it.")
    return int(n)


def _rows(text: str, path: Path):
    """(row number, {column: cell}) of every non-blank data row; a row with fewer or more
    cells than the header is a UserError naming it (a truncated or hand-edited table)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None) or []
    missing = [c for c in NEEDED if c not in header]
    if missing:
        raise UserError("FILE", f"{path.name} has no column {', '.join(missing)}.",
                        f"A SkyPilot catalog CSV (vms.csv) has {', '.join(NEEDED)}, ... - "
                        "columns are read by name in any order.")
    width = len(header)
    for i, cells in enumerate(reader, start=2):  # row 1 is the header
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue
        if len(cells) != width:
            what = (f"has {len(cells)} of the header's {width} columns" if len(cells) < width
                    else f"has {len(cells)} cells: more columns than the header's {width}")
            raise UserError(f"{path.name}: row {i}", f"{what} (a truncated or damaged table).",
                            "Fix or drop the row, then import again.")
        yield i, dict(zip(header, cells, strict=True))


def import_vms_csv(path: Path, *, region: str | None = None, as_of: str | None = None,
                   catalog=None) -> CatalogImport:
    from tunepilot.catalog import load_catalog

    catalog = catalog or load_catalog()
    path = Path(path)
    from tunepilot.limits import Refused, read_capped

    try:
        raw = read_capped(path, MAX_TABLE_BYTES)
        text = raw.decode("utf-8-sig")
    except Refused as exc:
        raise UserError("FILE", f"{path} {exc}.", "Give SkyPilot's vms.csv for one cloud "
                        "(~/.sky/catalogs/v*/CLOUD/vms.csv).") from None
    except OSError as exc:
        raise UserError("FILE", f"{path} cannot be read ({exc.strerror or exc}).") from None
    except UnicodeDecodeError:
        raise UserError("FILE", f"{path} is not UTF-8 text (a SkyPilot vms.csv is).") from None
    offers: dict[str, list[_Offer]] = {}
    unknown: dict[str, dict] = {}
    gpu_info = _GpuInfoCheck(catalog)
    host = _HostColumns(catalog)
    rows = skipped = 0
    for i, r in _rows(text, path):
        rows += 1
        name = r["AcceleratorName"].strip()
        if not name:
            skipped += 1  # a CPU-only instance
            continue
        if region and r["Region"].strip() != region:
            continue
        count = _count(r["AcceleratorCount"], i)
        price = _money(r["Price"], i, "Price")
        spot = _money(r.get("SpotPrice"), i, "SpotPrice")
        card_id = SKY_TO_CARD.get(name)
        if card_id is None:
            unknown.setdefault(name, {"accelerator": name, "instances": set(),
                                      "missing": _missing_facts(name)})
            unknown[name]["instances"].add(r["InstanceType"].strip())
            continue
        if not gpu_info.check(r.get("GpuInfo"), name, card_id, count,
                              r["InstanceType"].strip()):
            skipped += 1  # the row contradicts itself: no price is derived from it
            continue
        if price is None and spot is None:
            skipped += 1
            continue
        offers.setdefault(card_id, []).append(_Offer(
            card_id, price / count if price is not None else None,
            spot / count if spot is not None else None, r["InstanceType"].strip(),
            r["Region"].strip(), count, *host.read(r, name, count, card_id)))
    if region and not offers and not unknown:
        raise UserError("--region", f"no accelerator rows in region {region!r} of {path.name}.")
    when = as_of or datetime.fromtimestamp(path.stat().st_mtime, UTC).date().isoformat()
    digest = hashlib.sha256(raw).hexdigest()[:12]
    source = f"SkyPilot catalog {path.name} (sha256 {digest}), imported by tunepilot"
    cards = [_card_entry(card_id, rows_, source, when) for card_id, rows_ in sorted(offers.items())]
    if not any(cards):  # a catalog of no cards is refused by --catalog: write none
        found = (gpu_info.warnings() + host.warnings())[:2] + [
            _unknown_entry(u)["accelerator"] + ": " + u["missing"] for u in unknown.values()][:1]
        raise UserError("FILE", f"no row of {path.name} prices a card tunepilot knows ({rows:,} "
                        f"rows read, {skipped:,} skipped)" + (": " + "; ".join(found) if found
                                                              else "") + "; nothing was written.",
                        "Import the table of a cloud that rents H100/H200/A100-80GB/MI300X "
                        "cards, or add the card with its facts in a --catalog.")
    return CatalogImport(str(path), when, [c for c in cards if c],
                         [_unknown_entry(u) for u in unknown.values()],
                         gpu_info.warnings() + host.warnings(), rows, skipped)


UNKNOWN_ACCELERATORS_SHOWN = 20  # in the table and the YAML header; --json has them all
UNKNOWN_INSTANCES_LISTED = 5  # per unknown accelerator; the count says how many there were


def _unknown_entry(u: dict) -> dict:
    instances = sorted(u["instances"])
    return {**u, "instances": instances[:UNKNOWN_INSTANCES_LISTED],
            "num_instances": len(instances)}


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
    if best.host_gib is not None:
        pricing["host"] = {"instance_type": best.instance, "accelerators": best.count,
                           "ram_gib": best.host_gib, "vcpus": best.vcpus,
                           "source": f"{source}: MemoryGiB and vCPUs of {best.instance} (local "
                                     "disk: the table has none)", "as_of": when}
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


class _HostColumns:
    """(host RAM GiB, vCPUs) of a row from MemoryGiB and vCPUs, where readable. A MemoryGiB no
    larger than the GPUs' own memory is not host RAM (RunPod's v7 table lists GPU memory there):
    dropped, with one warning per accelerator."""

    def __init__(self, catalog):
        self.catalog = catalog
        self._memory: dict[str, int] = {}  # card id -> bytes per GPU
        self._trap: dict[str, tuple[float, int, int]] = {}  # name -> (MemoryGiB, GPUs, rows)

    def read(self, r: dict, name: str, count: int, card_id: str
             ) -> tuple[float | None, int | None]:
        gib, vcpus = _positive(r.get("MemoryGiB")), _positive(r.get("vCPUs"))
        per_gpu = self._memory.get(card_id) or self._memory.setdefault(
            card_id, self.catalog.get(card_id).memory_bytes)
        if gib is not None and gib * (1 << 30) <= 1.05 * count * per_gpu:
            first, n, rows = self._trap.get(name, (gib, count, 0))
            self._trap[name] = (first, n, rows + 1)
            gib = None
        return gib, int(vcpus) if vcpus is not None and vcpus == int(vcpus) else None

    def warnings(self) -> list[str]:
        return [f"{name}: MemoryGiB {gib:g} is no more than the {n} GPUs' own memory - the table "
                "lists GPU memory there, not host RAM: host RAM not taken"
                + (f" ({rows:,} rows)" if rows > 1 else "")
                for name, (gib, n, rows) in self._trap.items()]


def _positive(raw: str | None) -> float | None:
    try:
        value = float((raw or "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


class _GpuInfoCheck:
    """Where the table's GPU memory disagrees with the card's facts (known traps): each distinct
    GpuInfo text is parsed once, and the findings are one warning per accelerator and trap -
    with the number of rows and the values listed - however many rows repeat them."""

    def __init__(self, catalog):
        self.catalog = catalog
        self._seen: dict[tuple[str, str], tuple] = {}
        self._cards: dict = {}
        self._memory: dict[str, dict] = {}  # name -> {"card", "listed": {MiB: rows}}
        self._total: dict[str, dict] = {}  # name -> {"total", "count", "rows"}
        self._unreadable: dict[str, tuple[str, int]] = {}
        self._miscounted: dict[str, dict] = {}  # name -> {"rows", "example"}

    def check(self, raw: str | None, name: str, card_id: str, accelerators: int,
              instance: str) -> bool:
        """Record what the row's GpuInfo says; False when it contradicts the row's own
        AcceleratorCount (its GPUs' Count says otherwise): the price per card would be the
        instance's price over the wrong count, so the row is not priced."""
        if not raw:
            return True
        key = (raw, name)
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = _read_gpu_info(raw)
        kind, per, total, count, gpus = found
        if kind == "unreadable":
            first, n = self._unreadable.get(name, (raw, 0))
            self._unreadable[name] = (first, n + 1)
            return True
        if gpus is not None and gpus != accelerators:
            m = self._miscounted.setdefault(name, {"rows": 0, "example": (instance,
                                                                          accelerators, gpus)})
            m["rows"] += 1
            return False
        card = self._cards.get(card_id) or self._cards.setdefault(card_id,
                                                                   self.catalog.get(card_id))
        if isinstance(per, int | float) and per > 0 and \
                abs(per * _MIB - card.memory_bytes) > 0.05 * card.memory_bytes:
            m = self._memory.setdefault(name, {"card": card, "listed": {}})
            m["listed"][per] = m["listed"].get(per, 0) + 1
        if isinstance(total, int | float) and isinstance(per, int | float) and \
                isinstance(count, int | float) and count > 1 and abs(total - per) < 1:
            t = self._total.setdefault(name, {"total": total, "count": count, "rows": 0})
            t["rows"] += 1
        return True

    def warnings(self) -> list[str]:
        out = []
        for name, m in self._miscounted.items():
            instance, said, gpus = m["example"]
            more = f" and {m['rows'] - 1:,} more rows" if m["rows"] > 1 else ""
            out.append(f"{name}: {instance} says AcceleratorCount {said} but its GpuInfo lists "
                       f"{gpus} GPUs{more}: the row contradicts itself, so no price per card is "
                       "taken from it (skipped)")
        for name, (first, n) in self._unreadable.items():
            out.append(f"{name}: GpuInfo is not readable ({first[:60]!r}"
                       + (f" and {n - 1:,} more rows" if n > 1 else "") + "); card facts used")
        for name, m in self._memory.items():
            card, listed = m["card"], m["listed"]
            rows = sum(listed.values())
            if len(listed) == 1:
                what = f"the table lists {next(iter(listed)):,.0f} MiB per GPU"
            else:
                what = (f"{rows:,} rows list {min(listed):,.0f}-{max(listed):,.0f} MiB per GPU "
                        f"({len(listed):,} different values)")
            out.append(f"{name}: {what}; {card.id} has {card.memory_bytes // _MIB:,} MiB "
                       f"({card.memory_gb:g} GB): the table is wrong there, tunepilot's card "
                       "facts are used")
        for name, t in self._total.items():
            rows = f" ({t['rows']:,} rows)" if t["rows"] > 1 else ""
            out.append(f"{name}: TotalGpuMemoryInMiB ({t['total']:,.0f}) is per GPU here, not "
                       f"the total of {t['count']:g} GPUs{rows}")
        return out


def _gpu_count(info: object) -> int | None:
    """The GPUs a GpuInfo cell lists (the Count of every entry of Gpus, summed); None when it
    does not say (no Gpus, or a Count that is not a positive whole number)."""
    gpus = info.get("Gpus") if isinstance(info, dict) else None
    if not isinstance(gpus, list) or not gpus:
        return None
    counts = [g.get("Count") if isinstance(g, dict) else None for g in gpus]
    if not all(isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c)
               and c > 0 and c == int(c) for c in counts):
        return None
    return int(sum(counts))


def _read_gpu_info(raw: str) -> tuple:
    """("ok" | "unreadable", MiB per GPU, TotalGpuMemoryInMiB, the first GPU entry's Count,
    the GPUs listed in all) of a GpuInfo cell."""
    try:
        info = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return "unreadable", None, None, None, None
    if not isinstance(info, dict):
        return "ok", None, None, None, None
    gpus = info.get("Gpus") or []
    first = gpus[0] if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict) else {}
    mem = first.get("MemoryInfo")
    per = mem.get("SizeInMiB") if isinstance(mem, dict) else None
    return "ok", per, info.get("TotalGpuMemoryInMiB"), first.get("Count"), _gpu_count(info)


def write_catalog(result: CatalogImport, out: Path) -> None:
    import yaml

    from tunepilot.spec.yaml_input import yaml_comment
    from tunepilot.store import atomic_write_bytes

    head = [f"# imported by `tunepilot catalog import --from skypilot` from {result.source}",
            "# a partial override catalog: pass it as --catalog; card facts stay tunepilot's own"]
    head += [f"# warning: {w}" for w in result.warnings]
    shown = result.unknown[:UNKNOWN_ACCELERATORS_SHOWN]
    head += [f"# unknown accelerator {u['accelerator']}: {u['missing']}" for u in shown]
    if len(result.unknown) > len(shown):
        head.append(f"# ... and {len(result.unknown) - len(shown):,} more unknown accelerators")
    body = {"schema_version": 1, "as_of": result.as_of,
            "note": f"prices from {result.source}", "cards": result.cards}
    text = "".join(yaml_comment(h.removeprefix("# ")) + "\n" for h in head) + \
        yaml.safe_dump(body, sort_keys=False)
    _check_reads_back(text, out)
    atomic_write_bytes(out, text.encode())


def _check_reads_back(text: str, out: Path) -> None:
    """The catalog about to be written must load as a --catalog (merged over the shipped one)
    before it is written: exit 0 means `--catalog OUT` works."""
    import tempfile

    from tunepilot.catalog import load_catalog

    with tempfile.TemporaryDirectory(prefix="tunepilot-catalog-") as tmp:
        probe = Path(tmp) / out.name
        probe.write_text(text, encoding="utf-8")
        try:
            load_catalog(probe)
        except UserError as exc:
            raise UserError("--out", f"the catalog import would write does not load as a "
                            f"--catalog ({exc}); nothing was written.", "Report this with the "
                            "table: it is a bug in tunepilot's importer.") from None
