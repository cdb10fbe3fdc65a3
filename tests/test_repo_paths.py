"""The repository names no path of the machine it was written on: a source, a comment or a doc
that cites a file under the work, root, home or Users directories of one machine points at a file
nobody else has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the machine roots, spelt so that this file does not match itself
ROOTS = ("work", "root", "home", "Users")
PATTERN = re.compile(r"(?<![\w.~-])/(?:" + "|".join(ROOTS) + r")/[\w.-]")


def _tracked() -> list[Path]:
    """Files git tracks (a plain clone's files); every file under the root when git is absent."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", "runs"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def test_no_tracked_file_names_a_path_of_this_machine():
    found = []
    for path in _tracked():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        for n, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine in the repository:\n" + "\n".join(found)


def test_the_pattern_catches_a_machine_path_and_leaves_urls_alone():
    assert PATTERN.search("source: /" + "work/research/gpu/gpu_check.json")
    assert PATTERN.search("see /" + "Users/me/x.csv")
    assert not PATTERN.search("https://github.com/org/" + "work/blob/x")  # a URL's path part
    assert not PATTERN.search("benchmarks/data/h200_gpu_check.yaml")
