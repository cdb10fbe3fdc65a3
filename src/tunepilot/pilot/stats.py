"""Step-time statistics and the adaptive stop rule of the pilot (pure Python, no torch).

The pilot measures steps until the 95% confidence interval of the mean step time is narrow:

    half_width = t(0.975, n - 1) * s / sqrt(n)        s = sample standard deviation (ddof=1)
    stop when half_width / mean < rel_ci (default 0.02), after at least MIN_STEPS, or at max_steps.

Percentiles interpolate linearly between the closest ranks (numpy's default, ``method="linear"``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

REL_CI = 0.02  # stop when the 95% CI half-width is under 2% of the mean step time
MIN_STEPS = 5  # fewer steps give a t-interval too wide to trust the rule

# Two-sided 95% Student t quantiles t(0.975, df) for df = 1..30 (any statistics table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964  # the normal quantile the t quantile tends to


def t975(df: int) -> float:
    """t(0.975, df): the table for df <= 30, else the Cornish-Fisher expansion about z
    (Abramowitz & Stegun 26.7.5; error < 1e-4 for df > 30)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (statistics.quantiles'
    inclusive method, numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if len(values) == 1 or q in (0, 100):
        return min(values) if q == 0 else max(values) if q == 100 else values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")  # q = 1..99
    return cuts[int(q) - 1] if float(q).is_integer() else _between(values, q)


def _between(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def stdev(values: Sequence[float]) -> float:
    """Sample standard deviation (ddof=1); 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def ci95_half_width(values: Sequence[float]) -> float:
    """Half-width of the 95% t-interval of the mean; inf for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.inf
    return t975(n - 1) * stdev(values) / math.sqrt(n)


@dataclass(frozen=True)
class Summary:
    """Distribution of one per-step quantity (seconds for times)."""

    n: int
    mean: float
    std: float
    cv: float  # std / mean
    p50: float
    p90: float
    p99: float
    min: float
    max: float
    ci95_half_width: float
    ci95_relative: float  # ci95_half_width / mean

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("no values to summarise")
    m = statistics.fmean(values)
    s = stdev(values)
    hw = ci95_half_width(values)
    return Summary(n=len(values), mean=m, std=s, cv=s / m if m else math.inf,
                   p50=percentile(values, 50), p90=percentile(values, 90),
                   p99=percentile(values, 99), min=min(values), max=max(values),
                   ci95_half_width=hw, ci95_relative=hw / m if m else math.inf)


@dataclass(frozen=True)
class StopRule:
    """When the pilot stops measuring: a fixed count, or adaptive (CI under rel_ci)."""

    max_steps: int
    min_steps: int = MIN_STEPS
    rel_ci: float = REL_CI
    fixed_steps: int | None = None  # --steps N: exactly N, no adaptive stop

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be at least 1")

    @property
    def limit(self) -> int:
        return self.fixed_steps if self.fixed_steps is not None else self.max_steps

    def verdict(self, step_times: Sequence[float]) -> str | None:
        """Why to stop now ("fixed", "converged", "max_steps"), or None to go on."""
        n = len(step_times)
        if self.fixed_steps is not None:
            return "fixed" if n >= self.fixed_steps else None
        if n >= max(2, min(self.min_steps, self.max_steps)):
            m = statistics.fmean(step_times)
            if m > 0 and ci95_half_width(step_times) / m < self.rel_ci:
                return "converged"
        return "max_steps" if n >= self.max_steps else None

    def describe(self) -> str:
        if self.fixed_steps is not None:
            return f"exactly {self.fixed_steps} measured steps (--steps)"
        return (f"adaptive: stop when the 95% CI half-width of the mean step time is under "
                f"{self.rel_ci:.0%} of the mean (t-interval, at least {self.min_steps} steps), "
                f"or at {self.max_steps} steps (--max-steps)")
