"""A unit test asserts behaviour, never a wall or CPU time: on a shared 2-core machine a time
bound fails for the load, not the code (issue 40 item 15). Speed targets live in benchmarks/
(plan_speed.py, timing_targets.py), which print their ratios. This reads every test's source
and refuses an assert that reads a clock - directly, or through a name bound from one."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time",
          "process_time_ns", "thread_time", "getrusage", "time"}


def _is_clock(node: ast.AST) -> bool:
    """time.perf_counter() and friends, resource.getrusage(...)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr in CLOCKS and isinstance(node.func.value, ast.Name) and \
        node.func.value.id in {"time", "resource"}


def _timing_asserts(tree: ast.AST) -> list[int]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        clocked: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(_is_clock(n) for n in ast.walk(node.value)):
                clocked |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assert):
                continue
            reads = list(ast.walk(node.test))
            if any(_is_clock(n) for n in reads) or \
                    any(isinstance(n, ast.Name) and n.id in clocked for n in reads):
                found.append(node.lineno)
    return found


def test_no_unit_test_asserts_a_wall_or_cpu_time():
    offenders = {f"{p.name}:{line}" for p in sorted(TESTS.glob("test_*.py"))
                 for line in _timing_asserts(ast.parse(p.read_text(encoding="utf-8")))}
    assert not offenders, f"timing assertions belong in benchmarks/: {sorted(offenders)}"


def test_the_check_finds_the_kinds_it_refuses():
    caught = ast.parse("import time\n"
                       "def test_a():\n    t = time.perf_counter()\n    f()\n"
                       "    took = time.perf_counter() - t\n    assert took < 15\n"
                       "def test_b():\n    t = time.monotonic()\n    assert time.monotonic() - t < 5\n"
                       "def test_c():\n    deadline = time.monotonic() + 30\n"
                       "    while time.monotonic() < deadline:\n        pass\n"
                       "    assert done()\n")
    assert _timing_asserts(caught) == [6, 9]  # a poll's deadline is not an assertion of time
