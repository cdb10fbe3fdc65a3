"""What every command shares: option types, loading a spec (or importing a trainer's config on
the fly), the run directory default, and the one ending ``show(result, as_json, view)``."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tunepilot.views.common import emit_json, show, show_committed

__all__ = ["CatalogOpt", "DbOpt", "DaysOpt", "FromOpt", "HoursOpt", "JsonOpt", "OptionOpt",
           "OutOpt", "SpecArg", "emit_json", "load_run_spec", "out_dir", "say", "show",
           "show_committed"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
CatalogOpt = Annotated[Path | None, typer.Option(
    "--catalog", help="A catalog YAML that overrides or adds cards (only the keys it changes); "
    "e.g. one written by `tunepilot catalog import`.")]
SpecArg = Annotated[Path, typer.Argument(
    help="The run spec (YAML), e.g. examples/llama3-8b-lora.yaml - or a trainer's config "
    "(axolotl, LLaMA-Factory, TRL, TrainingArguments), imported on the fly.")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", help="Run directory (default runs/<spec name>-<spec hash[:8]>).")]
FromOpt = Annotated[Path | None, typer.Option(
    "--from", help="A run directory of this spec (pilot/restore/scale/export results).")]
HoursOpt = Annotated[str | None, typer.Option("--hours", help="Term length in hours, e.g. 72.")]
DaysOpt = Annotated[str | None, typer.Option("--days", help="Term length in days, e.g. 3.")]
OptionOpt = Annotated[list[str] | None, typer.Option(
    "--option", help="A card option as NAME=QUANTITY (repeatable), e.g. storage_gb_month=500.")]
DbOpt = Annotated[Path | None, typer.Option(
    "--db", help="The ledger database (default: $TUNEPILOT_DB, else ledger.sqlite3 in the user "
    "data directory).")]
NoMemoryCheckOpt = Annotated[bool, typer.Option(
    "--no-memory-check", help="Skip refusing, before anything is built, a run whose plan "
    "exceeds this machine's memory.")]


class Strategy(str, Enum):
    both = "both"
    ddp = "ddp"
    fsdp = "fsdp"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


def say(msg: str) -> None:
    """A progress line on stderr (stdout is the result's)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def load_run_spec(path: Path, *, quiet: bool = False):
    """A tunepilot run spec - or a trainer's config (axolotl, LLaMA-Factory, TRL, HF
    TrainingArguments) imported on the fly, which the output says."""
    from tunepilot.integrations.importers import ImportOptions, import_config, looks_imported
    from tunepilot.integrations.importers.common import DataUnavailable
    from tunepilot.spec import load_spec

    if looks_imported(path):
        fallback = None
        try:
            result = import_config(path)
        except DataUnavailable as e:
            fallback = e
            result = import_config(path, options=ImportOptions(synthetic_data=True))
        if not quiet:
            say(f"imported {path} ({result.source} config) as a tunepilot spec"
                + (f"; ignored: {', '.join(result.ignored)}" if result.ignored else ""))
            if fallback is not None:
                say(f"note: planned with synthetic tokens, not the config's data - "
                    f"{fallback.message} Run `tunepilot import {path} --tokenizer DIR` to "
                    "profile the data.")
        return result.spec
    return load_spec(path)


def out_dir(out: Path | None, spec) -> Path:
    from tunepilot.store import default_run_dir

    return out if out is not None else default_run_dir(spec)
