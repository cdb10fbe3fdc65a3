"""The command line as a user meets it: usage errors, --version, prompt exits - exit codes and
one paragraph, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("tunepilot")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,field,words", [
    (("report", "--from", "x"), "--from", ["`tunepilot report` has no option --from",
                                           "Its options:"]),
    (("plan",), "spec", ["`tunepilot plan` needs SPEC", "Example: tunepilot plan "]),
    (("nosuch",), "command", ["`tunepilot` has no command 'nosuch'",
                              "Its commands: plan, pilot, restore"]),
    (("pln",), "command", ["Did you mean plan?"]),
    (("quote", "examples/tiny.yaml", "--card", "h100", "--count", "two"), "--count",
     ["'two' is not valid: input should be a valid integer", "How many cards",
      "See `tunepilot quote --help`"]),
    (("plan", "examples/tiny.yaml", "--headroom", "2"), "--headroom",
     ["'2' is not valid: input should be less than or equal to 0.9",
      "Fraction of card memory to keep free"]),
    (("plan", "examples/tiny.yaml", "--hedroom", "0.2"), "--hedroom",
     ["Did you mean --headroom?"]),
    (("quote", "examples/tiny.yaml"), "--card", ["`tunepilot quote` needs --card"]),
])
def test_usage_errors_are_one_paragraph_with_the_field_and_the_fix(args, field, words):
    """Typer's own errors (`Error: Invalid value for '--headroom'` under a usage block) take
    tunepilot's form: `error: FIELD: what was wrong. The fix.`, exit 2, no traceback. (In this
    process: a traceback is raised here; test_help_lists_... runs the console script.)"""
    from support.cli import run_cli

    code, _, err = run_cli(*args)
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith(f"error: {field}: "), line
    for w in words:
        assert w in line, line
    assert "Usage:" not in err
    code, out, _ = run_cli(*args, "--json")
    assert code == 2 and json.loads(out)["field"] == field


def test_help_lists_the_stages_in_order_then_the_tools_with_uncut_summaries():
    proc = _cli("--help")
    assert proc.returncode == 0
    text = proc.stdout
    stages = text[text.index("Stages, in the order a run takes them:"):text.index("Tools:")]
    names = [line.split()[0] for line in stages.splitlines()[1:]
             if line.startswith("  ") and not line.startswith("    ")]
    assert names == ["plan", "pilot", "restore", "scale", "quote", "book", "run", "demo"]
    tools = text[text.index("Tools:"):]
    for name in ("compare", "data", "import", "catalog", "launch", "ledger", "watch", "verify"):
        assert f"\n  {name} " in tools
    assert "..." not in text.split("Stages,")[1]  # click cut summaries at ~45 characters
    from tunepilot.cli import app
    from tunepilot.cli.usage import STAGES, TOOLS, _command_name

    registered = {_command_name(c) for c in app.registered_commands} | {
        g.name for g in app.registered_groups}
    assert registered == set(STAGES) | set(TOOLS)  # every command has its line, no stale one


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tunepilot ")


@pytest.mark.slow
def test_a_command_leaves_at_once_after_its_last_output():
    """The console script skips the interpreter's teardown (2-4 s with torch loaded): nothing
    registered to run at exit runs, and the output is complete. (How long the command takes
    is benchmarks/timing_targets.py's.)"""
    code = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('TEARDOWN')); "
            "from tunepilot.cli import console_main; "
            "sys.argv = ['tunepilot', 'plan', sys.argv[1], '--json']; console_main()")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "tiny.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fidelity"] == "analytic"  # flushed before leaving
    assert "TEARDOWN" not in proc.stderr


def test_progress_lines_keep_coming_through_one_long_silent_call():
    import io

    from tunepilot.views.progress import _Lines

    out = io.StringIO()
    with _Lines("pilot", out, every_s=0.1) as lines:
        lines("load model", 0, None)
        time.sleep(0.6)  # a model build: nobody calls back for a while
    text = out.getvalue().splitlines()
    assert text[0].startswith("pilot [") and text[0].endswith("load model")
    assert sum(line.endswith("load model (still running)") for line in text) >= 3


def test_a_counted_phase_says_how_far_how_fast_and_what_is_left(capsys, monkeypatch):
    """The demo's 'measure steps' off a terminal: the heartbeat carries the step count, the
    last step's time and the estimate of what is left - not only '(still running)'."""
    from tunepilot.views.progress import messages

    monkeypatch.setenv("TUNEPILOT_PROGRESS_EVERY_S", "0.1")
    with messages("run") as say:
        say("pilot: real training steps on this machine's device")
        for i in range(4):
            say("pilot: measure steps", i, 20)
            time.sleep(0.05)
        time.sleep(0.6)  # a long step: nobody calls back for a while
    lines = capsys.readouterr().err.splitlines()
    beats = [x for x in lines if "measure steps" in x and x.endswith("(still running)")]
    assert beats, lines
    last = beats[-1]
    assert "measure steps 3/20" in last and "each" in last and "left at this pace" in last


def test_the_time_left_is_the_steps_left_at_the_pace_so_far():
    """The estimate's arithmetic on a given clock (the test above runs on the real one, whose
    pace a loaded machine stretches): 17 steps left at 0.05 s each is about 0.85 s."""
    from tunepilot.views.progress import _Pace

    pace = _Pace(0.0)
    for i in range(4):
        pace.update(0.10 + 0.05 * i, i)
    words = pace.words(20, 0.30)
    assert words.startswith(" 3/20 (last 0.05 s each") and "about 0.85 s left" in words


@pytest.mark.slow
def test_restore_off_a_terminal_says_what_it_does_and_that_it_is_alive(tmp_path):
    import os

    env = {**os.environ, "TUNEPILOT_PROGRESS_EVERY_S": "1"}
    proc = subprocess.run([str(EXE), "restore", str(ROOT / "examples" / "tiny.yaml"),
                           "--steps-before", "2", "--steps-after", "2", "--out",
                           str(tmp_path / "r"), "--json"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert any("restore [" in x and "original: build the model" in x for x in lines)
    assert any("fresh process: load the checkpoint" in x for x in lines)
    assert any(x.endswith("(still running)") for x in lines), proc.stderr
    assert proc.stdout.lstrip().startswith("{")  # stdout stays the JSON result


@pytest.mark.slow
def test_report_refuses_a_checkpoint_directory_and_writes_nothing_into_it(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-4"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    proc = _cli("report", str(ckpt))
    assert proc.returncode == 2 and "is a checkpoint directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "model"]


@pytest.mark.slow
@pytest.mark.parametrize("content", ["{broken", '{"schema_version": 1, "fits": "yes"}', ""])
def test_plan_calibrate_on_a_malformed_pilot_json_names_it(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pilot.json").write_text(content)
    proc = _cli("plan", str(ROOT / "examples" / "tiny.yaml"), "--calibrate", str(run))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--calibrate" in proc.stderr and "pilot.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", ["pilot", "run", "plan-out"])
def test_a_read_only_out_directory_is_one_message_not_a_traceback(tmp_path, command):
    from tests.support.full_disk import available, run_on_full_disk

    if not available():
        pytest.skip("mounting a read-only tmpfs needs root / CAP_SYS_ADMIN")
    spec = str(ROOT / "examples" / "tiny.yaml")
    target = tmp_path / "ro" / "x"
    args = {"pilot": ["pilot", spec, "--out", str(target)],
            "run": ["run", spec, "--out", str(target)],
            "plan-out": ["import", str(ROOT / "tests" / "fixtures" / "configs" / "trl-sft.yaml"),
                         "--data", "synthetic", "--out", str(target / "spec.yaml")]}[command]
    proc = run_on_full_disk(tmp_path / "ro", 64, [str(EXE), *args], readonly=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Read-only file system" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [
    ("plan", "examples/tiny.yaml", "--json"),
    pytest.param(("quote", "examples/tiny.yaml", "--card", "h100", "--json"),
                 marks=pytest.mark.slow),
    pytest.param(("book", "--card", "h100", "--count", "1", "--hours", "1", "--start",
                  "2031-01-01T00:00Z", "--json"), marks=pytest.mark.slow),
    ("--help",),
])
def test_the_fast_paths_import_no_rich_no_torch_and_build_one_command(tmp_path, args):
    """What `plan`, `quote`, `book` and `--help` start with (issue 40 item 14; the seconds are
    benchmarks/plan_speed.py's): rich only when a person reads a table, never torch, and typer
    builds the command invoked, not all 24 (a signature parse each)."""
    argv = [*args, "--db", str(tmp_path / "l.db")] if args[0] == "book" else list(args)
    code = ("import sys\n"
            "import typer.main as tm\n"
            "built = []\n"
            "real = tm.get_command_from_info\n"
            "tm.get_command_from_info = lambda *a, **k: built.append(1) or real(*a, **k)\n"
            "from tunepilot.cli import main\n"
            f"sys.argv = ['tunepilot', *{argv!r}]\n"
            "try:\n"
            "    main()\n"
            "finally:\n"
            "    heavy = sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'torch'})\n"
            "    sys.stderr.write(f'HEAVY={heavy} BUILT={len(built)}\\n')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("HEAVY="))
    assert line.startswith("HEAVY=[] "), line
    built = int(line.split("BUILT=")[1])
    assert built == (24 if args == ("--help",) else 1), line


def test_the_shipped_catalog_is_read_once_per_process():
    """The time model's fit asks for the catalog once per published run (156 reads of 4 ms a
    quote): the shipped one is validated once while its file is unchanged."""
    from tunepilot.catalog import load_catalog

    assert load_catalog() is load_catalog()
    assert load_catalog().get("h100").id == "h100-sxm-80gb"
