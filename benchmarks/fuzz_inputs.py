"""A seeded fuzzer of what users type: run specs for `tunepilot plan`, SkyPilot tables for
`catalog import`, and the ledger's flags (`book`, `usage`, `invoice`, `cancel`). Every case runs
the real command line in this process (tunepilot.cli.main) and is sorted by how it ended: exit 0,
a clear refusal (exit 2 / 3: one paragraph naming the field), any other exit code, or a
traceback (an exception that escaped - the one outcome that must never happen). The seed is
printed so a finding can be replayed; the first few tracebacks are shown with the input.

Run:  .venv/bin/python benchmarks/fuzz_inputs.py [--seed N] [--plans 1000] [--catalogs 300]
      [--ledger 300] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import random
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VMS = ROOT / "tests" / "fixtures" / "skypilot" / "vms.csv"

PRESETS = ["tiny", "llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "mixtral-8x7b", "gemma-2-2b",
           "phi-3-mini", "llama-3.1-70b", "nope", ""]
HOSTILE = [None, True, 0, -1, 1, 7, 2**31, 10**30, 1e308, float("inf"), float("nan"), -0.0,
           1e-300, "", "x", "-1", "1_000", "1e400", "all-linear", "\x00", "é" * 50, [], {},
           [1, [2, [3]]], {"a": {"b": None}}, "9" * 40]
def _pick(r: random.Random, good: list, odd: list, p_odd: float = 0.025):
    """A value a user would write, or (with probability p_odd) one a tester would."""
    return r.choice(odd) if odd and r.random() < p_odd else r.choice(good)


FIELDS = {
    "method": lambda r: _method(r),
    "precision": lambda r: _pick(r, ["fp32", "bf16-mixed", "bf16-true", "fp16-mixed"],
                                 ["fp8"]),
    "optimizer": lambda r: {"name": _pick(r, ["adamw", "adamw_8bit", "paged_adamw",
                                              "paged_adamw_8bit", "sgd", "adafactor"],
                                          ["lion"]),
                            "impl": _pick(r, [None, "foreach", "fused", "for-loop"], ["x"])},
    "sequence_length": lambda r: _pick(r, [1, 2, 64, 128, 2048, 4096, 32768, 131072],
                                       [0, -5, 2**40, 3.5]),
    "micro_batch_size": lambda r: _pick(r, [1, 2, 8, 64, 512], [0, 2**31, "4"]),
    "gradient_accumulation_steps": lambda r: _pick(r, [1, 4, 64], [0, 10**6]),
    "activation_checkpointing": lambda r: _pick(r, ["none", "full", "selective",
                                                    "selective-op"], [True, "some"]),
    "parallel": lambda r: {"strategy": _pick(r, ["ddp", "fsdp"], ["tp", "single"]),
                           "devices": _pick(r, [1, 2, 8, 64, 4096], [0, 5000]),
                           "nodes": _pick(r, [1, 2], [0]),
                           "cpu_offload": r.choice([False, True])},
    "kernels": lambda r: {"attention": _pick(r, ["sdpa", "eager", "flash-attention-2", "flex"],
                                             ["flash_attention_2"]),
                          "liger": _pick(r, [[], ["rms_norm"], ["fused_linear_cross_entropy"],
                                             ["rms_norm", "swiglu", "rope"]],
                                         [["rms_norm", "rms_norm"], ["x"]]),
                          "cut_cross_entropy": _pick(r, [False], [True], 0.1)},
    "objective": lambda r: {"kind": _pick(r, ["sft", "dpo", "kto", "reward", "grpo"], ["x"]),
                            "num_generations": _pick(r, [1, 8, 64], [0, 4097])},
    "target": lambda r: _pick(r, [{"tokens": 1e9}, {"tokens": 1e12}, {"tokens": 5e5}],
                              [{"tokens": -1}, {"tokens": 1e30}, {"epochs": 2}]),
    "validation": lambda r: {"micro_batch_size": _pick(r, [None, 1, 64], [0])},
    "chunked_loss": lambda r: _pick(r, [True, False], ["yes"]),
}


def _method(r: random.Random) -> dict:
    kind = _pick(r, ["full", "lora", "qlora"], ["dora", 3])
    m: dict = {"kind": kind}
    if kind != "full" or r.random() < 0.025:
        m["lora_rank"] = _pick(r, [1, 8, 64, 256], [0, -3, 10**9, 2.5])
        m["lora_alpha"] = _pick(r, [16, 32.0], [0, float("inf")])
        m["lora_targets"] = _pick(r, ["all-linear", ["o_proj", "down_proj"], ["lm_head"]],
                                  [["embed_tokens"], ["w1"], ["gate"], [], "q_proj", [3]], 0.05)
    return m


def random_spec(r: random.Random) -> object:
    """Mostly a plausible spec with random choices (the arithmetic's corners: huge models on
    thousands of devices, 128k tokens, every optimizer and kernel), now and then a hostile value
    in a field, rarely not a spec at all."""
    if r.random() < 0.03:
        return r.choice(HOSTILE)
    spec: dict = {"model": {"preset": _pick(r, PRESETS[:-2], PRESETS[-2:], 0.03)}}
    if r.random() < 0.03:
        spec["model"] = r.choice(HOSTILE)
    for name, make in FIELDS.items():
        if r.random() < 0.5:
            spec[name] = make(r)
    if r.random() < 0.15:  # a hostile value somewhere
        name = r.choice([*FIELDS, "model", "bogus", "name", "seed"])
        if isinstance(spec.get(name), dict) and spec[name] and r.random() < 0.6:
            spec[name][r.choice(list(spec[name]))] = r.choice(HOSTILE)
        else:
            spec[name] = r.choice(HOSTILE)
    return spec


def random_table(r: random.Random) -> str:
    lines = VMS.read_text().splitlines()
    header, rows = lines[0].split(","), lines[1:]
    table = [next(csv.reader([row])) for row in rows * r.choice([1, 1, 2, 5])]
    for _ in range(r.choice([0, 0, 1, 1, 2, 3])):  # a few damaged cells in the whole table
        cells = r.choice(table)
        cells[r.randrange(len(cells))] = r.choice(
            ["nan", "inf", "-inf", "1e308", "0", "-1", "9" * 40, "", "x", "8.5", "1_000",
             "0x10", "{'Gpus': 1}", "[", "{'Gpus': [{'MemoryInfo': {'SizeInMiB': 'x'}}]}",
             "é", '"', "1e-300", "16", "120.00"])
    if r.random() < 0.05:
        cells = r.choice(table)
        del cells[r.randrange(len(cells)):]
    elif r.random() < 0.03:
        r.choice(table).append("extra")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(table)
    out = buf.getvalue().splitlines()
    if r.random() < 0.1:
        r.shuffle(header)
    if r.random() < 0.05:
        header = header[:-3]
    return "\n".join([",".join(header), *out]) + "\n"


GOOD_NUMBERS = ["1", "72", "0.5", "2.25", "24", "168", "1.5e1", ".5", "5."]
ODD_NUMBERS = ["1e-7", "1e9", "0", "-1", "1_000", "nan", "inf", "1e400", "", "x", "0x10",
               "99999999999999999999", "  2  ", "+3", "1e30"]
GOOD_IDS = ["1", "2", "3", "4"]
ODD_IDS = ["0", "-1", "123456789012345678901", "9223372036854775807", "9223372036854775808",
           "x", "1.5", "99"]


def _number(r: random.Random) -> str:
    return _pick(r, GOOD_NUMBERS, ODD_NUMBERS, 0.3)


def random_ledger_args(r: random.Random, db: str) -> list[str]:
    kind = r.choice(["book", "book", "book", "usage", "invoice", "cancel", "bookings"])
    if kind == "book":
        args = ["book", "--card", _pick(r, ["h100", "h200", "a100", "mi300x"], ["h20", ""]),
                "--count", _pick(r, ["1", "2", "8"], ["0", "9", "-1", "1e3", "10" * 10]),
                "--start", _pick(r, [f"2030-0{m}-0{d}T0{h}:00Z" for m in range(1, 4)
                                     for d in range(1, 4) for h in range(3)] + ["now"],
                                 ["2030-01-01T00:00", "9999-01-01T00:00Z", "2020-01-01T00:00Z",
                                  "x", "2030-02-30T00:00Z"], 0.1)]
        args += [r.choice(["--hours", "--hours", "--days"]), _number(r)]
        for _ in range(r.choice([0, 0, 1, 2])):
            args += ["--option", _pick(r, ["storage_gb_month"], ["x", "", "storage_gb_month="])
                     + "=" + _number(r)]
    elif kind == "usage":
        args = ["usage", _pick(r, GOOD_IDS, ODD_IDS, 0.3), "--hours-used", _number(r)]
    elif kind == "bookings":
        args = ["bookings", "--all"]
    else:
        args = [kind, _pick(r, GOOD_IDS, ODD_IDS, 0.3)]
    return [*args, "--db", db]


def run_cli(args: list[str]) -> tuple[str, str]:
    """(outcome, detail): 'exit N' or 'traceback', with the exception for a traceback."""
    from tunepilot.cli import main

    old = sys.argv
    sys.argv = ["tunepilot", *args]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(hard_exit=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if "Traceback" in err.getvalue():
            return "traceback", err.getvalue()[-800:]
        return f"exit {code}", ""
    except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer counts
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return "traceback", f"{type(exc).__name__}: {str(exc)[:200]} at {tb.filename}:{tb.lineno}"
    finally:
        sys.argv = old
    return "exit 0", ""


def fuzz(seed: int, plans: int, catalogs: int, ledger: int) -> dict:
    r = random.Random(seed)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tunepilot-fuzz-") as tmp:
        tmp_path = Path(tmp)
        for family, n in (("plan", plans), ("catalog import", catalogs), ("ledger", ledger)):
            outcomes: Counter = Counter()
            found: list[dict] = []
            db = str(tmp_path / "ledger.sqlite3")
            for i in range(n):
                if family == "plan":
                    p = tmp_path / f"spec{i % 8}.yaml"
                    body = random_spec(r)
                    p.write_text(yaml.safe_dump(body, allow_unicode=True))
                    args = ["plan", str(p), "--card", "h100", "--json"]
                    shown = body
                elif family == "catalog import":
                    p = tmp_path / f"vms{i % 8}.csv"
                    p.write_text(random_table(r))
                    args = ["catalog", "import", str(p), "--out", str(tmp_path / "c.yaml"),
                            "--json"]
                    shown = p.read_text()[:400]
                else:
                    args = random_ledger_args(r, db)
                    shown = args
                outcome, detail = run_cli(args)
                outcomes[outcome] += 1
                if outcome == "traceback" and len(found) < 5:
                    found.append({"case": i, "input": shown, "error": detail})
            results[family] = {"cases": n, "outcomes": dict(outcomes),
                               "tracebacks": outcomes.get("traceback", 0), "examples": found}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--plans", type=int, default=1000)
    ap.add_argument("--catalogs", type=int, default=300)
    ap.add_argument("--ledger", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "big")
    print(f"seed {seed}", file=sys.stderr)
    os.environ.setdefault("TUNEPILOT_DB", os.devnull)  # never the user's own ledger
    results = fuzz(seed, a.plans, a.catalogs, a.ledger)
    if a.json:
        print(json.dumps({"seed": seed, **results}, indent=1, default=str))
        return
    for family, res in results.items():
        print(f"{family}: {res['cases']} cases, {res['tracebacks']} tracebacks; "
              f"outcomes {res['outcomes']}")
        for ex in res["examples"]:
            print(f"  case {ex['case']}: {ex['error']}\n    input: {str(ex['input'])[:300]}")
    print(f"(seed {seed}: replay with --seed {seed})")


if __name__ == "__main__":
    main()
