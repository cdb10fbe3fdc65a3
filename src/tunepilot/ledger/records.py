"""The ledger's records: bookings, invoices, cancellations, usage; the refund rule and the
interval arithmetic of card allocation. Money is integer cents; times are UTC."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from decimal import ROUND_HALF_UP, Decimal

from tunepilot.results.quote import LineItem
from tunepilot.units import cents_to_usd

BOOKED, CANCELLED = "booked", "cancelled"


@dataclass(frozen=True)
class Booking:
    id: int
    card_id: str
    count: int
    start: str
    end: str
    hours: str
    status: str
    quote_id: str | None
    created_at: str
    cancelled_at: str | None
    total_cents: int

    def to_dict(self) -> dict:
        return {**asdict(self), "total_usd": str(cents_to_usd(self.total_cents))}


@dataclass(frozen=True)
class Invoice:
    booking: Booking
    issued_at: str
    items: tuple[LineItem, ...]

    @property
    def total_cents(self) -> int:
        return sum(i.amount_cents for i in self.items)

    def to_dict(self) -> dict:
        return {"booking": self.booking.to_dict(), "issued_at": self.issued_at, "currency": "USD",
                "items": [i.model_dump() for i in self.items], "total_cents": self.total_cents,
                "total_usd": str(cents_to_usd(self.total_cents))}


@dataclass(frozen=True)
class Cancellation:
    booking: Booking
    rule: str
    refund_percent: str
    paid_cents: int
    refund_cents: int

    def to_dict(self) -> dict:
        return {"booking": self.booking.to_dict(), "rule": self.rule,
                "refund_percent": self.refund_percent, "paid_cents": self.paid_cents,
                "refund_cents": self.refund_cents, "kept_cents": self.paid_cents - self.refund_cents,
                "refund_usd": str(cents_to_usd(self.refund_cents))}


@dataclass(frozen=True)
class Usage:
    booking: Booking
    hours_used: str
    hours_booked: str
    utilisation: str
    cost_per_used_hour_usd: str | None

    def to_dict(self) -> dict:
        return {**asdict(self), "booking": self.booking.to_dict()}


def refund_cents(paid_cents: int, percent: Decimal) -> int:
    """``percent`` of ``paid_cents``, rounded half up to a cent; the provider keeps the rest."""
    return int((Decimal(paid_cents) * percent / 100).to_integral_value(rounding=ROUND_HALF_UP))


def cancellation_rule(policy: dict, start_ts: int, now_ts: int) -> tuple[str, Decimal]:
    """(which rule applies, refund percent) for cancelling at ``now_ts`` a booking starting at
    ``start_ts``: full refund at least ``full_refund_before_h`` ahead, partial before the start,
    the after-start rate from the start on."""
    lead_s = start_ts - now_ts
    full_h = policy.get("full_refund_before_h")
    if full_h is not None and lead_s >= Decimal(str(full_h)) * 3600:
        return f"cancelled at least {full_h} h before the start: full refund", Decimal(100)
    if lead_s > 0:
        pct = Decimal(str(policy["partial_refund_percent"]))
        return f"cancelled {lead_s / 3600:.1f} h before the start: {pct}% refund", pct
    pct = Decimal(str(policy["after_start_refund_percent"]))
    return f"cancelled after the start: {pct}% refund", pct


def peak_use(rows: list[tuple[int, int, int]], start: int, end: int) -> tuple[int, int]:
    """(the most cards in use at any instant of [start, end), the first instant it happens) over
    bookings ``rows`` = (start_ts, end_ts, count). A booking ending at t does not overlap one
    starting at t."""
    events: list[tuple[int, int]] = []
    for s, e, n in rows:
        if s < end and e > start:
            events += [(max(s, start), n), (e, -n)]
    events.sort(key=lambda ev: (ev[0], ev[1]))  # ends (-n) before starts at the same instant
    peak, at, used = 0, start, 0
    for t, delta in events:
        used += delta
        if used > peak and t < end:
            peak, at = used, t
    return peak, at


def line_problem(item: LineItem, before: list[LineItem], count: int,
                 held_hours: Decimal | None) -> str | None:
    """What is wrong with one invoice line read back from the ledger, or None: its amount must
    follow from its own quantity and unit price (to the rounding the line was written with), a
    compute line's card-hours from the booking's cards and held hours (``held_hours``; None for
    a quoted booking, whose lines the quote priced), a discount or refund must be negative and
    at most what the earlier lines bill."""
    from decimal import InvalidOperation

    amount = item.amount_cents
    billed = sum(i.amount_cents for i in before)
    try:
        qty = Decimal(item.quantity)
        price = Decimal(item.unit_price_usd) if item.unit_price_usd else None
    except InvalidOperation:
        return f"quantity {item.quantity[:20]!r} or unit price {item.unit_price_usd[:20]!r} is " \
               "not a number"
    if not qty.is_finite() or (price is not None and not price.is_finite()):
        return "quantity or unit price is not finite"
    if item.kind in ("compute", "option"):
        if price is None or price < 0 or qty < 0:
            return f"a {item.kind} line with quantity {qty} and price {price}"
        # quantities are written rounded (3 places for card-hours, 6 for options): the amount
        # was priced on the exact quantity, so allow that rounding and one cent
        slack = price * 100 * Decimal("0.0005") + 1
        if abs(Decimal(amount) - qty * price * 100) > slack:
            return (f"bills {amount} cents for {qty} {item.unit} at ${price} (that is "
                    f"{(qty * price * 100).quantize(Decimal(1))} cents)")
        if item.kind == "compute" and held_hours is not None and \
                abs(qty - count * held_hours) > Decimal("0.001"):
            return (f"bills {qty} card-hours, but the booking holds {count} card(s) for "
                    f"{held_hours.normalize():f} h")
        return None
    if item.kind in ("discount", "refund"):
        if amount > 0 or -amount > billed:
            return f"a {item.kind} of {amount} cents against {billed} cents billed before it"
        return None
    return f"kind {item.kind[:20]!r} is not one tunepilot writes"
