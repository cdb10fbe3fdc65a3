"""Profile 100k chat samples with the shipped chat tokenizer (its Jinja ChatML template,
completions-only masking, packing) - cold (tokenized) and warm (from the cache).

Target: <= 60 s cold on 2 cores. Printed, not asserted.
Run:  .venv/bin/python benchmarks/data_profile.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

SAMPLES = 100_000


def main() -> None:
    from tunepilot.dataset.profile import profile_dataset
    from tunepilot.resources import TINY_CHAT, TINY_CHAT_TOKENIZER
    from tunepilot.spec import spec_from_dict

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TUNEPILOT_CACHE"] = str(Path(tmp) / "cache")
        rows = TINY_CHAT.read_text().splitlines()
        data = Path(tmp) / "chat-100k.jsonl"
        with open(data, "w") as f:
            for i in range(SAMPLES):
                f.write(rows[i % len(rows)] + "\n")
        spec = spec_from_dict({
            "model": {"preset": "tiny"}, "sequence_length": 512, "micro_batch_size": 4,
            "data": {"source": "jsonl", "path": str(data), "tokenizer": str(TINY_CHAT_TOKENIZER),
                     "format": "messages", "train_on": "completions", "packing": True}})
        t = time.perf_counter()
        cold = profile_dataset(spec, 512)
        cold_s = time.perf_counter() - t
        t = time.perf_counter()
        warm = profile_dataset(spec, 512)
        warm_s = time.perf_counter() - t
    assert warm.tokens_supervised == cold.tokens_supervised and warm.cached
    print(json.dumps({"samples": cold.samples, "tokens_total": cold.tokens_total.value,
                      "tokens_supervised": cold.tokens_supervised.value}))
    print(f"data profile, {SAMPLES:,} chat samples, {os.cpu_count()} cores: cold "
          f"{cold_s:.1f} s (target <= 60 s), warm from the cache {warm_s:.2f} s; "
          f"cold / target: {cold_s / 60:.2f}")


if __name__ == "__main__":
    main()
