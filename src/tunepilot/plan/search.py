"""The one search tunepilot does twice: the largest value for which a monotone test passes
(the plan's max micro-batch / sequence length / device count, the pilot's --find-max-batch).
Doubling from the largest value known to pass, then bisection. Pure Python."""

from __future__ import annotations

from collections.abc import Callable


def largest_passing(ok: Callable[[int], bool], upper: int, known_ok: int | None = None,
                    known_bad: int | None = None) -> tuple[int, list[tuple[int, bool]]]:
    """The largest x in 1..upper with ok(x) (ok monotone: true up to a point), 0 if none, and
    the tries made, in order."""
    tries: list[tuple[int, bool]] = []

    def test(x: int) -> bool:
        r = ok(x)
        tries.append((x, r))
        return r

    lo = known_ok or 0
    hi = known_bad
    if hi is None:
        x = 1 if lo == 0 else lo * 2
        while x <= upper:
            if test(x):
                lo, x = x, x * 2
            else:
                hi = x
                break
        if hi is None:  # passed all the way: the cap itself may pass too
            if lo >= upper:
                return lo, tries
            hi = upper + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, tries
