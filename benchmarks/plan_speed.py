"""Start-up: what a user waits for at `tunepilot plan examples/tiny.yaml --json` (analytic),
`quote`, `book` and `--help` - a fresh process, start-up and imports included - as CPU seconds
(user + system of the child, so another job on the machine does not add its own time), the
median of N runs, and its ratio to `python -c pass` measured in the same run (the interpreter's
own start-up on this machine: the ratio travels between machines, the seconds do not). The
commands run round-robin, so a burst of load on a shared machine falls on all of them alike.

Target: <= 0.4 s CPU each for plan (analytic), quote, book and --help (issue 40 item 14), and
<= 0.5 s for the in-process plan of llama-3.1-70b with the full fit table. Warm: Python's
bytecode already compiled (any run after the first, or an install that compiled it), in a
private bytecode cache (PYTHONPYCACHEPREFIX), so nothing is written into the source tree and an
environment with PYTHONDONTWRITEBYTECODE=1 is measured as a user's would be. Cold (plan only): an
empty cache every run, the first run after `pip install -e .` or a fresh clone. The README
quotes these figures; ``--check-readme`` says whether its words still hold (exit 1 when not).

Run:  .venv/bin/python benchmarks/plan_speed.py [--runs N] [--json] [--check-readme]
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_CPU_S = 0.4
SPEC = {"model": {"preset": "llama-3.1-70b"}, "method": {"kind": "full"},
        "precision": "bf16-mixed", "sequence_length": 4096, "micro_batch_size": 1,
        "activation_checkpointing": "full", "parallel": {"strategy": "fsdp", "devices": 8}}


def commands(db: Path) -> dict[str, list[str]]:
    """What is timed: the interpreter alone, then the four start-up paths of item 14."""
    exe = str(Path(sys.executable).with_name("tunepilot"))
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "tunepilot --help": [exe, "--help"],
        "tunepilot plan examples/tiny.yaml --json": [exe, "plan", "examples/tiny.yaml", "--json"],
        "tunepilot quote examples/tiny.yaml --card h100 --json": [
            exe, "quote", "examples/tiny.yaml", "--card", "h100", "--json"],
        "tunepilot book --card h100 --count 1 --hours 1 --json": [
            exe, "book", "--card", "h100", "--count", "1", "--hours", "1", "--db", str(db),
            "--json", "--start"],  # + a start of its own per run (the inventory is 8 cards)
    }


def _cpu_of(argv: list[str], env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def _argv(argv: list[str], i: int) -> list[str]:
    return argv + [f"2031-01-{1 + i % 28:02d}T{i // 28 % 24:02d}:00Z"] if argv[-1] == "--start" \
        else argv


def cpu_seconds(runs: int = 9) -> dict[str, list[float]]:
    """CPU seconds of each command over ``runs`` fresh processes, round-robin, warm bytecode
    (one untimed run of each first fills a private cache)."""
    with tempfile.TemporaryDirectory(prefix="tunepilot-startup-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pyc")
        cmds = commands(Path(tmp) / "ledger.sqlite3")
        for argv in cmds.values():
            _cpu_of(_argv(argv, 10_000), env)
        out: dict[str, list[float]] = {name: [] for name in cmds}
        for i in range(runs):
            for name, argv in cmds.items():
                out[name].append(_cpu_of(_argv(argv, i), env))
        return out


def cold_plan_cpu_seconds(runs: int = 3) -> list[float]:
    """`tunepilot plan examples/tiny.yaml --json` with no bytecode: an empty cache every run."""
    exe = str(Path(sys.executable).with_name("tunepilot"))
    out = []
    with tempfile.TemporaryDirectory(prefix="tunepilot-pyc-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        for i in range(runs):
            env["PYTHONPYCACHEPREFIX"] = os.path.join(cache, str(i))
            out.append(_cpu_of([exe, "plan", "examples/tiny.yaml", "--json"], env))
    return out


def in_process_ms(repeats: int = 7) -> tuple[list[float], int]:
    from tunepilot.catalog import load_catalog
    from tunepilot.plan.api import make_plan
    from tunepilot.spec import spec_from_dict

    spec = spec_from_dict(SPEC)
    catalog = load_catalog()
    make_plan(spec, catalog=catalog)  # warm caches (preset and runtime files)
    times = []
    for _ in range(repeats):
        t = time.process_time()
        plan = make_plan(spec, catalog=catalog)
        times.append((time.process_time() - t) * 1000)
    return times, len(plan.cards)


def figures(runs: int) -> dict:
    warm = cpu_seconds(runs)
    base = statistics.median(warm["python -c pass"])
    out: dict = {"runs": runs, "machine_cpus": os.cpu_count(), "load_average": os.getloadavg(),
                 "target_cpu_s": TARGET_CPU_S, "commands": {}}
    for name, values in warm.items():
        mid = statistics.median(values)
        out["commands"][name] = {
            "median_cpu_s": round(mid, 4), "min_cpu_s": round(min(values), 4),
            "ratio_to_python": round(mid / base, 1) if base > 0 else None,
            "unit": "s", "basis": "measured", "bytecode": "warm"}
    cold = cold_plan_cpu_seconds()
    out["plan_cold_cpu_s"] = {"median": round(statistics.median(cold), 3),
                              "min": round(min(cold), 3), "unit": "s", "basis": "measured",
                              "bytecode": "cold (compiled on the run)"}
    times, cards = in_process_ms()
    out["in_process_plan_ms"] = {"median": round(statistics.median(times), 1),
                                 "max": round(max(times), 1), "unit": "ms", "basis": "measured",
                                 "what": f"analytic plan, llama-3.1-70b full FSDPx8, {cards} cards "
                                         "with fit table, CPU in-process (target <= 500 ms)"}
    return out


def readme_claims() -> tuple[float, float]:
    """The README's words: `plan`'s warm CPU as a ratio to `python -c pass` (the figure that
    travels between machines and loads), and its cold CPU seconds."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    warm = re.search(r"about ([\d.]+) x `python -c pass` on the same machine", text)
    cold = re.search(r"and about ([\d.]+) s on the first run after an install", text)
    if warm is None or cold is None:
        raise SystemExit("README.md no longer states the plan's start-up in the words this "
                         "benchmark reads; update readme_claims()")
    return float(warm[1]), float(cold[1])


def main() -> None:
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 9
    f = figures(runs)
    if "--json" in sys.argv:
        print(json.dumps(f, indent=1))
    else:
        print(f"start-up, CPU s (user+sys), median of {runs} fresh processes, warm bytecode; "
              f"{f['machine_cpus']} CPUs, load {f['load_average'][0]:.1f} (measured)")
        for name, c in f["commands"].items():
            verdict = "" if name.startswith("python") else \
                ("  <= 0.4 s: yes" if c["median_cpu_s"] <= TARGET_CPU_S else "  <= 0.4 s: NO")
            print(f"  {name:58s} {c['median_cpu_s']:6.3f} s  (min {c['min_cpu_s']:.3f})  "
                  f"x{c['ratio_to_python']} python -c pass{verdict}")
        cold = f["plan_cold_cpu_s"]
        print(f"  plan, cold bytecode (first run after install): median {cold['median']:.3f} s "
              f"(min {cold['min']:.3f})")
        ip = f["in_process_plan_ms"]
        print(f"  {ip['what']}: median {ip['median']:.1f} ms (max {ip['max']:.1f})")
    if "--check-readme" in sys.argv:
        warm_claim, cold_claim = readme_claims()
        warm = f["commands"]["tunepilot plan examples/tiny.yaml --json"]["ratio_to_python"]
        cold = f["plan_cold_cpu_s"]["median"]
        ok = warm <= warm_claim * 1.3 and cold <= cold_claim * 1.3
        print(f"README says plan takes about {warm_claim} x python -c pass warm and {cold_claim} "
              f"s cold; measured x{warm} and {cold:.2f} s: "
              f"{'holds' if ok else 'UPDATE THE README'}")
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
