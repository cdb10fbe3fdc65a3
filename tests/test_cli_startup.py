"""The command line's start-up shortcuts give what typer itself gives: a plain value coerced
without a pydantic TypeAdapter equals typer's own coercion of it, every other value goes to
typer (its result and its error message), and the root --help lists every command as typer
would list it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
import typer

core = pytest.importorskip("typer.core")
if not hasattr(core, "_TyperParameter"):
    pytest.skip("this typer has no runtime-coercion layer to shortcut", allow_module_level=True)

from typer._coercion import build_runtime_param  # noqa: E402

from tunepilot.cli import startup  # noqa: E402

demo = typer.Typer()


@demo.command()
def cmd(
    spec: Annotated[Path, typer.Argument()],
    name: Annotated[str, typer.Option()] = "x",
    count: Annotated[int, typer.Option()] = 1,
    ratio: Annotated[float, typer.Option(min=0.0, max=0.9)] = 0.1,
    clamped: Annotated[int, typer.Option(min=0, max=5, clamp=True)] = 0,
    tags: Annotated[list[str] | None, typer.Option()] = None,
    where: Annotated[Path | None, typer.Option()] = None,
    flag: Annotated[bool, typer.Option()] = False,
) -> None:
    """A command with one parameter of each plain kind."""


def _params() -> dict[str, object]:
    command = typer.main.get_command(demo)
    return {p.name: p for p in command.params}, typer.main._click.Context(command)


def _typer(param, value, ctx):
    """typer's own coercion: its result, or its error message."""
    try:
        return "ok", build_runtime_param(param.type_descriptor).coerce(value, param=param,
                                                                       ctx=ctx)
    except Exception as exc:  # BadParameter and friends: their message
        return "error", str(exc)


@pytest.mark.parametrize("name,value", [
    ("spec", "examples/tiny.yaml"), ("spec", "."), ("spec", "no/such/file.yaml"), ("spec", ""),
    ("name", "h100"), ("name", None), ("name", ""),
    ("count", "1"), ("count", "007"), ("count", "-3"), ("count", 1), ("count", "two"),
    ("count", "1.0"), ("count", " 5"), ("count", "1_0"), ("count", True),
    ("ratio", "0.2"), ("ratio", "0.9"), ("ratio", "2"), ("ratio", "-0.1"), ("ratio", 0.1),
    ("ratio", "1e-1"), ("ratio", "nan"), ("ratio", 0),
    ("clamped", "9"), ("clamped", "3"),
    ("tags", None), ("tags", ("a", "b")), ("tags", ()), ("tags", "a"),
    ("where", None), ("where", "/"), ("where", "x.sqlite3"),
    ("flag", None), ("flag", "yes"),
])
def test_a_value_coerced_at_start_up_is_what_typer_gives(name, value):
    params, ctx = _params()
    param = params[name]
    expected = _typer(param, value, ctx)
    original = core._TyperParameter.get_runtime_param
    try:
        startup.prepare()
        param._runtime_param = None
        try:
            got = "ok", param.get_runtime_param().coerce(value, param=param, ctx=ctx)
        except Exception as exc:
            got = "error", str(exc)
    finally:
        core._TyperParameter.get_runtime_param = original
    assert got == expected
    assert type(got[1]) is type(expected[1])


def test_a_plain_value_needs_no_type_adapter_and_another_hands_over_to_typer():
    params, ctx = _params()
    quick = startup._Quick(lambda p: pytest.fail("typer's coercion built"), None)
    assert quick.coerce("3", param=params["count"], ctx=ctx) == 3
    assert quick.coerce(None, param=params["tags"], ctx=ctx) == ()
    assert startup._plain("two", params["count"]) is startup._SLOW
    assert startup._plain("9", params["clamped"]) is startup._SLOW  # typer clamps it


def test_the_root_help_lists_every_command_as_typer_does():
    """`tunepilot --help` lists commands built without their parameters; the listing (names,
    summaries, order, hidden ones left out) is the one the full app gives."""
    from typer.testing import CliRunner

    from tunepilot.cli import app
    from tunepilot.cli.usage import _listed

    runner = CliRunner()
    full = runner.invoke(app, ["--help"])
    listed = runner.invoke(_listed(app), ["--help"])
    assert full.exit_code == listed.exit_code == 0
    assert listed.output == full.output
    assert "Stages, in the order a run takes them" in listed.output


def _fresh(code: str) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PATH": "", "PYDANTIC_DISABLE_PLUGINS": "__all__"}
                          ).stdout.strip()


def test_with_plugins_off_pydantic_validates_without_plugin_discovery():
    """The stand-in for pydantic's plugin loader returns no plugins, as the real one does with
    PYDANTIC_DISABLE_PLUGINS=__all__, without importing importlib.metadata; a name the
    stand-in does not have is the real loader's."""
    out = _fresh(
        "import sys\n"
        "from tunepilot.cli.startup import prepare\n"
        "prepare()\n"
        "from pydantic import BaseModel\n"
        "class M(BaseModel):\n"
        "    x: int\n"
        "print(M(x='3').x, 'importlib.metadata' in sys.modules)\n"
        "import pydantic.plugin._loader as loader\n"
        "print(tuple(loader.get_plugins()), loader.PYDANTIC_ENTRY_POINT_GROUP)\n")
    assert out.splitlines() == ["3 False", "() pydantic"]


def test_the_ledger_reads_the_billing_terms_without_the_quote():
    """`book` imports the ledger, whose billing terms live in tunepilot.cost: the package
    re-exports nothing, so the quote (the plan, every stage result) is not loaded with it."""
    out = _fresh("import sys\nimport tunepilot.ledger.api\n"
                 "print(sorted(m for m in sys.modules if m.startswith(('tunepilot.cost.', "
                 "'tunepilot.results.pilot', 'tunepilot.plan.'))))")
    assert out == "['tunepilot.cost.terms']"
