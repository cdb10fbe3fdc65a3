"""The sbatch script that runs the staged pilot on a Slurm allocation (see launch/__init__.py)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from tunepilot.launch import RDZV_PORT, LaunchPlan, run_line, slug


def sbatch_script(spec_path: Path, spec, card, nodes: int, per: int, count: int, hours, install,
           plan: LaunchPlan) -> str:
    minutes = max(1, math.ceil((hours or 2) * 60))
    spec_name = str(spec_path.resolve())
    run = run_line(spec_name, card, count, per, hours, plan.run_dir)
    lines = [
        "#!/bin/bash",
        f"# sbatch script written by `tunepilot launch`: the staged pilot of {spec_path.name} on "
        f"{count} x {card.id}.",
        f"#SBATCH --job-name=tunepilot-{slug(spec.label)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gres=gpu:{per}",
        f"#SBATCH --time={minutes // 60:02d}:{minutes % 60:02d}:00",
        "#SBATCH --output=tunepilot-%j.out",
        "set -euo pipefail",
        f"mkdir -p {plan.run_dir}",
        f"# tunepilot must be installed on the nodes next to their torch: {install}",
        "HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)",
    ]
    if nodes > 1:
        lines.append(f"srun tunepilot scale {shlex.quote(spec_name)} --nproc {per} --nnodes "
                     f"{nodes} --node-rank \"$SLURM_NODEID\" --rdzv-endpoint \"$HEAD:{RDZV_PORT}\" "
                     f"--out {plan.run_dir}/scale-{nodes}nodes")
    lines.append(f"srun --nodes=1 --ntasks=1 -w \"$HEAD\" {run}")
    plan.notes.append(f"the run directory {plan.run_dir} is written on the shared filesystem "
                      "(relative to the directory sbatch was called from)")
    return "\n".join(lines) + "\n"


