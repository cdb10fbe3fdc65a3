"""Faults for child processes, plugged in with TUNEPILOT_CHILD_HOOK=support.faults:NAME."""

from __future__ import annotations

import os
import sys
import time


def abort() -> None:
    """What a C++ abort inside PyTorch looks like to the parent."""
    os.abort()


def crash_rank_1() -> None:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 fails on purpose (test fault hook)")


def hang_rank_1() -> None:
    if os.environ.get("RANK") == "1":
        print("[tunepilot rank 1] init hanging on purpose (test fault hook)", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(3600)


def raise_value_error() -> None:
    """The child fails with an ordinary Python error (a bug, or a library refusing the step)."""
    raise ValueError("a library refused the step (test fault)")


def crash_rank_1_under_ddp() -> None:
    """Rank 1 of a DDP scaling launch fails; the baseline and FSDP run on (the job file is the
    rank's last argument)."""
    if os.environ.get("RANK") != "1" or not sys.argv[-1].endswith(".json"):
        return
    import json
    from pathlib import Path

    if json.loads(Path(sys.argv[-1]).read_text()).get("strategy") == "ddp":
        raise RuntimeError("rank 1 fails on purpose under ddp (test fault hook)")
