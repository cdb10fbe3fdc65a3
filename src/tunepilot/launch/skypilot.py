"""The SkyPilot task that runs the staged pilot on CARD:N (see launch/__init__.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.launch import RDZV_PORT, Install, LaunchPlan, data_mounts, run_line, slug

# SkyPilot's default GPU image has the NVIDIA driver and CUDA but no torch; PyPI's torch wheel
# for Linux x86_64 is a CUDA build, so the node installs it unless the image already has one
# that sees the GPUs. ROCm cards need an image with a ROCm torch (PyPI has none).
CUDA_TORCH = ('python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" '
              '2>/dev/null || python -m pip install "torch{floor}"')
ROCM_TORCH = ('python -c "import sys, torch; sys.exit(0 if torch.version.hip and '
              'torch.cuda.is_available() else 1)" 2>/dev/null || { echo "this task needs an '
              'image with a ROCm build of torch (set resources.image_id, e.g. a rocm/pytorch '
              'image): PyPI has none" >&2; exit 1; }')


def cluster_name(spec) -> str:
    """The cluster the task runs on: `sky launch -c NAME`, and the ssh/rsync host of its head
    node (SkyPilot writes it into ~/.ssh/config)."""
    return f"tunepilot-{slug(spec.label)}"


def task_yaml(spec_path: Path, spec, card, nodes: int, per: int, count: int, hours,
              install: Install, plan: LaunchPlan) -> str:
    import yaml

    accel = _sky_name(card)
    spec_name = spec_path.name
    run = run_line(spec_name, card, count, per, hours, plan.run_dir)
    if nodes > 1:  # node 0 writes RUN_DIR/scale.json, which `tunepilot run` then reuses
        scale = (f"tunepilot scale {shlex.quote(spec_name)} --nproc {per} --nnodes {nodes} "
                 f"--node-rank $SKYPILOT_NODE_RANK --rdzv-endpoint "
                 f"$(echo \"$SKYPILOT_NODE_IPS\" | sed -n 1p):{RDZV_PORT} --out \"$OUT\"")
        body = (f"set -e\nOUT={plan.run_dir}\nif [ \"$SKYPILOT_NODE_RANK\" != \"0\" ]; then "
                f"OUT={plan.run_dir}-node$SKYPILOT_NODE_RANK; fi\n{scale}\n"
                f"if [ \"$SKYPILOT_NODE_RANK\" = \"0\" ]; then\n  {run}\nfi\n")
    else:
        body = f"set -e\n{run}\n"
    resources = {"accelerators": f"{accel}:{per}"}
    if plan.spot is not None:
        resources["use_spot"] = True
        plan.notes.append("spot: launch it as a managed job (sky jobs launch THIS_FILE) so "
                          "SkyPilot re-provisions and re-runs it after a preemption; a managed "
                          "job's cluster is torn down at its end, so mount a bucket for the run "
                          "directory (file_mounts) or the copy-back below has nothing to read")
    torch_line = ROCM_TORCH if card.software_stack == "rocm" else \
        CUDA_TORCH.format(floor=torch_floor())
    name = cluster_name(spec)
    task = {"name": name, "resources": resources,
            "num_nodes": nodes, "workdir": str(spec_path.parent.resolve()),
            "setup": f"set -e\n{torch_line}\n{install.command}\ntunepilot --version\n",
            "run": body}
    mounts = {**install.sky_mounts, **data_mounts(spec_path, spec)}
    if mounts:
        task["file_mounts"] = mounts
    plan.cluster = name
    plan.launch_command = launch_command(name, plan.out, plan.teardown, plan.idle_minutes)
    plan.commands_after[:0] = after_job(name, plan.run_dir, plan.teardown)
    plan.notes.append(
        ("torch: the image's own when it sees the GPUs, else PyPI's (a CUDA build on Linux "
         "x86_64) on SkyPilot's default GPU image" if card.software_stack == "cuda" else
         "torch: the image must bring a ROCm build (resources.image_id); the setup stops "
         "naming it otherwise") + f"; then tunepilot from {install.how}")
    if nodes > 1:
        plan.notes.append(f"node 0 writes the {nodes}-node scaling result to "
                          f"{plan.run_dir}/scale.json, which the run on node 0 reuses and the "
                          "quote reads as measured; the other nodes write their logs to "
                          f"{plan.run_dir}-node<N> on their own disks")
    head = (f"# SkyPilot task written by `tunepilot launch`: the staged pilot of {spec_name} on "
            f"{count} x {card.id} ({accel}:{per} x {nodes} node(s)).\n"
            f"# {plan.launch_command}\n"
            + "".join(f"# then: {c}\n" for c in plan.commands_after[:2]))
    return head + yaml.dump(task, Dumper=_block_dumper(), sort_keys=False)


def launch_command(name: str, path, teardown: str, idle_minutes: int) -> str:
    """`sky launch -c NAME`, with the idle safety net: the cluster stops (or is torn down)
    after ``idle_minutes`` idle even if nobody copies back and tears it down."""
    down = " --down" if teardown == "down" else ""
    return f"sky launch -c {name} -i {idle_minutes}{down} -y {shlex.quote(str(path))}"


def after_job(name: str, run_dir: str, teardown: str) -> list[str]:
    """Copy the run directory back from the head node (the cluster name is its ssh host), then
    stop or tear the cluster down."""
    return [f"rsync -Pavz {name}:~/sky_workdir/{run_dir}/ {run_dir}/",
            f"sky {'down' if teardown == 'down' else 'stop'} -y {name}"]


def torch_floor() -> str:
    """'>=X' of the lowest torch tunepilot runs on (launch installs no older one)."""
    from tunepilot.launch import TORCH_FLOOR

    return f">={TORCH_FLOOR}"


def _block_dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return Dumper


def _sky_name(card) -> str:
    from tunepilot.catalog.skypilot import CARD_TO_SKY

    name = CARD_TO_SKY.get(card.id)
    if name is None:
        raise UserError("--card", f"{card.id} has no SkyPilot accelerator name tunepilot knows.",
                        f"Known: {', '.join(sorted(CARD_TO_SKY))}.")
    return name


