"""pilot.json from what a pilot measured (pilot/measurements.py): every number a Figure with its
unit, measured here or "not measured" with the reason (docs/pilot.md). ``pilot_result`` is the one
function that turns Measurements into a PilotResult, for tunepilot's pilot and the callbacks
alike. No torch work happens here."""

from __future__ import annotations

import resource
import statistics
import sys

from tunepilot.model.flops import MFU_RULE, flops_per_token, mfu
from tunepilot.pilot.measurements import Measurements
from tunepilot.pilot.stats import summarize
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    AllocatorMemory,
    DataWait,
    DeviceBlock,
    DeviceMemory,
    GenerationBlock,
    LossBlock,
    MemoryBlock,
    PerStep,
    PilotResult,
    ProcessMemory,
    RunBlock,
    Split,
    StepsBlock,
    StepTime,
    Throughput,
    Timings,
    ValidationBlock,
    WarmupStep,
    no_allocator,
)

STALL_FRACTION = 0.05  # a step "stalls" when it waited on the loader > 5% of its wall time
WIDE_CI = 0.10  # a mean step time known only to +-10% or worse is flagged in the result
M = Figure.measured


def pilot_result(m: Measurements, *, no_steps_why: str | None = None) -> PilotResult:
    """The pilot.json document of what was measured. The pilot adds its own blocks (the data,
    the plan comparison, the max-batch search) to the result; a callback's result is this.
    ``no_steps_why``: what the figures of a run without measured steps say instead."""
    why = no_steps_why or "no measured steps: none ran"
    return PilotResult(
        source=m.source, fits=True, verdict=f"measured {len(m.steps)} steps"
        + ("" if m.trainer == "tunepilot" else f" of the user's own {m.trainer} run"),
        device=DeviceBlock(**m.device.summary(), count=m.device.count,
                           memory=M(m.device.memory_bytes, "bytes", why="not reported")),
        run=run_block(m), timings=_timings(m), steps=_steps_block(m),
        step_time=_step_time(m, why), split=_split(m, why), data_wait=_data_wait(m, why),
        throughput=_throughput(m, why), mfu=_mfu(m, why), memory=_memory(m),
        validation=_validation(m), loss=_loss(m), per_step=_per_step(m),
        machine_load=m.load, generation=_generation(m),
        notes=list(dict.fromkeys(m.notes + m.device.notes + _bf16_note(m)
                                                     + _confidence_notes(m))))


def _bf16_note(m: Measurements) -> list[str]:
    from tunepilot.device import emulated_bf16_note

    note = emulated_bf16_note(m.device, m.spec.precision) if hasattr(m.device, "cpu") else None
    return [note] if note else []


def run_block(m: Measurements) -> RunBlock:
    sp = m.spec
    seq = max((x.sequence_length for x in m.steps + m.warmup), default=None) \
        if m.trainer != "tunepilot" else sp.sequence_length
    return RunBlock(label=sp.label, method=sp.method.kind, precision=sp.precision,
                    optimizer=sp.optimizer.name, micro_batch_size=sp.micro_batch_size,
                    sequence_length=seq,
                    gradient_accumulation_steps=sp.gradient_accumulation_steps,
                    activation_checkpointing=sp.activation_checkpointing, trainer=m.trainer,
                    objective=sp.objective.kind,
                    tokens_per_optimizer_step=M(sp.batch.positions_per_step, "tokens",
                                                covers=None if m.trainer == "tunepilot" else
                                                "at the longest sequence seen"))


def _timings(m: Measurements) -> Timings:
    t, ck = m.times, m.checkpoint
    why_ck = (ck.unavailable if ck and ck.unavailable else
              "the run saved no checkpoint while recording" if m.trainer != "tunepilot" else
              "the run did not fit: no checkpoint was written")
    nbytes, secs = (ck.nbytes, ck.seconds) if ck else (None, None)
    v = m.validation
    return Timings(
        model_load_s=M(t.model_load_s, "s", why=t.model_load_why,
                       covers="model build and load, optimizer, scheduler and data loader"),
        setup_s=M(t.setup_s, "s", why="set-up did not complete", covers=t.setup_covers),
        warmup_s=M(t.warmup_s, "s", why="warm-up did not complete"),
        measure_s=M(t.measure_s, "s", why="no measured steps"),
        validation_pass_s=M(v.seconds if v else None, "s",
                            why="no validation pass (the run did not fit)"
                            if m.trainer == "tunepilot" else
                            "the run did not evaluate while recording"),
        checkpoint_write_s=M(secs, "s", why=why_ck,
                             covers=(f"the last of {ck.count} saves ({ck.total_s:.2f} s in all)"
                                     if ck and ck.count > 1 and ck.total_s else None)),
        checkpoint_bytes=M(nbytes, "bytes", why=why_ck),
        checkpoint_bytes_per_s=M(nbytes / secs if nbytes and secs else None, "bytes/s",
                                 why=why_ck),
        checkpoint_method=ck.method if ck else None,
        pilot_total_s=M(t.total_s, "s", why="not finished", covers=t.total_covers))


def _steps_block(m: Measurements) -> StepsBlock:
    st = summarize([x.wall_s for x in m.steps]) if m.steps else None
    ci = st.ci95_relative if st and st.n > 1 else None
    return StepsBlock(
        warmup=M(len(m.warmup), "steps"), measured=M(len(m.steps), "steps"),
        stop_rule=m.stop_rule, stopped_because=m.stopped_because,
        ci95_relative=M(ci, "fraction", why="fewer than 2 measured steps"),
        warmup_steps=[WarmupStep(wall_s=M(w.wall_s, "s"), loss=w.loss) for w in m.warmup],
        confidence=_confidence(ci, m.load))


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


def _confidence_notes(m: Measurements) -> list[str]:
    c = _confidence(summarize([x.wall_s for x in m.steps]).ci95_relative
                    if len(m.steps) > 1 else None, m.load)
    return [c] if c and not c.startswith("converged") else []


def _step_time(m: Measurements, why: str) -> StepTime:
    keys = ("mean", "p50", "p90", "p99", "min", "max", "std", "ci95_half_width")
    if not m.steps:
        return StepTime(**{f"{k}_s": Figure.missing("s", why) for k in keys},
                        cv=Figure.missing("fraction", why))
    st = summarize([x.wall_s for x in m.steps])
    return StepTime(**{f"{k}_s": M(getattr(st, k), "s") for k in keys}, cv=M(st.cv, "fraction"),
                    timer=("CUDA/HIP events around each step" if m.gpu else
                           "perf_counter around each step (the step ends synchronised)"))


def _split(m: Measurements, why: str) -> Split:
    split = [x for x in m.steps if x.forward_s is not None]
    names = ("forward_s", "backward_s", "optimizer_s")
    if not split:
        out = Split(**{n: Figure.missing("s", why) for n in (*names, "data_wait_s", "other_s")})
        if m.steps:
            out.data_wait_s = M(statistics.fmean(x.data_wait_s for x in m.steps), "s",
                                per="step (mean)")
        out.how = m.split_how
        return out
    means = {k: statistics.fmean(getattr(x, k) for x in split) for k in names}
    gens = [x.generation_s or 0.0 for x in split]
    if any(gens):
        means["generation_s"] = statistics.fmean(gens)
    wall = statistics.fmean(x.wall_s for x in split)
    wait = statistics.fmean(x.data_wait_s for x in split)
    return Split(
        **{k: M(v, "s", per="step (mean)") for k, v in means.items()},
        data_wait_s=M(wait, "s", per="step (mean)"),
        other_s=M(max(0.0, wall - wait - sum(means.values())), "s", per="step (mean)",
                  covers="host-to-device copies, loss bookkeeping, Python overhead"),
        num_split_steps=M(len(split), "steps"),
        how=m.split_how or (
            "perf_counter with a device synchronise between forward, backward and the "
            "optimizer step" + (" on every 5th step (it costs two synchronises)" if m.gpu else
                                " on every step")))


def _generation(m: Measurements) -> GenerationBlock | None:
    """GRPO/RLOO's generation phase: seconds per step, its share of the step, tokens/s."""
    steps = [x for x in m.steps if x.generation_s is not None]
    if not steps and m.generation_peak_bytes is None:
        return None
    gen = sum(x.generation_s for x in steps)
    toks = sum(x.generated_tokens or 0 for x in steps)
    wall = sum(x.wall_s for x in steps)
    return GenerationBlock(
        backend=m.generation_how or "transformers' generate (KV cache)",
        seconds_per_step=M(gen / len(steps) if steps else None, "s", why="no measured steps",
                           per="step (mean)"),
        fraction_of_step_time=M(gen / wall if wall else None, "fraction",
                                why="no measured steps"),
        generated_tokens_per_s=M(toks / gen if gen else None, "tokens/s",
                                 why="no measured steps"),
        peak_bytes=M(m.generation_peak_bytes, "bytes", why="not tracked",
                     covers="the memory-probe step's generation: weights, optimizer state, "
                            "the KV cache and the sampling logits"),
        how="perf_counter around generate (synchronised on a GPU); each step's generation "
            "batch is micro_batch_size x gradient_accumulation_steps completions")


def _data_wait(m: Measurements, why: str) -> DataWait:
    if not m.steps:
        return DataWait(mean_s=Figure.missing("s", why), max_s=Figure.missing("s", why),
                        num_stalls=Figure.missing("steps", why))
    waits = [x.data_wait_s for x in m.steps]
    stalls = sum(1 for x in m.steps if x.data_wait_s > STALL_FRACTION * x.wall_s)
    return DataWait(mean_s=M(statistics.fmean(waits), "s"), max_s=M(max(waits), "s"),
                    num_stalls=M(stalls, "steps"),
                    stall_threshold=f"data wait > {STALL_FRACTION:.0%} of the step's wall time",
                    fraction_of_step_time=M(sum(waits) / sum(x.wall_s for x in m.steps),
                                            "fraction"))


def _throughput(m: Measurements, why: str) -> Throughput:
    if not m.steps:
        return Throughput(**{k: Figure.missing(u, why) for k, u in (
            ("useful_tokens_per_s", "tokens/s"), ("padded_tokens_per_s", "tokens/s"),
            ("useful_fraction", "fraction"), ("samples_per_s", "samples/s"),
            ("optimizer_steps_per_s", "steps/s"))})
    wall = sum(x.wall_s for x in m.steps)
    useful = sum(x.useful_tokens for x in m.steps)
    padded = sum(x.padded_tokens for x in m.steps)
    sp = m.spec
    per_step = sp.micro_batch_size * sp.gradient_accumulation_steps
    samples = sum(x.samples if x.samples is not None else per_step for x in m.steps)
    return Throughput(
        useful_tokens_per_s=M(useful / wall, "tokens/s", rule="supervised target tokens "
                              "(labels != -100) of the measured steps / their summed wall time"),
        padded_tokens_per_s=M(padded / wall, "tokens/s", rule="every token position of the "
                              "measured batches / their summed wall time"),
        useful_fraction=M(useful / padded if padded else None, "fraction"),
        samples_per_s=M(samples / wall, "samples/s"),
        optimizer_steps_per_s=M(len(m.steps) / wall, "steps/s"),
        useful_tokens=M(useful, "tokens"), padded_tokens=M(padded, "tokens"),
        mean_sequence_length=M(mean_processed_length(m), "tokens"))


def mean_processed_length(m: Measurements) -> float:
    """The mean padded length of the measured micro-batch rows (MFU_RULE's length): token
    positions / sequences of the measured steps."""
    per_step = m.spec.micro_batch_size * m.spec.gradient_accumulation_steps
    rows = sum(x.samples if x.samples else per_step for x in m.steps)
    return sum(x.padded_tokens for x in m.steps) / rows


def _mfu(m: Measurements, why: str) -> Figure:
    card_id = m.device.card_id
    if card_id is None:
        return Figure.missing("fraction", f"{m.device.name!r} is not a catalog card: no dense "
                              "peak to divide by" if m.gpu else
                              "CPU pilot: MFU is defined against a catalog card's dense peak")
    if not m.steps:
        return Figure.missing("fraction", why)
    from tunepilot.catalog import load_catalog

    key = m.spec.precision.peak_key
    peak = (m.catalog or load_catalog()).get(card_id).peak_flops(key)
    if not peak:
        return Figure.missing("fraction", f"{card_id} has no {key} peak in the catalog")
    seq = mean_processed_length(m)
    fpt = flops_per_token(m.arch, m.spec, seq)
    positions = sum(x.padded_tokens for x in m.steps) / sum(x.wall_s for x in m.steps)
    value = mfu(m.arch, m.spec, positions, seq, peak)
    return M(value, "fraction", card_id=card_id, peak_precision=key,
             peak_flops=Figure.projected(peak, "FLOP/s", f"catalog {card_id} dense {key} peak"),
             flops_per_token=M(fpt.train, "FLOP/token"),
             achieved_flops=M(fpt.train * positions, "FLOP/s"),
             formula=f"{MFU_RULE}; {fpt.formula}" + _tf32_note(m))


def _tf32_note(m: Measurements) -> str:
    if not m.gpu or not m.spec.precision.all_fp32:
        return ""
    import torch

    return ("; TF32 was on for matmuls in this run, so fp32 matmuls ran faster than the fp32 "
            "peak counts" if torch.backends.cuda.matmul.allow_tf32 else "")


def _memory(m: Measurements) -> MemoryBlock:
    a = m.allocator
    ours = m.trainer == "tunepilot"
    if m.gpu:
        allocator = AllocatorMemory(
            peak_allocated_bytes=M(a.steady_peak_allocated_bytes, "bytes", why="no steps ran",
                                   covers="steady state: after the warm-up steps (the plan's "
                                          "step 2+)"),
            peak_reserved_bytes=M(a.steady_peak_reserved_bytes, "bytes", why="no steps ran"),
            first_step_peak_allocated_bytes=M(
                a.first_step_peak_allocated_bytes, "bytes", why="no steps ran",
                covers="model load + warm-up step 1 (creates the optimizer state)" if ours
                else "model load + the warm-up steps"),
            model_load_peak_allocated_bytes=M(a.model_load_peak_allocated_bytes, "bytes",
                                              why=m.times.model_load_why),
            num_alloc_retries=M(a.num_alloc_retries, "count"),
            num_ooms=M(a.num_ooms, "count"))
    else:
        allocator = no_allocator()
    return MemoryBlock(allocator=allocator, device=device_memory(m),
                       process=_process_memory(m))


def device_memory(m: Measurements) -> DeviceMemory:
    """The device-wide NVML/amdsmi reading (a GPU), or why there is none."""
    r = m.reading
    if m.gpu and r is not None:
        delta = r.peak_minus_baseline_bytes
        reserved = m.allocator.max_reserved_bytes or m.allocator.steady_peak_reserved_bytes
        return DeviceMemory(
            source=r.source, baseline_bytes=M(r.baseline_bytes, "bytes"),
            peak_bytes=M(r.peak_bytes, "bytes"), peak_minus_baseline_bytes=M(delta, "bytes"),
            gap_bytes=M(delta - reserved if reserved is not None else None, "bytes",
                        why="no allocator reading", covers="device-wide peak minus the allocator's "
                        "reserved peak: runtime context, cuBLAS/cuDNN workspaces, NCCL "
                        "buffers, other processes' growth"),
            interval_s=r.interval_s, num_samples=r.num_samples)
    why = ("CPU: no device memory (CUDA/HIP only)" if not m.gpu else
           "no device-wide reading (NVML/amdsmi not available)")
    return DeviceMemory(**{k: Figure.missing("bytes", why) for k in
                           ("baseline_bytes", "peak_bytes", "peak_minus_baseline_bytes",
                            "gap_bytes")})


def _process_memory(m: Measurements) -> ProcessMemory:
    r = m.reading
    if not m.gpu and r is not None:
        return ProcessMemory(
            baseline_rss_bytes=M(r.baseline_bytes, "bytes"), peak_rss_bytes=M(r.peak_bytes, "bytes"),
            rss_growth_bytes=M(r.peak_minus_baseline_bytes, "bytes"),
            source="VmHWM: the kernel's exact peak RSS, reset at the baseline "
                   "(/proc/self/clear_refs)" if r.hwm_bytes else
                   f"psutil RSS sampled every {r.interval_s * 1e3:.0f} ms",
            covers="from before the model load to the end of the checkpoint write"
            if m.trainer == "tunepilot" else "from the first step to the end of training")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return ProcessMemory(peak_rss_bytes=M(peak, "bytes", covers="the process's lifetime "
                                          "(getrusage): host memory of the training process"))


def _validation(m: Measurements) -> ValidationBlock:
    v = m.validation
    if v is None:
        return ValidationBlock(seconds=Figure.missing(
            "s", "no validation pass (the run did not fit)" if m.trainer == "tunepilot" else
            "the run did not evaluate while recording"))
    return ValidationBlock(
        num_batches=v.num_batches, seconds=M(v.seconds, "s"),
        loss=M(v.loss, "nats/token", why="not reported"),
        useful_tokens=M(v.useful_tokens, "tokens", why="not counted"),
        batches_from=v.batches_from)


def _loss(m: Measurements) -> LossBlock:
    if m.losses is not None:
        return LossBlock(first=M(m.losses[0], "nats/token"), last=M(m.losses[1], "nats/token"))
    if not m.steps:
        return LossBlock()
    return LossBlock(first=M(m.steps[0].loss, "nats/token"),
                     last=M(m.steps[-1].loss, "nats/token"))


def _per_step(m: Measurements) -> PerStep:
    st = m.steps
    return PerStep(wall_s=M([x.wall_s for x in st], "s"),
                   data_wait_s=M([x.data_wait_s for x in st], "s"),
                   useful_tokens=M([x.useful_tokens for x in st], "tokens"),
                   padded_tokens=M([x.padded_tokens for x in st], "tokens"),
                   loss=M([x.loss for x in st], "nats/token"))
