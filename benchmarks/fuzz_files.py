"""The fuzzer's generators for what tunepilot reads from files and flags besides configs and
specs (benchmarks/fuzz_cases.py has those): dataset JSONL rows, checkpoints a tester tampered
with, SkyPilot price tables, ledger operations, and the counts of the CLI's flags."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import shutil
import sqlite3
from pathlib import Path

from fuzz_cases import BIGCAT, HOSTILE, ROOT, TOKENIZER, VMS, Case, deep_json, dump_yaml, pick

# --- datasets (`data`) -------------------------------------------------------------------------

_ROW = {"text": lambda r: {"text": r.choice(_TEXTS)},
        "prompt-completion": lambda r: {"prompt": r.choice(_TEXTS), "completion":
                                        r.choice(_TEXTS)},
        "messages": lambda r: {"messages": [{"role": "user", "content": r.choice(_TEXTS)},
                                            {"role": "assistant", "content": r.choice(_TEXTS)}]},
        "preference": lambda r: {"prompt": r.choice(_TEXTS), "chosen": r.choice(_TEXTS),
                                 "rejected": r.choice(_TEXTS)},
        "prompt": lambda r: {"prompt": r.choice(_TEXTS)}}
_TEXTS = ["hello", "a short answer", "the memory budget fits a long sequence " * 20, "ok", "",
          "é" * 30, "tokens and more tokens, with punctuation!"]
_ODD_TEXT = ["\ud800", "a \udfff b", "\x00", "\u2028", "\ufeff", "x" * 20000]
_KIND = {"text": "sft", "prompt-completion": "sft", "messages": "sft", "preference": "dpo",
         "prompt": "grpo"}


def _row(r: random.Random, fmt: str) -> str:
    row: object = _ROW[fmt](r)
    roll = r.random()
    if roll < 0.1 and isinstance(row, dict):  # a hostile value in a field
        key = r.choice(list(row))
        row[key] = pick(r, [r.choice(_ODD_TEXT)], HOSTILE, 0.5)
    elif roll < 0.14 and isinstance(row, dict):
        row.pop(r.choice(list(row)))
    elif roll < 0.17 and fmt == "messages":
        row["messages"][0] = pick(r, [{"role": "system"}, {"content": "x"}, "user"], HOSTILE, 0.5)
    elif roll < 0.19:
        row = r.choice(HOSTILE[:12])
    text = deep_json(r.choice([50, 2000])) if 0.19 <= roll < 0.2 else json.dumps(row)
    if r.random() < 0.03:
        text = text[: max(1, len(text) // 2)]  # a torn line
    return text


def dataset_case(r: random.Random, tmp: Path, i: int) -> Case:
    d = tmp / f"data-{i % 4}"
    d.mkdir(exist_ok=True)
    fmt = r.choice(list(_ROW))
    rows = [_row(r, fmt) for _ in range(r.choice([1, 2, 5, 12]))]
    data = d / "data.jsonl"
    if data.exists() or data.is_symlink():
        data.unlink()
    roll = r.random()
    if roll < 0.02:
        os.mkfifo(data)
    elif roll < 0.03:
        data.symlink_to("/dev/zero")
    else:
        data.write_text("\n".join(rows) + r.choice(["\n", "", "\n\n", "\n \n"]),
                        encoding="utf-8", errors="surrogatepass")
    spec = {"name": "fuzz", "model": {"preset": "tiny"}, "method": {"kind": "lora"},
            "precision": "fp32", "sequence_length": pick(r, [16, 64, 256], [2, 1], 0.1),
            "micro_batch_size": pick(r, [1, 2, 8], [64], 0.1),
            "data": {"source": "jsonl", "path": "data.jsonl", "tokenizer": str(TOKENIZER),
                     "format": pick(r, [fmt], list(_ROW), 0.15),
                     "skip_bad_rows": r.choice([True, False]),
                     "train_on": pick(r, [None, "completions", "all"], [], 0.0)},
            "target": {"epochs": 1}}
    spec["objective"] = {"kind": _KIND[spec["data"]["format"]]}
    if spec["objective"]["kind"] == "grpo":
        spec["micro_batch_size"] = 8
    if spec["data"]["train_on"] is None:
        del spec["data"]["train_on"]
    p = d / "spec.yaml"
    p.write_text(dump_yaml(spec))
    steps = [["data", str(p), "--json"]]
    if r.random() < 0.1:
        steps.append(["quote", str(p), "--card", "h100", "--hours", "1", "--json"])
    return Case(steps, rows[:3])


# --- checkpoints (`verify`, `export`) ----------------------------------------------------------

CKPT = "checkpoints/step-1"


def make_base_run(tmp: Path) -> Path:
    """A run directory holding a real (tiny) checkpoint, made once: what every case copies."""
    import torch

    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.spec import load_spec
    from tunepilot.training.step import TrainState

    spec = load_spec(ROOT / "examples" / "tiny.yaml")
    run = tmp / "base-run"
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ds, info = build_dataset(spec, 256)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), step=1)
    save_checkpoint(run / CKPT, state, DataStream(make_loader(spec, ds, info)), spec)
    (run / "logs").mkdir(exist_ok=True)
    (run / "logs" / "pilot.log").write_text("step 1\n")
    return run


def _reseal(ckpt: Path) -> None:
    from tunepilot.checkpoint.manifest import digest

    if not (ckpt / "manifest.json").is_file():  # a FIFO or /dev/zero: nothing to re-seal
        return
    try:
        m = json.loads((ckpt / "manifest.json").read_text())
        for rel, e in m["files"].items():
            p = ckpt / rel
            if p.is_file():
                e["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
                e["bytes"] = p.stat().st_size
        m["manifest_sha256"] = digest(m)
        _put(ckpt / "manifest.json", json.dumps(m))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # the tampering left nothing to reseal


def _put(p: Path, data: bytes | str) -> None:
    """Write ``p`` anew (a FIFO or a symlink an earlier tampering left there is replaced, not
    opened: opening a FIFO for writing waits for a reader)."""
    if p.is_symlink() or (p.exists() and not p.is_file()):
        p.unlink()
    if isinstance(data, str):
        p.write_text(data)
    else:
        p.write_bytes(data)


def _tamper(r: random.Random, ckpt: Path) -> str:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    target = r.choice(files)
    op = r.randrange(10)
    if op == 0:
        target.unlink()
    elif op == 1:
        _put(target, target.read_bytes()[: r.randrange(max(1, target.stat().st_size))])
    elif op == 2:
        data = bytearray(target.read_bytes() or b"\0")
        data[r.randrange(len(data))] ^= 1 << r.randrange(8)
        _put(target, bytes(data))
    elif op == 3:
        _put(target.parent / r.choice(["__0_9.distcp", "extra.json", "rng.rank1.json"]),
             target.read_bytes())
    elif op == 4:  # a JSON component replaced
        name = r.choice(["scheduler.json", "progress.json", "rng.rank0.json", "data.rank0.json"])
        _put(ckpt / name, deep_json(3000) if r.random() < 0.1 else json.dumps(
            pick(r, [[1, 2], {}, {"step": "x"}], HOSTILE, 0.5)))
    elif op == 5 or op == 6:  # a manifest field
        if not (ckpt / "manifest.json").is_file():
            return "skipped (no manifest file)"
        m = json.loads((ckpt / "manifest.json").read_text())
        key = r.choice(["world_size", "step", "files", "components", "format_version",
                        "tensor_encoding", "useful_tokens_seen"])
        m[key] = pick(r, [10**9, 100_000, -1, 0, 2, {"../x": {}}, {"/etc/passwd": {
            "sha256": "0" * 64, "bytes": 1, "component": "model"}}], HOSTILE, 0.4)
        _put(ckpt / "manifest.json", json.dumps(m))
    elif op == 7:  # not a regular file where one is read
        victim = ckpt / r.choice(["manifest.json", "scheduler.json", "progress.json"])
        victim.unlink(missing_ok=True)
        if r.random() < 0.5:
            os.mkfifo(victim)
        else:
            victim.symlink_to("/dev/zero")
    elif op == 8:
        _put(ckpt / "manifest.json", deep_json(r.choice([100, 5000])))
    else:
        _put(target, target.read_bytes() + b"\0" * r.choice([1, 4096]))
    return f"{op} on {target.relative_to(ckpt)}"


def _tamper_or_not(r: random.Random, ckpt: Path) -> str:
    """One tampering; one an earlier one made impossible (the manifest is gone) is skipped."""
    try:
        return _tamper(r, ckpt)
    except (OSError, ValueError, RecursionError, KeyError, TypeError, IndexError) as exc:
        return f"skipped ({type(exc).__name__})"


def checkpoint_case(r: random.Random, tmp: Path, i: int, base: Path) -> Case:
    run = tmp / f"ckpt-run-{i % 2}"
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(base, run, symlinks=True)
    ckpt = run / CKPT
    done = [_tamper_or_not(r, ckpt) for _ in range(r.choice([1, 1, 2, 3]))]
    if r.random() < 0.06:  # a forger's re-seal: only the fresh load (seconds) can tell
        _reseal(ckpt)
        done.append("resealed")
    dest = tmp / f"export-{i % 2}"
    shutil.rmtree(dest, ignore_errors=True)
    steps = [["verify", str(ckpt), "--json"], ["export", str(run), str(dest), "--json"]]

    def check(results):
        (verified, _, out), (exported, _, _) = results
        try:
            ok = json.loads(out)["ok"] if out.strip() else None
        except ValueError:
            ok = None
        if exported == "exit 0" and (verified != "exit 0" or ok is False):
            return f"export exited 0 on a checkpoint verify rejects ({verified})"
        return None
    return Case(steps, done, check=check)


# --- SkyPilot tables (`catalog import`) --------------------------------------------------------

def random_table(r: random.Random) -> str:
    lines = VMS.read_text().splitlines()
    header, rows = lines[0].split(","), lines[1:]
    table = [next(csv.reader([row])) for row in rows * r.choice([1, 1, 2, 5])]
    for _ in range(r.choice([0, 0, 1, 1, 2, 3])):  # a few damaged cells in the whole table
        cells = r.choice(table)
        cells[r.randrange(len(cells))] = r.choice(
            ["nan", "inf", "-inf", "1e308", "0", "-1", "9" * 40, "", "x", "8.5", "1_000",
             "0x10", "{'Gpus': 1}", "[", "{'Gpus': [{'MemoryInfo': {'SizeInMiB': 'x'}}]}",
             "{'Gpus': [{'Name': 'H200', 'Count': 8.0}]}", "100", "é", '"', "1e-300", "16",
             "120.00", "\x00", "a\nb"])
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


def catalog_case(r: random.Random, tmp: Path, i: int) -> Case:
    p = tmp / f"vms{i % 4}.csv"
    p.write_text(random_table(r), encoding="utf-8", errors="surrogatepass")
    out = tmp / f"c{i % 4}.yaml"
    out.unlink(missing_ok=True)
    steps = [["catalog", "import", str(p), "--out", str(out), "--json"],
             ["cards", "--catalog", str(out), "--json"]]

    def check(results):
        if results[0][0] == "exit 0" and out.exists() and results[1][0] != "exit 0":
            return f"catalog import wrote a catalog --catalog refuses ({results[1][0]})"
        return None
    return Case(steps, p.read_text(errors="replace")[:400], check=check)


# --- the ledger (`book`, `usage`, `invoice`, `cancel`, `bookings`) ------------------------------

GOOD_NUMBERS = ["1", "72", "0.5", "2.25", "24", "168", "1.5e1", ".5", "5."]
ODD_NUMBERS = ["1e-7", "1e9", "0", "-1", "1_000", "nan", "inf", "1e400", "", "x", "0x10",
               "99999999999999999999", "  2  ", "+3", "1e30"]
GOOD_IDS = ["1", "2", "3", "4"]
ODD_IDS = ["0", "-1", "123456789012345678901", "9223372036854775807", "9223372036854775808",
           "x", "1.5", "99"]
STARTS = [f"2030-0{m}-0{d}T0{h}:00Z" for m in range(1, 4) for d in range(1, 4) for h in range(3)]
ODD_STARTS = ["2030-01-01T00:00", "9999-01-01T00:00Z", "2020-01-01T00:00Z", "x",
              "2030-02-30T00:00Z", "0001-01-01T00:00+14:00", "9999-12-31T23:00-14:00"]


def ledger_case(r: random.Random, tmp: Path, i: int) -> Case:
    db = tmp / f"ledger-{i // 200}.sqlite3"  # a fresh ledger every 200 operations
    kind = r.choice(["book", "book", "book", "usage", "invoice", "cancel", "bookings"])
    number = lambda: pick(r, GOOD_NUMBERS, ODD_NUMBERS, 0.3)  # noqa: E731
    if kind == "book":
        args = ["book", "--card", pick(r, ["h100", "h200", "a100", "mi300x"], ["h20", ""], 0.03),
                "--count", pick(r, ["1", "2", "8"], ["0", "9", "-1", "1e3", "10" * 10,
                                                     "131073"], 0.1),
                "--start", pick(r, STARTS + ["now"], ODD_STARTS, 0.1),
                r.choice(["--hours", "--hours", "--days"]), number()]
        for _ in range(r.choice([0, 0, 1, 2])):
            args += ["--option", pick(r, ["storage_gb_month"], ["x", "", "storage_gb_month="],
                                      0.1) + "=" + number()]
        if r.random() < 0.1:
            args += ["--catalog", str(BIGCAT)]  # a second catalog claims 100 H200s
    elif kind == "usage":
        args = ["usage", pick(r, GOOD_IDS, ODD_IDS, 0.3), "--hours-used", number()]
    elif kind == "bookings":
        args = ["bookings", "--all"]
    else:
        args = [kind, pick(r, GOOD_IDS, ODD_IDS, 0.3)]
    return Case([[*args, "--db", str(db), "--json"]], args, check=_capacity_holds(db))


def _capacity_holds(db: Path):
    """No instant of any card holds more booked cards than the ledger's inventory."""
    def check(_results):
        from tunepilot.ledger.records import peak_use

        if not db.exists():
            return None
        with sqlite3.connect(db) as c:
            inventory = dict(c.execute("SELECT card_id, count FROM inventory"))
            for card, count in inventory.items():
                rows = c.execute("SELECT start_ts, end_ts, count FROM bookings WHERE card_id "
                                 "= ? AND status = 'booked'", (card,)).fetchall()
                for start, end, _ in rows:
                    used = peak_use(rows, start, end)[0]
                    if used > count:
                        return f"{used} x {card} booked at once from an inventory of {count}"
        return None
    return check


# --- counts on the command line ------------------------------------------------------------

ODD_COUNTS = ["0", "-1", "1e3", "1000000000000", "99999999999999999999", "131073", "nan", "",
              "0x10", "1_000", " 8", "8.0", "+8", "9" * 400]


def count_case(r: random.Random, tmp: Path, i: int) -> Case:
    from tunepilot.limits import MAX_CARDS

    n = pick(r, ["1", "2", "8", "64", "4096", "131072"], ODD_COUNTS, 0.5)
    spec = str(ROOT / "examples" / "tiny.yaml")
    which = r.choice(["quote", "book", "launch", "import-devices"])
    if which == "quote":
        args = ["quote", spec, "--card", r.choice(["h100", "h200"]), "--count", n, "--hours",
                "1", "--json"]
    elif which == "book":
        args = ["book", "--card", "h200", "--count", n, "--start", "2031-01-01T00:00Z",
                "--hours", "1", "--db", str(tmp / "counts.sqlite3"), "--json"]
    elif which == "launch":
        args = ["launch", spec, "--card", "h100", "--count", n, "--via",
                r.choice(["slurm", "skypilot"]), "--out", str(tmp / f"launch{i % 2}.txt")]
    else:
        args = ["import", str(ROOT / "tests" / "fixtures" / "configs" / "hf-training-args.json"),
                "--data", "synthetic", "--devices", n, "--json"]

    def check(results):
        try:  # what a count may be written as: a whole number, 8.0 included
            f = float(n.strip().replace("_", "")) if n.strip() else float("nan")
            value = int(f) if f == f and abs(f) != float("inf") and f == int(f) else None
        except (ValueError, OverflowError):
            value = None
        if results[0][0] == "exit 0" and (value is None or not 1 <= value <= MAX_CARDS):
            return f"--count/--devices {n[:30]!r} accepted (exit 0)"
        return None
    return Case([args], args, check=check)
