"""`tunepilot launch SPEC --card CARD --count N --via skypilot|slurm --out FILE`: pilot on the card
you would rent, through the scheduler you already use (tunepilot has no scheduler of its own).

SkyPilot: a task YAML asking for ``ACCEL:N`` (SkyPilot's accelerator name) on ``num_nodes``
nodes; ``workdir`` syncs the spec's directory (its data with it; data outside it is mounted with
``file_mounts``); ``setup`` installs tunepilot next to the image's own torch; ``run`` does
``tunepilot run SPEC --card CARD --count N --out RUN_DIR`` on the head node (with ``--nproc`` =
the GPUs per node) and, for several nodes, ``tunepilot scale`` on every node with the rendezvous
on the head node (SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS); node 0's multi-node result is
RUN_DIR/scale.json, which `run` reuses and the quote reads as measured. ``sky launch -c NAME``
runs it (with an idle autostop or autodown as a safety net); the run directory comes back with
``rsync -Pavz NAME:~/sky_workdir/RUN_DIR/ RUN_DIR/`` (the cluster name is an ssh host), then the
cluster is torn down (``sky down``, the default) or stopped (``--teardown stop``); ``--submit``
does all three. Slurm: an sbatch script (``--nodes``, ``--gres=gpu:N``, ``--cpus-per-task`` and
``--mem`` from the offer's host, ``--time`` = the pilot's projected wall time with a margin, or
``--time-limit``), tunepilot in a venv on the shared filesystem, ``srun`` on every node, the
rendezvous on the first node of the allocation, the run in node-local scratch and copied back to
the submit directory when the job ends (also when it fails).

After the job, ``tunepilot quote RUN_DIR/.. --from RUN_DIR`` uses what was measured on the card.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.device import TORCH_FLOOR  # noqa: F401 - the launch scripts install at least it
from tunepilot.errors import UserError

EXTRAS = "[torch,gpu]"
TEARDOWNS = ("down", "stop")
INDEX_INSTALL = f'pip install "tunepilot{EXTRAS}"'  # only where tunepilot is on the index
RDZV_PORT = 29400
SKY_SRC = "~/.tunepilot/src"  # where a SkyPilot node gets this tunepilot's source (file_mounts)


@dataclass
class Install:
    """How the node installs tunepilot: the shell line, what SkyPilot must upload for it
    (file_mounts: remote -> local), and a warning when it relies on the package index."""

    command: str
    sky_mounts: dict[str, str] = field(default_factory=dict)
    warning: str | None = None
    how: str = ""


def source_tree() -> Path | None:
    """The source checkout this tunepilot runs from (src/tunepilot + pyproject.toml naming
    tunepilot), or None when it was installed from a wheel."""
    import re

    import tunepilot

    pkg = Path(tunepilot.__file__).resolve().parent
    root = pkg.parent.parent
    try:
        text = (root / "pyproject.toml").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    named = re.search(r'(?m)^name\s*=\s*"tunepilot"\s*$', text)
    return root if pkg.parent.name == "src" and named else None


def install_plan(via: str, install: str | None, wheel: Path | None,
                 source: Path | None) -> Install:
    """``--install CMD`` as given; else ``--wheel FILE``; else this tunepilot's own source tree
    (SkyPilot uploads its pyproject.toml, README.md and src/; Slurm installs from the path on
    the shared filesystem); else the package index, with a warning that it needs tunepilot
    there."""
    if install:
        return Install(install, how="--install, as given")
    if wheel is not None:
        wheel = Path(wheel).resolve()
        if not wheel.is_file() or wheel.suffix != ".whl":
            raise UserError("--wheel", f"{wheel} is not a wheel file (.whl).",
                            "Build one with `pip wheel --no-deps -w dist .` in the tunepilot "
                            "source tree and pass its path.")
        if via == "skypilot":
            remote = f"~/.tunepilot/{wheel.name}"
            return Install(f'python -m pip install "$HOME/.tunepilot/{wheel.name}{EXTRAS}"',
                           {remote: str(wheel)}, how=f"the wheel {wheel.name}, uploaded")
        return Install(f'python -m pip install "{wheel}{EXTRAS}"',
                       how=f"the wheel {wheel} (on the shared filesystem)")
    if source is not None:
        if via == "skypilot":
            mounts = {f"{SKY_SRC}/{name}": str(source / name)
                      for name in ("pyproject.toml", "README.md", "src")
                      if (source / name).exists()}
            return Install(f'python -m pip install "$HOME/.tunepilot/src{EXTRAS}"', mounts,
                           how=f"this tunepilot's source ({source}), uploaded")
        return Install(f'python -m pip install "{source}{EXTRAS}"',
                       how=f"this tunepilot's source {source} (on the shared filesystem)")
    return Install(INDEX_INSTALL, warning=(
        "tunepilot here was installed from a wheel, not a source tree, and no --wheel was "
        f"given: the node runs `{INDEX_INSTALL}`, which only works where tunepilot is on your "
        "package index. Pass --wheel FILE (a wheel of this version) or --install CMD."),
        how="the package index")


@dataclass
class LaunchPlan:
    via: str
    out: str
    card: str
    count: int
    nodes: int
    gpus_per_node: int
    run_dir: str
    commands_after: list[str] = field(default_factory=list)
    submitted: str | None = None
    notes: list[str] = field(default_factory=list)
    install: str = ""
    warnings: list[str] = field(default_factory=list)
    spot: dict | None = None
    """--spot: the spec written with the recommended checkpoint interval, and the interval"""
    teardown: str = "down"
    """SkyPilot: after the job, down (tear the cluster down) or stop (keep its disk)"""
    idle_minutes: int = 30
    cluster: str | None = None
    launch_command: str | None = None
    """SkyPilot: the `sky launch -c NAME ...` that runs the task"""
    time_limit: str | None = None
    """Slurm: the job's --time (HH:MM:SS), and how it was chosen"""
    time_limit_how: str | None = None

    def to_dict(self) -> dict:
        return {"via": self.via, "out": self.out, "card": self.card, "count": self.count,
                "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "run_dir": self.run_dir, "launch_command": self.launch_command,
                "cluster": self.cluster, "teardown": self.teardown,
                "idle_minutes": self.idle_minutes, "time_limit": self.time_limit,
                "time_limit_how": self.time_limit_how, "commands_after": self.commands_after,
                "submitted": self.submitted, "install": self.install,
                "warnings": self.warnings, "notes": self.notes, "spot": self.spot}


def _layout(count: int, gpus_per_node: int | None) -> tuple[int, int]:
    per = gpus_per_node or min(count, 8)
    if count % per:
        raise UserError("--count", f"{count} cards do not split into nodes of {per} GPUs.",
                        "Use a multiple of --gpus-per-node (8 per node by default).")
    return count // per, per


def plan_launch(spec_path: Path, spec, card, *, count: int, via: str, out: Path,
                hours: float | None, gpus_per_node: int | None = None,
                install: str | None = None, wheel: Path | None = None,
                run_dir: str | None = None, spot=None, teardown: str = "down",
                idle_minutes: int | None = None, time_limit_s: int | None = None,
                catalog=None) -> tuple[str, LaunchPlan]:
    """(the file's text, what it does) for ``via``. ``spot`` (a SpotQuote): run on spot
    capacity with the spec rewritten to checkpoint at its recommended interval
    (write_spot_spec), which the file runs instead of ``spec_path``. SkyPilot: ``teardown``
    (down | stop) after the copy-back, ``idle_minutes`` the autostop safety net. Slurm:
    ``time_limit_s`` (default: the pilot's projected wall time with a margin)."""
    from tunepilot.resources import launch_constants

    if via not in ("skypilot", "slurm"):
        raise UserError("--via", f"{via!r} is not skypilot or slurm.",
                        "Use --via skypilot (any cloud SkyPilot knows) or --via slurm.")
    if teardown not in TEARDOWNS:
        raise UserError("--teardown", f"{teardown!r} is not down or stop.",
                        "Use --teardown down (the default: nothing left billing) or stop "
                        "(keep the cluster's disk; it still bills storage).")
    nodes, per = _layout(count, gpus_per_node)
    run_dir = run_dir or f"runs/{spec.label}-{card.id}x{count}"
    plan = LaunchPlan(via, str(out), card.id, count, nodes, per, run_dir, teardown=teardown,
                      idle_minutes=idle_minutes or launch_constants()["skypilot"]["idle_minutes"])
    if via == "slurm":
        _time_limit(plan, spec_path, spec, card, time_limit_s, catalog)
    if spot is not None:
        spec_path, spec = write_spot_spec(spec_path, spec, spot)
        plan.spot = {"spec": str(spec_path), "checkpoint_every_steps": spot.interval_steps,
                     "interval_s": spot.interval_s.value, "rule": spot.interval_rule}
        plan.notes.append(f"on spot: {spec_path.name} checkpoints every {spot.interval_steps:,} "
                          f"steps ({spot.interval_rule}); a re-run after a preemption reuses the "
                          "stages the run directory already holds")
    install = install_plan(via, install, wheel, source_tree())
    plan.install = install.how
    if install.warning:
        plan.warnings.append(install.warning)
    if via == "skypilot":
        from tunepilot.launch.skypilot import task_yaml

        text = task_yaml(spec_path, spec, card, nodes, per, count, hours, install, plan)
    else:
        from tunepilot.launch.slurm import sbatch_script

        text = sbatch_script(spec_path, spec, card, nodes, per, count, hours, install, plan)
    plan.commands_after.append(f"tunepilot quote {shlex.quote(str(spec_path))} --from "
                               f"{run_dir} --card {card.id} --count {count}"
                               + (f" --hours {hours:g}" if hours else " --hours 24"))
    plan.commands_after.append(f"tunepilot report {run_dir}")
    return text, plan


def _time_limit(plan: LaunchPlan, spec_path: Path, spec, card, time_limit_s: int | None,
                catalog) -> None:
    """Slurm's --time: --time-limit as given, else the pilot's projected wall time."""
    from tunepilot.launch.walltime import WallTime, pilot_wall_time

    if time_limit_s is not None:
        wall = WallTime(int(time_limit_s), ["--time-limit, as given"])
    else:
        from tunepilot.catalog import load_catalog

        wall = pilot_wall_time(spec, card, plan.gpus_per_node, plan.nodes,
                               catalog or load_catalog(), spec_path.parent)
    plan.time_limit, plan.time_limit_how = wall.slurm, "; ".join(wall.parts)


def write_spot_spec(spec_path: Path, spec, spot) -> tuple[Path, object]:
    """SPEC.spot.yaml beside ``spec_path`` (so relative paths and SkyPilot's workdir still
    hold): the spec with checkpoint.every_steps = the spot quote's recommended interval. Read
    back and checked before it is used."""
    import yaml

    from tunepilot.spec import load_spec
    from tunepilot.store import atomic_write_bytes

    every = spot.interval_steps
    new = spec.with_changes(checkpoint={**spec.checkpoint.model_dump(), "every_steps": every})
    out = spec_path.with_name(f"{spec_path.stem}.spot.yaml")
    head = [f"# written by `tunepilot launch --spot` from {spec_path.name}: the same run, "
            f"checkpointing every {every:,} optimizer steps",
            f"# (was {spec.checkpoint.every_steps:,}): the interval that minimises the expected "
            f"cost on spot, {spot.interval_s.value / 60:,.1f} min of work at "
            f"{spot.step_s:,.2f} s/step;",
            f"# {spot.interval_rule}; C = one checkpoint save ({spot.save_s.basis}), M = the "
            "mean time between interruptions"]
    body = yaml.safe_dump(new.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    atomic_write_bytes(out, ("\n".join(head) + "\n" + body).encode())
    back = load_spec(out)
    assert back.spec_hash() == new.spec_hash(), "the spot spec did not read back as written"
    return out, back


def run_line(spec_name: str, card, count: int, per: int, hours, run_dir: str) -> str:
    return (f"tunepilot run {shlex.quote(spec_name)} --card {card.id} --count {count}"
            + (f" --hours {hours:g}" if hours else "") + f" --nproc {per} --out {run_dir}")


def data_mounts(spec_path: Path, spec) -> dict[str, str]:
    """Data outside the spec's directory: mounted at the same relative path on the node."""
    mounts: dict[str, str] = {}
    base = spec_path.parent.resolve()
    for p in (getattr(spec.data, "path", None), getattr(spec.data, "tokenizer", None),
              spec.model.config):
        if not p:
            continue
        full = (base / p).resolve() if not Path(p).is_absolute() else Path(p)
        if not full.is_relative_to(base):
            mounts[str(full)] = str(full)
    return mounts


def slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40] or "run"


def _tool(cmd: list[str], **kw):
    """sky / rsync / sbatch as a tool that dies with tunepilot (proc/spawn.py); a cluster left
    running by a killed `sky launch` stops itself after --idle-minutes."""
    from tunepilot.proc.spawn import run_tool

    return run_tool(cmd, timeout_s=None, **kw)


def submit(plan: LaunchPlan, path: Path, run=_tool) -> str:
    """Submit the written file (only when the scheduler's command is installed). SkyPilot:
    ``sky launch -c NAME`` (it waits for the job), then - whether the job passed its gates or
    not - the copy-back and the teardown (down or stop, as asked); when the copy-back fails the
    cluster is stopped, not torn down, so its run directory survives. Slurm: sbatch (the script
    copies back itself)."""
    exe = "sky" if plan.via == "skypilot" else "sbatch"
    if shutil.which(exe) is None:
        raise UserError("--submit", f"{exe} is not installed here.",
                        f"Install it, or submit {path} yourself.")
    if plan.via == "slurm":
        return _step(run, [exe, str(path)])
    assert plan.launch_command is not None and plan.cluster is not None
    copy, teardown = plan.commands_after[0], plan.commands_after[1]
    job = None
    try:
        _step(run, shlex.split(plan.launch_command), stream=True)  # the job's own logs
    except UserError as exc:
        job = exc.message
    try:
        said = _step(run, shlex.split(copy))
    except UserError as exc:
        stopped = _try(run, ["sky", "stop", "-y", plan.cluster])
        raise UserError("--submit", (f"{job}; then " if job else "the job ran but ")
                        + f"copying its run directory back failed ({exc.message}); the cluster "
                        f"{plan.cluster} was " + ("STOPPED, not torn down, so the run directory "
                                                  "is still on its disk" if stopped else
                                                  "not stopped (sky stop failed: it may not "
                                                  "exist)") + ".",
                        f"Run `{copy}`, then `sky down -y {plan.cluster}`.") from None
    _step(run, shlex.split(teardown))
    if job:
        done = "torn down" if plan.teardown == "down" else "stopped"
        raise UserError("--submit", f"{job}; its run directory was copied back to "
                        f"{plan.run_dir} and the cluster {done}.",
                        f"See {plan.run_dir}/decision.json (a failed gate says why).")
    return said


def _try(run, cmd: list[str]) -> bool:
    try:
        _step(run, cmd)
        return True
    except UserError:
        return False


def _step(run, cmd: list[str], stream: bool = False) -> str:
    """Run one command; ``stream``: its output goes to stderr as it comes (a job's logs)."""
    import sys

    if stream:
        proc = run(cmd, stdout=sys.stderr, stderr=sys.stderr, text=True)
        out = ""
    else:
        proc = run(cmd, capture_output=True, text=True)
        out = (proc.stdout or "").strip()[-300:]
    if proc.returncode:
        err = "" if stream else f": {(proc.stderr or proc.stdout or '').strip()[-300:]}"
        raise UserError("--submit", f"{' '.join(cmd)} failed (exit {proc.returncode}){err}")
    return out
