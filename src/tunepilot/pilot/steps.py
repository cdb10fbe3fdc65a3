"""One pilot step, instrumented: device-accurate wall time, data wait, forward / backward /
optimizer split - and the memory-probe step that splits one step's memory by component.

Wall time: CUDA/HIP events around the step on a GPU (the step ends with a device synchronise),
perf_counter on the CPU (``train_step`` synchronises before it reads the clock). The split needs
a synchronise between forward, backward and the optimizer step: free on the CPU, so every CPU
step is split; on a GPU it drains the launch queue, so only every ``GPU_SPLIT_EVERY``-th step is.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tunepilot.pilot.measurements import StepRecord
from tunepilot.plan.trace.tracker import StorageTracker, state_tensors, tensor_bytes
from tunepilot.spec import RunSpec
from tunepilot.training.step import StepStats, TrainState, train_step

GPU_SPLIT_EVERY = 5  # split fwd/bwd/opt on every 5th GPU step (each split costs two syncs)

Batch = dict[str, torch.Tensor]


class InstrumentedStep:
    """Runs ``train_step`` and times it as the pilot does."""

    def __init__(self, spec: RunSpec, device_type: str, *, split_every: int | None = None,
                 tracker: StorageTracker | None = None, sharded: bool = False):
        self.spec = spec
        self.sharded = sharded
        """FSDP: the tracker follows the unsharded parameters FSDP resizes in place"""
        self.device_type = device_type
        self.gpu = device_type == "cuda"
        self.split_every = split_every or (GPU_SPLIT_EVERY if self.gpu else 1)
        self.tracker = tracker
        self.count = 0

    def __call__(self, state: TrainState, next_batch: Callable[[], Batch],
                 accumulation: int | None = None) -> StepRecord:
        split = self.count % self.split_every == 0
        self.count += 1
        seq = [0]

        def fetch() -> Batch:
            b = next_batch()
            seq[0] = int(b["input_ids"].shape[1])
            return b

        if self.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with contextlib.ExitStack() as ctx:
            if self.tracker is not None:
                ctx.enter_context(self.tracker)
                if self.sharded:
                    ctx.enter_context(self.tracker.track_resizes())
                self.tracker.enter("step")
            st: StepStats = train_step(
                state, fetch, self.spec, accumulation=accumulation, split_timing=split,
                phase=self.tracker.enter if self.tracker is not None else None)
        if self.gpu:
            end.record()
            end.synchronize()
            wall = start.elapsed_time(end) / 1e3  # ms -> s
        else:
            wall = st.wall_s
        generated = self.spec.objective.generative and st.generation_s > 0
        if self.spec.objective.generative:  # the policy sees prompt + completion
            from tunepilot.spec.objective import lengths

            seq[0] += lengths(self.spec).completion
        return StepRecord(wall_s=wall, data_wait_s=st.data_wait_s,
                          forward_s=st.forward_s if split else None,
                          backward_s=st.backward_s if split else None,
                          optimizer_s=st.optimizer_s if split else None,
                          useful_tokens=st.useful_tokens, padded_tokens=st.padded_tokens,
                          sequence_length=seq[0], loss=st.loss,
                          generation_s=st.generation_s if generated else None,
                          generated_tokens=st.generated_tokens if generated else None)


@dataclass
class StepMemory:
    """One step's live tensor bytes by component (the memory-probe step; bytes)."""

    weights_bytes: int  # parameters + buffers
    gradients_bytes: int  # at the optimizer step, all gradients materialised
    optimizer_bytes: int  # optimizer state after the step
    activations_bytes: int  # alive at the start of backward, beyond what lived before the step
    forward_backward_temporary_bytes: int  # the forward/backward peak beyond the activations
    optimizer_temporary_bytes: int  # the optimizer step's peak beyond its inputs
    peak_bytes: int  # the step's tracked peak (weights and states included)
    start_bytes: int  # live at the start of the step
    generation_peak_bytes: int | None = None  # GRPO/RLOO: the peak while generating

    @property
    def temporary_bytes(self) -> int:
        return max(self.forward_backward_temporary_bytes, self.optimizer_temporary_bytes)


def probe_step_memory(state: TrainState, batch_fn: Callable[[], Batch], spec: RunSpec,
                      tracker: StorageTracker, step: InstrumentedStep
                      ) -> tuple[StepRecord, StepMemory]:
    """Run one step under `tracker` and split its memory by component.

    The optimizer's step hooks mark the start and end of the optimizer region; the tracker marks
    the start of backward itself (the first op run inside an autograd node).
    """
    model, opt = state.model, state.optimizer
    grads = [0]

    def pre_hook(_opt, _args, _kwargs):
        grads[0] = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        tracker.enter("optimizer")

    def post_hook(_opt, _args, _kwargs):
        tracker.enter("after-optimizer")

    tracker.adopt(state_tensors(model, opt))
    tracker.reset_marks()
    handles = [opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)]
    peak_before = tracker.peak_bytes
    tracker.peak_bytes = tracker.live_bytes
    try:
        rec = step(state, batch_fn)
    finally:
        for h in handles:
            h.remove()
        tracker.region = "idle"
    m = tracker.marks
    start = m.get("step-start", 0)
    bwd = m.get("backward-start", start)
    opt_start = m.get("optimizer-start", bwd)
    peaks = tracker.region_peaks
    mem = StepMemory(
        weights_bytes=tensor_bytes(list(model.parameters()) + list(model.buffers())),
        gradients_bytes=grads[0],
        optimizer_bytes=tensor_bytes(v for s in opt.state.values() for v in s.values()
                                     if isinstance(v, torch.Tensor)),
        activations_bytes=max(0, bwd - start),
        forward_backward_temporary_bytes=max(0, peaks.get("step", bwd) - bwd),
        optimizer_temporary_bytes=max(0, peaks.get("optimizer", opt_start) - opt_start),
        peak_bytes=tracker.peak_bytes,
        start_bytes=start,
        generation_peak_bytes=peaks.get("generation"),
    )
    tracker.peak_bytes = max(tracker.peak_bytes, peak_before)
    return rec, mem


def optimizer_state_complete(state: TrainState) -> bool:
    """True once every trainable parameter has optimizer state (after the first step)."""
    params = [p for g in state.optimizer.param_groups for p in g["params"] if p.requires_grad]
    return bool(params) and all(len(state.optimizer.state.get(p, {})) > 0 for p in params)


def free_memory(model: torch.nn.Module | None = None) -> None:
    """Drop gradients and cached blocks between tries (a failed step leaves garbage behind)."""
    if model is not None:
        for p in model.parameters():
            p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
