"""`tunepilot watch --out DIR -- CMD ...`: run any training command as a child and measure its
whole process tree from outside.

The command runs in its own session (process group). Every ``interval_s`` the tree is walked
(psutil): resident memory per process and for the tree, CPU time per process (kept for processes
that have exited), device memory per process and device-wide (NVML; amdsmi device-wide only).
SIGINT/SIGTERM sent to `watch` are forwarded to the whole group; when the command ends, anything
it left running - in its group, or anywhere below it - is terminated (then killed after a grace
period): no orphans. `watch` is a child subreaper while the command runs (a grandchild that
`setsid`s and loses its parent is re-parented to `watch`, so it is still sampled and torn down),
and if `watch` itself is killed (even with SIGKILL) proc/spawn.py's sentinel ends the command,
everything it recorded below it and every process carrying its token - see proc/spawn.py for
what Linux cannot cover without a cgroup.

When TunepilotCallback runs inside the command it writes its own pilot.json into DIR (pass the
same directory as its out_dir, or let watch tell it through $TUNEPILOT_WATCH_DIR) and marks its
first optimizer step ($TUNEPILOT_WATCH_MARKERS); watch then adds what it saw to that result
instead of writing a result of its own.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tunepilot.device import nvml_handles, nvml_used_per_process, nvml_used_total
from tunepilot.errors import UserError
from tunepilot.proc.spawn import Spawned
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    DeviceBlock,
    DeviceMemory,
    MemoryBlock,
    PilotResult,
    ProcessMemory,
    Watched,
)

MARKERS_ENV = "TUNEPILOT_WATCH_MARKERS"
DIR_ENV = "TUNEPILOT_WATCH_DIR"
GRACE_S = 10.0
M = Figure.measured


class _Tree:
    """The peaks of a process tree, sampled."""

    def __init__(self, spawned: Spawned):
        self.spawned = spawned
        self.seen: dict[int, dict] = {}
        self.peak_tree_rss = 0
        self.peak_rss: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.gpu_peak: dict[int, int] = {}
        self.device_peak = 0
        self.device_baseline: int | None = None
        self.samples = 0
        self._nvml = nvml_handles()
        if self._nvml:
            self.device_baseline = nvml_used_total(self._nvml)

    def sample(self) -> None:
        import psutil

        procs = self.spawned.tree()
        total = 0
        for p in procs:
            try:
                with p.oneshot():
                    rss = p.memory_info().rss
                    t = p.cpu_times()
                    if p.pid not in self.seen:
                        self.seen[p.pid] = {"name": p.name(), "cmdline": p.cmdline()[:6]}
            except psutil.Error:
                continue
            total += rss
            self.peak_rss[p.pid] = max(self.peak_rss.get(p.pid, 0), rss)
            self.cpu[p.pid] = t.user + t.system
        self.peak_tree_rss = max(self.peak_tree_rss, total)
        if self._nvml:
            pids = set(self.seen)
            for pid, used in nvml_used_per_process(self._nvml).items():
                if pid in pids:
                    self.gpu_peak[pid] = max(self.gpu_peak.get(pid, 0), used)
            self.device_peak = max(self.device_peak, nvml_used_total(self._nvml))
        self.samples += 1


def watch_command(cmd: list[str], out: Path | str, *, spec=None, interval_s: float = 0.2,
                  progress=None) -> PilotResult:
    """Run ``cmd``, sample its tree until it ends, write DIR/pilot.json (or add to the
    callback's) and the manifest."""
    from tunepilot.store import RunDir

    if not cmd:
        raise UserError("CMD", "watch needs the command to run after --.",
                        "E.g. tunepilot watch --out runs/mine -- python train.py")
    run = RunDir(out)
    run.path.mkdir(parents=True, exist_ok=True)
    markers = run.logs_dir() / "watch-markers.jsonl"
    markers.unlink(missing_ok=True)
    env = {**os.environ, MARKERS_ENV: str(markers), DIR_ENV: str(run.path)}
    t0_wall, t0 = time.time(), time.perf_counter()
    got_signal: list[int] = []
    signalled_at: list[float] = []
    started: list[Spawned] = []  # filled once the child exists

    def forward(signum, _frame):
        got_signal.append(signum)
        signalled_at.append(time.perf_counter())
        if started:
            started[0].signal_group(signum)

    # The forwarding is in place before the child starts: a signal that arrives while it is
    # being started is recorded and passed on as soon as it has a process group.
    old = {s: signal.signal(s, forward) for s in _FORWARDED}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # a parent may have blocked them
    try:
        started.append(Spawned(cmd, env=env, reaper=True, grace_s=GRACE_S,
                               preexec=_unblock_signals, subreaper=True))
    except OSError as exc:
        for s, h in old.items():
            signal.signal(s, h)
        raise UserError("CMD", f"{cmd[0]!r} could not be started ({exc.strerror or exc}).",
                        "Check the command and that it is on PATH.") from None
    child = started[0]
    if got_signal:
        child.signal_group(got_signal[0])
    tree = _Tree(child)
    try:
        while child.running():
            tree.sample()
            time.sleep(interval_s)
            if signalled_at and time.perf_counter() - signalled_at[0] > GRACE_S:
                child.signal_group(signal.SIGKILL)  # it ignored the signal
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        leftovers = child.teardown()  # whatever the command left running below it
    wall = time.perf_counter() - t0
    code = child.returncode
    watched = Watched(
        command=[str(c) for c in cmd], exit_code=code, wall_s=M(wall, "s"),
        cpu_s=M(sum(tree.cpu.values()), "s", covers="user + system CPU time of every process "
                "of the tree, as last sampled"),
        processes=len(tree.seen), first_step_s=_first_step(markers, t0_wall),
        signal=signal.Signals(-code).name if code is not None and code < 0 else
        (signal.Signals(got_signal[0]).name if got_signal else None))
    result = _result(run, spec, watched, tree, interval_s, leftovers)
    run.write(result)
    return result


_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def _unblock_signals() -> None:
    """In the child before exec: the signals watch forwards must reach it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)


def _first_step(markers: Path, t0_wall: float) -> Figure | None:
    try:
        for line in markers.read_text().splitlines():
            d = json.loads(line)
            if d.get("event") == "first_step":
                return M(max(0.0, float(d["unix_s"]) - t0_wall), "s",
                         covers="from the command's start to the end of its first optimizer "
                                "step (TunepilotCallback's marker)")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _result(run, spec, watched: Watched, tree: _Tree, interval_s: float,
            leftovers: int) -> PilotResult:
    from tunepilot.device import probe_device
    from tunepilot.pilot.provenance import collect_provenance, tunepilot_version

    per_process = {str(pid): {**tree.seen.get(pid, {}), "peak_rss_bytes": tree.peak_rss.get(pid),
                              "peak_device_bytes": tree.gpu_peak.get(pid)}
                   for pid in tree.seen}
    device_mem = DeviceMemory(
        source="nvml" if tree._nvml else None,
        baseline_bytes=M(tree.device_baseline, "bytes", why="no NVML on this machine"),
        peak_bytes=M(tree.device_peak if tree._nvml else None, "bytes",
                     why="no NVML on this machine (a CPU run: see the process tree's RSS)"),
        peak_minus_baseline_bytes=M(tree.device_peak - tree.device_baseline
                                    if tree._nvml and tree.device_baseline is not None
                                    else None, "bytes", why="no NVML on this machine"),
        interval_s=interval_s, num_samples=tree.samples, per_process=per_process)
    process = ProcessMemory(peak_rss_bytes=M(tree.peak_tree_rss or None, "bytes",
                                             why="the command ended before the first sample"),
                            source=f"psutil RSS of every process of the tree, summed, every "
                                   f"{interval_s * 1e3:.0f} ms", covers="the command's lifetime")
    notes = [f"{leftovers} process(es) the command left running were terminated"] \
        if leftovers else []
    existing = run.read_if(PilotResult)
    if existing is not None and existing.source in ("hf-callback", "lightning-callback"):
        existing.watched = watched
        existing.memory.device.per_process = per_process
        existing.memory.process = process if not tree._nvml else existing.memory.process
        existing.notes = list(dict.fromkeys(existing.notes + notes))
        return existing
    info = probe_device()
    why = "watch sees the process tree, not its steps: add TunepilotCallback for step times"
    result = PilotResult(
        source="watch", fits=watched.exit_code == 0,
        verdict=f"the command exited with code {watched.exit_code}" +
                (f" ({watched.signal})" if watched.signal else ""),
        device=DeviceBlock(**info.summary(), count=info.count,
                           memory=M(info.memory_bytes, "bytes", why="not reported")),
        memory=MemoryBlock(device=device_mem, process=process), watched=watched,
        notes=[why, *notes])
    result.step_time.mean_s = Figure.missing("s", why)
    if spec is not None:
        result.spec_hash = spec.spec_hash()
        run.update_manifest(spec=spec.model_dump(mode="json"), device=info.summary(),
                            provenance=collect_provenance(spec, device=info.to_dict(), data={},
                                                          model={}),
                            tunepilot_version=tunepilot_version())
    else:
        run.update_manifest(device=info.summary(), tunepilot_version=tunepilot_version())
    return result
