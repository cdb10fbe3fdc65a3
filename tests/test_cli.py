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
