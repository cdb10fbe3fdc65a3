"""What TunepilotCallback costs the user's HF Trainer run.

Two figures, measured in one run:
  1. inside: the seconds spent in the callback's methods and its forward pre-hook, as a fraction
     of the measured steps' wall time (precise: it does not depend on machine noise);
  2. end to end: the median train time of runs with and without the callback, interleaved
     (noisy on a shared CPU; printed for the record).
Target: <= 1% of step time. Printed, not asserted.
Run:  .venv/bin/python benchmarks/callback_overhead.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "own-loop"))

STEPS = 30
ROUNDS = 3


def _trainer(tmp: Path, callbacks):
    import torch
    from tiny_data import VariedLengths, collate
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    args = TrainingArguments(output_dir=str(tmp / "trainer"), max_steps=STEPS,
                             per_device_train_batch_size=8, logging_steps=10, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    return Trainer(model=LlamaForCausalLM(config), args=args,
                   train_dataset=VariedLengths(512, 4096), data_collator=collate,
                   callbacks=callbacks)


def _timed_callback(out: Path):
    """A TunepilotCallback whose every method (and the hook) adds its own time to a counter."""
    from tunepilot.integrations.hf import TunepilotCallback

    spent = {"per_step": 0.0, "once": 0.0}

    class Timed(TunepilotCallback):
        pass

    for name in ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_evaluate",
                 "on_save", "on_train_end", "_count"):
        orig = getattr(TunepilotCallback, name)

        kind = "once" if name in ("on_train_begin", "on_train_end") else "per_step"

        def wrapped(self, *a, _orig=orig, _kind=kind, **k):
            t = time.perf_counter()
            try:
                return _orig(self, *a, **k)
            finally:
                spent[_kind] += time.perf_counter() - t

        setattr(Timed, name, wrapped)
    return Timed(out_dir=out), spent


def main() -> None:
    import json

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with_cb, without = [], []
        inside, once = [], []
        for r in range(ROUNDS):
            cb, spent = _timed_callback(tmp / f"run{r}")
            t = time.perf_counter()
            _trainer(tmp, [cb]).train()
            with_cb.append(time.perf_counter() - t)
            d = json.loads((tmp / f"run{r}" / "pilot.json").read_text())
            steps_s = d["timings"]["warmup_s"]["value"] + d["timings"]["measure_s"]["value"]
            inside.append(spent["per_step"] / steps_s)
            once.append(spent["once"])
            t = time.perf_counter()
            _trainer(tmp, []).train()
            without.append(time.perf_counter() - t)
        step = d["step_time"]["p50_s"]["value"]
        print(f"steps per run: {STEPS}; step time p50 {step * 1e3:.1f} ms (measured)")
        print(f"inside the callback, per step (hook + step/log events): median "
              f"{statistics.median(inside):.3%} of the steps' wall time (target <= 1%)")
        print(f"once per run (device probe at the start, writing the result at the end): "
              f"median {statistics.median(once):.2f} s")
        ratio = statistics.median(with_cb) / statistics.median(without)
        print(f"end to end, median of {ROUNDS} interleaved runs: with {statistics.median(with_cb):.2f}"
              f" s, without {statistics.median(without):.2f} s, ratio {ratio:.3f} (noisy)")


if __name__ == "__main__":
    main()
