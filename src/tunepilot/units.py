"""Units: parsing sizes, and formatting bytes, seconds, rates and money the one way tunepilot
prints them (terminal views, the HTML report and the decision sentence alike).

Bytes are binary units chosen by size (B, KiB, MiB, GiB, TiB: 2^10 steps) unless a caller asks
for the decimal GB cards are sold in. Numbers never print in scientific notation. Money is
integer cents or Decimal, never a float; times are UTC. No heavy imports here.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from decimal import ROUND_HALF_UP, Decimal

from tunepilot.errors import UserError

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40
GB = 10**9
MAX_BYTES = 2**63 - 1  # a size past this is not a device or a file anyone has


# --- parsing -----------------------------------------------------------------------------------


def parse_bytes(text: str | int, field: str = "--memory-limit") -> int:
    """'12884901888', '12 GiB', '1.5GB', '512MiB' -> bytes (GiB = 2^30, GB = 10^9), read by
    pydantic's ByteSize; a UserError naming ``field`` for anything else."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    if isinstance(text, bool):
        text = str(text)
    try:
        value = int(TypeAdapter(ByteSize).validate_python(text))
    except (ValidationError, ValueError, OverflowError):
        raise UserError(field, f"{_short(text)!r} is not a size.",
                        "Give bytes or a number with a unit: 12GiB, 1.5GB, 512MiB "
                        "(GiB = 2^30 bytes, GB = 10^9).") from None
    if value <= 0 or value > MAX_BYTES:
        raise UserError(field, f"{_short(text)!r} is not a positive size below 8 EiB.")
    return value


def _short(value: object, limit: int = 60) -> str:
    """A value for an error message, never unbounded (a user's input may be huge)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- numbers -----------------------------------------------------------------------------------


def fmt_number(value: float | int | None, digits: int = 3) -> str:
    """A number with thousands separators and about ``digits`` significant digits, never in
    scientific notation: 21561 -> '21,561', 0.000712 -> '0.000712', 7.15e-07 -> '0.000000715'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    v = float(value)
    if not math.isfinite(v):
        return "infinite" if v > 0 else ("-infinite" if v < 0 else "not a number")
    if isinstance(value, int) or (v.is_integer() and abs(v) >= 10**digits):
        return f"{round(v):,}"
    if v == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(v)))
    places = max(0, digits - 1 - magnitude)
    return f"{v:,.{places}f}"


# --- bytes -------------------------------------------------------------------------------------


def fmt_bytes(n: float | int | None, *, decimal: bool = False) -> str:
    """Bytes in the unit that reads best: '512 B', '1.50 KiB', '18.7 MiB', '14.96 GiB'; with
    ``decimal`` the 10^9-byte GB cards are sold in ('80.0 GB')."""
    if n is None:
        return "-"
    v = float(n)
    sign = "-" if v < 0 else ""
    v = abs(v)
    if decimal:
        steps = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
    else:
        steps = (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
    for unit, scale in steps:
        if v >= scale:
            return f"{sign}{_two_places(v / scale)} {unit}"
    return f"{sign}{v:,.0f} B"


def _two_places(x: float) -> str:
    return f"{x:,.2f}" if x < 100 else f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


# --- time --------------------------------------------------------------------------------------


def fmt_seconds(s: float | None) -> str:
    """'18.6 ms', '1.27 s', '9.5 min (570 s)', '2.25 h (8,100 s)', days past two days."""
    if s is None:
        return "-"
    if not math.isfinite(s):
        return "infinite"
    a = abs(s)
    if a < 1e-3:
        return f"{s * 1e6:,.1f} us"
    if a < 1:
        return f"{s * 1e3:,.1f} ms"
    if a < 120:
        return f"{fmt_number(s)} s"
    if a < 3600:
        return f"{s / 60:,.1f} min ({s:,.0f} s)"
    hours = s / 3600
    days = f", {hours / 24:,.2f} d" if a >= 48 * 3600 else ""
    return f"{hours:,.2f} h ({s:,.0f} s{days})"


def fmt_hours(s: float) -> str:
    """A term length in the unit a person books in: '45 seconds', '13 minutes', '1.5 hours',
    '3 days' (never '0.2167 hours')."""
    unit, size = next(((u, n) for u, n in (("day", 86400), ("hour", 3600), ("minute", 60))
                       if s >= n), ("second", 1))
    v = s / size
    text = f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    return f"{text} {unit}" + ("" if text == "1" else "s")


def fmt_rate(value: float | None, unit: str) -> str:
    """'21,561 tokens/s', '45.8 MB/s' (bytes/s shown in decimal MB/s, as disks are sold)."""
    if value is None:
        return "-"
    if unit in ("B/s", "bytes/s"):
        return fmt_bytes(value, decimal=True) + "/s"
    return f"{fmt_number(value)} {unit}"


def utc_now() -> datetime:
    """Now, timezone-aware UTC (the one clock every result and the ledger read)."""
    return datetime.now(timezone.utc)


def iso_utc(when: datetime) -> str:
    """'2026-12-03T08:00:00Z' (seconds, UTC)."""
    if when.tzinfo is None:
        raise ValueError("times are UTC and must be timezone-aware")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- money -------------------------------------------------------------------------------------


def cents_to_usd(cents: int) -> Decimal:
    """``cents`` as a Decimal USD amount with two places (249 -> Decimal('2.49'))."""
    return Decimal(int(cents)).scaleb(-2)


def fmt_cents(cents: int) -> str:
    """249 -> '$2.49', -100 -> '-$1.00', 123456 -> '$1,234.56'."""
    amount = cents_to_usd(cents)
    return f"-${-amount:,.2f}" if amount < 0 else f"${amount:,.2f}"


def fmt_usd(value: Decimal | str | int | None) -> str:
    """A Decimal amount: cents from $1 up ('$1,234.56'); under a dollar 2 significant digits past
    the cents so small rates stay readable ('$0.30', '$0.0064')."""
    if value is None:
        return "-"
    d = Decimal(str(value))
    if d == 0:
        return "$0.00"
    sign = "-" if d < 0 else ""
    d = abs(d)
    if d >= 1:
        return f"{sign}${d.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP):,}"
    exp = min(-2, d.adjusted() - 1)  # two significant digits, at least cents
    q = d.quantize(Decimal(1).scaleb(exp), rounding=ROUND_HALF_UP)
    return f"{sign}${q:f}"


def fmt_usd_per_m(value: Decimal | str | None) -> str:
    """Cost per million useful tokens: '$0.0064/M tokens'."""
    return "-" if value is None else f"{fmt_usd(value)}/M tokens"
