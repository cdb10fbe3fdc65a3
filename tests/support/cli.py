"""The real command line, run in this process: (exit code, stdout, stderr). A traceback (an
exception that escaped the CLI's own error handling) is raised, so a test that meets one fails
with it."""

from __future__ import annotations

import contextlib
import io
import sys


def run_cli(*args: str) -> tuple[int, str, str]:
    from tunepilot.cli import main

    old = sys.argv
    sys.argv = ["tunepilot", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(hard_exit=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, out.getvalue(), err.getvalue()
    finally:
        sys.argv = old
    return 0, out.getvalue(), err.getvalue()
