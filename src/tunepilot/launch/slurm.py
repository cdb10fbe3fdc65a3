"""The sbatch script that runs the staged pilot on a Slurm allocation (see launch/__init__.py).

The batch script itself runs on the first node only. What must differ per node - the node rank
and the directory each node writes - is therefore evaluated *on each node*: ``srun`` starts one
``bash -c '...'`` per node and the single quotes keep ``$SLURM_NODEID`` unexpanded until that
shell runs there (the batch shell would expand it once, to 0, for every node).
``--kill-on-bad-exit=1`` ends every node's task when one fails, so a rank that dies does not
leave the others waiting on the rendezvous until the time limit.

Where things live: tunepilot in a venv on the shared filesystem (``$TUNEPILOT_VENV``, default
the submit directory's .tunepilot-venv; created with the cluster's python3 - never a ``pip
install`` into whatever python is first on PATH, which PEP 668 refuses - and seeing the
system's site-packages, so a cluster-provided torch is used; PyPI's CUDA torch otherwise); the
run in node-local scratch (``$TUNEPILOT_WORK``, default ``$TMPDIR``/tunepilot-JOB), copied back
to the submit directory when the job ends, passed or failed (an EXIT trap; each node copies its
own directory, node 0's is RUN_DIR with the scaling result in it).
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from tunepilot.launch import RDZV_PORT, TORCH_FLOOR, Install, LaunchPlan, run_line, slug

MEM_FRACTION = 0.9
"""of the offer's host RAM share asked as --mem: a node reports less than the instance's
listed RAM to Slurm (RealMemory excludes what the OS holds), and a request above it is refused"""


def resources(card, per: int) -> tuple[list[str], str]:
    """The CPU and memory directives for one task (one per node) of ``per`` GPUs: the offer's
    share of its host's vCPUs and RAM; the whole node (--exclusive, --mem=0) when the catalog
    lists no host."""
    host = card.pricing.host
    if host is None or host.vcpus is None:
        return (["#SBATCH --exclusive", "#SBATCH --mem=0"],
                "the catalog lists no host for this offer: the job asks for whole nodes "
                "(--exclusive, --mem=0: all of each node's CPUs and memory)")
    share = min(per, host.accelerators) / host.accelerators
    cpus = max(1, math.floor(host.vcpus * share))
    mem_gib = max(1, math.floor(host.ram_gib * share * MEM_FRACTION))
    return ([f"#SBATCH --cpus-per-task={cpus}", f"#SBATCH --mem={mem_gib}G"],
            f"{cpus} CPUs and {mem_gib} GiB per task (one task per node): the {per}-GPU share "
            f"of {host.instance_type or 'the offer'}'s {host.vcpus} vCPUs and "
            f"{host.ram_gib:g} GiB (x {MEM_FRACTION:g}: RealMemory is under the listed RAM)")


def sbatch_script(spec_path: Path, spec, card, nodes: int, per: int, count: int, hours,
                  install: Install, plan: LaunchPlan) -> str:
    spec_name = str(spec_path.resolve())
    rd = plan.run_dir
    run = run_line(spec_name, card, count, per, hours, f'"$WORK/{rd}"')
    directives, how = resources(card, per)
    plan.notes.append(how)
    plan.notes.append(f"--time {plan.time_limit}: {plan.time_limit_how}")
    lines = [
        "#!/bin/bash",
        f"# sbatch script written by `tunepilot launch`: the staged pilot of {spec_path.name} on "
        f"{count} x {card.id}.",
        f"#SBATCH --job-name=tunepilot-{slug(spec.label)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gres=gpu:{per}",
        *directives,
        f"#SBATCH --time={plan.time_limit}",
        "#SBATCH --output=tunepilot-%j.out",
        *(["#SBATCH --requeue"] if plan.spot is not None else []),
        "set -euo pipefail",
        'SUBMIT="${SLURM_SUBMIT_DIR:-$PWD}"',
        "# tunepilot in a venv on the shared filesystem, so every node runs the same one",
        'VENV="${TUNEPILOT_VENV:-$SUBMIT/.tunepilot-venv}"',
        '[ -x "$VENV/bin/python" ] || "${TUNEPILOT_PYTHON:-python3}" -m venv '
        '--system-site-packages "$VENV"',
        'source "$VENV/bin/activate"',
        "# the cluster's torch when it sees the GPUs, else PyPI's (a CUDA build on Linux x86_64)",
        'python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" '
        f'2>/dev/null || python -m pip install "torch>={TORCH_FLOOR}"',
        f"# tunepilot from {install.how}",
        install.command,
        "# the run in node-local scratch, copied back to the submit directory at the end",
        'WORK="${TUNEPILOT_WORK:-${TMPDIR:-/tmp}/tunepilot-$SLURM_JOB_ID}"',
        f'mkdir -p "$WORK/{rd}"',
        f'copy_back() {{ mkdir -p "$SUBMIT/{rd}" && cp -a "$WORK/{rd}/." "$SUBMIT/{rd}/"; }}',
        "trap copy_back EXIT",
        "export SUBMIT WORK",
        # sed reads the whole list: `head -n1` would close the pipe early and, under
        # pipefail, a SIGPIPE'd scontrol fails the job (exit 141)
        "HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)",
    ]
    if nodes > 1:
        per_node = (
            f'OUT="$WORK/{rd}"; DEST="$SUBMIT/{rd}"; if [ "$SLURM_NODEID" != 0 ]; then '
            f'OUT="$WORK/{rd}-node$SLURM_NODEID"; DEST="$SUBMIT/{rd}-node$SLURM_NODEID"; fi; '
            'mkdir -p "$OUT"; trap \'mkdir -p "$DEST" && cp -a "$OUT/." "$DEST/"\' EXIT; '
            f"tunepilot scale {shlex.quote(spec_name)} --nproc {per} --nnodes {nodes} "
            f'--node-rank "$SLURM_NODEID" --rdzv-endpoint "$HEAD:{RDZV_PORT}" --out "$OUT"')
        lines += ["export HEAD",
                  "# one task per node; $SLURM_NODEID is expanded there (single quotes); node 0",
                  f"# writes $WORK/{rd}/scale.json, which the run below reuses",
                  f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks={nodes} "
                  f"--ntasks-per-node=1 bash -c {shlex.quote(per_node)}"]
        plan.notes.append(f"node 0 writes the {nodes}-node scaling result to {rd}/scale.json "
                          "(the run reuses it and the quote reads it as measured); the other "
                          f"nodes' logs come back to {rd}-node<N>")
    lines.append(f"srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 -w \"$HEAD\" {run}")
    plan.notes.append(f"the run directory comes back to {rd} in the directory sbatch was "
                      "called from, when the job ends (passed or failed)")
    return "\n".join(lines) + "\n"
