"""How busy the machine was while steps were measured: step times taken on a loaded machine
(other processes on the cores, or a hypervisor stealing CPU time) measure the load, not the run.

Linux's 1-minute load average (os.getloadavg) read before the measured steps start - before this
pilot's own threads add to it - and the CPU steal share over the measured steps from /proc/stat
(the time the hypervisor ran someone else while this VM wanted the CPU).
"""

from __future__ import annotations

import os

from tunepilot.results.pilot import MachineLoad

LOADED_LOAD_FRACTION = 0.5  # other work using half the cores or more before the steps started
LOADED_STEAL_FRACTION = 0.05  # the hypervisor took 5% or more of the CPU time


def _cpu_times() -> list[int] | None:
    """The 'cpu' line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in first[1:]] if first and first[0] == "cpu" else None


class MachineLoadWatch:
    """Start before the measured steps, stop after them."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        try:
            self.load_before = os.getloadavg()[0]
        except OSError:
            self.load_before = None
        self.t0 = _cpu_times()

    def stop(self) -> MachineLoad:
        t1 = _cpu_times()
        steal = None
        if self.t0 and t1 and len(t1) > 7:
            total = sum(t1) - sum(self.t0)
            steal = (t1[7] - self.t0[7]) / total if total > 0 else 0.0
        busy = self.load_before is not None and \
            self.load_before >= LOADED_LOAD_FRACTION * self.cores
        stolen = steal is not None and steal >= LOADED_STEAL_FRACTION
        note = None
        if busy or stolen:
            parts = []
            if busy:
                parts.append(f"load average {self.load_before:.2f} on {self.cores} cores before "
                             "the steps started (other work was running)")
            if stolen:
                parts.append(f"the hypervisor stole {steal:.0%} of the CPU time")
            note = ("the machine was loaded while measuring: " + " and ".join(parts)
                    + "; step times are slower and noisier than on an idle machine")
        return MachineLoad(logical_cores=self.cores, load_average_1m=self.load_before,
                           cpu_steal_fraction=steal, loaded=busy or stolen, note=note)
