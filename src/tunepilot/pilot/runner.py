"""The pilot: real training steps of the run on the local device, worst case first.

    probe device -> check the plan against the device's memory -> plan (analytic, for the
    residuals) -> data (longest batch) -> build the run (tunepilot.training.build.build_run)
    -> warm-up: 2 full steps on the longest batch (step 1 creates the optimizer state; step 2,
       the steady state the plan describes, runs under the tensor tracker: memory by component)
    -> measured steps on real batches until the 95% CI of the mean step time is under 2%
    -> one validation pass (validation.num_batches) -> one checkpoint write -> [--find-max-batch]
An out-of-memory error anywhere (the device's, or the simulated one of --memory-limit) ends the
pilot with "does not fit at micro_batch=B, seq=S" and the last numbers; it never crashes.

``run_pilot`` returns the PilotResult it wrote to RUN_DIR/pilot.json (with manifest.json and
logs/pilot.log). It never prints: progress goes to the optional ``progress`` callback.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path

import torch

from tunepilot.catalog import load_catalog
from tunepilot.dataset import longest_batch, useful_tokens
from tunepilot.device import make_sampler, nvml_used_by_uuid
from tunepilot.errors import UserError
from tunepilot.pilot.measurements import ValidationPass
from tunepilot.pilot.session import (
    PilotOptions,
    PilotOutOfMemory,
    Progress,
    Session,
)
from tunepilot.pilot.stats import StopRule
from tunepilot.pilot.steps import InstrumentedStep, free_memory
from tunepilot.plan.trace.tracker import StorageTracker, state_tensors
from tunepilot.results.pilot import PilotResult
from tunepilot.spec import RunSpec
from tunepilot.store import RunDir, default_run_dir
from tunepilot.training.build import Shard, build_run
from tunepilot.training.step import evaluate

WARMUP_STEPS = 2  # step 1 creates the optimizer state; step 2 is the steady state (plan = step 2+)



class _RunLog:
    """logs/pilot.log, one timestamped line per event, flushed as it goes."""

    def __init__(self, path: Path):
        self._f = path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        self._f.write(f"{time.perf_counter() - self._t0:9.3f}s  {msg}\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def run_pilot(spec: RunSpec, out: Path | str | None = None, options: PilotOptions | None = None,
              progress: Progress | None = None) -> PilotResult:
    """Pilot `spec` on this machine; write pilot.json, manifest.json and logs/pilot.log."""
    from tunepilot.pilot.prepare import prepare

    options = options or PilotOptions()
    if options.steps is not None and options.steps < 1:
        raise UserError("--steps", f"is {options.steps} but must be at least 1.")
    if options.max_steps < 1:
        raise UserError("--max-steps", f"is {options.max_steps} but must be at least 1.")
    run_dir = RunDir(out if out is not None else default_run_dir(spec))
    run_dir.check_spec(spec.spec_hash())
    ranks = pilot_ranks(spec, options)
    if ranks > 1:
        from tunepilot.pilot.ranks import run_sharded_pilot

        return run_sharded_pilot(spec, run_dir, options, ranks, progress)
    t_start = time.perf_counter()
    baselines = nvml_used_by_uuid()  # before torch touches a GPU: the pre-run baseline
    run_dir.path.mkdir(parents=True, exist_ok=True)
    log = _RunLog(run_dir.logs_dir() / "pilot.log")
    s: Session | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            s = prepare(spec, options, options.catalog or load_catalog(), log,
                        progress or (lambda *_: None), run_dir.path)
            if s.does_not_fit is None:  # refused by the memory check: nothing to run
                s.sampler = make_sampler(s.device, baselines)  # the baseline: before the model
                if s.sampler is not None:
                    s.sampler.start()
                _execute(s)
            s.m.times.total_s = time.perf_counter() - t_start
            return _finish(s, run_dir)
    finally:
        if s is not None and s.sampler is not None and s.m.reading is None:
            s.sampler.stop()  # an error before the end: do not leave the thread running
        log.close()


def pilot_ranks(spec: RunSpec, options: PilotOptions) -> int:
    """How many ranks the pilot runs: the spec's FSDP ranks on this machine (one node's) under
    torchrun - gloo on the CPU, one GPU each with NCCL - else one device."""
    par = spec.parallel
    if options.ranks is not None or par.strategy != "fsdp" or par.devices < 2 or \
            par.data_parallel != par.world_size:  # tensor/context parallel: not tunepilot's step
        return 1
    n = spec.parallel.devices
    if options.find_max_batch:
        raise UserError("--find-max-batch", f"searches one device's micro-batch, but the spec "
                        f"shards the run over {n} FSDP ranks (the pilot runs all of them).",
                        "Leave out --find-max-batch; the pilot measures every rank's peak.")
    if options.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise UserError("parallel.devices", f"the sharded pilot runs the spec's {n} FSDP ranks, "
                        f"one per GPU, but this machine has {torch.cuda.device_count()}.",
                        "Pilot on the node you mean to rent, or set parallel.devices to the "
                        "GPUs here (the plan projects other counts).")
    return n


def _execute(s: Session) -> None:
    from tunepilot.pilot.probe import checkpoint_probe, find_max_batch, read_allocator

    try:
        _build(s)
        _warmup(s)
        _measure(s)
        _validate(s)
    except PilotOutOfMemory as dnf:
        # drop the failed step's frames (and the tensors they hold) with the traceback
        dnf.__context__ = dnf.__cause__ = dnf.__traceback__ = None
        s.does_not_fit = dnf
        s.log(f"does not fit ({dnf.phase}): {dnf.error}")
        free_memory(s.run.model if s.run else None)
    finally:
        read_allocator(s)
    if s.does_not_fit is None:
        checkpoint_probe(s)
    if s.sampler is not None:  # before the search, which runs into the limit on purpose
        s.m.reading = s.sampler.stop()
    if s.options.find_max_batch and s.run is not None:
        find_max_batch(s)


def _build(s: Session) -> None:
    """The model, optimizer, scheduler and data stream (tunepilot.training.build.build_run)."""
    s.progress("load model", 0, None)
    if s.gpu:
        torch.cuda.reset_peak_memory_stats()
    rule = StopRule(max_steps=s.options.max_steps, fixed_steps=s.options.steps)
    s.rule = rule
    s.m.stop_rule = rule.describe()
    t0 = time.perf_counter()
    with s.oom_guard("model load"):
        s.run = build_run(s.pilot_spec, s.device.torch_device, total_steps=WARMUP_STEPS +
                          rule.limit, base_dir=s.options.base_dir,
                          dataset=(s.dataset, s.data_info), rank=s.rank,
                          world_size=s.world_size, shard=Shard() if s.sharded else None,
                          kernels=True)
        s.sync()
    s.m.times.model_load_s = time.perf_counter() - t0
    params = list(s.run.model.parameters())
    s.params = {"total": sum(p.numel() for p in params),
                "trainable": sum(p.numel() for p in params if p.requires_grad)}
    s.params["frozen"] = s.params["total"] - s.params["trainable"]
    if s.gpu:
        s.m.allocator.model_load_peak_allocated_bytes = torch.cuda.max_memory_allocated()
    s.log(f"model built in {s.m.times.model_load_s:.3f} s: {s.params}")
    s.tracker = StorageTracker(1, limit_bytes=s.options.memory_limit_bytes,
                               device_type=s.device_type)
    s.tracker.adopt(state_tensors(s.run.model))
    with s.oom_guard("model load"):
        s.tracker.check_limit(" (the model's weights alone)")
    _longest(s)
    s.step = InstrumentedStep(s.pilot_spec, s.device_type,
                              tracker=s.tracker if s.options.memory_limit_bytes else None,
                              sharded=s.sharded)


def _longest(s: Session) -> None:
    """The worst batch: the micro-batch's longest samples, padded as training pads them."""
    from tunepilot.spec.objective import lengths, prompts_per_generation

    spec = s.pilot_spec
    generative = spec.objective.generative
    rows = prompts_per_generation(spec) if generative else spec.micro_batch_size
    lb = longest_batch(s.run.dataset, s.data_info, rows)
    s.longest_batch = lb
    seq = int(lb["input_ids"].shape[1])  # a pair's longer reply; a prompt + its completion
    ln = lengths(spec)
    s.longest = {"micro_batch_size": spec.micro_batch_size,
                 "sequence_length": seq + (ln.completion if generative else 0),
                 "useful_tokens": useful_tokens(lb), "padded_tokens": int(lb["input_ids"].numel())}
    if s.longest["sequence_length"] < spec.sequence_length:
        from tunepilot.plan.analytic.core import analytic_plan

        # compare like with like: the plan of the batch the probe step runs
        changes: dict = {"sequence_length": s.longest["sequence_length"]}
        if generative:
            changes["objective"] = dict(spec.objective.model_dump(), max_prompt_length=seq)
        s.plan = analytic_plan(spec.with_changes(**changes), s.arch, s.device.kind)
        s.m.notes.append(f"the longest batch is {s.longest['sequence_length']} tokens long "
                       f"(sequence_length {spec.sequence_length}): the plan the pilot is "
                       "compared with is of that length")


def _warmup(s: Session) -> None:
    from tunepilot.pilot.probe import probe_step, reset_allocator_peak

    t0 = time.perf_counter()
    state, lb = s.run.state, s.longest_batch
    for i in range(WARMUP_STEPS):
        s.progress("warm-up (longest batch)", i, WARMUP_STEPS)
        phase = f"warm-up step {i + 1} (longest batch)"
        with s.oom_guard(phase):
            if i == WARMUP_STEPS - 1:
                reset_allocator_peak(s, "first_step")
                rec = probe_step(s)
            else:
                rec = s.step(state, lambda: lb)
        s.m.warmup.append(rec)
        s.log(f"{phase}: {rec.wall_s:.4f} s, loss {rec.loss:.4f}")
    s.m.times.warmup_s = time.perf_counter() - t0


def _measure(s: Session) -> None:
    from tunepilot.pilot.load import MachineLoadWatch

    rule = s.rule
    t0 = time.perf_counter()
    s.progress("measure steps", 0, rule.limit)
    times: list[float] = []
    watch = MachineLoadWatch()
    while True:
        with s.oom_guard(f"measured step {len(s.m.steps) + 1}"):
            rec = s.step(s.run.state, s.run.stream.next)
        s.m.steps.append(rec)
        times.append(s.agree_max(rec.wall_s))  # the slowest rank's, on every rank
        s.progress("measure steps", len(times), rule.limit)
        if not math.isfinite(rec.loss):
            s.m.notes.append(f"measured step {len(times)}: the loss is not finite "
                           f"({rec.loss}); check precision and learning rate")
        why = rule.verdict(times)
        if why:
            s.m.stopped_because = why
            break
    s.m.load = watch.stop()
    s.m.times.measure_s = time.perf_counter() - t0
    s.log(f"measured {len(times)} steps ({s.m.stopped_because}); wall "
          + " ".join(f"{t:.4f}" for t in times))


def _validate(s: Session) -> None:
    from tunepilot.dataset import DataStream, make_loader

    spec = s.pilot_spec
    n = spec.validation.num_batches
    if not spec.validation.enabled:
        s.m.notes.append("no validation pass: the spec turns validation off (validation."
                         "enabled false)")
        return
    if spec.objective.generative:
        s.m.notes.append("no validation pass: GRPO/RLOO evaluate by generating (TRL's eval "
                         "generates and scores completions); the generation phase is measured")
        return
    s.progress("validation pass", 0, None)
    vstream = DataStream(make_loader(spec, s.run.dataset, s.data_info, seed=spec.seed + 1,
                                     micro_batch_size=spec.validation_micro_batch_size))
    with s.oom_guard("validation pass"), contextlib.ExitStack() as ctx:
        if s.options.memory_limit_bytes:
            ctx.enter_context(s.tracker)
            if s.sharded:
                ctx.enter_context(s.tracker.track_resizes())
        s.sync()
        t0 = time.perf_counter()
        loss, tokens = evaluate(s.run.model, (vstream.next() for _ in range(n)), spec,
                                s.run.state.reference)
        s.sync()
        dt = time.perf_counter() - t0
    s.m.validation = ValidationPass(seconds=dt, num_batches=n, loss=loss, useful_tokens=tokens)
    s.log(f"validation pass: {n} batches in {dt:.4f} s, loss {loss:.4f}")


def _finish(s: Session, run_dir: RunDir) -> PilotResult:
    from tunepilot.pilot.blocks import pilot_document
    from tunepilot.pilot.provenance import tunepilot_version

    result = pilot_document(s)
    result.spec_hash = s.spec.spec_hash()
    run_dir.write(result)
    run_dir.update_manifest(spec=s.spec.model_dump(mode="json"), device=s.device.summary(),
                            provenance=s.provenance, tunepilot_version=tunepilot_version())
    s.log(f"result: {result.verdict}; wrote {run_dir.file('pilot')}")
    return result
