"""The traced memory plan: the spec's real training step, run on fake tensors on a CPU.

`make_traced_plan` builds the user's model (transformers + PEFT, as the pilot builds it, via
tunepilot.models) on the meta device, turns every parameter and buffer into a fake CPU tensor
(FakeTensorMode: shapes, dtypes and aliasing, no data) and runs two optimizer steps of the step
tunepilot.training runs - forward, loss, backward, gradient clipping, optimizer step, zero_grad -
under `StorageTracker` (memory/tracker.py). The peak of step 2 counts: optimizer state exists
from step 1. Gradient accumulation: step 2 runs min(accumulation, 3) micro-batches; micro-batches
after the second repeat its allocations exactly (same shapes), and the third shows it.

The trace runs in a child process (`python -m tunepilot.memory.trace`): an abort inside PyTorch
(e.g. fake CUDA tensors reaching a kernel without a device guard) becomes a fallback to the
analytic plan with the reason, never a crash of the CLI. The parent never imports torch.

What the trace maps to the target card rather than traces (each says so in `assumptions`):
  attention  fake *CPU* tensors take the CPU flash-attention kernel, which saves the output and
             the logsumexp, as CUDA flash / memory-efficient attention do (the meta device would
             take the math path with an s x s matrix per head; fake CUDA tensors abort).
  QLoRA      bitsandbytes is CUDA-only: the frozen base is traced as bf16 linears whose storage is
             counted as bitsandbytes lays out NF4 (packed codes + absmax, tracker.nf4_parts),
             each matmul dequantising a bf16 weight-sized temporary in forward and again in
             backward, as bnb's MatMul4Bit does.
  8-bit and paged optimizers (bitsandbytes): a stand-in with the same state (uint8 + absmax).
  DDP        gradient buckets added to every phase (a second copy of the gradients).
  FSDP       per-rank figures derived from the single-device trace (see `_derive_fsdp`).
  runtime    context, workspaces and allocator reserve from analytic.runtime_constants, as the
             analytic plan does, so both share one schema.
The inverse queries of the fit table (max micro-batch, max sequence length, device counts) use
the analytic planner scaled by the traced/analytic ratio of model states and of the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tunepilot.arch import Arch
from tunepilot.catalog import Catalog, load_catalog
from tunepilot.memory.analytic import (
    FSDP_UNSHARDED_LAYERS,
    MemoryPlan,
    ParamSplit,
    Phase,
    analytic_plan,
    per_device_figures,
    runtime_constants,
)
from tunepilot.memory.fit import DEFAULT_HEADROOM, fit_card
from tunepilot.memory.plan import resolve_model_config
from tunepilot.spec import RunSpec

# Environment knobs (tests and benchmarks; not user flags).
ENV_TIMEOUT = "TUNEPILOT_TRACE_TIMEOUT_S"
ENV_FORCE_ABORT = "TUNEPILOT_TRACE_FORCE_ABORT"  # "1": the child calls os.abort() (tests)
DEFAULT_TIMEOUT_S = 900
COMPONENTS = ("weights", "master_weights", "gradients", "optimizer", "activations", "temporary")


@dataclass
class TracedPlan(MemoryPlan):
    """A MemoryPlan (same schema, fidelity "trace") plus what the trace saw."""

    trace: dict = field(default_factory=dict)


class TraceFailed(Exception):
    """The trace could not run; the message is the reason shown with the analytic fallback."""


# ============================================================================ the parent side


def make_traced_plan(spec: RunSpec, *, catalog: Catalog | None = None,
                     card_ids: list[str] | None = None, headroom: float = DEFAULT_HEADROOM,
                     base_dir: Path | None = None, timeout_s: float | None = None) -> MemoryPlan:
    """The traced plan of `spec`, fitted against `card_ids` (default: every catalog card).

    Falls back to the analytic plan (fidelity "analytic", the reason first in `assumptions` and
    in `trace["fallback_reason"]`) when the trace fails for any reason.
    """
    catalog = catalog or load_catalog()
    config = resolve_model_config(spec, base_dir)
    arch = Arch.from_config(config)
    cards = [catalog.get(c) for c in card_ids] if card_ids else list(catalog.cards)
    stack = cards[0].software_stack if cards else "cuda"
    analytic = analytic_plan(spec, arch, stack)
    t0 = time.perf_counter()
    try:
        raw = trace_in_child(spec, config, stack, timeout_s=timeout_s)
        plan = traced_plan_from(spec, raw, analytic, stack)
    except TraceFailed as exc:
        plan = _fallback(analytic, str(exc))
    except (KeyError, TypeError, ValueError) as exc:  # a result this version cannot read
        plan = _fallback(analytic, f"the trace's result could not be read ({exc!r})")
    if plan.fidelity != "trace":
        plan.cards = [fit_card(spec, arch, c, analytic_plan, headroom, plan) for c in cards]
        return plan
    plan.trace["wall_s"] = round(time.perf_counter() - t0, 2)
    planner = scaled_planner(plan, analytic)
    plan.cards = [fit_card(spec, arch, c, planner, headroom, plan) for c in cards]
    return plan


def trace_in_child(spec: RunSpec, config: dict, stack: str, *,
                   timeout_s: float | None = None) -> dict:
    """Run `trace_step` in a fresh Python process; its result, or TraceFailed with the reason."""
    timeout = float(timeout_s or os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="tunepilot-trace-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "config": config,
                                   "stack": stack}))
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "tunepilot.memory.trace", str(req), str(res)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise TraceFailed(f"the trace took longer than {timeout:.0f} s (set "
                              f"{ENV_TIMEOUT} to allow more)") from None
        try:
            result = json.loads(res.read_text()) if res.exists() else None
        except (OSError, json.JSONDecodeError):  # killed while writing it
            result = None
    if proc.returncode != 0 or result is None:
        raise TraceFailed(_child_failure(proc.returncode, proc.stderr, result))
    if result.get("status") != "ok":
        raise TraceFailed(result.get("reason", "the trace reported no result"))
    return result


def _child_failure(rc: int, stderr: str, result: dict | None) -> str:
    if result and result.get("status") == "error":
        return result["reason"]
    if rc < 0:
        try:
            how = f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            how = f"was killed by signal {-rc}"
    else:
        how = f"exited with code {rc}"
    lines = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
    tail = f": {lines[-1].strip()[:300]}" if lines else ""
    return f"the trace process {how} (an abort inside PyTorch){tail}"


def _fallback(analytic: MemoryPlan, reason: str) -> TracedPlan:
    d = analytic.to_dict()
    d["phases"] = analytic.phases
    d.pop("cards", None)
    plan = TracedPlan(**{k: v for k, v in d.items() if k != "params"}, params=analytic.params,
                      trace={"status": "fallback", "fallback_reason": reason})
    plan.assumptions = [f"trace failed, so this is the analytic plan: {reason}"] + list(
        analytic.assumptions)
    return plan


def traced_peak_for_benchmark(spec: RunSpec, arch: Arch, config: dict | None = None) -> dict:
    """The traced figures benchmarks/plan_accuracy.py compares against published peaks: the
    allocated, reserved and device peaks of one CUDA device, and a note (the attention path, or
    the reason the trace fell back, in which case the peaks are absent)."""
    config = config or resolve_model_config(spec)
    analytic = analytic_plan(spec, arch, "cuda")
    try:
        plan = traced_plan_from(spec, trace_in_child(spec, config, "cuda"), analytic, "cuda")
    except TraceFailed as exc:
        return {"note": f"fallback: {exc}"}
    keys = ("allocated_peak_bytes", "reserved_peak_bytes", "device_peak_bytes")
    return {**{k: plan.per_device[k] for k in keys}, "peak_phase": plan.peak_phase,
            "note": plan.trace.get("attention_path", "").split(":")[0],
            "child_wall_s": plan.trace.get("child_wall_s")}


# ---------------------------------------------------------------------------- building the plan


def _phase_bytes(p: dict) -> dict:
    d = {c: int(p.get(f"{c}_bytes", 0)) for c in COMPONENTS}
    d["cast_act"] = int(p.get("weight_cast_activations_bytes", 0))
    d["cast_tmp"] = int(p.get("weight_cast_bytes", 0)) - d["cast_act"]
    return d


def traced_plan_from(spec: RunSpec, raw: dict, analytic: MemoryPlan, stack: str) -> TracedPlan:
    """Turn the child's trace (single device) into the plan of `spec` on one of its ranks."""
    N = spec.parallel.world_size
    strategy = spec.parallel.strategy
    notes = list(raw.get("notes", []))
    phases_in = [dict(_phase_bytes(p), name=p["name"]) for p in raw["phases"]]
    buckets = 0
    if strategy == "fsdp" and N > 1:
        phases_in, fsdp_notes = _derive_fsdp(spec, raw, phases_in)
        notes += fsdp_notes
    elif strategy == "ddp" and N > 1:
        buckets = int(raw["model"]["trainable_bytes"])
        notes.append("DDP: gradient buckets (a second copy of the gradients, PyTorch's default "
                     "gradient_as_bucket_view=False) added to every phase")
    phases = [Phase(p["name"], p["weights"], p["master_weights"], p["gradients"], p["optimizer"],
                    p["activations"], p["temporary"], buckets) for p in phases_in]
    peak = max(phases, key=lambda p: p.total_bytes)
    load_peak = analytic.per_device["load_peak_bytes"]
    per_device = per_device_figures(phases, buckets, stack, N, load_peak)
    slack = runtime_constants()["allocator"]["reserve_slack_fraction"]
    peak_name = peak.name
    if load_peak > peak.total_bytes:
        notes.append("loading the model sets the peak, not the training step (load peak from "
                     "the analytic plan; loading is not traced)")
        peak_name = "model-load"
    notes.append(f"runtime overhead and allocator reserve (+{slack:.0%}) from the same model as "
                 "the analytic plan (data/runtime.yaml)")
    m = raw["model"]
    params = ParamSplit(total=m["total_params"], trainable=m["trainable_params"],
                        frozen=m["total_params"] - m["trainable_params"])
    shard = N if strategy == "fsdp" else 1
    bpp = _bytes_per_param(params, per_device, shard)
    trace = {k: raw[k] for k in ("attention_path", "attention_kernel", "optimizer_impl",
                                 "step1_peak_bytes", "micro_batch_peaks_bytes",
                                 "accumulation_peak_stable", "peak_raw_bytes", "num_ops",
                                 "child_wall_s", "child_peak_rss_bytes", "saved_bytes_at_peak",
                                 "traced_on") if k in raw}
    trace.update(status="traced", peak_phase=peak.name,
                 fsdp="derived from the single-device trace" if shard > 1 else None)
    return TracedPlan(
        fidelity="trace", params=params, per_device=per_device, phases=phases,
        peak_phase=peak_name, bytes_per_param=bpp,
        tokens_per_micro_batch=spec.tokens_per_micro_batch,
        tokens_per_optimizer_step=spec.tokens_per_micro_batch * spec.gradient_accumulation_steps
        * N, world_size=N, strategy=strategy, stack=stack, assumptions=notes, trace=trace)


def _bytes_per_param(params: ParamSplit, d: dict, shard: int) -> dict:
    tr, total = max(params.trainable, 1), max(params.total, 1)
    w, mw, g, o = (d[k] for k in ("weights_bytes", "master_weights_bytes", "gradients_bytes",
                                  "optimizer_bytes"))
    return {"weights_per_param": w * shard / total,
            "master_weights_per_trainable_param": mw * shard / tr,
            "gradients_per_trainable_param": g * shard / tr,
            "optimizer_per_trainable_param": o * shard / tr,
            "model_states_per_param": (w + mw + g + o) * shard / total}


def _derive_fsdp(spec: RunSpec, raw: dict, phases: list[dict]) -> tuple[list[dict], list[str]]:
    """One FSDP2 rank, from the single-device trace and the traced model's parameter shapes.

    Not traced under a fake process group: FSDP2 frees and re-allocates unsharded parameters by
    resizing storages in place (UntypedStorage.resize_), which no dispatch mode sees, so a trace
    of fully_shard would under-count exactly the memory FSDP adds. Instead, per phase:
      parameters, gradients  each tensor sharded on dim 0, padded as FSDP2 pads it
                             (ceil(dim0 / N) rows per rank), from the traced shapes (the
                             scaling worker reduce-scatters every micro-batch, so gradients
                             stay sharded through accumulation);
      optimizer state        scaled like the trainable parameters it shadows;
      activations            per rank as traced (the micro-batch does not shrink), except
                             autocast's 16-bit weight copies (saved, or held by autocast's cast
                             cache until the forward ends), counted 1/N as the analytic plan
                             does;
      temporaries            + the unsharded parameters in the compute dtype: the current and
                             the prefetched layer (FSDP_UNSHARDED_LAYERS) + the root module
                             (embedding, norm, lm_head), or every layer when
                             reshard_after_forward is false; the optimizer step's temporaries
                             scale with the shards.
    """
    N = spec.parallel.world_size
    m = raw["model"]
    cb = 4 if spec.precision == "fp32" else 2
    rows = m["param_rows"]  # [dim 0, bytes, trainable] per parameter tensor

    def full(keep) -> int:
        return sum(b for _, b, t in rows if keep(t))

    def sharded(keep) -> int:  # FSDP2: ceil(dim0 / N) rows of each tensor per rank
        return sum(-(-d0 // N) * (b // max(d0, 1)) for d0, b, t in rows if keep(t))

    def is_w(t):
        return not _is_master(spec, t)

    def is_mw(t):
        return _is_master(spec, t)

    def is_tr(t):
        return t

    full_w, full_mw, full_tr = full(is_w), full(is_mw), full(is_tr)
    sh_w, sh_mw, sh_tr = sharded(is_w), sharded(is_mw), sharded(is_tr)
    tr_ratio = sh_tr / full_tr if full_tr else 0.0
    layer_numel, root_numel = m["layer_numel"], m["root_numel"]
    if spec.parallel.reshard_after_forward:
        unsharded = cb * (FSDP_UNSHARDED_LAYERS * layer_numel + root_numel)
        what = f"{FSDP_UNSHARDED_LAYERS} layers + root"
    else:
        unsharded = cb * m["total_base_numel"]
        what = "all layers (reshard_after_forward: false)"
    out = []
    for p in phases:
        q = dict(p)
        opt_phase = p["name"].startswith("optimizer")
        q["weights"] = int(p["weights"] * sh_w / full_w) if full_w else 0
        q["master_weights"] = int(p["master_weights"] * sh_mw / full_mw) if full_mw else 0
        q["gradients"] = int(p["gradients"] * tr_ratio)
        q["optimizer"] = int(p["optimizer"] * tr_ratio)
        ca, ct = p["cast_act"], p["cast_tmp"]
        q["activations"] = p["activations"] - ca + ca // N
        if opt_phase:
            q["temporary"] = int(p["temporary"] * tr_ratio)
        else:
            q["temporary"] = p["temporary"] - ct + ct // N + unsharded
        out.append(q)
    notes = [f"FSDP2 over {N} ranks: per-rank figures derived from the single-device trace "
             "(fully_shard under a fake process group is not traced: it resizes storages in "
             "place, which a dispatch-mode tracker cannot see); parameters, gradients and "
             f"optimizer state sharded 1/{N} per tensor with FSDP2's dim-0 padding; unsharded "
             f"{what} in the compute dtype"]
    return out, notes


def _is_master(spec: RunSpec, trainable: bool) -> bool:
    return trainable and spec.precision.endswith("-mixed")


def scaled_planner(traced: MemoryPlan, analytic: MemoryPlan):
    """An analytic planner scaled by traced/analytic ratios taken at the spec, for the inverse
    queries (max micro-batch, max sequence length, device counts), which would otherwise need
    one trace per candidate. Three ratios, each of like phases: model states (largest phase of
    each plan), the rest of the forward/backward phases (activations, temporaries, buffers:
    what grows with tokens) and the rest of the optimizer step (its temporaries)."""
    r_states = _ratio(max(map(_states, traced.phases)), max(map(_states, analytic.phases)))
    r_act = _ratio(_rest_max(traced, False), _rest_max(analytic, False))
    r_opt = _ratio(_rest_max(traced, True), _rest_max(analytic, True))

    def planner(spec: RunSpec, arch: Arch, stack: str) -> MemoryPlan:
        a = analytic_plan(spec, arch, stack)
        allocated = max(int(_states(ph) * r_states + _rest(ph) * (r_opt if _is_opt(ph) else r_act))
                        for ph in a.phases)
        allocated = max(allocated, a.per_device["load_peak_bytes"])
        slack = runtime_constants()["allocator"]["reserve_slack_fraction"]
        d = dict(a.per_device, allocated_peak_bytes=allocated,
                 reserved_peak_bytes=int(allocated * (1 + slack)))
        d["device_peak_bytes"] = d["reserved_peak_bytes"] + d["runtime_overhead_bytes"]
        a.per_device = d
        return a

    return planner


def _states(p: Phase) -> int:
    return p.weights_bytes + p.master_weights_bytes + p.gradients_bytes + p.optimizer_bytes


def _rest(p: Phase) -> int:
    return p.total_bytes - _states(p)


def _is_opt(p: Phase) -> bool:
    return p.name.startswith("optimizer")


def _rest_max(plan: MemoryPlan, optimizer: bool) -> int:
    return max((_rest(p) for p in plan.phases if _is_opt(p) == optimizer), default=0)


def _ratio(a: int, b: int) -> float:
    return a / b if b > 0 else 1.0


# ============================================================================ the child side


def trace_step(spec: RunSpec, config: dict, stack: str, *, fake: bool = True,
               device: str = "cpu") -> dict:
    """Two optimizer steps of the spec under a StorageTracker; the peaks of step 2, by phase.

    The step is tunepilot.training.train_step's, phase by phase: forward + loss under the
    spec's autocast, backward, then gradient clipping, optimizer step, zero_grad, scheduler.
    `fake=False` runs it on real tensors on `device` (the fake-vs-real test on the CPU; the GPU
    check on CUDA, which also records the caching allocator's own peak of step 2).
    """
    import contextlib
    import resource

    import torch
    import transformers

    from tunepilot.memory.tracker import (
        ACCUMULATION_TOLERANCE_BYTES,
        STEP2_MICRO_BATCHES,
        CudaAutocastRules,
        StorageTracker,
        attention_path,
        build_for_trace,
        register_model,
        trace_optimizer,
        unpacked_sequences,
    )
    from tunepilot.models import trainable_parameters
    from tunepilot.training import MAX_GRAD_NORM, autocast_context, build_scheduler, compute_loss

    t0 = time.perf_counter()
    dev = torch.device("cpu" if fake else device)
    cuda = dev.type == "cuda"
    built = build_for_trace(spec, config, fake=fake, device=str(dev))
    unpacked = unpacked_sequences() if fake else contextlib.nullcontext()
    # tracing on the CPU for a GPU: apply CUDA autocast's float32 op list (CPU autocast's differs)
    cuda_rules = spec.precision.endswith("-mixed") and dev.type == "cpu" and stack != "cpu"
    rules = CudaAutocastRules() if cuda_rules else contextlib.nullcontext()
    model, notes = built.model, built.notes
    if cuda_rules:
        notes.append("autocast: CUDA's rules (its float32 op list: layer_norm, softmax, pow, "
                     "exp, sum, ... run in fp32) applied to the CPU trace")
    vocab = int(model.config.vocab_size)
    accum = spec.gradient_accumulation_steps
    micro2 = min(accum, STEP2_MICRO_BATCHES)
    tracker = StorageTracker()
    with built.fake_mode or contextlib.nullcontext(), unpacked, rules:
        info = register_model(tracker, model, spec, built.nf4)
        opt, impl = trace_optimizer(spec, model, stack, notes)
        sched = build_scheduler(spec, opt, total_steps=2)
        params = trainable_parameters(model)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda q: tracker.classify(q.grad, "gradients"))
        fp16 = spec.precision == "fp16-mixed"
        # Synthetic batches have no padding: transformers drops an all-ones mask (a data check
        # fake tensors cannot answer) and runs causal SDPA with native GQA, so pass none. Text
        # data may pad: keep a mask, which takes transformers' padded path (a 4-D additive mask,
        # repeated K/V heads) - the worst case the pilot's longest batch measures.
        padded = spec.data.source != "synthetic"
        mask = torch.ones(spec.micro_batch_size, spec.sequence_length, dtype=torch.long,
                          device=dev) if padded else None
        notes.append("batches: " + ("padded text: attention mask kept (transformers' padded "
                                    "path: 4-D mask, K/V heads repeated)" if padded else
                                    "synthetic, no padding: causal SDPA, no mask, native GQA"))
        model.train()
        state = {"batch": None, "losses": []}

        def micro_step(prefix: str) -> None:
            w = tracker.open_window(prefix + "forward")
            tracker.begin_forward()
            ids = torch.randint(0, vocab, (spec.micro_batch_size, spec.sequence_length),
                                device=dev)
            state["batch"] = {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}
            with autocast_context(spec, dev.type):
                loss = compute_loss(model, state["batch"], spec) / accum
            tracker.end_forward()
            tracker.close_window(w)
            w = tracker.open_window(prefix + "backward")
            (loss * scale if fp16 else loss).backward()
            state["losses"].append(loss.detach())
            del loss
            tracker.close_window(w)

        def optimizer_step() -> None:
            w = tracker.open_window("optimizer-step")
            if fp16:  # GradScaler.unscale_ (its found-inf check needs values, so no .step())
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [p.grad for p in params], torch.zeros(1, device=dev), 1.0 / scale)
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        tracker.classify(v, "optimizer")
            opt.zero_grad(set_to_none=True)
            sched.step()
            state["losses"].clear()
            tracker.close_window(w)

        with tracker, tracker.saved_tensors_hooks():
            scale = torch.full((), 65536.0, device=dev) if fp16 else None
            step1 = tracker.open_window("step 1")
            micro_step("")
            optimizer_step()
            tracker.close_window(step1)
            n_step1 = len(tracker.peaks)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            step2 = tracker.open_window("step 2")
            for i in range(micro2):
                micro_step(f"micro {i + 1} " if micro2 > 1 else "")
            optimizer_step()
            tracker.close_window(step2)
            if cuda:
                torch.cuda.synchronize()
                allocator = {"cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                             "cuda_max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
        attention, kernel = attention_path(tracker)
    phases = [p for p in tracker.peaks[n_step1:] if p is not step2]
    micro_peaks = [max(p.peak_bytes for p in phases if p.name.startswith(f"micro {i + 1} "))
                   for i in range(micro2)] if micro2 > 1 else []
    growth = max(0, micro_peaks[2] - micro_peaks[1]) if len(micro_peaks) > 2 else 0
    if accum > 1:
        peaks = ", ".join(f"{b / 2**30:.2f}" for b in micro_peaks)
        notes.append(f"gradient accumulation: step 2 traced {micro2} of {accum} micro-batches "
                     f"(peaks {peaks} GiB); from the second on a micro-batch repeats the same "
                     f"allocations (+{growth} B each: the detached loss train_step keeps)")
    where = f"{'fake' if fake else 'real'} {dev.type.upper()} tensors"
    notes.insert(0, f"traced: the training step on {where}, "
                 f"transformers {transformers.__version__}, torch {torch.__version__}, "
                 "2 optimizer steps, peak of step 2; attention " + attention.split(":")[0])
    return {
        "phases": [p.to_dict() for p in phases],
        "peak_bytes": step2.peak_bytes,
        "peak_raw_bytes": step2.peak_raw_bytes,
        "saved_bytes_at_peak": step2.saved_bytes,
        "step1_peak_bytes": tracker.peaks[n_step1 - 1].peak_bytes,
        "micro_batch_peaks_bytes": micro_peaks,
        "accumulation_peak_stable": growth <= ACCUMULATION_TOLERANCE_BYTES,
        "accumulation_growth_bytes_per_micro_batch": growth,
        "attention_path": attention,
        "attention_kernel": kernel,
        "optimizer_impl": impl,
        "num_ops": tracker.num_ops,
        "model": info,
        "notes": notes,
        "child_wall_s": round(time.perf_counter() - t0, 2),
        "child_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "traced_on": f"{where}, torch {torch.__version__}",
        **(allocator if cuda else {}),
    }




def main(argv: list[str] | None = None) -> int:
    """Child entry point: read the request, trace, write the result (always, if Python lives)."""
    argv = sys.argv[1:] if argv is None else argv
    req_path, res_path = Path(argv[0]), Path(argv[1])
    if os.environ.get(ENV_FORCE_ABORT) == "1":
        os.abort()  # what a C++ abort inside PyTorch looks like to the parent
    try:
        req = json.loads(req_path.read_text())
        spec = RunSpec.model_validate(req["spec"])
        result = trace_step(spec, req["config"], req["stack"], fake=True)
        result["status"] = "ok"
    except Exception as exc:  # every failure becomes a stated reason for the fallback
        from tunepilot.errors import UserError

        msg = exc.render() if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        result = {"status": "error",
                  "reason": f"tracing failed: {msg.strip()[:600]}{_where(exc)}"}
    res_path.write_text(json.dumps(result))
    return 0


def _where(exc: BaseException) -> str:
    """' (in tunepilot/training.py:111 compute_loss)': the innermost frame of tunepilot's own."""
    import traceback

    frames = [(Path(f.filename).as_posix(), f) for f in traceback.extract_tb(exc.__traceback__)]
    ours = [(name, f) for name, f in frames if "/tunepilot/" in name]
    if not ours:
        return ""
    name, f = ours[-1]
    return f" (in tunepilot/{name.split('/tunepilot/')[-1]}:{f.lineno} {f.name})"


if __name__ == "__main__":
    sys.exit(main())
