"""How the command line presents itself: `tunepilot --help` lists the commands in the order a
run takes its stages, each with a one-line summary that is never cut; only the command invoked
is built (start-up); and click's usage errors (an unknown option, a value out of range, a
missing argument) come out in tunepilot's one-paragraph form - the field, what was wrong, the
fix - with exit code 2, like every other bad input.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import re
from typing import Any

import typer
from typer.core import TyperGroup

from tunepilot.errors import UserError

# The stages, in the order `run` takes them, then the tools; one line each for --help (the
# command's docstring is its full help).
STAGES = {
    "plan": "Memory one device needs, component by component, and the fit on each card.",
    "pilot": "Real training steps on this machine: does it fit, step time, memory.",
    "restore": "Prove a checkpoint resumes the run exactly, in a fresh process.",
    "scale": "Scaling test on torchrun: 1 rank vs N ranks with DDP and FSDP.",
    "quote": "Time and itemised cost on COUNT x CARD, and the cost per useful token.",
    "book": "Allocate cards from the inventory for a term.",
    "run": "The staged pilot: plan, pilot, restore, scale, quote, then a decision.",
    "demo": "The whole staged pilot on this CPU with the shipped tiny model.",
}
TOOLS = {
    "compare": "Every card x count that fits, ranked by cost per useful token.",
    "data": "Profile the dataset: tokens, lengths, truncation, padding.",
    "presets": "The shipped model presets with their parameter counts.",
    "cards": "The catalog's cards with their datasheet figures and prices.",
    "watch": "Run any training command and measure its whole process tree.",
    "verify": "Check a checkpoint without a spec: manifest, digests, a fresh load.",
    "export": "Copy a run's artifacts off the machine and verify every file.",
    "report": "Write RUN_DIR/report.html and report.md.",
    "bookings": "List the ledger's bookings.",
    "cancel": "Cancel a booking per its card's cancellation policy.",
    "invoice": "A booking's invoice: line items and total in cents.",
    "usage": "Record the hours a booking was actually used.",
    "ledger": "Spend by card and month.",
    "import": "Read a trainer's config (axolotl, LLaMA-Factory, TRL) as a spec.",
    "catalog": "Catalogs of cards and prices: catalog import.",
    "launch": "Write (and --submit) a SkyPilot task or a Slurm batch script.",
}


class Commands(TyperGroup):
    """The root group: commands in stage order, listed in two sections, summaries uncut."""

    def list_commands(self, ctx: Any) -> list[str]:
        known = [n for n in (*STAGES, *TOOLS) if n in self.commands]
        return known + [n for n in self.commands if n not in known]

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        names = [n for n in self.list_commands(ctx) if not self.commands[n].hidden]
        for title, table in (("Stages, in the order a run takes them", STAGES),
                             ("Tools", None)):
            rows = [(n, (table or TOOLS).get(n) or _first_sentence(self.commands[n].help))
                    for n in names if (n in STAGES) == (table is not None)]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    return re.split(r"(?<=[.;:])\s", text, maxsplit=1)[0]


def _command_name(info: Any) -> str | None:
    if info.name:
        return info.name
    callback = getattr(info, "callback", None)
    return callback.__name__.lower().replace("_", "-") if callback else None


def only_invoked(app: typer.Typer, argv: list[str]) -> typer.Typer:
    """``app`` with only the command ``argv`` invokes: typer builds every command's parameters
    from its signature before it runs one (24 commands, tens of ms of start-up). With no
    command (--help, --version, nothing), ``app`` listed only: each command's name, help and
    hidden flag, none of its parameters. ``app`` itself for a name it does not know (whose
    message lists all)."""
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is None:
        return _listed(app)
    commands = [c for c in app.registered_commands if _command_name(c) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    one = copy.copy(app)
    one.registered_commands, one.registered_groups = commands, groups
    return one


def _listed(app: typer.Typer) -> typer.Typer:
    """``app`` for its own help: every command as it is listed (name, help, hidden) with a
    callback of no parameters, which never runs - no command is invoked without a name."""
    listed = copy.copy(app)
    listed.registered_commands = [_listed_command(c) for c in app.registered_commands]
    return listed


def _listed_command(info: Any) -> Any:
    listed = copy.copy(info)
    listed.name = _command_name(info)
    if listed.help is None and info.callback is not None:
        listed.help = inspect.getdoc(info.callback)
    listed.callback = _not_invoked
    return listed


def _not_invoked() -> None:
    raise RuntimeError("a command listed for --help was invoked")


def usage_error(exc: Exception) -> UserError:
    """click's usage error as tunepilot's paragraph: the option or argument, what was wrong, and
    the fix (the option's own help, the command's example, the names it knows)."""
    ctx = getattr(exc, "ctx", None)
    command = _path(ctx)
    see = f"See `{command} --help`."
    kind = type(exc).__name__
    param = getattr(exc, "param", None)
    if kind == "MissingParameter" and param is not None:
        field = _param_name(param)
        shown = field if field.startswith("-") else field.upper()
        example = _example(ctx)
        return UserError(field, f"`{command}` needs {shown}{_param_help(param, ' (', ')')}.",
                         f"Example: {example}" if example else see)
    if kind == "BadParameter" and param is not None:
        field = _param_name(param)
        given = _given(field)
        what = _sentence(getattr(exc, "message", str(exc)))
        return UserError(field, (f"{given!r} is not valid: " if given is not None else "")
                         + what, _param_help(param, "", ". ") + see)
    if kind == "NoSuchOption":
        option = getattr(exc, "option_name", "option")
        known = _options(ctx)
        close = difflib.get_close_matches(option, known, n=2, cutoff=0.5)
        guess = f"Did you mean {' or '.join(close)}? " if close else ""
        return UserError(option, f"`{command}` has no option {option}.",
                         f"{guess}Its options: {', '.join(known)}. {see}")
    raw = str(getattr(exc, "message", exc))
    unknown = re.match(r"No such command '(.+?)'", raw)
    if unknown:
        names = list(ctx.command.list_commands(ctx)) if ctx is not None else [*STAGES, *TOOLS]
        close = difflib.get_close_matches(unknown[1], names, n=2, cutoff=0.6)
        guess = f"Did you mean {' or '.join(close)}? " if close else ""
        return UserError("command", f"`{command}` has no command {unknown[1]!r}.",
                         f"{guess}Its commands: {', '.join(names)}. {see}")
    message = _sentence(raw)
    option = getattr(exc, "option_name", None)
    return UserError(option or command, message, see)


def _path(ctx: Any) -> str:
    """'tunepilot plan': the command the error is about (from the command line when click
    raised it before making the command's context)."""
    if ctx is None:
        import sys

        name = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        return f"tunepilot {name}" if name in (*STAGES, *TOOLS) else "tunepilot"
    names = []
    while ctx is not None and ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    return " ".join(["tunepilot", *names])


def _param_name(param: Any) -> str:
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return opts[0] if opts else (param.name or "argument")


def _param_help(param: Any, before: str, after: str) -> str:
    text = " ".join((getattr(param, "help", None) or "").split()).rstrip(".")
    return f"{before}{text}{after}" if text else ""


def _given(option: str) -> str | None:
    """The value the user gave ``option`` on the command line, if it can be told."""
    import sys

    args = sys.argv[1:]
    for i, a in enumerate(args):
        if a == option and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(option + "="):
            return a[len(option) + 1:]
    return None


def _sentence(text: str) -> str:
    text = " ".join(str(text).split()).rstrip(".")
    return (text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text) + "."


def _options(ctx: Any) -> list[str]:
    if ctx is None:
        return []
    return [o for p in ctx.command.params for o in getattr(p, "opts", []) if o.startswith("--")]


def _example(ctx: Any) -> str | None:
    text = " ".join(((ctx.command.help if ctx is not None else None) or "").split())
    found = re.search(r"Example: (.+?)(?: Example:|$)", text)
    return found[1].strip() if found else None
