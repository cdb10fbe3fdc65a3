"""The lowest version pyproject.toml states of torch ([tool.tunepilot] torch-floor), transformers
and peft (the [torch] extra), as pip requirements pinned to that floor
(`torch==2.13 transformers==4.56.0 ...`): what
`make floor` installs, so the floors CI tests are the ones pyproject states.

    python scripts/floors.py            # prints the pins, space-separated
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
FLOORED = ("torch", "transformers", "peft")


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """package -> the version after its '>=' in the [torch] extra; torch's from [tool.tunepilot]
    torch-floor (torch is no requirement: the user's own build must keep working)."""
    doc = tomllib.loads(pyproject.read_text())
    extra = doc["project"]["optional-dependencies"]["torch"]
    out = {"torch": doc["tool"]["tunepilot"]["torch-floor"]}
    for req in extra:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*(,.*)?", req)
        if m and m.group(1).lower() in FLOORED:
            out[m.group(1).lower()] = m.group(2)
    missing = [p for p in FLOORED if p not in out]
    if missing:
        raise SystemExit(f"pyproject.toml's [torch] extra names no '>=' floor for {missing}")
    return out


if __name__ == "__main__":
    sys.stdout.write(" ".join(f"{p}=={v}" for p, v in floors().items()) + "\n")
