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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunepilot.results.figure import Figure
from tunepilot.results.pilot import (
    AllocatorMemory,
    DeviceBlock,
    DeviceMemory,
    MemoryBlock,
    PilotResult,
    ProcessMemory,
    RunBlock,
    Timings,
    ValidationBlock,
    no_allocator,
)

M = Figure.measured
IGNORE_INDEX = -100
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


@dataclass
class _Step:
    wall_s: float
    data_wait_s: float
    forward_s: None = None
    backward_s: None = None
    optimizer_s: None = None
    useful_tokens: int = 0
    padded_tokens: int = 0
    sequence_length: int = 0
    loss: float | None = None
    samples: int = 0


@dataclass
class _View:
    """The attributes pilot/assemble.py's helpers read from a pilot Session."""

    steps: list
    warmup: list
    pilot_spec: Any
    device: Any
    arch: Any
    gpu: bool
    load: Any = None
    stop_rule: Any = None
    stopped_because: str | None = None
    options: Any = field(default_factory=lambda: type("O", (), {"catalog": None})())


class Recorder:
    """Measures the user's own steps. ``start`` before the first step, ``finish`` at the end."""

    def __init__(self, out_dir: str | Path | None, *, source: str, trainer: str,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.source, self.trainer, self.warmup_steps = source, trainer, warmup_steps
        self.disabled = False
        self.started = False
        self.steps: list[_Step] = []
        self.warmup: list[_Step] = []
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
        self._allocator: dict[str, int] = {}
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
            self._useful = self._useful + (labels[:, 1:] != IGNORE_INDEX).sum()
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
        step = _Step(wall_s=now - self._mark,
                     data_wait_s=max(0.0, begin - self._mark) + self._extra_wait,
                     useful_tokens=useful, padded_tokens=self._padded,
                     sequence_length=self._seq, loss=loss, samples=self._samples)
        if not self.warmup and not self.steps:
            _mark_first_step()
        if len(self.warmup) < self.warmup_steps:
            self.warmup.append(step)
            if len(self.warmup) == self.warmup_steps and self.gpu:
                import torch

                self._allocator["first_step_peak_allocated_bytes"] = \
                    torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        else:
            self.steps.append(step)
        self._useful, self._padded, self._seq, self._samples = 0, 0, 0, 0
        self._extra_wait = 0.0
        self._begin = None
        self._mark = now

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
        from tunepilot.pilot.assemble import (
            _confidence_notes,
            _data_wait,
            _mfu,
            _per_step,
            _split,
            _step_time,
            _steps_block,
            _throughput,
        )
        from tunepilot.pilot.provenance import collect_provenance, tunepilot_version
        from tunepilot.store import RunDir

        if self._sampler is not None:
            self._reading = self._sampler.stop()
            self._sampler = None
        if self.gpu:
            import torch

            self._allocator["steady_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            self._allocator["steady_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            stats = torch.cuda.memory_stats()
            self._allocator["num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            self._allocator["num_ooms"] = int(stats.get("num_ooms", 0))
        view = _View(steps=self.steps, warmup=self.warmup, pilot_spec=spec, device=self.device,
                     arch=arch, gpu=self.gpu, load=self._load.stop() if self._load else None)
        why = ("no measured steps: the run ended within the "
               f"{self.warmup_steps} warm-up steps" if not self.steps else "not measured")
        throughput = _throughput(view, why)
        if self.steps:  # samples: what the batches held, not micro_batch x accumulation
            wall = sum(x.wall_s for x in self.steps)
            throughput.samples_per_s = M(sum(x.samples for x in self.steps) / wall, "samples/s")
        split = _split(view, why)
        split.how = "not split: the user's loop runs forward, backward and the optimizer"
        result = PilotResult(
            source=self.source, fits=True, verdict=f"measured {len(self.steps)} steps of the "
            f"user's own {self.trainer} run",
            device=DeviceBlock(**self.device.summary(), count=self.device.count,
                               memory=M(self.device.memory_bytes, "bytes", why="not reported")),
            run=self._run_block(spec), timings=self._timings(startup_s),
            steps=_steps_block(view), step_time=_step_time(view, why), split=split,
            data_wait=_data_wait(view, why), throughput=throughput, mfu=_mfu(view, why),
            memory=self._memory(), validation=self._validation(), per_step=_per_step(view),
            machine_load=view.load,
            notes=list(dict.fromkeys(self.notes + self.device.notes + _confidence_notes(view))))
        result.spec_hash = spec.spec_hash()
        if losses:
            result.loss.first = M(losses[0], "nats/token")
            result.loss.last = M(losses[-1], "nats/token")
        run = RunDir(self.out_dir)
        run.write(result)
        provenance = collect_provenance(spec, device=self.device.to_dict(),
                                        data={"source": f"the user's own data ({self.trainer})"},
                                        model=provenance_model or {})
        run.update_manifest(spec=spec.model_dump(mode="json"), device=self.device.summary(),
                            provenance=provenance, tunepilot_version=tunepilot_version())
        return result

    def _run_block(self, spec) -> RunBlock:
        seq = max((x.sequence_length for x in self.steps + self.warmup), default=None)
        return RunBlock(label=spec.label, method=spec.method.kind, precision=spec.precision,
                        optimizer=spec.optimizer.name, micro_batch_size=spec.micro_batch_size,
                        sequence_length=seq,
                        gradient_accumulation_steps=spec.gradient_accumulation_steps,
                        activation_checkpointing=spec.activation_checkpointing,
                        trainer=self.trainer,
                        tokens_per_optimizer_step=M(spec.tokens_per_optimizer_step, "tokens",
                                                    covers="at the longest sequence seen"))

    def _timings(self, startup_s: float | None) -> Timings:
        warm = sum(x.wall_s for x in self.warmup)
        meas = sum(x.wall_s for x in self.steps)
        ck_s = sum(s for s, _ in self.checkpoints)
        ck_b = self.checkpoints[-1][1] if self.checkpoints else None
        last_s = self.checkpoints[-1][0] if self.checkpoints else None
        why_ck = "the run saved no checkpoint while recording"
        return Timings(
            model_load_s=Figure.missing("s", "the model was loaded before the callback started "
                                        "(see setup_s)"),
            setup_s=M(startup_s, "s", why="the process start time was not readable",
                      covers="process start to the first step: imports, model load, data "
                             "preparation, the trainer's set-up"),
            warmup_s=M(warm if self.warmup else None, "s", why="no warm-up steps"),
            measure_s=M(meas if self.steps else None, "s", why="no measured steps"),
            validation_pass_s=M(self.validation_s[-1] if self.validation_s else None, "s",
                                why="the run did not evaluate while recording"),
            checkpoint_write_s=M(last_s, "s", why=why_ck,
                                 covers=(f"the last of {len(self.checkpoints)} saves "
                                         f"({ck_s:.2f} s in all)") if self.checkpoints
                                 else None),
            checkpoint_bytes=M(ck_b, "bytes", why=why_ck),
            checkpoint_bytes_per_s=M(ck_b / last_s if ck_b and last_s else None, "bytes/s",
                                     why=why_ck),
            checkpoint_method=f"the {self.trainer}'s own save" if self.checkpoints else None,
            pilot_total_s=M(time.perf_counter() - self.t_start, "s",
                            covers="from the first step to the end of training"))

    def _memory(self) -> MemoryBlock:
        from tunepilot.device import _read_hwm

        a, r = self._allocator, self._reading
        if self.gpu:
            alloc = AllocatorMemory(
                peak_allocated_bytes=M(a.get("steady_peak_allocated_bytes"), "bytes",
                                       why="no steps ran", covers="after the warm-up steps"),
                peak_reserved_bytes=M(a.get("steady_peak_reserved_bytes"), "bytes",
                                      why="no steps ran"),
                first_step_peak_allocated_bytes=M(a.get("first_step_peak_allocated_bytes"),
                                                  "bytes", why="fewer steps than the warm-up",
                                                  covers="model load + the warm-up steps"),
                model_load_peak_allocated_bytes=Figure.missing(
                    "bytes", "the model was loaded before the callback started"),
                num_alloc_retries=M(a.get("num_alloc_retries", 0), "count"),
                num_ooms=M(a.get("num_ooms", 0), "count"))
        else:
            alloc = no_allocator()
        if self.gpu and r is not None:
            reserved = a.get("steady_peak_reserved_bytes")
            device = DeviceMemory(
                source=r.source, baseline_bytes=M(r.baseline_bytes, "bytes"),
                peak_bytes=M(r.peak_bytes, "bytes"),
                peak_minus_baseline_bytes=M(r.peak_minus_baseline_bytes, "bytes"),
                gap_bytes=M(r.peak_minus_baseline_bytes - reserved if reserved else None,
                            "bytes", why="no allocator reading"),
                interval_s=r.interval_s, num_samples=r.num_samples)
        else:
            why = ("CPU: no device memory (CUDA/HIP only)" if not self.gpu else
                   "no device-wide reading (NVML/amdsmi not available)")
            device = DeviceMemory(**{k: Figure.missing("bytes", why) for k in (
                "baseline_bytes", "peak_bytes", "peak_minus_baseline_bytes", "gap_bytes")})
        process = ProcessMemory()
        if not self.gpu and r is not None:
            hwm = _read_hwm()
            process = ProcessMemory(
                baseline_rss_bytes=M(r.baseline_bytes, "bytes"),
                peak_rss_bytes=M(max(r.peak_bytes, hwm or 0), "bytes"),
                rss_growth_bytes=M(r.peak_minus_baseline_bytes, "bytes"),
                source=f"{r.source} from the first step on", covers="the training steps")
        return MemoryBlock(allocator=alloc, device=device, process=process)

    def _validation(self) -> ValidationBlock:
        if not self.validation_s:
            return ValidationBlock(seconds=Figure.missing(
                "s", "the run did not evaluate while recording"))
        return ValidationBlock(num_batches=None, seconds=M(self.validation_s[-1], "s"),
                               batches_from=f"the {self.trainer}'s own evaluation "
                               f"({len(self.validation_s)} pass(es))")


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
