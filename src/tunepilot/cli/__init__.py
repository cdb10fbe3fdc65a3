"""The `tunepilot` command line: a shell over the library. Each command parses its flags, calls
one library function and ends with ``show(result, as_json, view)``; ``main`` maps errors to exit
codes (bad input 2, a failed gate or run 1, no capacity 3) - never a traceback.

One module per family of commands: plan (plan, presets, cards), pilot (pilot, watch), restore
(restore, verify, export), scale, cost (quote, compare), ledger (book, bookings, ...), run (run,
demo, report), data (data), tools (import, catalog import, launch). Heavy imports (torch,
transformers) happen inside the commands that need them, so `plan`, `quote` and `book` start
fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys

import typer

from tunepilot.cli.usage import Commands, only_invoked, usage_error
from tunepilot.errors import TunepilotError, UserError

app = typer.Typer(
    name="tunepilot",
    help="Which accelerator, how many, for how long, and what each useful trained token costs - "
    "measured before the term is booked.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=Commands,
)


def _version(value: bool) -> None:
    if value:
        from tunepilot.pilot.provenance import tunepilot_version

        sys.stdout.write(f"tunepilot {tunepilot_version()}\n")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                       callback=_version, is_eager=True)) -> None:
    """Which accelerator, how many, for how long, and what each useful trained token costs."""


from tunepilot.cli import cost, data, ledger, pilot, plan, restore, run, scale, tools  # noqa: E402,F401


def console_main() -> None:
    """The `tunepilot` console script: main, then leave at once after the last output (no
    seconds of interpreter teardown of torch and friends)."""
    main(hard_exit=True)


def main(*, hard_exit: bool = False) -> None:
    """Run the command line: user errors exit 2 with one paragraph, never a traceback. Usage
    errors (unknown option, missing argument) are click's: exit 2 with the usage line."""
    from tunepilot.cli.startup import prepare
    from tunepilot.proc.child import Terminated, raise_on_terminate

    # tunepilot's models are its own: no pydantic plugin observes them, and looking for one
    # (every installed package's entry points) costs 20-30 ms of start-up
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # tunepilot never downloads: models come from shipped configs, data and tokenizers from disk
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    raise_on_terminate()
    prepare()  # start-up: plain values without pydantic adapters, package metadata on use
    code = 0
    try:
        rv = only_invoked(app, sys.argv[1:])(standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except UserError as exc:
        code = _fail(exc, exc.exit_code)
    except TunepilotError as exc:
        code = _fail(exc, exc.exit_code)
    except sqlite3.DatabaseError as exc:  # met while reading a ledger (damaged pages, I/O)
        from tunepilot.ledger.db import db_error

        code = _fail(db_error(exc, None), 2)
    except OSError as exc:  # the filesystem refused: a read-only or full disk, a permission
        code = _fail(_os_error(exc), 2)
    except (KeyboardInterrupt, Terminated) as exc:
        sys.stderr.write("interrupted\n" if isinstance(exc, KeyboardInterrupt) else f"{exc}\n")
        code = 130 if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
    except Exception as exc:  # click's usage errors and aborts
        code = _click_error(exc)
    _exit(code, hard_exit)


def _os_error(exc: OSError) -> UserError:
    """One paragraph for an OSError no command caught: the path, what the system said, the fix."""
    from tunepilot.errors import os_error_kind

    where = repr(exc.filename) if exc.filename else "a file"
    fix = {"full": "Free disk space there or choose another --out; nothing already written "
                   "changed.",
           "unwritable": "Choose a directory you can write (--out, --db or checkpoint.dir).",
           }.get(os_error_kind(exc)[0], "Check the path and the disk.")
    return UserError("path", f"cannot use {where}: {exc.strerror or exc}.", fix)


def _click_error(exc: Exception) -> int:
    """click's (or typer's vendored click's) usage errors: tunepilot's one paragraph and exit 2
    (no arguments at all: the help)."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()
        return exc.exit_code
    if hasattr(exc, "ctx") and isinstance(getattr(exc, "exit_code", None), int):
        return _fail(usage_error(exc), exc.exit_code)
    if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
        exc.show()
        return exc.exit_code
    if type(exc).__name__ == "Abort":
        sys.stderr.write("aborted\n")
        return 1
    raise exc


def _exit(code: int, hard: bool) -> None:
    """Flush, then leave: the console script skips the interpreter's teardown (os._exit). A
    closed or broken stdout/stderr (``>&-``, ``| head``) is not a traceback: what could not be
    written is lost, the exit code stands."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    if hard:
        os._exit(code)
    sys.exit(code)


def _fail(exc: TunepilotError, code: int) -> int:
    if "--json" in sys.argv:
        payload = exc.to_dict() if hasattr(exc, "to_dict") else {
            "error": type(exc).__name__, "message": str(exc)}
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed stdout
            sys.stdout.write(json.dumps(payload, default=str) + "\n")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(f"error: {exc}\n")
    return code
