"""The SkyPilot task that runs the staged pilot on CARD:N (see launch/__init__.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.launch import RDZV_PORT, Install, LaunchPlan, data_mounts, run_line, slug


def task_yaml(spec_path: Path, spec, card, nodes: int, per: int, count: int, hours,
              install: Install, plan: LaunchPlan) -> str:
    import yaml

    accel = _sky_name(card)
    spec_name = spec_path.name
    run = run_line(spec_name, card, count, per, hours, plan.run_dir)
    if nodes > 1:
        scale = (f"tunepilot scale {shlex.quote(spec_name)} --nproc {per} --nnodes {nodes} "
                 f"--node-rank $SKYPILOT_NODE_RANK --rdzv-endpoint "
                 f"$(echo \"$SKYPILOT_NODE_IPS\" | sed -n 1p):{RDZV_PORT} "
                 f"--out {plan.run_dir}/scale-{nodes}nodes")
        body = (f"set -e\n{scale}\nif [ \"$SKYPILOT_NODE_RANK\" = \"0\" ]; then\n  {run}\nfi\n")
    else:
        body = f"set -e\n{run}\n"
    resources = {"accelerators": f"{accel}:{per}"}
    if plan.spot is not None:
        resources["use_spot"] = True
        plan.notes.append("spot: launch it as a managed job (sky jobs launch THIS_FILE) so "
                          "SkyPilot re-provisions and re-runs it after a preemption")
    task = {"name": f"tunepilot-{slug(spec.label)}", "resources": resources,
            "num_nodes": nodes, "workdir": str(spec_path.parent.resolve()),
            "setup": f"set -e\n{install.command}\ntunepilot --version\n", "run": body}
    mounts = {**install.sky_mounts, **data_mounts(spec_path, spec)}
    if mounts:
        task["file_mounts"] = mounts
    plan.commands_after.insert(0, f"sky rsync-down {task['name']} ~/sky_workdir/{plan.run_dir} "
                                  f"{plan.run_dir}")
    head = (f"# SkyPilot task written by `tunepilot launch`: the staged pilot of {spec_name} on "
            f"{count} x {card.id} ({accel}:{per} x {nodes} node(s)).\n"
            f"# sky launch -c {task['name']} THIS_FILE\n")
    return head + yaml.dump(task, Dumper=_block_dumper(), sort_keys=False)


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


