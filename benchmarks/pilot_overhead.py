"""What the pilot's instrumentation costs: the same tiny model and steps in a bare training loop
and under the pilot's measured-step instrumentation, interleaved in one process.

    bare          train_step(state, stream.next, spec)             (a user's own loop)
    instrumented  InstrumentedStep (timer, data-wait, fwd/bwd/opt split), the background memory
                  sampler running, the adaptive stop rule evaluated and a progress callback
                  called after every step - exactly what the pilot does on a measured step
Blocks of K steps alternate A B B A so drift (thermal, other processes) falls on both sides.
The ratio is total instrumented time / total bare time (and the ratio of the per-step medians).
Target: <= 1.01.

The reported ratio is the median of the per-round ratios (robust to a round that another process
disturbed); the ratio of the totals is printed too.

Run:  .venv/bin/python benchmarks/pilot_overhead.py [--rounds 20] [--block 5] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = 1.01


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(HERE.parent / "examples" / "tiny.yaml"))
    ap.add_argument("--rounds", type=int, default=20, help="A B B A rounds")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto",
                    help="auto: the GPU when there is one (the sampler then reads NVML)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: least disturbed by other processes on the machine)")
    return ap.parse_args()


def main() -> int:
    args = _args()
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    import torch

    torch.set_num_threads(args.threads)

    from tunepilot.dataset import DataStream, build_dataset, make_loader
    from tunepilot.device import make_sampler, probe_device
    from tunepilot.model.build import build_model
    from tunepilot.pilot.stats import StopRule
    from tunepilot.pilot.steps import InstrumentedStep
    from tunepilot.spec import load_spec
    from tunepilot.training.build import make_state
    from tunepilot.training.step import train_step

    spec = load_spec(args.spec)
    info = probe_device(device=args.device)
    dev_type = "cpu" if info.kind == "cpu" else "cuda"
    model = build_model(spec, info.torch_device)
    ds, data_info = build_dataset(spec, model.config.vocab_size)
    total = 4 * args.rounds * args.block + 10
    state = make_state(spec, model, total)
    stream = DataStream(make_loader(spec, ds, data_info))
    for _ in range(3):  # warm-up: optimizer state, allocator, kernels
        train_step(state, stream.next, spec)

    step = InstrumentedStep(spec, dev_type)
    rule = StopRule(max_steps=10**9)  # never stops: evaluated for its cost only
    times: list[float] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        pass

    def bare_block() -> list[float]:
        out = []
        for _ in range(args.block):
            t0 = time.perf_counter()
            train_step(state, stream.next, spec)  # ends with a device synchronise
            out.append(time.perf_counter() - t0)
        return out

    def instrumented_block() -> list[float]:
        sampler = make_sampler(info)
        sampler.start()
        out = []
        for _ in range(args.block):
            t0 = time.perf_counter()
            rec = step(state, stream.next)
            times.append(rec.wall_s)
            rule.verdict(times)
            progress("measure steps", len(times), None)
            out.append(time.perf_counter() - t0)
        sampler.stop()
        return out

    bare: list[float] = []
    inst: list[float] = []
    per_round: list[float] = []
    for _ in range(args.rounds):
        b = bare_block()
        i = instrumented_block() + instrumented_block()
        b += bare_block()
        bare += b
        inst += i
        per_round.append(sum(i) / sum(b))
    ratio = statistics.median(per_round)  # robust to a round another process disturbed
    q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [ratio, ratio, ratio]
    result = {"device": info.summary(), "torch_threads": torch.get_num_threads(), "rounds": args.rounds,
              "steps_each": len(bare), "bare_total_s": sum(bare),
              "instrumented_total_s": sum(inst),
              "bare_median_step_s": statistics.median(bare),
              "instrumented_median_step_s": statistics.median(inst),
              "ratio_median_of_rounds": ratio, "ratio_of_totals": sum(inst) / sum(bare),
              "ratio_of_step_medians": statistics.median(inst) / statistics.median(bare),
              "per_round": per_round, "per_round_quartiles": [q[0], q[2]],
              "target": TARGET, "meets_target": ratio <= TARGET}
    _show(result, args, spec, info, bare, inst, q)
    return 0


def _show(result: dict, args, spec, info, bare: list[float], inst: list[float], q) -> None:
    ratio = result["ratio_median_of_rounds"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"pilot instrumentation overhead ({spec.label} on {info.kind} {info.name!r}, "
              f"{len(bare)} steps each side, "
              f"{args.rounds} rounds A B B A in blocks of {args.block}, "
              f"{result['torch_threads']} torch thread(s)):")
        print(f"  bare loop      {sum(bare):8.3f} s  (median step "
              f"{statistics.median(bare) * 1e3:.2f} ms)")
        print(f"  instrumented   {sum(inst):8.3f} s  (median step "
              f"{statistics.median(inst) * 1e3:.2f} ms)")
        print(f"  ratio instrumented / bare: {ratio:.4f} (median of the per-round ratios; totals "
              f"{result['ratio_of_totals']:.4f}, step medians "
              f"{result['ratio_of_step_medians']:.4f}); target <= {TARGET}")
        print(f"  per-round ratios: quartiles {q[0]:.4f} .. {q[2]:.4f} (the noise of this machine: "
              "a spread wider than the target means the difference is not resolved)")


if __name__ == "__main__":
    sys.exit(main())
