"""What crash safety and verification cost: tunepilot's checkpoint save + load of a training state
against a plain torch.save / torch.load of the same state, interleaved in one process.

    plain      torch.save({model, optimizer, scheduler, rng}) to one file; torch.load it and
               load_state_dict into the model and optimizer (no fsync, no checksum, not atomic)
    tunepilot  save_checkpoint: DCP files, fsync of every file and directory, SHA-256 of every
               file, manifest, atomic rename; load_checkpoint: verify every SHA-256, then load
The state is a Llama-style model built from a config (random weights, fp32 full fine-tune) with
AdamW moments after one step: ~60 M parameters, ~250 MB of weights, ~750 MB of state in all.
Rounds alternate A B / B A so drift (page cache, other processes) falls on both sides.
Throughput = state bytes / (save s + load s); the ratio is tunepilot / plain (target >= 0.9),
the median of the per-round ratios; the best round of each is compared too (least disturbed by
other processes). A plain save followed by fsync is printed for context (what durability alone
costs on this disk).

Run:  .venv/bin/python benchmarks/checkpoint_speed.py [--rounds 5] [--dir /tmp/ckbench] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = 0.9
MB = 10**6
# ~62 M parameters: 2 x 16000 x 768 embeddings + 6 layers of 768-wide attention (4 KV heads) and a
# 2048-wide SwiGLU MLP
CONFIG = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048,
          "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
          "vocab_size": 16000, "max_position_embeddings": 512, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def _state(tmp: Path):
    import torch

    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.model.build import build_model
    from tunepilot.spec import spec_from_dict
    from tunepilot.training.build import make_state
    from tunepilot.training.step import train_step

    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(CONFIG))
    spec = spec_from_dict({"model": {"config": str(cfg_path)}, "method": {"kind": "full"},
                           "precision": "fp32", "sequence_length": 16, "micro_batch_size": 1,
                           "optimizer": {"name": "adamw"}})
    model = build_model(spec)
    ds, info = build_dataset(spec, model.config.vocab_size)
    stream = DataStream(make_loader(spec, ds, info))
    state = make_state(spec, model, 100)
    train_step(state, stream.next, spec)  # AdamW moments exist after the first step
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in state.optimizer.state.values()
                       for v in s.values() if isinstance(v, torch.Tensor))
    return spec, state, stream, state_bytes


def _plain(state, path: Path, fsync: bool) -> tuple[float, float]:
    import torch

    t0 = time.perf_counter()
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(), "rng": torch.get_rng_state()}, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    t1 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    state.model.load_state_dict(sd["model"])
    state.optimizer.load_state_dict(sd["optimizer"])
    state.scheduler.load_state_dict(sd["scheduler"])
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


def _tunepilot(spec, state, stream, path: Path) -> tuple[float, float, int]:
    from tunepilot.checkpoint import load_checkpoint, save_checkpoint

    t0 = time.perf_counter()
    info = save_checkpoint(path, state, stream, spec)
    t1 = time.perf_counter()
    load_checkpoint(path, state, stream, spec)
    t2 = time.perf_counter()
    shutil.rmtree(path)
    return t1 - t0, t2 - t1, info.bytes


def _async(spec, state, stream, path: Path) -> tuple[float, float]:
    """(seconds the caller is held, seconds until the checkpoint is in place)."""
    from tunepilot.checkpoint.async_save import save_checkpoint_async

    t0 = time.perf_counter()
    pending = save_checkpoint_async(path, state, stream, spec)
    pending.result()
    total = time.perf_counter() - t0
    shutil.rmtree(path)
    return pending.unblocked_s, total


def _hash_seconds(state) -> float:
    """SHA-256 of every byte of the state once, in memory, on the threads a save uses."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from tunepilot.checkpoint.dcp import _bytes_view
    from tunepilot.checkpoint.files import HASH_THREADS

    tensors = [t.detach() for t in state.model.state_dict().values()]
    tensors += [v for s in state.optimizer.state.values() for v in s.values()
                if hasattr(v, "numel") and v.numel() > 1]
    views = [_bytes_view(t.contiguous()) for t in tensors]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        list(pool.map(lambda v: hashlib.sha256(v).digest(), views))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="A B / B A rounds")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE.parent / "src"))
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckbench-"))
    root.mkdir(parents=True, exist_ok=True)
    spec, state, stream, state_bytes = _state(root)
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "plain+fsync": [], "tunepilot": []}
    async_rows: list[tuple[float, float]] = []
    hashing: list[float] = []
    disk_bytes = 0
    _tunepilot(spec, state, stream, root / "warm")  # first-touch allocations, page cache warm
    _plain(state, root / "warm.pt", fsync=False)
    for r in range(args.rounds):
        order = ("plain", "tunepilot") if r % 2 == 0 else ("tunepilot", "plain")
        for name in order:
            if name == "plain":
                rows["plain"].append(_plain(state, root / "plain.pt", fsync=False))
            else:
                s, ld, disk_bytes = _tunepilot(spec, state, stream, root / "ckpt")
                rows["tunepilot"].append((s, ld))
        rows["plain+fsync"].append(_plain(state, root / "plain.pt", fsync=True))
        async_rows.append(_async(spec, state, stream, root / "async"))
        hashing.append(_hash_seconds(state))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    def rate(pair):
        return state_bytes / (pair[0] + pair[1])

    ratios = [rate(t) / rate(p) for t, p in zip(rows["tunepilot"], rows["plain"], strict=True)]
    ratio = statistics.median(ratios)
    # best round of each: the least disturbed by other processes (a shared machine is noisy)
    best = max(rate(t) for t in rows["tunepilot"]) / max(rate(p) for p in rows["plain"])
    best_durable = max(rate(t) for t in rows["tunepilot"]) / max(rate(p)
                                                                 for p in rows["plain+fsync"])
    load_avg = os.getloadavg()[0]
    out = {"state_bytes": state_bytes, "cpus": os.cpu_count(), "load_average_1min": load_avg, "tunepilot_disk_bytes": disk_bytes, "rounds": args.rounds,
           "ratio": ratio, "target": TARGET, "per_round_ratios": ratios, "best_ratio": best,
           "best_ratio_vs_plain_fsync": best_durable,
           "median_s": {k: {"save": statistics.median(p[0] for p in v),
                            "load": statistics.median(p[1] for p in v)} for k, v in rows.items()},
           "median_mb_per_s": {k: statistics.median(rate(p) for p in v) / MB
                               for k, v in rows.items()},
           "async_save_median_s": {"unblocked": statistics.median(a for a, _ in async_rows),
                                   "in_place": statistics.median(b for _, b in async_rows)},
           "sha256_one_pass_median_s": statistics.median(hashing)}
    plain_total = sum(out["median_s"]["plain"].values())
    out["sha256_both_passes_over_plain"] = 2 * out["sha256_one_pass_median_s"] / plain_total
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"state {state_bytes / MB:,.0f} MB (model + AdamW moments; tunepilot writes "
              f"{disk_bytes / MB:,.0f} MB with metadata); {args.rounds} interleaved rounds; "
              f"MB = 10^6 bytes; {os.cpu_count()} CPUs, load average {load_avg:.1f} (SHA-256 and "
              "fsync compete for the same cores: a loaded machine widens the gap)")
        for k in rows:
            m = out["median_s"][k]
            print(f"  {k:<12} save {m['save']:.3f} s  load {m['load']:.3f} s  ->  "
                  f"{out['median_mb_per_s'][k]:,.0f} MB/s (save + load)")
        print(f"tunepilot / plain throughput: {ratio:.2f}x median of rounds (target >= "
              f"{TARGET}x; per round: " + ", ".join(f"{x:.2f}" for x in ratios) + ")")
        print(f"best round vs best round: {best:.2f}x of plain, {best_durable:.2f}x of plain + "
              "fsync")
        a = out["async_save_median_s"]
        print(f"async save: training held {a['unblocked']:.3f} s (the copy into staging "
              f"buffers), checkpoint in place after {a['in_place']:.3f} s")
        h = out["sha256_one_pass_median_s"]
        print(f"SHA-256 of the state, one pass in memory on {os.cpu_count()} CPUs: {h:.3f} s; "
              f"once on save and once on load that is "
              f"{out['sha256_both_passes_over_plain']:.0%} of plain's whole save + load time "
              "(the part of the gap that verifying every byte costs on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
