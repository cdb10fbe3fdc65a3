"""The blocks of pilot.json only tunepilot's own pilot has: why it did not fit, the data and its
longest batch, the tracked tensor memory, the max-batch search, the plan comparison."""

from __future__ import annotations

from tunepilot.pilot.assemble import pilot_result
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    DataBlock,
    DoesNotFit,
    LongestBatch,
    MaxBatchSearch,
    PilotResult,
    ProbeStep,
    SearchTry,
    TrackedMemory,
)

M = Figure.measured


def pilot_document(s) -> PilotResult:
    """pilot.json of a pilot Session: the measurements (pilot_result) and the pilot's own."""
    from tunepilot.pilot.residuals import calibration, plan_vs_measured

    m = s.m
    spec = m.spec
    seq = s.longest["sequence_length"] if s.longest else spec.sequence_length
    b = spec.micro_batch_size
    fits = s.does_not_fit is None
    result = pilot_result(m, no_steps_why=None if fits else
                          f"no measured steps: the run did not fit ({s.does_not_fit.phase})")
    result.fits = fits
    result.verdict = f"{'fits' if fits else 'does not fit'} at micro_batch={b}, seq={seq}"
    result.does_not_fit = None if fits else _does_not_fit(s, b, seq)
    result.params = {k: M(v, "count") for k, v in (s.params or {}).items()}
    result.data = _data_block(s)
    result.memory.tracked = _tracked(s)
    result.memory.memory_limit_bytes = M(s.options.memory_limit_bytes, "bytes", simulated=True) \
        if s.options.memory_limit_bytes else None
    r = m.reading
    if not m.gpu and r is not None and s.tracked_peak_bytes is not None:
        result.memory.process.rss_minus_tracked_bytes = M(
            r.peak_minus_baseline_bytes - s.tracked_peak_bytes, "bytes",
            covers="RSS growth beyond the tracked tensor peak: the C allocator's slack, "
                   "kernel scratch buffers, libraries loaded lazily, Python objects "
                   "(negative when memory from before the baseline was reused)")
    result.find_max_batch = _search(s)
    result.plan_vs_measured = plan_vs_measured(s)
    result.calibration = calibration(s, result.plan_vs_measured)
    result.log = "logs/pilot.log"
    return result


def _does_not_fit(s, b: int, seq: int) -> DoesNotFit:
    d = s.does_not_fit
    where = (f"the local CPU ({s.device.name})" if not s.m.gpu else
             f"{s.device.torch_device} ({s.device.name})")
    if d.simulated:
        where += f", capped by --memory-limit {s.options.memory_limit_bytes:,} bytes (simulated)"
    return DoesNotFit(micro_batch_size=b, sequence_length=seq, phase=d.phase,
                      simulated=d.simulated, error=d.error, device=where,
                      message=f"does not fit at micro_batch={b}, seq={seq} on {where} "
                              f"({d.phase})",
                      live_tensor_bytes_at_oom=s.tracker_live_at_oom)


def _data_block(s) -> DataBlock:
    d = s.data_info
    if d is None:
        return DataBlock(source=s.m.spec.data.source)
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
