"""What every command shares: option types, loading a spec (or importing a trainer's config on
the fly), the run directory default, and the one ending ``show(result, as_json, view)``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["CatalogOpt", "DbOpt", "DaysOpt", "FromOpt", "HoursOpt", "JsonOpt", "OptionOpt",
           "OutOpt", "SpecArg", "emit_json", "load_run_spec", "out_dir", "say", "show",
           "show_committed", "view"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
CatalogOpt = Annotated[Path | None, typer.Option(
    "--catalog", help="A catalog YAML that overrides or adds cards (only the keys it changes); "
    "e.g. one written by `tunepilot catalog import`.")]
SpecArg = Annotated[Path, typer.Argument(
    help="The run spec (YAML), e.g. examples/llama3-8b-lora.yaml - or a trainer's config "
    "(axolotl, LLaMA-Factory, TRL, TrainingArguments, LitGPT), imported on the fly.")]
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


def emit_json(data: object) -> None:
    """Write JSON to stdout (the only thing a --json command prints there)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def show(result: Any, as_json: bool, view: Callable[[Any], None] | None = None) -> None:
    """The end of every command: the result as JSON for machines, or the view for people (the
    view imports rich; a --json command never does)."""
    if as_json or view is None:
        emit_json(result.to_dict() if hasattr(result, "to_dict") else
                  [r.to_dict() if hasattr(r, "to_dict") else r for r in result]
                  if isinstance(result, list) else result)
        return
    view(result)


def show_committed(result: Any, as_json: bool, view: Callable[[Any], None], done: str) -> None:
    """The end of a command whose change is already committed (a booking, a cancellation): the
    reply, as show() writes it - and when stdout cannot take it (closed, a broken pipe) the
    change is not undone and the exit stays 0: ``done`` (what was committed, with its id) goes
    to stderr instead, so a script that retries on failure does not book twice."""
    try:
        if sys.stdout is None:
            raise OSError("stdout is closed")
        try:
            show(result, as_json, view)
        except SystemExit:  # rich's Console.on_broken_pipe: stdout went to devnull, exit 1
            raise BrokenPipeError("broken pipe") from None
        sys.stdout.flush()
    except (OSError, ValueError) as exc:  # EPIPE, EBADF; ValueError: a closed file object
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.write(f"{done} (committed; the reply could not be written to stdout: "
                             f"{exc}) - do not run it again\n")
            sys.stderr.flush()
        with contextlib.suppress(OSError, ValueError):  # nothing more goes to a broken stdout
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until the process ends


def view(name: str, *args: Any) -> Callable[[Any], None]:
    """The view ``name`` ("ledger.render_booking" in tunepilot.views), imported only when a
    person reads the result: a --json command never imports rich."""
    def render(result: Any) -> None:
        import importlib

        module, func = name.rsplit(".", 1)
        getattr(importlib.import_module(f"tunepilot.views.{module}"), func)(result, *args)

    return render


def say(msg: str) -> None:
    """A progress line on stderr (stdout is the result's)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def load_run_spec(path: Path, *, quiet: bool = False):
    """A tunepilot run spec - or a trainer's config (axolotl, LLaMA-Factory, TRL, HF
    TrainingArguments) imported on the fly, which the output says."""
    from tunepilot.spec import spec_from_dict
    from tunepilot.spec.yaml_input import read_yaml_mapping

    raw = read_yaml_mapping(path)  # every problem of the file a SpecError naming it
    if isinstance(raw.get("model"), dict):  # a tunepilot spec (model: {preset|config}): read once
        return spec_from_dict(raw, source=path.name)
    from tunepilot.integrations.importers import ImportOptions, import_config, looks_imported
    from tunepilot.integrations.importers.common import DataUnavailable

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
    return spec_from_dict(raw, source=path.name)


def out_dir(out: Path | None, spec) -> Path:
    from tunepilot.store import default_run_dir

    return out if out is not None else default_run_dir(spec)
