"""Views of the tools: an imported config."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.markup import escape

from tunepilot.views.common import console, notes, table

_NAMES = {"axolotl": "an axolotl", "llamafactory": "a LLaMA-Factory", "trl": "a TRL `trl CMD`",
          "hf": "a TrainingArguments", "litgpt": "a LitGPT `litgpt finetune_*`"}


def render_import(result, out: Path | None) -> None:
    console.print(f"[bold]{escape(result.path)}[/bold] read as {_NAMES[result.source]} config")
    t = table("Mapped", [f"{result.source} key", "spec field"])
    for key, field in result.mapped.items():
        t.add_row(escape(key), escape(field))
    console.print(t)
    if result.defaults:
        console.print("read, spec default kept (off/empty in the config): "
                      + escape(", ".join(result.defaults)))
    if result.not_mapped:
        console.print("read, set in the config, spec default kept (the notes say more): "
                      + escape(", ".join(result.not_mapped)))
    if result.no_effect:
        console.print("read, no effect on memory or time: "
                      + escape(", ".join(result.no_effect)))
    if result.ignored:
        console.print("ignored (not modelled): " + escape(", ".join(result.ignored)))
    for n in result.notes:
        console.print(f"note: {escape(n)}")
    if out is not None:
        console.print(f"wrote {out}: tunepilot plan {out}")
    else:
        console.print(escape(yaml.safe_dump(result.spec_dict, sort_keys=False)))


def render_catalog_import(result, out) -> None:
    """`tunepilot catalog import`: the prices read, the traps warned about, the unknowns."""
    t = table(f"Prices from {result.source} (as of {result.as_of})",
              ["card", "on-demand $/card-hour", "spot $/card-hour", "instance", "region"],
              ("on-demand $/card-hour", "spot $/card-hour"))
    for c in result.cards:
        p = c["pricing"]
        t.add_row(c["id"], p["on_demand_usd_per_hour"], p.get("spot_usd_per_hour") or "-",
                  escape(p.get("instance_type") or "-"), escape(p.get("region") or "-"))
    console.print(t)
    for w in result.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(w)}")
    from tunepilot.catalog.skypilot import UNKNOWN_ACCELERATORS_SHOWN

    for u in result.unknown[:UNKNOWN_ACCELERATORS_SHOWN]:
        more = u.get("num_instances", 0) - 3
        console.print(f"unknown accelerator {escape(u['accelerator'])} "
                      f"({escape(', '.join(u['instances'][:3]))}"
                      + (f" and {more:,} more" if more > 0 else "")
                      + f"): {escape(u['missing'])}")
    if len(result.unknown) > UNKNOWN_ACCELERATORS_SHOWN:
        console.print(f"... and {len(result.unknown) - UNKNOWN_ACCELERATORS_SHOWN:,} more "
                      "unknown accelerators (--json lists them all)")
    console.print(f"{result.rows} rows read, {result.skipped_rows} skipped (no accelerator, no "
                  "price, or a count its GpuInfo contradicts); wrote "
                  f"{escape(str(out))}: pass it as --catalog")


def render_launch(plan) -> None:
    """`tunepilot launch`: what was written and the commands after the job."""
    console.print(f"wrote {escape(plan.out)}: {plan.via}, {plan.count} x {plan.card} "
                  f"({plan.nodes} node(s) x {plan.gpus_per_node} GPU(s)); run directory "
                  f"{escape(plan.run_dir)}")
    if plan.submitted is not None:
        console.print(f"submitted: {escape(plan.submitted)}")
    else:
        how = plan.launch_command or f"sbatch {plan.out}"
        console.print(f"submit it: {escape(how)}  (or pass --submit"
                      + (": it also copies back and tears the cluster down)" if
                         plan.via == "skypilot" else ")"))
    if plan.time_limit:
        console.print(f"time limit {plan.time_limit} ({escape(plan.time_limit_how or '')})")
    console.print(f"installs tunepilot from {escape(plan.install)}")
    console.print("after the job:")
    for c in plan.commands_after:
        console.print(f"  {escape(c)}")
    notes(plan.notes)
