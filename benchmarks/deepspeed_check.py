"""DeepSpeed ZeRO itself against the plan, where DeepSpeed is installed and a CUDA GPU is at hand
(prints why it skipped otherwise, exit 0): one rank (a process group of one; run it under
torchrun --nproc-per-node N for N) trains the spec's model with its ZeRO stage for three
optimizer steps through DeepSpeed's engine (training/deepspeed.py: the spec's ds_config and
optimizer), and the measured allocator peaks of the last step are printed beside the analytic
and the traced plan's (measured vs projected, GiB = 2^30 B).

Run:  .venv/bin/python benchmarks/deepspeed_check.py [SPEC.yaml]   (default: a ZeRO-2 and a
      ZeRO-3 full fine-tune of llama-3.2-1b at 1024 tokens)
"""

from __future__ import annotations

import importlib.util
import os
import sys

DEFAULTS = [{"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
             "sequence_length": 1024, "activation_checkpointing": "full",
             "parallel": {"strategy": "deepspeed", "devices": 1,
                          "deepspeed": {"stage": stage}}} for stage in (2, 3)]


def skip_reason() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    return None


def measure(spec) -> dict:
    """Three optimizer steps under DeepSpeed's engine; the allocator's peaks of the last."""
    import torch
    import torch.distributed as dist

    from tunepilot.training.build import build_optimizer, build_policy
    from tunepilot.training.deepspeed import engine

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    model = build_policy(spec, device, None, None, None)
    eng, _ = engine(spec, model, build_optimizer(spec, model))
    vocab = int(model.config.vocab_size)
    for step in range(3):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(spec.gradient_accumulation_steps):
            ids = torch.randint(0, vocab, (spec.micro_batch_size, spec.sequence_length),
                                device=device)
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
    torch.cuda.synchronize()
    return {"allocated_peak_bytes": torch.cuda.max_memory_allocated(),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved()}


def main() -> int:
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from plan_accuracy import traced_peak  # benchmarks/ is on sys.path when run as a script
    from tunepilot.model.arch import resolve_arch
    from tunepilot.model.arch.files import resolve_model_config
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.spec import load_spec, spec_from_dict

    specs = [load_spec(sys.argv[1])] if len(sys.argv) > 1 else [spec_from_dict(d)
                                                                 for d in DEFAULTS]
    for spec in specs:
        arch = resolve_arch(spec)
        got = measure(spec)
        plan = analytic_plan(spec, arch).per_device
        traced = traced_peak(spec, arch, resolve_model_config(spec))
        for key in ("allocated_peak_bytes", "reserved_peak_bytes"):
            m, a = got[key], getattr(plan, key)
            t = traced.get(key)
            print(f"ZeRO-{spec.parallel.deepspeed.stage} {key.split('_')[0]:<9} measured "
                  f"{m / 2**30:6.2f} GiB  analytic {a / 2**30:6.2f} GiB ({a / m - 1:+.1%})"
                  + (f"  traced {t / 2**30:6.2f} GiB ({t / m - 1:+.1%})" if t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
