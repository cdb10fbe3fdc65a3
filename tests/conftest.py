"""Child processes the tests start (the trace, the restore proof's fresh process, torchrun
ranks) can import tests/support: the hooks the tests plug faults into live there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
# the tokenized-dataset cache of the tests' own (never the user's ~/.cache)
os.environ.setdefault("TUNEPILOT_CACHE", tempfile.mkdtemp(prefix="tunepilot-cache-"))
