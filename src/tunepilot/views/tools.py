"""Views of the tools: an imported config."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.markup import escape

from tunepilot.views.common import console, table

_NAMES = {"axolotl": "an axolotl", "llamafactory": "a LLaMA-Factory", "trl": "a TRL `trl sft`",
          "hf": "a TrainingArguments"}


def render_import(result, out: Path | None) -> None:
    console.print(f"[bold]{escape(result.path)}[/bold] read as {_NAMES[result.source]} config")
    t = table("Mapped", [f"{result.source} key", "spec field"])
    for key, field in result.mapped.items():
        t.add_row(escape(key), escape(field))
    console.print(t)
    if result.defaults:
        console.print("read, spec default kept (off/empty in the config): "
                      + escape(", ".join(result.defaults)))
    if result.ignored:
        console.print("ignored (not modelled): " + escape(", ".join(result.ignored)))
    for n in result.notes:
        console.print(f"note: {escape(n)}")
    if out is not None:
        console.print(f"wrote {out}: tunepilot plan {out}")
    else:
        console.print(escape(yaml.safe_dump(result.spec_dict, sort_keys=False)))
