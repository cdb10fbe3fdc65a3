"""pilot.json from what a pilot Session measured: every number a Figure with its unit, measured
here or "not measured" with the reason (docs/pilot.md). No torch work happens here."""

from __future__ import annotations

import resource
import sys

from tunepilot.model.flops import flops_per_token, peak_precision
from tunepilot.pilot.stats import summarize
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    AllocatorMemory,
    DataBlock,
    DataWait,
    DeviceBlock,
    DoesNotFit,
    LongestBatch,
    LossBlock,
    MaxBatchSearch,
    MemoryBlock,
    PerStep,
    PilotResult,
    ProbeStep,
    ProcessMemory,
    RunBlock,
    SearchTry,
    Split,
    StepsBlock,
    StepTime,
    Throughput,
    Timings,
    TrackedMemory,
    ValidationBlock,
    WarmupStep,
    no_allocator,
)

STALL_FRACTION = 0.05  # a step "stalls" when it waited on the loader > 5% of its wall time
WIDE_CI = 0.10  # a mean step time known only to +-10% or worse is flagged in the result
M = Figure.measured


def assemble(s) -> PilotResult:
    """The pilot.json document of a pilot Session."""
    from tunepilot.pilot.residuals import calibration, plan_vs_measured

    spec = s.pilot_spec
    seq = s.longest["sequence_length"] if s.longest else spec.sequence_length
    b = spec.micro_batch_size
    fits = s.does_not_fit is None
    why = "no measured steps: " + (f"the run did not fit ({s.does_not_fit.phase})"
                                   if not fits else "none ran")
    pvm = plan_vs_measured(s)
    return PilotResult(
        fits=fits, verdict=f"{'fits' if fits else 'does not fit'} at micro_batch={b}, seq={seq}",
        does_not_fit=None if fits else _does_not_fit(s, b, seq),
        device=DeviceBlock(**s.device.summary(), count=s.device.count,
                           memory=M(s.device.memory_bytes, "bytes", why="not reported")),
        run=_run_block(s), params={k: M(v, "count") for k, v in (s.params or {}).items()},
        data=_data_block(s), timings=_timings(s), steps=_steps_block(s),
        step_time=_step_time(s, why), split=_split(s, why), data_wait=_data_wait(s, why),
        throughput=_throughput(s, why), mfu=_mfu(s, why), memory=_memory(s),
        validation=_validation(s), loss=_loss(s), find_max_batch=_search(s),
        per_step=_per_step(s), machine_load=s.load,
        notes=list(dict.fromkeys(s.notes + s.device.notes + _confidence_notes(s))),
        plan_vs_measured=pvm, calibration=calibration(s, pvm), log="logs/pilot.log")


def _does_not_fit(s, b: int, seq: int) -> DoesNotFit:
    d = s.does_not_fit
    where = (f"the local CPU ({s.device.name})" if not s.gpu else
             f"{s.device.torch_device} ({s.device.name})")
    if d.simulated:
        where += f", capped by --memory-limit {s.options.memory_limit_bytes:,} bytes (simulated)"
    return DoesNotFit(micro_batch_size=b, sequence_length=seq, phase=d.phase,
                      simulated=d.simulated, error=d.error, device=where,
                      message=f"does not fit at micro_batch={b}, seq={seq} on {where} "
                              f"({d.phase})",
                      live_tensor_bytes_at_oom=s.tracker_live_at_oom)


def _run_block(s) -> RunBlock:
    sp = s.pilot_spec
    return RunBlock(label=s.spec.label, method=sp.method.kind, precision=sp.precision,
                    optimizer=sp.optimizer.name, micro_batch_size=sp.micro_batch_size,
                    sequence_length=sp.sequence_length,
                    gradient_accumulation_steps=sp.gradient_accumulation_steps,
                    activation_checkpointing=sp.activation_checkpointing, trainer="tunepilot",
                    tokens_per_optimizer_step=M(sp.tokens_per_optimizer_step, "tokens"))


def _data_block(s) -> DataBlock:
    d = s.data_info
    if d is None:
        return DataBlock(source=s.pilot_spec.data.source)
    out = DataBlock(source=d.source, num_samples=M(d.num_samples, "samples"),
                    truncated_samples=M(d.truncated_samples, "samples"),
                    longest_sample_tokens=M(d.longest_sample_tokens, "tokens"),
                    path=d.path, tokenizer=d.tokenizer, notes=list(d.notes),
                    packing=d.packing, format=d.format, train_on=d.train_on,
                    chat_template=d.chat_template, packed_rows=d.packed_rows,
                    skipped_rows=d.skipped_rows)
    if s.longest:
        lb = s.longest
        out.longest_batch = LongestBatch(
            micro_batch_size=lb["micro_batch_size"], sequence_length=lb["sequence_length"],
            useful_tokens=M(lb["useful_tokens"], "tokens"),
            padded_tokens=M(lb["padded_tokens"], "tokens"),
            rule=("the micro_batch_size fullest packed rows of the whole dataset" if d.packing
                  else "the micro_batch_size longest samples of the whole dataset, padded to the "
                  "longest as training pads (synthetic: every sample is sequence_length long)"))
    return out


def _timings(s) -> Timings:
    t, ck = s.timings, s.checkpoint or {}
    why_ck = ck.get("unavailable") or ("the run did not fit: no checkpoint was written"
                                       if s.does_not_fit else "not written")
    nbytes, secs = ck.get("bytes"), ck.get("seconds")
    return Timings(
        model_load_s=M(t.get("model_load_s"), "s", why="the model did not load",
                       covers="model build and load, optimizer, scheduler and data loader"),
        setup_s=M(t.get("setup_s"), "s", why="set-up did not complete",
                  covers="device probe, plan, data read + tokenisation (not the model load, "
                         "not warm-up)"),
        warmup_s=M(t.get("warmup_s"), "s", why="warm-up did not complete"),
        measure_s=M(t.get("measure_s"), "s", why="no measured steps"),
        validation_pass_s=M((s.validation or {}).get("seconds"), "s",
                            why="no validation pass (the run did not fit)"),
        checkpoint_write_s=M(secs, "s", why=why_ck), checkpoint_bytes=M(nbytes, "bytes", why=why_ck),
        checkpoint_bytes_per_s=M(nbytes / secs if nbytes and secs else None, "bytes/s", why=why_ck),
        checkpoint_method=ck.get("method"),
        pilot_total_s=M(t.get("pilot_total_s"), "s", why="not finished"))


def _steps_block(s) -> StepsBlock:
    rule = s.stop_rule
    st = summarize([x.wall_s for x in s.steps]) if s.steps else None
    ci = st.ci95_relative if st and st.n > 1 else None
    return StepsBlock(
        warmup=M(len(s.warmup), "steps"), measured=M(len(s.steps), "steps"),
        stop_rule=rule.describe() if rule else None, stopped_because=s.stopped_because,
        ci95_relative=M(ci, "fraction", why="fewer than 2 measured steps"),
        warmup_steps=[WarmupStep(wall_s=M(w.wall_s, "s"), loss=w.loss) for w in s.warmup],
        confidence=_confidence(ci, s.load))


def _confidence(ci: float | None, load) -> str | None:
    if ci is None:
        return None
    parts = []
    if ci > WIDE_CI:
        parts.append(f"the mean step time is known to +-{ci:.0%} (95% CI), wider than "
                     f"+-{WIDE_CI:.0%}: more steps (--max-steps) or a quieter machine narrow it")
    if load is not None and load.loaded:
        parts.append(load.note)
    return "; ".join(parts) if parts else f"converged: mean step time known to +-{ci:.1%}"


def _confidence_notes(s) -> list[str]:
    c = _confidence(summarize([x.wall_s for x in s.steps]).ci95_relative
                    if len(s.steps) > 1 else None, s.load)
    return [c] if c and not c.startswith("converged") else []


def _step_time(s, why: str) -> StepTime:
    keys = ("mean", "p50", "p90", "p99", "min", "max", "std", "ci95_half_width")
    if not s.steps:
        return StepTime(**{f"{k}_s": Figure.missing("s", why) for k in keys},
                        cv=Figure.missing("fraction", why))
    st = summarize([x.wall_s for x in s.steps])
    return StepTime(**{f"{k}_s": M(getattr(st, k), "s") for k in keys}, cv=M(st.cv, "fraction"),
                    timer=("CUDA/HIP events around each step" if s.gpu else
                           "perf_counter around each step (the step ends synchronised)"))


def _split(s, why: str) -> Split:
    split = [x for x in s.steps if x.forward_s is not None]
    names = ("forward_s", "backward_s", "optimizer_s")
    if not split:
        return Split(**{n: Figure.missing("s", why) for n in (*names, "data_wait_s", "other_s")})
    n = len(split)
    means = {k: sum(getattr(x, k) for x in split) / n for k in names}
    wall = sum(x.wall_s for x in split) / n
    wait = sum(x.data_wait_s for x in split) / n
    return Split(
        **{k: M(v, "s", per="step (mean)") for k, v in means.items()},
        data_wait_s=M(wait, "s", per="step (mean)"),
        other_s=M(max(0.0, wall - wait - sum(means.values())), "s", per="step (mean)",
                  covers="host-to-device copies, loss bookkeeping, Python overhead"),
        num_split_steps=M(n, "steps"),
        how="perf_counter with a device synchronise between forward, backward and the optimizer"
            " step" + (" on every 5th step (it costs two synchronises)" if s.gpu else
                       " on every step"))


def _data_wait(s, why: str) -> DataWait:
    if not s.steps:
        return DataWait(mean_s=Figure.missing("s", why), max_s=Figure.missing("s", why),
                        num_stalls=Figure.missing("steps", why))
    waits = [x.data_wait_s for x in s.steps]
    stalls = sum(1 for x in s.steps if x.data_wait_s > STALL_FRACTION * x.wall_s)
    return DataWait(mean_s=M(sum(waits) / len(waits), "s"), max_s=M(max(waits), "s"),
                    num_stalls=M(stalls, "steps"),
                    stall_threshold=f"data wait > {STALL_FRACTION:.0%} of the step's wall time",
                    fraction_of_step_time=M(sum(waits) / sum(x.wall_s for x in s.steps),
                                            "fraction"))


def _throughput(s, why: str) -> Throughput:
    if not s.steps:
        return Throughput(**{k: Figure.missing(u, why) for k, u in (
            ("useful_tokens_per_s", "tokens/s"), ("padded_tokens_per_s", "tokens/s"),
            ("useful_fraction", "fraction"), ("samples_per_s", "samples/s"),
            ("optimizer_steps_per_s", "steps/s"))})
    wall = sum(x.wall_s for x in s.steps)
    useful = sum(x.useful_tokens for x in s.steps)
    padded = sum(x.padded_tokens for x in s.steps)
    sp = s.pilot_spec
    samples = len(s.steps) * sp.micro_batch_size * sp.gradient_accumulation_steps
    return Throughput(
        useful_tokens_per_s=M(useful / wall, "tokens/s", rule="supervised target tokens "
                              "(labels != -100) of the measured steps / their summed wall time"),
        padded_tokens_per_s=M(padded / wall, "tokens/s", rule="every token position of the "
                              "measured batches / their summed wall time"),
        useful_fraction=M(useful / padded if padded else None, "fraction"),
        samples_per_s=M(samples / wall, "samples/s"),
        optimizer_steps_per_s=M(len(s.steps) / wall, "steps/s"),
        useful_tokens=M(useful, "tokens"), padded_tokens=M(padded, "tokens"))


def _mfu(s, why: str) -> Figure:
    card_id = s.device.card_id
    if card_id is None:
        return Figure.missing("fraction", f"{s.device.name!r} is not a catalog card: no dense "
                              "peak to divide by" if s.gpu else
                              "CPU pilot: MFU is defined against a catalog card's dense peak")
    if not s.steps:
        return Figure.missing("fraction", why)
    import torch

    from tunepilot.catalog import load_catalog

    key = peak_precision(s.pilot_spec, tf32=torch.backends.cuda.matmul.allow_tf32)
    peak = (s.options.catalog or load_catalog()).get(card_id).peak_flops(key)
    if not peak:
        return Figure.missing("fraction", f"{card_id} has no {key} peak in the catalog")
    seq = sum(x.sequence_length for x in s.steps) / len(s.steps)
    fpt = flops_per_token(s.arch, s.pilot_spec, seq)
    tps = sum(x.useful_tokens for x in s.steps) / sum(x.wall_s for x in s.steps)
    return M(fpt.train * tps / peak, "fraction", card_id=card_id, peak_precision=key,
             peak_flops=M(peak, "FLOP/s"), flops_per_token=M(fpt.train, "FLOP/token"),
             achieved_flops=M(fpt.train * tps, "FLOP/s"),
             formula=f"MFU = FLOPs per token x useful tokens/s / dense {key} peak; "
                     f"{fpt.formula} (mean padded length of the measured batches)")


def _memory(s) -> MemoryBlock:
    from tunepilot.pilot.residuals import device_memory

    a = s.allocator
    if s.gpu:
        allocator = AllocatorMemory(
            peak_allocated_bytes=M(a.get("steady_peak_allocated_bytes"), "bytes", why="no steps ran",
                                   covers="steady state: warm-up step 2 onwards (the plan's "
                                          "step 2+)"),
            peak_reserved_bytes=M(a.get("steady_peak_reserved_bytes"), "bytes", why="no steps ran"),
            first_step_peak_allocated_bytes=M(
                a.get("first_step_peak_allocated_bytes"), "bytes", why="no steps ran",
                covers="model load + warm-up step 1 (creates the optimizer state)"),
            model_load_peak_allocated_bytes=M(a.get("model_load_peak_allocated_bytes"), "bytes",
                                              why="the model did not load"),
            num_alloc_retries=M(a.get("num_alloc_retries", 0), "count"),
            num_ooms=M(a.get("num_ooms", 0), "count"))
    else:
        allocator = no_allocator()
    limit = s.options.memory_limit_bytes
    return MemoryBlock(allocator=allocator, device=device_memory(s), process=_process_memory(s),
                       tracked=_tracked(s),
                       memory_limit_bytes=M(limit, "bytes", simulated=True) if limit else None)


def _process_memory(s) -> ProcessMemory:
    r = s.reading
    if not s.gpu and r is not None:
        out = ProcessMemory(
            baseline_rss_bytes=M(r.baseline_bytes, "bytes"), peak_rss_bytes=M(r.peak_bytes, "bytes"),
            rss_growth_bytes=M(r.peak_minus_baseline_bytes, "bytes"),
            source="VmHWM: the kernel's exact peak RSS, reset at the baseline "
                   "(/proc/self/clear_refs)" if r.hwm_bytes else
                   f"psutil RSS sampled every {r.interval_s * 1e3:.0f} ms",
            covers="from before the model load to the end of the checkpoint write")
        if s.tracked_peak_bytes is not None:
            out.rss_minus_tracked_bytes = M(
                r.peak_minus_baseline_bytes - s.tracked_peak_bytes, "bytes",
                covers="RSS growth beyond the tracked tensor peak: the C allocator's slack, "
                       "kernel scratch buffers, libraries loaded lazily, Python objects "
                       "(negative when memory from before the baseline was reused)")
        return out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return ProcessMemory(peak_rss_bytes=M(peak, "bytes", covers="the process's lifetime "
                                          "(getrusage)"))


def _tracked(s) -> TrackedMemory:
    mem = s.step_memory
    seen = mem is not None or s.options.memory_limit_bytes
    out = TrackedMemory(
        peak_bytes=M(s.tracked_peak_bytes if seen else None, "bytes",
                     why="the memory-probe step did not run"),
        method="TorchDispatchMode over every ATen op: distinct storages returned by ops, freed "
               "by weakref callbacks (kernel-internal scratch is not seen); on from warm-up "
               "step 2 (and on every step with --memory-limit)")
    if mem is not None:
        out.probe_step = ProbeStep(
            what="warm-up step 2 on the longest batch (optimizer state exists: the steady "
                 "state)",
            weights_bytes=M(mem.weights_bytes, "bytes"),
            gradients_bytes=M(mem.gradients_bytes, "bytes"),
            optimizer_bytes=M(mem.optimizer_bytes, "bytes"),
            activations_bytes=M(mem.activations_bytes, "bytes",
                                covers="alive at the start of backward beyond the step's start"),
            forward_backward_temporary_bytes=M(mem.forward_backward_temporary_bytes, "bytes"),
            optimizer_temporary_bytes=M(mem.optimizer_temporary_bytes, "bytes"),
            temporary_bytes=M(mem.temporary_bytes, "bytes"), peak_bytes=M(mem.peak_bytes, "bytes"))
    return out


def _validation(s) -> ValidationBlock:
    v = s.validation
    if v is None:
        return ValidationBlock(seconds=Figure.missing("s", "no validation pass (the run did "
                                                           "not fit)"))
    return ValidationBlock(
        num_batches=v["num_batches"], seconds=M(v["seconds"], "s"),
        loss=M(v["loss"], "nats/token"), useful_tokens=M(v["useful_tokens"], "tokens"),
        batches_from="the training data, a second shuffle (the spec names no validation set)")


def _loss(s) -> LossBlock:
    if not s.steps:
        return LossBlock()
    return LossBlock(first=M(s.steps[0].loss, "nats/token"),
                     last=M(s.steps[-1].loss, "nats/token"))


def _search(s) -> MaxBatchSearch | None:
    r = s.search
    if r is None:
        return None
    return MaxBatchSearch(
        max_micro_batch=M(r["max_micro_batch"], "samples", at_sequence_length=r["sequence_length"]),
        reached_search_cap=r["capped"], limit=r["limit"], accumulation_tried=r["accumulation_tried"],
        tries=[SearchTry(**t) for t in r["tries"]], seconds=M(r["seconds"], "s"),
        rule="doubling from the largest size known to fit, then bisection; each try runs full "
             "steps (fwd, bwd, optimizer) on the longest batches")


def _per_step(s) -> PerStep:
    st = s.steps
    return PerStep(wall_s=M([x.wall_s for x in st], "s"),
                   data_wait_s=M([x.data_wait_s for x in st], "s"),
                   useful_tokens=M([x.useful_tokens for x in st], "tokens"),
                   padded_tokens=M([x.padded_tokens for x in st], "tokens"),
                   loss=M([x.loss for x in st], "nats/token"))
