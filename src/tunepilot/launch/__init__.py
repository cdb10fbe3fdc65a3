"""`tunepilot launch SPEC --card CARD --count N --via skypilot|slurm --out FILE`: pilot on the card
you would rent, through the scheduler you already use (tunepilot has no scheduler of its own).

SkyPilot: a task YAML asking for ``ACCEL:N`` (SkyPilot's accelerator name) on ``num_nodes``
nodes; ``workdir`` syncs the spec's directory (its data with it; data outside it is mounted with
``file_mounts``); ``setup`` installs tunepilot next to the image's own torch; ``run`` does
``tunepilot run SPEC --card CARD --count N --out RUN_DIR`` on the head node (with ``--nproc`` =
the GPUs per node) and, for several nodes, ``tunepilot scale`` on every node with the rendezvous
on the head node (SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS). The run directory comes back with
``sky rsync-down``. Slurm: an sbatch script (``--nodes``, ``--gres=gpu:N``, ``--time`` from the
hours), ``srun`` on every node, the rendezvous on the first node of the allocation, and the run
directory on the shared filesystem.

After the job, ``tunepilot quote RUN_DIR/.. --from RUN_DIR`` uses what was measured on the card.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.errors import UserError

DEFAULT_INSTALL = 'pip install "tunepilot[torch,gpu]"'
RDZV_PORT = 29400


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

    def to_dict(self) -> dict:
        return {"via": self.via, "out": self.out, "card": self.card, "count": self.count,
                "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "run_dir": self.run_dir, "commands_after": self.commands_after,
                "submitted": self.submitted, "notes": self.notes}


def _layout(count: int, gpus_per_node: int | None) -> tuple[int, int]:
    per = gpus_per_node or min(count, 8)
    if count % per:
        raise UserError("--count", f"{count} cards do not split into nodes of {per} GPUs.",
                        "Use a multiple of --gpus-per-node (8 per node by default).")
    return count // per, per


def plan_launch(spec_path: Path, spec, card, *, count: int, via: str, out: Path,
                hours: float | None, gpus_per_node: int | None = None,
                install: str = DEFAULT_INSTALL, run_dir: str | None = None) -> tuple[str,
                                                                                    LaunchPlan]:
    """(the file's text, what it does) for ``via``."""
    if via not in ("skypilot", "slurm"):
        raise UserError("--via", f"{via!r} is not skypilot or slurm.",
                        "Use --via skypilot (any cloud SkyPilot knows) or --via slurm.")
    nodes, per = _layout(count, gpus_per_node)
    run_dir = run_dir or f"runs/{spec.label}-{card.id}x{count}"
    plan = LaunchPlan(via, str(out), card.id, count, nodes, per, run_dir)
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


def submit(via: str, path: Path) -> str:
    """Submit the written file (only when the scheduler's command is installed)."""
    exe = "sky" if via == "skypilot" else "sbatch"
    if shutil.which(exe) is None:
        raise UserError("--submit", f"{exe} is not installed here.",
                        f"Install it, or submit {path} yourself.")
    cmd = [exe, "launch", "-y", str(path)] if via == "skypilot" else [exe, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise UserError("--submit", f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                        f"{(proc.stderr or proc.stdout).strip()[-300:]}")
    return (proc.stdout or "").strip()[-300:]
