"""Term pricing: billed time, term discounts and options as exact line items, and the parsing
of the durations, counts and options a user types.

Shared by the quote (cost/quote.py) and the ledger, so a booking is billed exactly as it was
quoted. Money is Decimal until a line item is rounded, once, to integer cents (half up); a total is
the sum of its lines, so no cent is lost or invented between the lines and the total.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal, InvalidOperation

from tunepilot.catalog import Card
from tunepilot.errors import UserError, did_you_mean
from tunepilot.results.quote import LineItem, TermCost

# Options priced per GB-month / TB-month are prorated by term hours / this: the AWS pricing
# convention (8760 h / 12 = 730 h per month) that most cloud calculators use.
HOURS_PER_MONTH = Decimal(730)


# --- terms -------------------------------------------------------------------------------------


def to_cents(usd: Decimal) -> int:
    """Round an exact Decimal USD amount to whole cents, half up (the one rounding a line makes)."""
    return int(usd.scaleb(2).to_integral_value(rounding=ROUND_HALF_UP))


def billed_seconds(card: Card, term_s: int) -> int:
    """``term_s`` rounded up to the billing increment, and at least the minimum charge."""
    step = card.pricing.billing_increment_s
    return max(card.pricing.minimum_charge_s, -(-term_s // step) * step)


def term_cost(card: Card, count: int, term_s: int, options: dict[str, Decimal] | None = None
              ) -> TermCost:
    """Itemised cost: cards x billed hours x rate, the discount of the longest term the length
    reaches, and options (X-month units prorated by term hours / hours_per_month, "hour" units
    x term hours, others one-off). Each line is rounded to cents once; the total is their sum."""
    p = card.pricing
    billed = billed_seconds(card, term_s)
    hours = Decimal(billed) / 3600
    gross = count * hours * p.on_demand_usd_per_hour
    step = p.billing_increment_s
    items = [_item("compute", f"{count} x {card.id}, {_dec(hours)} h billed "
                   f"({step} s increments, minimum {p.minimum_charge_s} s)",
                   _dec(count * hours), "card-hour", str(p.on_demand_usd_per_hour),
                   to_cents(gross))]
    reached = [t for t in p.terms if t.hours * 3600 <= term_s]
    term = max(reached, key=lambda t: t.hours) if reached else None
    if term is not None and term.discount_percent > 0:
        items.append(_item("discount", f"{term.name} term ({term.hours} h) discount "
                           f"{term.discount_percent}%", str(term.discount_percent), "percent",
                           "", -to_cents(gross * term.discount_percent / 100)))
    months = Decimal(term_s) / 3600 / HOURS_PER_MONTH
    for name, qty in sorted((options or {}).items()):
        opt = p.options[name]
        if opt.unit.endswith("-month"):
            quantity, what = qty * months, f"{_dec(qty)} {opt.unit[:-6]} x {_dec(months, 4)} month"
        elif opt.unit == "hour":
            quantity = qty * Decimal(term_s) / 3600
            what = (f"{_dec(quantity, 6)} hours charged ({_dec(qty)} per term hour x the "
                    f"{_dec(Decimal(term_s) / 3600, 4)} h term)")
        else:
            quantity, what = qty, f"{_dec(qty)} {opt.unit}"
        items.append(_item("option", f"{name}: {what}", _dec(quantity, 6), opt.unit,
                           str(opt.usd), to_cents(quantity * opt.usd)))
    return TermCost(card_id=card.id, count=count, term_s=term_s, billed_s=billed,
                    discount_term=term.name if term else None,
                    discount_percent=str(term.discount_percent) if term else "0", items=items)


def _item(kind: str, description: str, quantity: str, unit: str, price: str, cents: int
          ) -> LineItem:
    return LineItem(kind=kind, description=description, quantity=quantity, unit=unit,
                    unit_price_usd=price, amount_cents=cents)


def _dec(value: Decimal, places: int = 3) -> str:
    q = value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP).normalize()
    return f"{q:f}"


# --- parsing user input ------------------------------------------------------------------------


# A number as a person types one: digits, one decimal point, an exponent. Decimal() itself also
# takes "1_000", "Infinity" and "NaN", which are typos here, not terms.
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_decimal(text: str | float | int) -> Decimal | None:
    """A finite Decimal from user text written as a plain number; None for anything else."""
    raw = str(text).strip()
    if not _PLAIN_NUMBER.fullmatch(raw):
        return None
    try:
        return Decimal(raw)
    except InvalidOperation:
        return None


def parse_positive(text: str | float | int, field: str, unit: str) -> Decimal:
    """A positive finite decimal from user text ("2.5"), or a UserError naming ``field``."""
    value = parse_decimal(text)
    if value is None:
        raise UserError(field, f"{str(text)[:40]!r} is not a number of {unit}.",
                        "E.g. 72 or 2.5 (digits and one decimal point).")
    if not value.is_finite() or value <= 0:
        raise UserError(field, f"must be a positive number of {unit}, got {text}.",
                        f"Give a duration greater than 0 {unit}.")
    return value


MAX_TERM_S = 10 * 365 * 86400  # ten years: longer is a typo, not a rental
# an option's quantity: a billion units (GB-months: an exabyte for a month) is past any rental;
# a larger number is a typo, and would overflow the ledger's integer cents
MAX_OPTION_QUANTITY = Decimal(10**9)


def parse_duration(hours: str | None, days: str | None, *, required: bool = True) -> int | None:
    """Whole seconds from exactly one of ``--hours`` / ``--days`` (a fraction of a second rounds
    up); None when neither is given and ``required`` is False."""
    if hours is None and days is None and not required:
        return None
    if (hours is None) == (days is None):
        raise UserError("hours", "give the term's length with exactly one of --hours or --days.",
                        "E.g. --hours 72 or --days 3.")
    value = parse_positive(hours, "hours", "hours") * 3600 if hours is not None else (
        parse_positive(days, "days", "days") * 86400)
    if value > MAX_TERM_S:
        flag = "hours" if hours is not None else "days"
        raise UserError(flag, f"{(hours if hours is not None else days)[:30]} {flag} is longer "
                        f"than tunepilot quotes or books (at most {MAX_TERM_S // 3600:,} hours "
                        "= 10 years).", "Give the term you mean to rent, e.g. --days 30.")
    return int(value.to_integral_value(rounding=ROUND_CEILING))


def check_count(count: int) -> int:
    """A card count from a flag: 1 .. limits.MAX_CARDS (the one bound on counts of cards)."""
    from tunepilot.limits import check_cards

    return check_cards(count)


def parse_options(card: Card, texts: list[str] | tuple[str, ...] | None) -> dict[str, Decimal]:
    """``["storage_gb_month=500", ...]`` -> {name: quantity}; only options the card offers."""
    offered = card.pricing.options
    out: dict[str, Decimal] = {}
    for text in texts or ():
        name, sep, qty = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError("option", f"{text!r} is not NAME=QUANTITY.",
                            f"E.g. --option storage_gb_month=500. {card.id} offers: "
                            f"{', '.join(offered) or 'no options'}.")
        if name not in offered:
            raise UserError("option", f"{card.id} does not offer {name!r}.",
                            did_you_mean(name, list(offered)) if offered else
                            f"{card.id} offers no options.")
        if name in out:
            raise UserError("option", f"{name!r} is given twice.", "Give each option once.")
        value = parse_decimal(qty)
        if value is None or value < 0 or value > MAX_OPTION_QUANTITY:
            raise UserError("option", f"{name}={qty[:40]!r}: the quantity must be a number >= 0 "
                            f"and at most {MAX_OPTION_QUANTITY:,} (in {offered[name].unit} "
                            "units).", "E.g. storage_gb_month=500.")
        out[name] = value
    return out
