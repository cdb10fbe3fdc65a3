"""What both sides of a restore proof run: build the run, train and record each step exactly,
digest the state; and the fresh process itself (``python -m tunepilot.restore.worker``).

A hook (``module:object``, tests/support) may alter the run on purpose: ``before_load(state,
stream)`` returns what it needs, ``after_load(state, stream, before)`` applies its change - so
the proof can be shown to fail and name the component. The library itself carries no faults.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

from tunepilot.checkpoint import (
    DATA,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    SCALER,
    SCHEDULER,
    CheckpointError,
    data_position,
    load_checkpoint,
    model_and_optimizer_state,
    rng_state,
)
from tunepilot.restore.messages import FreshJob, ProcessReport
from tunepilot.results.restore import StepRecord
from tunepilot.spec import RunSpec

# What PyTorch warns, under warn-only deterministic mode, when an op runs a non-deterministic
# kernel: "<op> does not have a deterministic implementation, but ..." (alert_not_deterministic),
# and the SDPA backward's "Flash Attention defaults to a non-deterministic algorithm. To
# explicitly enable determinism call torch.use_deterministic_algorithms(True, warn_only=False)."
# (and "Memory Efficient attention defaults to ..."; aten/src/ATen/native/transformers/cuda/
# attention_backward.cu).
NONDETERMINISTIC_WARNINGS = (" does not have a deterministic implementation",
                             " defaults to a non-deterministic algorithm")


def build(spec: RunSpec, total_steps: int, base_dir: Path | None, device: str, **kwargs):
    """(training state, data stream) of the spec, as every stage builds them."""
    from tunepilot.training.build import build_run

    run = build_run(spec, device, total_steps=total_steps, base_dir=base_dir, **kwargs)
    return run.state, run.stream


def train(state, stream, spec: RunSpec, n: int, *, accumulation: int | None = None
          ) -> list[StepRecord]:
    """n optimizer steps, each recorded exactly (loss and LR as float.hex, batch fingerprints)."""
    from tunepilot.dataset import batch_fingerprint
    from tunepilot.training.step import train_step

    out = []
    for _ in range(n):
        s = train_step(state, stream.next, spec, fingerprint=batch_fingerprint,
                       accumulation=accumulation)
        out.append(StepRecord(step=s.step, loss=s.loss, loss_bits=float(s.loss).hex(),
                              lr=float(s.lr), lr_bits=float(s.lr).hex(),
                              fingerprints=list(s.fingerprints), useful_tokens=s.useful_tokens,
                              grad_norm=s.grad_norm))
    return out


def state_digest(state, stream, spec: RunSpec) -> dict:
    """A hash per tensor of model and optimizer (this rank's shards), the scheduler state and
    LR, a hash per RNG stream, the data position, the step: what a resumed run must reproduce
    before it trains."""
    _, osd = model_and_optimizer_state(state, spec)
    opt: dict[str, str] = {}
    for fqn, per_param in osd["state"].items():
        for k, v in per_param.items():
            opt[f"{fqn}.{k}"] = value_sha(v)
    # the current LR is the scheduler's (checked there); the rest of each group is the optimizer's
    opt["param_groups"] = value_sha([{k: v for k, v in g.items() if k != "lr"}
                                     for g in osd["param_groups"]])
    sched = state.scheduler.state_dict()
    return {
        MODEL: {k: value_sha(v) for k, v in state.model.state_dict().items()},
        OPTIMIZER: opt,
        SCHEDULER: {"last_epoch": sched.get("last_epoch"),
                    "lr": [float(g["lr"]).hex() for g in state.optimizer.param_groups],
                    "last_lr": [float(x).hex() for x in sched.get("_last_lr", [])],
                    "state_sha": value_sha(sched)},
        SCALER: value_sha(state.scaler.state_dict()) if state.scaler is not None else None,
        RNG: {name: value_sha(s) for name, s in rng_state().items() if s != []},
        DATA: data_position(stream),
        PROGRESS: {"step": state.step, "useful_tokens_seen": state.useful_tokens_seen},
    }


def value_sha(v: Any) -> str:
    """SHA-256 (16 hex) of a tensor's dtype, shape and bytes (a DTensor: its local shard), or of
    a value's canonical JSON."""
    import torch

    from tunepilot.checkpoint.components import to_json

    h = hashlib.sha256()
    if isinstance(v, torch.Tensor):
        t = v.to_local() if hasattr(v, "to_local") else v
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(json.dumps(to_json(v), sort_keys=True, default=repr,
                            separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def strict_default(device: str) -> bool:
    """Force deterministic algorithms (not warn-only) on a GPU: SDPA's flash and memory-efficient
    backward then run their deterministic kernels instead of warning; an op that has none
    raises, and the proof runs again warn-only (restore/proof.py) and compares within its
    tolerance. On a CPU warn-only: every kernel tunepilot's step runs there is deterministic."""
    return str(device).startswith("cuda")


def nondeterministic_ops(messages) -> list[str]:
    """The ops PyTorch's warnings name as non-deterministic (NONDETERMINISTIC_WARNINGS)."""
    ops = set()
    for text in map(str, messages):
        for marker in NONDETERMINISTIC_WARNINGS:
            if marker in text:
                ops.add(text.split(marker)[0].strip())
    return sorted(ops)


def is_determinism_error(exc: BaseException) -> bool:
    """An op without a deterministic kernel, raised under strict deterministic mode."""
    return isinstance(exc, RuntimeError) and "deterministic implementation" in str(exc)


@contextlib.contextmanager
def deterministic(device: str, strict: bool = False):
    """Deterministic algorithms on - ``strict``: forced (an op without a deterministic kernel
    raises; SDPA's backward takes its deterministic path), else warn-only (such an op is
    recorded rather than fatal); the caller's settings come back afterwards."""
    import torch

    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    prev_bench = torch.backends.cudnn.benchmark
    report: dict = {"requested": True, "held": True, "nondeterministic_ops": [],
                    "strict": strict}
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    _set_deterministic(True, warn_only=not strict)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield report
        ops = nondeterministic_ops(w.message for w in caught)
        report["nondeterministic_ops"] = ops
        report["held"] = not ops
    finally:
        _set_deterministic(prev[0], warn_only=prev[1])
        torch.backends.cudnn.benchmark = prev_bench


def _set_deterministic(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms, without importing the compiler just to set its flag
    (torch 2.13 imports torch._inductor for that: 1.4 s per process); nothing here compiles."""
    import torch

    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def load_hook(ref: str | None):
    """The hook object ``module:object`` (tests/support), or None."""
    if not ref:
        return None
    from tunepilot.proc.child import load_object

    return load_object(ref)


def resume(job: FreshJob) -> ProcessReport:
    """The fresh process: build, load (verified), digest, train M steps; a ProcessReport."""
    from tunepilot.restore.messages import DeterminismReport

    spec = RunSpec.model_validate(job.spec)
    if spec.spec_hash() != job.spec_hash:
        return ProcessReport(error={"component": "fresh_process", "message": "the spec did not "
                                    "survive the trip to the fresh process (spec hash "
                                    "differs)"})
    import torch

    torch.set_num_threads(job.threads)
    base_dir = Path(job.base_dir) if job.base_dir else None
    hook = load_hook(job.hook)
    with deterministic(job.device, job.strict_determinism) as det:
        seed_everything(spec.seed)
        state, stream = build(spec, job.total_steps, base_dir, job.device)
        before = hook.before_load(state, stream) if hasattr(hook, "before_load") else None
        try:
            info = load_checkpoint(Path(job.checkpoint), state, stream, spec)
        except CheckpointError as exc:
            return ProcessReport(error=exc.to_dict())
        if hasattr(hook, "after_load"):
            hook.after_load(state, stream, before)
        digest = state_digest(state, stream, spec)
        steps = train(state, stream, spec, job.steps_after)
    return ProcessReport(load=info.to_dict(), digest=digest, steps=steps,
                         deterministic=DeterminismReport(**det))


if __name__ == "__main__":
    from tunepilot.proc.child import child_main

    sys.exit(child_main(resume, FreshJob))
