"""How long the pilot job on the rented card is projected to run: the time limit a scheduler
gets (Slurm's --time) instead of the quote's whole term.

    install + processes x (set-up + model load) + steps x step time, x margin

The step time, the set-up and the model load are the quote's own time terms on the card, at the
smallest count it projects (one card, the node's cards, or all of them: the stages run sharded
when the run does not fit one card); the steps are what `tunepilot run`
takes with its default options (pipeline.RunOptions); the install allowance, the processes and
the margin are resources/launch.yaml's, each with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tunepilot.errors import TunepilotError, UserError

MAX_TIME_LIMIT_S = 30 * 86400  # a pilot job longer than a month is a typo


@dataclass
class WallTime:
    seconds: int
    parts: list[str] = field(default_factory=list)
    """how the figure was made, in words"""

    @property
    def slurm(self) -> str:
        """HH:MM:SS (Slurm takes hours past 24 as 25:00:00)."""
        m = math.ceil(self.seconds / 60)
        return f"{m // 60:02d}:{m % 60:02d}:00"


def pilot_steps(nodes: int) -> int:
    """Optimizer steps `tunepilot run` takes with its defaults: the pilot (up to its maximum
    plus 2 warm-up), the restore proof (original before + after, the fresh process after),
    the scaling test (baseline, DDP, FSDP: 2 warm-up + its steps each), and a multi-node run's
    own scaling test before it."""
    from tunepilot.pipeline import RunOptions

    o = RunOptions()
    before, after = o.restore_steps
    scale = 3 * (2 + o.scale_steps)
    return o.pilot_max_steps + 2 + before + 2 * after + scale * (2 if nodes > 1 else 1)


def pilot_wall_time(spec, card, per_node: int, nodes: int, catalog, base_dir=None) -> WallTime:
    """The projected wall time of the pilot job, with its margin and bounds."""
    from tunepilot.cost.quote import quote
    from tunepilot.resources import launch_constants

    c = launch_constants()["pilot_job"]
    processes = c["processes"] + (4 if nodes > 1 else 0)
    steps = pilot_steps(nodes)
    q, cards = None, 1
    for n in dict.fromkeys((1, per_node, per_node * nodes)):
        try:
            q, cards = quote(spec, card_id=card.id, count=n, term_s=None, catalog=catalog,
                             base_dir=base_dir), n
            break
        except TunepilotError:
            continue
    if q is None:
        return WallTime(int(c["minimum_s"]), [
            f"the quote cannot project a step of this run on {card.id} (1, {per_node} or "
            f"{per_node * nodes} cards): the minimum of {c['minimum_s'] / 60:g} min "
            "(launch.yaml)"])
    terms = {t.name: t.total.value for t in q.time_terms}
    step_s = terms["training"] / max(q.optimizer_steps, 1)  # at the smallest count that fits
    start_s = terms.get("set-up", 0.0) + terms.get("model load", 0.0)
    raw = c["install_s"] + processes * start_s + steps * step_s
    seconds = min(max(raw * c["margin"], c["minimum_s"]), c["maximum_s"])
    parts = [f"install {c['install_s'] / 60:g} min + {processes} processes x "
             f"{start_s:,.0f} s set-up and model load + {steps} steps x {step_s:,.2f} s "
             f"({q.job_s.basis} on {cards} x {card.id}) = {raw / 60:,.1f} min, x "
             f"{c['margin']:g} margin" + (" (raised to the minimum)" if raw * c["margin"] <
                                          c["minimum_s"] else "")]
    return WallTime(int(seconds), parts)


def parse_time_limit(text: str) -> int:
    """Seconds from --time-limit: hours as a number (1.5), with a unit (90m, 2h, 1d), or
    Slurm's HH:MM:SS."""
    import re

    t = text.strip().lower()
    m = re.fullmatch(r"(\d+):([0-5]?\d):([0-5]?\d)", t)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 3600}
    n = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd]?)", t)
    if m:
        seconds = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
    elif n:
        seconds = math.ceil(float(n.group(1)) * units[n.group(2)])
    else:
        raise UserError("--time-limit", f"{text[:30]!r} is not a duration.",
                        "Give hours (1.5), a unit (90m, 2h) or HH:MM:SS.")
    if not 60 <= seconds <= MAX_TIME_LIMIT_S:
        raise UserError("--time-limit", f"{text[:30]!r} is {seconds:,} s; a pilot job takes "
                        "between a minute and 30 days.", "E.g. --time-limit 2h.")
    return seconds
