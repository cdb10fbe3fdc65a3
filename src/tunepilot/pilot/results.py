"""pilot.json: what the pilot measured, every number a figure with its unit (docs/pilot.md).

A figure is {"value", "unit", "measured": true} (tunepilot.figures); one this machine cannot give
is {"value": null, "measured": false, "unavailable": why}; a plan number is projected. This
module only arranges what runner measured - no torch work happens here.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from tunepilot import figures as fig
from tunepilot.arch import param_counts
from tunepilot.catalog import Catalog
from tunepilot.pilot.stats import summarize
from tunepilot.pilot.steps import StepRecord

STALL_FRACTION = 0.05  # a step "stalls" when it waited on the loader > 5% of its wall time
SCHEMA_VERSION = 1
CALIBRATED_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "temporary")

M = fig.measured


def _m(value: Any, unit: str, why: str, **extra: Any) -> dict:
    """measured(value) when there is one, else unavailable(why)."""
    return M(value, unit, **extra) if value is not None else fig.unavailable(unit, why)


def assemble(r, catalog: Catalog) -> dict:
    """The pilot.json document from a runner._Run."""
    spec = r.pilot_spec
    fits = r.does_not_fit is None
    seq = r.longest["sequence_length"] if r.longest else spec.sequence_length
    b = spec.micro_batch_size
    verdict = (f"fits at micro_batch={b}, seq={seq}" if fits else
               f"does not fit at micro_batch={b}, seq={seq}")
    no_steps = "no measured steps: " + (f"the run did not fit ({r.does_not_fit.phase})"
                                        if not fits else "none ran")
    steps = r.steps
    out: dict = {
        "schema_version": SCHEMA_VERSION,
        "fits": fits,
        "verdict": verdict,
        "does_not_fit": None if fits else {
            "micro_batch_size": b, "sequence_length": seq, "phase": r.does_not_fit.phase,
            "simulated": r.does_not_fit.simulated, "error": r.does_not_fit.error,
            "message": f"does not fit at micro_batch={b}, seq={seq} ({r.does_not_fit.phase})",
            "live_tensor_bytes_at_oom": r.tracker_live_at_oom,
        },
        "device": dict(r.device.summary(), count=r.device.count,
                       memory=_m(r.device.memory_bytes, "bytes", "not reported")),
        "run": _run_block(r),
        "params": {k: M(v, "count") for k, v in (r.params or {}).items()},
        "data": _data_block(r),
        "timings": _timings(r),
        "steps": _steps_block(r),
        "step_time": _step_time(steps, no_steps, r.device.kind),
        "split": _split(steps, no_steps, r.device.kind),
        "data_wait": _data_wait(steps, no_steps),
        "throughput": _throughput(r, steps, no_steps),
        "mfu": _mfu(r, steps, catalog, no_steps),
        "memory": _memory(r),
        "validation": _validation(r),
        "loss": _loss(r),
        "find_max_batch": _search(r),
        "per_step": _per_step(r),
        "notes": list(dict.fromkeys(r.notes + r.device.notes)),
    }
    pvm = plan_vs_measured(r)
    out["plan_vs_measured"] = pvm
    out["calibration"] = calibration(r, pvm)
    return out


def _run_block(r) -> dict:
    s = r.pilot_spec
    return {"label": r.spec.label, "method": s.method.kind, "precision": s.precision,
            "optimizer": s.optimizer.name, "micro_batch_size": s.micro_batch_size,
            "sequence_length": s.sequence_length,
            "gradient_accumulation_steps": s.gradient_accumulation_steps,
            "activation_checkpointing": s.activation_checkpointing,
            "tokens_per_optimizer_step": M(s.tokens_per_micro_batch * s.gradient_accumulation_steps,
                                           "tokens")}


def _data_block(r) -> dict:
    d = r.data_info
    out = {"source": d.source, "num_samples": M(d.num_samples, "samples"),
           "truncated_samples": M(d.truncated_samples, "samples"),
           "longest_sample_tokens": M(d.longest_sample_tokens, "tokens"),
           "path": d.path, "tokenizer": d.tokenizer, "notes": list(d.notes)}
    if r.longest:
        lb = r.longest
        out["longest_batch"] = {
            "micro_batch_size": lb["micro_batch_size"], "sequence_length": lb["sequence_length"],
            "useful_tokens": M(lb["useful_tokens"], "tokens"),
            "padded_tokens": M(lb["padded_tokens"], "tokens"),
            "rule": "the micro_batch_size longest samples, padded to the longest as training "
                    "pads (synthetic: every sample is sequence_length long)"}
    return out


def _timings(r) -> dict:
    t = r.timings
    ck = r.checkpoint or {}
    why_ck = ck.get("unavailable") or ("the run did not fit: no checkpoint was written"
                                       if r.does_not_fit else "not written")
    setup = None
    if "data_prep_s" in t and "state_setup_s" in t:
        setup = t["data_prep_s"] + t["state_setup_s"]
    nbytes, secs = ck.get("bytes"), ck.get("seconds")
    return {
        "model_load_s": _m(t.get("model_load_s"), "s", "the model did not load"),
        "setup_s": _m(setup, "s", "set-up did not complete",
                      covers="device probe, plan, data read + tokenisation, optimizer, "
                             "scheduler and loader creation (not the model load, not warm-up)"),
        "warmup_s": _m(t.get("warmup_s"), "s", "warm-up did not complete"),
        "measure_s": _m(t.get("measure_s"), "s", "no measured steps"),
        "validation_pass_s": _m((r.validation or {}).get("seconds"), "s",
                                "no validation pass (the run did not fit)"),
        "checkpoint_write_s": _m(secs, "s", why_ck),
        "checkpoint_bytes": _m(nbytes, "bytes", why_ck),
        "checkpoint_bytes_per_s": _m(nbytes / secs if nbytes and secs else None, "bytes/s",
                                     why_ck),
        "checkpoint_method": ck.get("method"),
        "pilot_total_s": _m(t.get("pilot_total_s"), "s", "not finished"),
    }


def _steps_block(r) -> dict:
    rule = r.stop_rule
    st = summarize([s.wall_s for s in r.steps]) if len(r.steps) else None
    return {
        "warmup": M(len(r.warmup), "steps"),
        "measured": M(len(r.steps), "steps"),
        "stop_rule": rule.describe() if rule else None,
        "stopped_because": r.stopped_because,
        "ci95_relative": _m(st.ci95_relative if st and st.n > 1 else None, "fraction",
                            "fewer than 2 measured steps"),
        "warmup_steps": [{"wall_s": M(w.wall_s, "s"), "loss": w.loss,
                          "batch": "longest"} for w in r.warmup],
    }


def _step_time(steps: list[StepRecord], why: str, kind: str) -> dict:
    keys = ("mean", "p50", "p90", "p99", "min", "max", "std", "ci95_half_width")
    if not steps:
        return {**{f"{k}_s": fig.unavailable("s", why) for k in keys},
                "cv": fig.unavailable("fraction", why)}
    s = summarize([x.wall_s for x in steps])
    out = {f"{k}_s": M(getattr(s, k), "s") for k in keys}
    out["cv"] = M(s.cv, "fraction")
    out["timer"] = ("CUDA/HIP events around each step" if kind != "cpu" else
                    "perf_counter around each step (the step ends synchronised)")
    return out


def _split(steps: list[StepRecord], why: str, kind: str) -> dict:
    split = [s for s in steps if s.forward_s is not None]
    names = ("forward_s", "backward_s", "optimizer_s")
    if not split:
        return {n: fig.unavailable("s", why) for n in (*names, "data_wait_s", "other_s")}
    n = len(split)
    means = {k: sum(getattr(s, k) for s in split) / n for k in names}
    wall = sum(s.wall_s for s in split) / n
    wait = sum(s.data_wait_s for s in split) / n
    out = {k: M(v, "s", per="step (mean)") for k, v in means.items()}
    out["data_wait_s"] = M(wait, "s", per="step (mean)")
    out["other_s"] = M(max(0.0, wall - wait - sum(means.values())), "s", per="step (mean)",
                       covers="host-to-device copies, loss bookkeeping, Python overhead")
    out["num_split_steps"] = M(n, "steps")
    out["how"] = ("perf_counter with a device synchronise between forward, backward and the "
                  "optimizer step" + (" on every step" if kind == "cpu" else
                                      " on every 5th step (it costs two synchronises)"))
    return out


def _data_wait(steps: list[StepRecord], why: str) -> dict:
    if not steps:
        return {"mean_s": fig.unavailable("s", why), "max_s": fig.unavailable("s", why),
                "num_stalls": fig.unavailable("steps", why)}
    waits = [s.data_wait_s for s in steps]
    stalls = sum(1 for s in steps if s.data_wait_s > STALL_FRACTION * s.wall_s)
    return {"mean_s": M(sum(waits) / len(waits), "s"), "max_s": M(max(waits), "s"),
            "num_stalls": M(stalls, "steps"),
            "stall_threshold": f"data wait > {STALL_FRACTION:.0%} of the step's wall time",
            "fraction_of_step_time": M(sum(waits) / sum(s.wall_s for s in steps), "fraction")}


def _throughput(r, steps: list[StepRecord], why: str) -> dict:
    if not steps:
        return {k: fig.unavailable(u, why) for k, u in (
            ("useful_tokens_per_s", "tokens/s"), ("padded_tokens_per_s", "tokens/s"),
            ("useful_fraction", "fraction"), ("samples_per_s", "samples/s"),
            ("optimizer_steps_per_s", "steps/s"))}
    wall = sum(s.wall_s for s in steps)
    useful = sum(s.useful_tokens for s in steps)
    padded = sum(s.padded_tokens for s in steps)
    spec = r.pilot_spec
    samples = len(steps) * spec.micro_batch_size * spec.gradient_accumulation_steps
    return {"useful_tokens_per_s": M(useful / wall, "tokens/s",
                                     rule="non-padding target tokens of the measured steps / "
                                          "their summed wall time"),
            "padded_tokens_per_s": M(padded / wall, "tokens/s",
                                     rule="every token position of the measured batches / "
                                          "their summed wall time"),
            "useful_fraction": M(useful / padded if padded else None, "fraction"),
            "samples_per_s": M(samples / wall, "samples/s"),
            "optimizer_steps_per_s": M(len(steps) / wall, "steps/s"),
            "useful_tokens": M(useful, "tokens"), "padded_tokens": M(padded, "tokens")}


PEAK_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}


def flops_per_token(r, seq_len: float) -> tuple[float, str]:
    """6 N_trainable + 4 N_frozen + 12 L H Q T (PaLM appendix B; frozen weights skip the
    weight-gradient matmul). N counts matmul weights a token passes through: the input embedding
    lookup is not a matmul (a tied embedding still is, as the LM head); MoE counts the top-k."""
    arch = r.arch
    counts = param_counts(arch)
    lookup = 0 if arch.tied_embeddings else counts.embedding
    n_matmul = counts.active_per_token - lookup
    if r.pilot_spec.method.is_lora:
        trainable, frozen = r.plan.params.trainable, n_matmul
    else:
        trainable, frozen = n_matmul, 0
    attn = 12 * arch.num_layers * arch.num_heads * arch.head_dim * seq_len
    total = 6 * trainable + 4 * frozen + attn
    formula = (f"6 x {trainable:,} trainable + 4 x {frozen:,} frozen + 12 x {arch.num_layers} "
               f"layers x {arch.num_heads} heads x {arch.head_dim} head dim x {seq_len:,.0f} "
               f"tokens (mean padded length of the measured batches) = {total:,.0f} FLOP/token")
    return total, formula


def _mfu(r, steps: list[StepRecord], catalog: Catalog, why: str) -> dict:
    card_id = r.device.card_id
    if card_id is None:
        return fig.unavailable("fraction", f"{r.device.name!r} is not a catalog card: no dense "
                               "peak to divide by" if r.device.kind != "cpu" else
                               "CPU pilot: MFU is defined against a catalog card's dense peak")
    if not steps:
        return fig.unavailable("fraction", why)
    import torch

    key = PEAK_KEY[r.pilot_spec.precision]
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    peak = catalog.get(card_id).peak_flops(key)
    if not peak:
        return fig.unavailable("fraction", f"{card_id} has no {key} peak in the catalog")
    seq = sum(s.sequence_length for s in steps) / len(steps)
    fpt, formula = flops_per_token(r, seq)
    wall = sum(s.wall_s for s in steps)
    tps = sum(s.useful_tokens for s in steps) / wall
    return M(fpt * tps / peak, "fraction", card_id=card_id, peak_precision=key,
             peak_flops=M(peak, "FLOP/s"), flops_per_token=M(fpt, "FLOP/token"),
             achieved_flops=M(fpt * tps, "FLOP/s"),
             formula=f"MFU = FLOPs per token x useful tokens/s / dense {key} peak; {formula}")


def _memory(r) -> dict:
    kind = r.device.kind
    a = r.allocator
    gpu = kind != "cpu"
    cpu_why = "CPU: no caching allocator (CUDA/HIP only)"
    if gpu:
        allocator = {
            "peak_allocated_bytes": _m(a.get("steady_peak_allocated_bytes"), "bytes",
                                       "no steps ran", covers="steady state: warm-up step 2 "
                                       "onwards (the plan's step 2+)"),
            "peak_reserved_bytes": _m(a.get("steady_peak_reserved_bytes"), "bytes",
                                      "no steps ran"),
            "first_step_peak_allocated_bytes": _m(
                a.get("first_step_peak_allocated_bytes"), "bytes", "no steps ran",
                covers="model load + warm-up step 1 (creates the optimizer state)"),
            "model_load_peak_allocated_bytes": _m(a.get("model_load_peak_allocated_bytes"),
                                                  "bytes", "the model did not load"),
            "num_alloc_retries": M(a.get("num_alloc_retries", 0), "count"),
            "num_ooms": M(a.get("num_ooms", 0), "count"),
        }
    else:
        allocator = {k: fig.unavailable(u, cpu_why) for k, u in (
            ("peak_allocated_bytes", "bytes"), ("peak_reserved_bytes", "bytes"),
            ("first_step_peak_allocated_bytes", "bytes"),
            ("model_load_peak_allocated_bytes", "bytes"), ("num_alloc_retries", "count"),
            ("num_ooms", "count"))}
    s = r.sampler
    if gpu and s is not None:
        delta = s.peak_minus_baseline_bytes
        reserved = a.get("max_reserved_bytes")
        device = {"source": s.source, "baseline_bytes": M(s.baseline_bytes, "bytes"),
                  "peak_bytes": M(s.peak_bytes, "bytes"),
                  "peak_minus_baseline_bytes": M(delta, "bytes"),
                  "gap_bytes": _m(delta - reserved if reserved is not None else None, "bytes",
                                  "no allocator reading", covers="device-wide peak minus the "
                                  "allocator's reserved peak: runtime context, cuBLAS/cuDNN "
                                  "workspaces, NCCL buffers, other processes' growth"),
                  "interval_s": s.interval_s, "num_samples": s.num_samples}
    else:
        why = cpu_why.replace("no caching allocator", "no device memory") if not gpu else \
            "no device-wide reading (NVML/amdsmi not available)"
        device = {k: fig.unavailable("bytes", why) for k in
                  ("baseline_bytes", "peak_bytes", "peak_minus_baseline_bytes", "gap_bytes")}
    process = _process_memory(r)
    tracked = _tracked(r)
    if not gpu and s is not None and r.tracked_peak_bytes is not None:
        process["rss_minus_tracked_bytes"] = M(
            s.peak_minus_baseline_bytes - r.tracked_peak_bytes, "bytes",
            covers="RSS growth beyond the tracked tensor peak: the C allocator's slack, "
                   "kernel scratch buffers, libraries loaded lazily, Python objects "
                   "(negative when memory from before the baseline was reused)")
    limit = r.options.memory_limit_bytes
    return {"allocator": allocator, "device": device, "process": process, "tracked": tracked,
            "memory_limit_bytes": M(limit, "bytes", simulated=True) if limit else None}


def _process_memory(r) -> dict:
    s = r.sampler
    if r.device.kind == "cpu" and s is not None:
        return {"baseline_rss_bytes": M(s.baseline_bytes, "bytes"),
                "peak_rss_bytes": M(s.peak_bytes, "bytes"),
                "rss_growth_bytes": M(s.peak_minus_baseline_bytes, "bytes"),
                "source": "VmHWM: the kernel's exact peak RSS, reset at the baseline "
                          "(/proc/self/clear_refs)" if s.hwm_bytes else
                f"psutil RSS sampled every {s.interval_s * 1e3:.0f} ms",
                "covers": "from before the model load to the end of the checkpoint write"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return {"peak_rss_bytes": M(peak, "bytes", covers="the process's lifetime (getrusage)")}


def _tracked(r) -> dict:
    mem = r.step_memory
    out = {"peak_bytes": _m(r.tracked_peak_bytes if mem is not None or r.options.memory_limit_bytes
                            else None, "bytes", "the memory-probe step did not run"),
           "method": "TorchDispatchMode over every ATen op: distinct storages returned by ops, "
                     "freed by weakref finalizers (kernel-internal scratch is not seen); on from "
                     "warm-up step 2 (and on every step with --memory-limit)"}
    if mem is None:
        out["probe_step"] = None
        return out
    out["probe_step"] = {
        "what": "warm-up step 2 on the longest batch (optimizer state exists: the steady state)",
        "weights_bytes": M(mem.weights_bytes, "bytes"),
        "gradients_bytes": M(mem.gradients_bytes, "bytes"),
        "optimizer_bytes": M(mem.optimizer_bytes, "bytes"),
        "activations_bytes": M(mem.activations_bytes, "bytes",
                               covers="alive at the start of backward beyond the step's start"),
        "forward_backward_temporary_bytes": M(mem.forward_backward_temporary_bytes, "bytes"),
        "optimizer_temporary_bytes": M(mem.optimizer_temporary_bytes, "bytes"),
        "temporary_bytes": M(mem.temporary_bytes, "bytes"),
        "peak_bytes": M(mem.peak_bytes, "bytes"),
    }
    return out


def plan_vs_measured(r) -> dict:
    """Residual per component: measured - planned (bytes) and measured / planned."""
    plan = r.plan
    d = plan.per_device
    mem = r.step_memory
    a = r.allocator
    gpu = r.device.kind != "cpu"
    rows: list[tuple[str, int, int | None, str]] = []
    if mem is not None:
        rows += [
            ("weights", d["weights_bytes"] + d["master_weights_bytes"], mem.weights_bytes,
             "parameters + buffers (the plan's weights + master weights)"),
            ("gradients", d["gradients_bytes"], mem.gradients_bytes, "at the optimizer step"),
            ("optimizer", d["optimizer_bytes"], mem.optimizer_bytes, "state after the step"),
            ("activations", d["activations_bytes"], mem.activations_bytes,
             "alive at the start of backward (saved tensors, logits)"),
            ("temporary", d["temporary_bytes"], mem.temporary_bytes,
             "largest transient beyond the phase's live tensors"),
        ]
    alloc = a.get("steady_peak_allocated_bytes") if gpu else (mem.peak_bytes if mem else None)
    rows.append(("allocated_peak", d["allocated_peak_bytes"], alloc,
                 "allocator max_memory_allocated" if gpu else "tracked tensor peak"))
    if gpu:
        rows.append(("reserved_peak", d["reserved_peak_bytes"], a.get("steady_peak_reserved_bytes"),
                     "allocator max_memory_reserved"))
        s = r.sampler
        if s is not None:
            delta = s.peak_minus_baseline_bytes
            reserved = a.get("max_reserved_bytes")
            rows.append(("runtime_overhead", d["runtime_overhead_bytes"],
                         delta - reserved if reserved is not None else None,
                         "device-wide peak minus reserved peak"))
            rows.append(("device_peak", d["device_peak_bytes"], delta,
                         "device-wide peak minus the pre-run baseline"))
    comps = {}
    for name, planned, measured, what in rows:
        row: dict = {"planned": fig.projected(planned, "bytes", f"{plan.fidelity} plan, "
                                              f"{plan.stack} stack"),
                     "measured": _m(measured, "bytes", "not measured (the run did not fit)"),
                     "what": what}
        if measured is not None:
            row["residual_bytes"] = M(measured - planned, "bytes", rule="measured - planned")
            row["ratio"] = M(measured / planned if planned else None, "ratio",
                             rule="measured / planned")
        comps[name] = row
    return {"plan_fidelity": plan.fidelity, "stack": plan.stack, "peak_phase": plan.peak_phase,
            "components": comps,
            "note": "the plan describes step 2+ (optimizer state exists), as the probe step is"}


def calibration(r, pvm: dict) -> dict | None:
    """The residual ratios later plans apply (memory/calibration.py, `plan --calibrate`)."""
    comps = pvm["components"]
    ratios = {c: comps[c]["ratio"]["value"] for c in CALIBRATED_COMPONENTS
              if c in comps and comps[c].get("ratio", {}).get("value") is not None}
    if not ratios:
        return None
    out: dict = {"stack": r.device.kind, "card_id": r.device.card_id, "device": r.device.name,
                 "model_config_sha256": r.arch.config_hash, "spec_hash": r.spec.spec_hash(),
                 "micro_batch_size": r.pilot_spec.micro_batch_size,
                 "sequence_length": r.longest["sequence_length"] if r.longest else None,
                 "ratios": ratios}
    a = r.allocator
    if r.device.kind != "cpu" and a.get("steady_peak_allocated_bytes"):
        out["reserve_slack_fraction"] = (a["steady_peak_reserved_bytes"] /
                                         a["steady_peak_allocated_bytes"] - 1)
        ro = comps.get("runtime_overhead", {}).get("measured", {}).get("value")
        if ro is not None:
            out["runtime_overhead_bytes"] = max(0, int(ro))
    return out


def _validation(r) -> dict:
    v = r.validation
    if v is None:
        why = "no validation pass (the run did not fit)"
        return {"seconds": fig.unavailable("s", why), "loss": None, "num_batches": None}
    return {"num_batches": v["num_batches"], "seconds": M(v["seconds"], "s"),
            "loss": M(v["loss"], "nats/token"), "useful_tokens": M(v["useful_tokens"], "tokens"),
            "batches_from": "the training data, a second shuffle (the spec names no validation "
                            "set)"}


def _loss(r) -> dict:
    losses = [s.loss for s in r.steps]
    if not losses:
        return {"first": None, "last": None}
    return {"first": M(losses[0], "nats/token"), "last": M(losses[-1], "nats/token")}


def _search(r) -> dict | None:
    s = r.search
    if s is None:
        return None
    return {"max_micro_batch": M(s["max_micro_batch"], "samples",
                                 at_sequence_length=s["sequence_length"]),
            "reached_search_cap": s["capped"], "limit": s["limit"],
            "accumulation_tried": s["accumulation_tried"],
            "tries": s["tries"], "seconds": M(s["seconds"], "s"),
            "rule": "doubling from the largest size known to fit, then bisection; each try runs "
                    "full steps (fwd, bwd, optimizer) on the longest batches"}


def _per_step(r) -> dict:
    st = r.steps
    return {"wall_s": M([s.wall_s for s in st], "s"),
            "data_wait_s": M([s.data_wait_s for s in st], "s"),
            "useful_tokens": M([s.useful_tokens for s in st], "tokens"),
            "padded_tokens": M([s.padded_tokens for s in st], "tokens"),
            "loss": M([s.loss for s in st], "nats/token")}
