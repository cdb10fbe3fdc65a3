"""import (a trainer's config as a spec), catalog import, launch."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.cli import app
from tunepilot.cli.common import JsonOpt, emit_json


class Trainer(str, Enum):
    axolotl = "axolotl"
    llamafactory = "llamafactory"
    trl = "trl"
    hf = "hf"


@app.command("import")
def import_(
    config: Annotated[Path, typer.Argument(help="The trainer's config: axolotl or LLaMA-Factory "
                                           "YAML, `trl sft --config` YAML, or TrainingArguments "
                                           "fields (JSON/YAML).")],
    source: Annotated[Trainer | None, typer.Option(
        "--from", help="Which trainer wrote it (detected when omitted).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the spec here (YAML); without it the spec is printed.")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="A local tokenizer directory for a local dataset (the hub model's "
        "tokenizer is never downloaded).")] = None,
    data: Annotated[str | None, typer.Option(
        "--data", help="'synthetic': plan with synthetic tokens instead of the config's "
        "dataset (e.g. a hub dataset).")] = None,
    devices: Annotated[int | None, typer.Option(
        "--devices", min=1, max=4096, help="GPUs per node of a DDP/FSDP/DeepSpeed run "
        "(default 8).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read a trainer's config as a tunepilot spec: every key it maps is listed with the spec
    field it became, every key it ignores is listed too; a hub model id must be a shipped
    preset's, a dataset must be local. `plan`, `run` and `quote` also accept the config directly.

    Example: tunepilot import axolotl/examples/llama-3/lora-8b.yml --out llama3-lora.yaml
    """
    from tunepilot.errors import UserError
    from tunepilot.integrations.importers import ImportOptions, import_config, write_spec

    if data not in (None, "synthetic"):
        raise UserError("--data", f"{data!r} is not 'synthetic'.",
                        "Omit --data to read the config's own (local) dataset.")
    result = import_config(config, source.value if source else None, ImportOptions(
        tokenizer=tokenizer, synthetic_data=data == "synthetic", devices=devices))
    if out is not None:
        write_spec(result, out)
    if as_json:
        emit_json(result.to_dict() | {"written": str(out) if out else None})
        return
    from tunepilot.views.tools import render_import

    render_import(result, out)
