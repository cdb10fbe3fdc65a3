"""kill -9 of one rank during a sharded save, N trials: does the previous checkpoint survive?

Each trial: 2 FSDP ranks under real torchrun (gloo, CPU) train one step and save the same
checkpoint path, again and again (a ~20 M-parameter Llama, so a save lasts long enough to be
caught); after 1-3 complete saves, one rank (rank 1, then rank 0, alternately) is SIGKILLed while
the next save's temporary directory holds that rank's shard files. Then the checkpoint at the
path is verified (manifest, every file's size and SHA-256) and loaded in a fresh process
(`tunepilot verify`), and must be the last save that completed.

Run:  .venv/bin/python benchmarks/sharded_save_kill.py [--trials 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from tests.support.sharded_kill import trial

    root = Path(tempfile.mkdtemp(prefix="sharded-kill-"))
    rows = []
    try:
        for i in range(args.trials):
            r = trial(root / f"t{i}", seed=i, victim=1 - i % 2)
            rows.append(r)
            if not args.json:
                print(f"trial {i + 1:>2}: killed rank {r['victim_rank']} "
                      f"{'mid-save' if r['killed_mid_save'] else 'NOT mid-save'} after "
                      f"{r['complete_saves_before']} complete saves -> checkpoint step "
                      f"{r['step']}, {len(r['problems'])} problems, loads in a fresh process: "
                      f"{r['loaded_in_fresh_process']}  {'ok' if r['ok'] else 'FAILED'}",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    good = sum(r["ok"] and r["killed_mid_save"] for r in rows)
    if args.json:
        print(json.dumps({"trials": rows, "intact_after_kill_mid_save": good}, indent=1))
    else:
        print(f"previous checkpoint intact and loadable after kill -9 of one rank mid-save: "
              f"{good} of {len(rows)} trials")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
