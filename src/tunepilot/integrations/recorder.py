"""What the callbacks share: a Recorder that times the user's own optimizer steps, counts their
tokens, reads the allocator and the device-wide peak, and writes the same pilot.json +
manifest.json as `tunepilot pilot` (with the spec it derived from the user's run, spec.yaml).

The callbacks (hf.py, lightning.py) only translate their trainer's events into
``begin_step`` / ``add_batch`` / ``end_step`` / ``evaluation`` / ``checkpoint`` calls. Nothing
here may break the user's run: every entry point is wrapped by ``guarded`` - an internal error
becomes one warning and the recorder switches itself off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from pathlib import Path
from typing import Any

from tunepilot.pilot.measurements import (
    AllocatorPeaks,
    CheckpointWrite,
    Measurements,
    StageTimes,
    StepRecord,
    ValidationPass,
)
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult

M = Figure.measured
DEFAULT_WARMUP_STEPS = 2


def guarded(method):
    """Run a recorder/callback method; any exception becomes a warning and switches it off."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        rec = getattr(self, "recorder", self)
        if getattr(rec, "disabled", False):
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # never break the user's run
            rec.disabled = True
            warnings.warn(f"tunepilot: {type(self).__name__}.{method.__name__} failed "
                          f"({type(exc).__name__}: {exc}); tunepilot stops recording, your run "
                          "goes on.", RuntimeWarning, stacklevel=2)
            return None

    return wrapper


class Recorder:
    """Measures the user's own steps. ``start`` before the first step, ``finish`` at the end."""

    def __init__(self, out_dir: str | Path | None, *, source: str, trainer: str,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.source, self.trainer, self.warmup_steps = source, trainer, warmup_steps
        self.disabled = False
        self.started = False
        self.steps: list[StepRecord] = []
        self.warmup: list[StepRecord] = []
        self.validation_s: list[float] = []
        self.checkpoints: list[tuple[float, int]] = []
        self.notes: list[str] = []
        self._mark = 0.0  # end of the last thing that was not a step (or the last step)
        self._begin: float | None = None
        self._useful: Any = 0
        self._padded = 0
        self._seq = 0
        self._samples = 0
        self._extra_wait = 0.0
        self._gen_s, self._gen_tokens = 0.0, 0
        self._allocator = AllocatorPeaks()
        self._sampler = None
        self._reading = None
        self._load = None
        self.device = None
        self.t_start = 0.0

    # --- events --------------------------------------------------------------------------
    def start(self) -> None:
        from tunepilot.device import make_sampler, probe_device
        from tunepilot.pilot.load import MachineLoadWatch

        self.device = probe_device()
        self.gpu = self.device.kind != "cpu"
        if self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        self._sampler = make_sampler(self.device)
        if self._sampler is not None and self.gpu and self.device.kind == "cuda":
            # the model is on the device already: the baseline is what others hold, not us
            from tunepilot.device import own_device_bytes

            own, how = own_device_bytes()
            self._sampler.baseline_bytes = max(0, self._sampler.reader() - own)
            self.notes.append(f"device-wide baseline: NVML used at the first step less this "
                              f"process's own memory then ({how}): the model loaded before the "
                              "callback started is counted as the run's")
        if self._sampler is not None:
            self._sampler.start()
        self._load = MachineLoadWatch()
        self.t_start = self._mark = time.perf_counter()
        self.started = True

    def begin_step(self) -> None:
        self._begin = time.perf_counter()

    def add_batch(self, input_ids=None, labels=None, attention_mask=None) -> None:
        """One micro-batch of the step: padded positions, and useful (supervised) tokens kept on
        the device until the step ends (no synchronise here)."""
        if input_ids is None:
            return
        shape = tuple(input_ids.shape)
        self._padded += int(shape[0] * shape[-1]) if len(shape) > 1 else int(shape[0])
        self._seq = max(self._seq, int(shape[-1]))
        self._samples += int(shape[0]) if len(shape) > 1 else 1
        if labels is not None and labels.dim() > 1:
            from tunepilot.dataset.loader import trained_positions

            self._useful = self._useful + trained_positions(labels)  # on the device: no sync
        elif attention_mask is not None:
            self._useful = self._useful + attention_mask[:, 1:].sum()
            self._note_once("no labels reached the model's forward: useful tokens are the "
                            "attention mask's non-padding tokens (all of them trained)")
        else:
            self._useful = self._useful + (shape[0] * max(shape[-1] - 1, 0))
            self._note_once("no labels and no attention mask reached the model's forward: "
                            "every token position is counted as useful")

    def end_step(self, loss: float | None = None) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        begin = self._begin if self._begin is not None else self._mark
        useful = int(self._useful.item()) if hasattr(self._useful, "item") else int(self._useful)
        step = StepRecord(wall_s=now - self._mark,
                          data_wait_s=max(0.0, begin - self._mark) + self._extra_wait,
                          forward_s=None, backward_s=None, optimizer_s=None,
                          useful_tokens=useful, padded_tokens=self._padded,
                          sequence_length=self._seq, loss=loss, samples=self._samples,
                          generation_s=self._gen_s or None,
                          generated_tokens=self._gen_tokens if self._gen_s else None)
        if not self.warmup and not self.steps:
            _mark_first_step()
        if len(self.warmup) < self.warmup_steps:
            self.warmup.append(step)
            if len(self.warmup) == self.warmup_steps and self.gpu:
                import torch

                self._allocator.note_segment("first_step", torch.cuda.max_memory_allocated(),
                                             torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
        else:
            self.steps.append(step)
        self._useful, self._padded, self._seq, self._samples = 0, 0, 0, 0
        self._extra_wait = 0.0
        self._gen_s, self._gen_tokens = 0.0, 0
        self._begin = None
        self._mark = now

    def generation(self, seconds: float, tokens: int) -> None:
        """The step generated completions (GRPO/RLOO's generate): its own phase of the step."""
        self._gen_s += float(seconds)
        self._gen_tokens += int(tokens)
        self._note_once("generation timed around the model's generate (transformers; a vLLM "
                        "engine's generation is not seen by the callback)")

    def add_wait(self, seconds: float) -> None:
        """Data wait before a later micro-batch of the same optimizer step."""
        self._extra_wait += max(0.0, float(seconds))

    def other_work_done(self) -> None:
        """Something between steps (logging, evaluation, a save) ended: the next step's data
        wait starts now."""
        self._mark = time.perf_counter()

    def evaluation(self, seconds: float) -> None:
        self.validation_s.append(float(seconds))
        self.other_work_done()

    def checkpoint(self, seconds: float, nbytes: int) -> None:
        self.checkpoints.append((float(seconds), int(nbytes)))
        self.other_work_done()

    def _note_once(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # --- the result ------------------------------------------------------------------------
    def finish(self, spec, arch, *, provenance_model: dict | None = None,
               startup_s: float | None = None, losses: list[float] | None = None
               ) -> PilotResult | None:
        """Write pilot.json and the manifest for ``spec`` (the spec derived from the run);
        ``losses``: the training losses the trainer logged, first and last recorded."""
        if self.out_dir is None or not self.started:
            return None
        from tunepilot.pilot.assemble import pilot_result
        from tunepilot.pilot.provenance import collect_provenance, tunepilot_version
        from tunepilot.store import RunDir

        result = pilot_result(self.measurements(spec, arch, startup_s, losses),
                              no_steps_why=None if self.steps else
                              "no measured steps: the run ended within the "
                              f"{self.warmup_steps} warm-up steps")
        result.spec_hash = spec.spec_hash()
        run = RunDir(self.out_dir)
        run.write(result)
        provenance = collect_provenance(spec, device=self.device.to_dict(),
                                        data={"source": f"the user's own data ({self.trainer})"},
                                        model=provenance_model or {})
        run.update_manifest(spec=spec.model_dump(mode="json"), device=self.device.summary(),
                            provenance=provenance, tunepilot_version=tunepilot_version())
        return result

    def measurements(self, spec, arch, startup_s: float | None = None,
                     losses: list[float] | None = None) -> Measurements:
        """What the recorder measured, as the pilot's typed Measurements."""
        reading = self._sampler.stop() if self._sampler is not None else self._reading
        self._sampler, self._reading = None, reading
        if self.gpu:
            import torch

            stats = torch.cuda.memory_stats()
            a = self._allocator
            a.note_segment("steady", torch.cuda.max_memory_allocated(),
                           torch.cuda.max_memory_reserved())
            a.num_alloc_retries = int(stats.get("num_alloc_retries", 0))
            a.num_ooms = int(stats.get("num_ooms", 0))
        ck = None
        if self.checkpoints:
            last_s, last_b = self.checkpoints[-1]
            ck = CheckpointWrite(seconds=last_s, nbytes=last_b, count=len(self.checkpoints),
                                 total_s=sum(x for x, _ in self.checkpoints),
                                 method=f"the {self.trainer}'s own save")
        val = ValidationPass(seconds=self.validation_s[-1], count=len(self.validation_s),
                             batches_from=f"the {self.trainer}'s own evaluation "
                             f"({len(self.validation_s)} pass(es))") if self.validation_s else None
        times = StageTimes(
            setup_s=startup_s, setup_covers="process start to the first step: imports, model "
            "load, data preparation, the trainer's set-up",
            model_load_why="the model was loaded before the callback started (see setup_s)",
            warmup_s=sum(x.wall_s for x in self.warmup) if self.warmup else None,
            measure_s=sum(x.wall_s for x in self.steps) if self.steps else None,
            total_s=time.perf_counter() - self.t_start,
            total_covers="from the first step to the end of training")
        return Measurements(
            spec=spec, arch=arch, device=self.device, source=self.source, trainer=self.trainer,
            steps=list(self.steps), warmup=list(self.warmup),
            load=self._load.stop() if self._load else None, allocator=self._allocator,
            reading=reading, validation=val, checkpoint=ck, times=times,
            notes=list(self.notes),
            split_how="not split: the user's loop runs forward, backward and the optimizer",
            losses=(losses[0], losses[-1]) if losses else None,
            generation_how="transformers' generate, timed around the model's generate by the "
            "callback" if any(x.generation_s for x in self.steps + self.warmup) else None)


def default_out_dir(name: str) -> Path:
    """$TUNEPILOT_WATCH_DIR under `tunepilot watch`, else runs/NAME."""
    from tunepilot.integrations.watch import DIR_ENV

    return Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else Path("runs") / name


def _mark_first_step() -> None:
    """Tell `tunepilot watch` (when it runs us) that the first optimizer step ended."""
    import json

    from tunepilot.integrations.watch import MARKERS_ENV

    path = os.environ.get(MARKERS_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"event": "first_step", "unix_s": time.time(),
                                "pid": os.getpid()}) + "\n")
    except OSError:
        pass


def process_age_s() -> float | None:
    """Seconds since this process started (psutil), for setup_s."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process(os.getpid()).create_time())
    except Exception:
        return None


def dir_bytes(path: str | Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total
