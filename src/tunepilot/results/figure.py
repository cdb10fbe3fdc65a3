"""One figure shape for every number tunepilot reports: its unit, and how it is known.

    {"value": 1234.5, "unit": "tokens/s", "basis": "measured", "how": "..."}
basis is "measured" (on the hardware named), "projected" (carried by the rule in ``how``) or
"not measured" (value null; ``how`` says why) - never a made-up number. Extra keys (``covers``,
``per``, ``card_id``, ...) say more about how it was obtained and are kept as plain JSON.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Basis = Literal["measured", "projected", "not measured"]
MEASURED, PROJECTED, NOT_MEASURED = "measured", "projected", "not measured"


def _plain(value: Any) -> Any:
    """Extras as JSON values (a nested Figure as its dict), so a figure read back is equal."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class Figure(BaseModel):
    """A number with its unit, whether it was measured or projected, and how it was obtained."""

    model_config = ConfigDict(frozen=True, extra="allow")

    value: Any = None
    unit: str
    basis: Basis
    how: str | None = None

    @property
    def is_measured(self) -> bool:
        return self.basis == MEASURED

    @property
    def known(self) -> bool:
        return self.value is not None

    @classmethod
    def measured(cls, value: Any, unit: str, how: str | None = None, *, why: str | None = None,
                 **extra: Any) -> Figure:
        """Measured here. ``how``: how it was obtained (for old callers also the reason when the
        value is missing); ``why``: only the reason a missing value (None) is "not measured" -
        it never labels a value that was measured."""
        if value is None:
            return cls.missing(unit, why or how or "not measured", **extra)
        return cls(value=value, unit=unit, basis=MEASURED, how=how, **_plain(extra))

    @classmethod
    def projected(cls, value: Any, unit: str, how: str, **extra: Any) -> Figure:
        return cls(value=value, unit=unit, basis=PROJECTED, how=how, **_plain(extra))

    @classmethod
    def missing(cls, unit: str, why: str, **extra: Any) -> Figure:
        return cls(value=None, unit=unit, basis=NOT_MEASURED, how=why, **_plain(extra))

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_none=False)

    def extra(self, key: str, default: Any = None) -> Any:
        return (self.model_extra or {}).get(key, default)


def value_of(fig: Any, default: Any = None) -> Any:
    """The value of a Figure (or a bare number), or ``default`` when missing."""
    if isinstance(fig, Figure):
        return default if fig.value is None else fig.value
    if isinstance(fig, dict):
        v = fig.get("value")
        return default if v is None else v
    return default if fig is None else fig


def missing(unit: str, why: str = "not measured"):
    """A pydantic default factory: a field that is "not measured" until a stage measures it."""
    return lambda: Figure.missing(unit, why)
