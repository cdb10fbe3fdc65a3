"""The sbatch script that runs the staged pilot on a Slurm allocation (see launch/__init__.py).

The batch script itself runs on the first node only. What must differ per node - the node rank
and the directory each node writes - is therefore evaluated *on each node*: ``srun`` starts one
``bash -c '...'`` per node and the single quotes keep ``$SLURM_NODEID`` unexpanded until that
shell runs there (the batch shell would expand it once, to 0, for every node).
``--kill-on-bad-exit=1`` ends every node's task when one fails, so a rank that dies does not
leave the others waiting on the rendezvous until the time limit.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from tunepilot.launch import RDZV_PORT, Install, LaunchPlan, run_line, slug


def sbatch_script(spec_path: Path, spec, card, nodes: int, per: int, count: int, hours,
                  install: Install, plan: LaunchPlan) -> str:
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
        *(["#SBATCH --requeue"] if plan.spot is not None else []),
        "set -euo pipefail",
        f"mkdir -p {plan.run_dir}",
        f"# tunepilot next to the nodes' own torch, from {install.how}; once, for the",
        "# job's environment on the shared filesystem",
        install.command,
        # sed reads the whole list: `head -n1` would close the pipe early and, under
        # pipefail, a SIGPIPE'd scontrol fails the job (exit 141)
        "HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)",
    ]
    if nodes > 1:
        out = f"{plan.run_dir}/scale-{nodes}nodes"
        per_node = (f"tunepilot scale {shlex.quote(spec_name)} --nproc {per} --nnodes {nodes} "
                    f"--node-rank \"$SLURM_NODEID\" --rdzv-endpoint \"$HEAD:{RDZV_PORT}\" "
                    f"--out \"{out}/node$SLURM_NODEID\"")
        lines += ["export HEAD",
                  "# one task per node; $SLURM_NODEID is expanded there (single quotes)",
                  f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks={nodes} "
                  f"--ntasks-per-node=1 bash -c {shlex.quote(per_node)}"]
        plan.notes.append(f"every node writes its own {out}/node<N>; node 0's holds the "
                          "scaling result")
    lines.append(f"srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 -w \"$HEAD\" {run}")
    plan.notes.append(f"the run directory {plan.run_dir} is written on the shared filesystem "
                      "(relative to the directory sbatch was called from)")
    return "\n".join(lines) + "\n"
