"""The command line as a user meets it: usage errors, --version, prompt exits - exit codes and
one paragraph, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("tunepilot")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,words", [
    (("report", "--from", "x"), "No such option: --from"),
    (("plan",), "Missing argument"),
    (("nosuch",), "No such command"),
    (("quote", "examples/tiny.yaml", "--card", "h100", "--count", "two"), "Invalid value for '--count'"),
])
def test_usage_errors_exit_2_with_the_usage_line_and_no_traceback(args, words):
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Usage:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tunepilot ")


def test_a_command_exits_promptly_after_its_last_output():
    t = time.perf_counter()
    proc = _cli("plan", str(ROOT / "examples" / "tiny.yaml"), "--json")
    assert proc.returncode == 0
    assert time.perf_counter() - t < 10  # was 2-4 s of interpreter teardown after the output


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
    left = float(last.split("about ")[1].split(" s left")[0])
    assert 0.5 < left < 3  # 17 steps at about 0.05 s each


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


def test_report_refuses_a_checkpoint_directory_and_writes_nothing_into_it(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-4"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    proc = _cli("report", str(ckpt))
    assert proc.returncode == 2 and "is a checkpoint directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "model"]


@pytest.mark.parametrize("content", ["{broken", '{"schema_version": 1, "fits": "yes"}', ""])
def test_plan_calibrate_on_a_malformed_pilot_json_names_it(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pilot.json").write_text(content)
    proc = _cli("plan", str(ROOT / "examples" / "tiny.yaml"), "--calibrate", str(run))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--calibrate" in proc.stderr and "pilot.json" in proc.stderr
    assert "Traceback" not in proc.stderr


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
