"""A seeded fuzzer of everything tunepilot reads from a user (issue 40 item 12): the trainer
configs `import` reads (axolotl, LLaMA-Factory, TRL, HF TrainingArguments, LitGPT, the DeepSpeed
configs they name), run specs (`plan`, `quote`), datasets (`data`), checkpoints and their
manifests and scheduler files (`verify`, `export`), SkyPilot price tables (`catalog import`),
ledger operations (`book`, `usage`, `invoice`, `cancel`, `bookings`) and the counts of the CLI's
flags. Generators: benchmarks/fuzz_cases.py and fuzz_files.py.

Every case runs the real command line in this process (tunepilot.cli.main) and is sorted by how
it ended: exit 0, a clear refusal (exit 2 / 3: one paragraph naming the field), exit 1 (a failed
check the command reports), a traceback (an exception that escaped - the outcome that must never
happen), or a hang (no answer within CASE_TIMEOUT_S). After its commands each case checks an
invariant: a spec import wrote with exit 0 plans; export refuses what verify rejects; the ledger
never holds more cards at once than its inventory; a count outside 1..131,072 is never accepted;
a catalog import wrote loads as --catalog. Each kind draws from its own stream of the seed, so a
finding replays with --seed N --only KIND.

Run:  .venv/bin/python benchmarks/fuzz_inputs.py [--seed N] [--cases 1000] [--only KIND ...]
      [--short] [--json]        (--short: CI's few dozen cases per kind)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_cases import config_case, ds_config_case, spec_case  # noqa: E402
from fuzz_files import (  # noqa: E402
    catalog_case,
    checkpoint_case,
    count_case,
    dataset_case,
    ledger_case,
    make_base_run,
)

KINDS = ("import-axolotl", "import-llamafactory", "import-trl", "import-hf", "import-litgpt",
         "import-ds_config",
         "spec", "dataset", "checkpoint", "catalog-csv", "ledger", "cli-counts")
SHORT_CASES = 30
CASE_TIMEOUT_S = 120  # a verify of a tiny checkpoint, with its fresh load, takes seconds
EXAMPLES_SHOWN = 5


class Hang(BaseException):
    """A command that did not return within CASE_TIMEOUT_S (raised by SIGALRM)."""


def _alarm(_signum, _frame):
    raise Hang


def run_cli(args: list[str]) -> tuple[str, int, str, str]:
    """(outcome, exit code, stdout, detail): outcome 'exit N', 'traceback' or 'hang'."""
    from tunepilot.cli import main

    old, old_handler = sys.argv, signal.signal(signal.SIGALRM, _alarm)
    sys.argv = ["tunepilot", *args]
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(hard_exit=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if "Traceback" in err.getvalue():
            return "traceback", code, out.getvalue(), err.getvalue()[-800:]
        return f"exit {code}", code, out.getvalue(), err.getvalue()[-300:]
    except Hang:
        return "hang", -1, out.getvalue(), f"no answer in {CASE_TIMEOUT_S} s"
    except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer counts
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return ("traceback", -1, out.getvalue(),
                f"{type(exc).__name__}: {str(exc)[:200]} at {tb.filename}:{tb.lineno}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        sys.argv = old
    return "exit 0", 0, out.getvalue(), ""


def _case(kind: str, r: random.Random, tmp: Path, i: int, base_run: Path | None):
    if kind.startswith("import-") and kind != "import-ds_config":
        return config_case(r, kind.removeprefix("import-"), tmp, i)
    return {"import-ds_config": lambda: ds_config_case(r, tmp, i),
            "spec": lambda: spec_case(r, tmp, i), "dataset": lambda: dataset_case(r, tmp, i),
            "checkpoint": lambda: checkpoint_case(r, tmp, i, base_run),
            "catalog-csv": lambda: catalog_case(r, tmp, i),
            "ledger": lambda: ledger_case(r, tmp, i),
            "cli-counts": lambda: count_case(r, tmp, i)}[kind]()


def fuzz_kind(kind: str, seed: int, n: int, tmp: Path, base_run: Path | None = None) -> dict:
    """``n`` cases of ``kind`` from the seed's stream for that kind."""
    r = random.Random(f"{seed}:{kind}")
    outcomes: Counter = Counter()
    found: list[dict] = []
    violations = 0
    t0 = time.perf_counter()
    for i in range(n):
        case = _case(kind, r, tmp, i, base_run)
        results = []
        for args in case.steps:
            outcome, code, out, detail = run_cli(args)
            outcomes[outcome] += 1
            results.append((outcome, code, out))
            if outcome in ("traceback", "hang") and len(found) < EXAMPLES_SHOWN:
                found.append({"case": i, "args": args, "input": str(case.shown)[:400],
                              "error": detail})
        broken = case.check(results) if case.check else None
        if broken:
            violations += 1
            if len(found) < EXAMPLES_SHOWN:
                found.append({"case": i, "args": case.steps, "input": str(case.shown)[:400],
                              "error": f"invariant: {broken}"})
    return {"cases": n, "commands": sum(outcomes.values()), "outcomes": dict(outcomes),
            "tracebacks": outcomes.get("traceback", 0), "hangs": outcomes.get("hang", 0),
            "invariant_violations": violations, "wall_s": round(time.perf_counter() - t0, 1),
            "examples": found}


def fuzz(seed: int, cases: int, kinds: tuple[str, ...] = KINDS) -> dict:
    """Every kind, ``cases`` cases each, in a scratch directory (and working directory: `data`
    writes runs/ there) that is removed after."""
    os.environ.setdefault("TUNEPILOT_DB", os.devnull)  # never the user's own ledger
    results: dict = {}
    here, t0 = Path.cwd(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tunepilot-fuzz-") as tmp_s:
        tmp = Path(tmp_s)
        os.chdir(tmp)
        try:
            base = make_base_run(tmp) if "checkpoint" in kinds else None
            for kind in kinds:
                (tmp / kind).mkdir()
                results[kind] = res = fuzz_kind(kind, seed, cases, tmp / kind, base)
                print(f"fuzz [{time.perf_counter() - t0:7.0f} s] {kind}: {res['cases']} cases, "
                      f"{res['tracebacks']} tracebacks, {res['hangs']} hangs, "
                      f"{res['invariant_violations']} broken invariants", file=sys.stderr,
                      flush=True)
        finally:
            os.chdir(here)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cases", type=int, default=1000, help="cases per kind")
    ap.add_argument("--short", action="store_true", help=f"{SHORT_CASES} cases per kind (CI)")
    ap.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "big")
    cases = SHORT_CASES if a.short else a.cases
    print(f"seed {seed}; {cases} cases per kind", file=sys.stderr)
    t0 = time.perf_counter()
    results = fuzz(seed, cases, tuple(a.only))
    wall = time.perf_counter() - t0
    if a.json:
        print(json.dumps({"seed": seed, "cases_per_kind": cases, "wall_s": round(wall, 1),
                          **results}, indent=1, default=str))
    else:
        for kind, res in results.items():
            print(f"{kind:20s} {res['cases']:5d} cases {res['commands']:5d} commands  "
                  f"{res['tracebacks']} tracebacks  {res['hangs']} hangs  "
                  f"{res['invariant_violations']} broken invariants  {res['wall_s']:7.1f} s  "
                  f"{res['outcomes']}")
            for ex in res["examples"]:
                print(f"    case {ex['case']}: {ex['error']}\n      args: {ex['args']}\n"
                      f"      input: {ex['input'][:300]}")
        bad = sum(r["tracebacks"] + r["hangs"] + r["invariant_violations"]
                  for r in results.values())
        print(f"seed {seed}: {bad} findings in {wall:.0f} s (wall, measured); replay with "
              f"--seed {seed}")
    sys.exit(1 if any(r["tracebacks"] + r["hangs"] + r["invariant_violations"]
                      for r in results.values()) else 0)


if __name__ == "__main__":
    main()
