"""The pilot: real training steps of the run on the local device, worst case first.

    probe device -> plan (analytic, for the residuals) -> data (longest batch) -> load model
    -> warm-up: 2 full steps on the longest batch (step 1 creates the optimizer state; step 2,
       the steady state the plan describes, runs under the tensor tracker: memory by component)
    -> measured steps on real batches until the 95% CI of the mean step time is under 2%
    -> one validation pass (validation.num_batches) -> one checkpoint write -> [--find-max-batch]
An out-of-memory error anywhere (the device's, or the simulated one of --memory-limit) ends the
pilot with "does not fit at micro_batch=B, seq=S" and the last numbers; it never crashes.

``run_pilot`` returns a PilotResult and writes RUN_DIR/pilot.json, manifest.json and
logs/pilot.log. It never prints: progress goes to the optional ``progress`` callback.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunepilot.catalog import Catalog, load_catalog
from tunepilot.data import DataStream, build_dataset, longest_batch, make_loader, useful_tokens
from tunepilot.errors import TunepilotError, UserError
from tunepilot.memory.analytic import MemoryPlan, analytic_plan
from tunepilot.memory.plan import resolve_arch, resolve_model_config
from tunepilot.models import build_model
from tunepilot.pilot import results
from tunepilot.pilot.device import DeviceInfo, make_sampler, nvml_used_by_uuid, probe_device
from tunepilot.pilot.memtrack import (
    SIMULATED_OOM,
    TensorMemoryTracker,
    state_tensors,
    tensor_bytes,
)
from tunepilot.pilot.provenance import collect_provenance, tunepilot_version
from tunepilot.pilot.stats import StopRule
from tunepilot.pilot.steps import (
    InstrumentedStep,
    StepRecord,
    free_memory,
    largest_passing,
    optimizer_state_complete,
    probe_step_memory,
)
from tunepilot.spec import RunSpec
from tunepilot.store import RunDir, utc_now
from tunepilot.training import TrainState, evaluate, make_state

DEFAULT_MAX_STEPS = 100
WARMUP_STEPS = 2  # step 1 creates the optimizer state; step 2 is the steady state (plan = step 2+)
MAX_SEARCH_MICRO_BATCH = 4096  # --find-max-batch stops doubling here
CPU_SEARCH_RAM_FRACTION = 0.8  # on CPU the search caps tensors at 80% of free RAM: the OS
# kills a process that runs out of RAM (no exception to catch), so the search must stop first
DISK_MARGIN = 1.2  # a checkpoint write needs this much more free disk than the state's bytes

Progress = Callable[[str, int, int | None], None]


@dataclass
class PilotOptions:
    """How the pilot runs (the CLI flags)."""

    steps: int | None = None
    """--steps N: exactly N measured steps; default adaptive."""
    max_steps: int = DEFAULT_MAX_STEPS
    memory_limit_bytes: int | None = None
    """--memory-limit: a simulated device cap on live tensor bytes (torch.OutOfMemoryError)."""
    find_max_batch: bool = False
    device: str | None = None
    """'cpu' forces the CPU; default: the first GPU torch sees, else the CPU."""
    base_dir: Path | None = None
    """where relative paths in the spec are resolved (the spec file's directory)."""
    catalog: Catalog | None = None


@dataclass
class PilotResult:
    """What `run_pilot` wrote to RUN_DIR/pilot.json (``data``)."""

    data: dict
    run_dir: Path

    @property
    def fits(self) -> bool:
        return bool(self.data.get("fits"))

    def to_dict(self) -> dict:
        return self.data


def default_run_dir(spec: RunSpec) -> Path:
    """runs/<spec label>-<spec hash[:8]> under the working directory."""
    return Path("runs") / f"{spec.label}-{spec.spec_hash()[:8]}"


def run_pilot(spec: RunSpec, out: Path | str | None = None, options: PilotOptions | None = None,
              progress: Progress | None = None) -> PilotResult:
    """Pilot `spec` on this machine; write pilot.json, manifest.json and logs/pilot.log."""
    options = options or PilotOptions()
    if options.steps is not None and options.steps < 1:
        raise UserError("--steps", f"is {options.steps} but must be at least 1.")
    if options.max_steps < 1:
        raise UserError("--max-steps", f"is {options.max_steps} but must be at least 1.")
    run_dir = RunDir(out if out is not None else default_run_dir(spec))
    run_dir.check_spec(spec.spec_hash())
    return _Pilot(spec, run_dir, options, progress or (lambda *_: None)).run()


class _RunLog:
    """logs/pilot.log, one timestamped line per event, flushed as it goes."""

    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        self._f.write(f"{time.perf_counter() - self._t0:9.3f}s  {msg}\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class _DoesNotFit(Exception):
    """Internal: an out-of-memory error with the phase it happened in."""

    def __init__(self, phase: str, exc: BaseException, simulated: bool):
        super().__init__(str(exc))
        self.phase, self.error, self.simulated = phase, str(exc).splitlines()[0][:400], simulated


@dataclass
class _Run:
    """What the pilot measured, gathered for results.assemble."""

    spec: RunSpec
    pilot_spec: RunSpec
    device: DeviceInfo
    options: PilotOptions
    notes: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    data_info: object = None
    longest: dict | None = None
    params: dict | None = None
    warmup: list[StepRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    stopped_because: str | None = None
    stop_rule: StopRule | None = None
    step_memory: object = None
    tracked_peak_bytes: int | None = None
    allocator: dict = field(default_factory=dict)
    sampler: object = None
    validation: dict | None = None
    checkpoint: dict | None = None
    does_not_fit: _DoesNotFit | None = None
    search: dict | None = None
    plan: MemoryPlan | None = None
    arch: object = None
    provenance: dict | None = None
    tracker_live_at_oom: int | None = None


class _Pilot:
    def __init__(self, spec: RunSpec, run_dir: RunDir, options: PilotOptions, progress: Progress):
        self.spec, self.run_dir, self.options, self.progress = spec, run_dir, options, progress
        self.catalog = options.catalog or load_catalog()
        self.model = None
        self.state: TrainState | None = None
        self.tracker: TensorMemoryTracker | None = None
        self.sampler = None
        self.r: _Run | None = None

    # --- the public sequence -------------------------------------------------------------------
    def run(self) -> PilotResult:
        t_start = time.perf_counter()
        baselines = nvml_used_by_uuid()  # before torch touches a GPU: the pre-run baseline
        self.run_dir.path.mkdir(parents=True, exist_ok=True)
        self.log = _RunLog(self.run_dir.logs_dir() / "pilot.log")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*set_vital.*")
                r = self._prepare(baselines)
                self.r = r
                self._execute()
                r.timings["pilot_total_s"] = time.perf_counter() - t_start
                return self._finish()
        finally:
            if self.sampler is not None and (self.r is None or self.r.sampler is None):
                self.sampler.stop()  # an error before the end: do not leave the thread running
            self.log.close()

    def _prepare(self, baselines: dict) -> _Run:
        self.progress("probe device", 0, None)
        t0 = time.perf_counter()
        spec = self.spec
        needs = ["bitsandbytes"] if (spec.method.kind == "qlora" or "8bit" in spec.optimizer.name
                                     or spec.optimizer.name.startswith("paged")) else []
        info = probe_device(self.catalog, needs, device=self.options.device)
        self.log(f"device: {info.kind} {info.name!r} card={info.card_id} torch {info.torch_version}"
                 f" cuda={info.cuda_version} hip={info.hip_version}")
        pilot_spec, notes = _single_device_spec(spec)
        _preflight(pilot_spec, info)
        r = _Run(spec=spec, pilot_spec=pilot_spec, device=info, options=self.options, notes=notes)
        r.notes += info.missing
        if self.options.memory_limit_bytes:
            r.notes.append(f"--memory-limit {self.options.memory_limit_bytes} bytes: every step "
                           "ran under the tensor tracker, which raises torch.OutOfMemoryError "
                           "past the limit; step times include the tracker's per-op cost")
        r.arch = resolve_arch(pilot_spec, self.options.base_dir)
        stack = info.kind
        r.plan = analytic_plan(pilot_spec, r.arch, stack)
        self.progress("read data", 0, None)
        ds, data_info = build_dataset(pilot_spec, r.arch.vocab_size, self.options.base_dir)
        if len(ds) < pilot_spec.micro_batch_size:
            raise UserError("micro_batch_size", f"the dataset has {len(ds)} samples, fewer than "
                            f"one micro-batch of {pilot_spec.micro_batch_size}.",
                            "Add samples, or lower micro_batch_size.")
        self.dataset, r.data_info = ds, data_info
        r.notes += data_info.notes
        for n in data_info.notes:
            self.log(f"data: {n}")
        r.timings["data_prep_s"] = time.perf_counter() - t0
        r.provenance = collect_provenance(
            spec, device=info.to_dict(), data=_data_provenance(data_info),
            model=_model_provenance(spec, r.arch, self.options.base_dir))
        self.sampler = make_sampler(info, baselines)  # the baseline: before the model exists
        if self.sampler is not None:
            self.sampler.start()
        return r

    def _execute(self) -> None:
        r = self.r
        try:
            self._load()
            self._setup_state()
            self._warmup()
            self._measure()
            self._validate()
        except _DoesNotFit as dnf:
            # drop the failed step's frames (and the tensors they hold) with the traceback
            dnf.__context__ = dnf.__cause__ = dnf.__traceback__ = None
            r.does_not_fit = dnf
            self.log(f"does not fit ({dnf.phase}): {dnf.error}")
            free_memory(self.model)
        finally:
            self._read_allocator()
        if r.does_not_fit is None:
            self._checkpoint()
        if self.sampler is not None:  # before the search, which runs into the limit on purpose
            r.sampler = self.sampler.stop()
        if self.options.find_max_batch and self.model is not None:
            self._search()

    def _finish(self) -> PilotResult:
        r = self.r
        data = results.assemble(r, self.catalog)
        data["created_utc"] = utc_now()
        data["log"] = str(Path("logs") / "pilot.log")
        spec_hash = self.spec.spec_hash()
        self.run_dir.write_stage("pilot", data, spec_hash)
        self.run_dir.update_manifest(spec_hash=spec_hash, spec=self.spec.model_dump(mode="json"),
                                     device=r.device.summary(), provenance=r.provenance,
                                     tunepilot_version=tunepilot_version())
        self.log(f"result: {data['verdict']}; wrote {self.run_dir.file('pilot')}")
        return PilotResult(self.run_dir.read("pilot"), self.run_dir.path)

    # --- steps of the pilot --------------------------------------------------------------------
    @contextlib.contextmanager
    def _oom_guard(self, phase: str) -> Iterator[None]:
        """Turn an out-of-memory error (the device's or the simulated one) into _DoesNotFit."""
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if self.tracker is not None:
                self.r.tracker_live_at_oom = self.tracker.live_bytes
            raise _DoesNotFit(phase, exc, SIMULATED_OOM in str(exc)) from None

    def _load(self) -> None:
        r, spec = self.r, self.r.pilot_spec
        self.progress("load model", 0, None)
        dev = r.device.torch_device
        if r.device.kind != "cpu":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with self._oom_guard("model load"):
            self.model = build_model(spec, dev, base_dir=self.options.base_dir)
            _sync(r.device)
        r.timings["model_load_s"] = time.perf_counter() - t0
        params = list(self.model.parameters())
        r.params = {"total": sum(p.numel() for p in params),
                    "trainable": sum(p.numel() for p in params if p.requires_grad)}
        r.params["frozen"] = r.params["total"] - r.params["trainable"]
        if r.device.kind != "cpu":
            r.allocator["model_load_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        self.log(f"model built in {r.timings['model_load_s']:.3f} s: {r.params}")
        tracker = TensorMemoryTracker(_device_type(r.device),
                                      self.options.memory_limit_bytes)
        tracker.adopt(state_tensors(self.model))
        self.tracker = tracker
        with self._oom_guard("model load"):
            tracker.check_limit(" (the model's weights alone)")

    def _setup_state(self) -> None:
        r, spec = self.r, self.r.pilot_spec
        t0 = time.perf_counter()
        opts = self.options
        r.stop_rule = StopRule(max_steps=opts.max_steps, fixed_steps=opts.steps)
        self.total_steps = WARMUP_STEPS + r.stop_rule.limit
        self.state = make_state(spec, self.model, self.total_steps)
        loader = make_loader(spec, self.dataset, r.data_info)
        self.stream = DataStream(loader)
        lb = longest_batch(self.dataset, r.data_info, spec.micro_batch_size)
        self.longest = lb
        r.longest = {"micro_batch_size": int(lb["input_ids"].shape[0]),
                     "sequence_length": int(lb["input_ids"].shape[1]),
                     "useful_tokens": useful_tokens(lb), "padded_tokens": int(lb["input_ids"].numel())}
        r.timings["state_setup_s"] = time.perf_counter() - t0
        if r.longest["sequence_length"] < spec.sequence_length:
            # compare like with like: the plan of the batch the probe step runs
            r.plan = analytic_plan(spec.with_changes(sequence_length=r.longest["sequence_length"]),
                                   r.arch, r.device.kind)
            r.notes.append(f"the longest batch is {r.longest['sequence_length']} tokens long "
                           f"(sequence_length {spec.sequence_length}): the plan the pilot is "
                           "compared with is of that length")
        self.step = InstrumentedStep(spec, _device_type(r.device),
                                     tracker=self.tracker if opts.memory_limit_bytes else None)

    def _warmup(self) -> None:
        r = self.r
        t0 = time.perf_counter()
        for i in range(WARMUP_STEPS):
            self.progress("warm-up (longest batch)", i, WARMUP_STEPS)
            phase = f"warm-up step {i + 1} (longest batch)"
            with self._oom_guard(phase):
                if i == WARMUP_STEPS - 1:
                    self._reset_allocator_peak("first_step")
                    self.tracker.adopt(self.longest.values())
                    rec, mem = probe_step_memory(self.state, lambda: self.longest, r.pilot_spec,
                                                 self.tracker, self._probe_step())
                    r.step_memory = mem
                    self.log(f"memory probe step: {mem}")
                else:
                    rec = self.step(self.state, lambda: self.longest)
            r.warmup.append(rec)
            self.log(f"{phase}: {rec.wall_s:.4f} s, loss {rec.loss:.4f}")
        r.timings["warmup_s"] = time.perf_counter() - t0

    def _probe_step(self) -> InstrumentedStep:
        """The memory-probe step: the tracker is on (with the limit, if any)."""
        return InstrumentedStep(self.r.pilot_spec, self.step.device_type, tracker=self.tracker)

    def _measure(self) -> None:
        r = self.r
        rule = r.stop_rule
        t0 = time.perf_counter()
        self.progress("measure steps", 0, rule.limit)
        times: list[float] = []
        while True:
            with self._oom_guard(f"measured step {len(r.steps) + 1}"):
                rec = self.step(self.state, self.stream.next)
            r.steps.append(rec)
            times.append(rec.wall_s)
            self.progress("measure steps", len(times), rule.limit)
            if not math.isfinite(rec.loss):
                r.notes.append(f"measured step {len(times)}: the loss is not finite "
                               f"({rec.loss}); check precision and learning rate")
            why = rule.verdict(times)
            if why:
                r.stopped_because = why
                break
        r.timings["measure_s"] = time.perf_counter() - t0
        self.log(f"measured {len(times)} steps ({r.stopped_because}); wall "
                 + " ".join(f"{t:.4f}" for t in times))

    def _validate(self) -> None:
        r, spec = self.r, self.r.pilot_spec
        n = spec.validation.num_batches
        self.progress("validation pass", 0, None)
        vstream = DataStream(make_loader(spec, self.dataset, r.data_info, seed=spec.seed + 1))
        ctx = self.tracker if self.options.memory_limit_bytes else contextlib.nullcontext()
        with self._oom_guard("validation pass"):
            _sync(r.device)
            t0 = time.perf_counter()
            with ctx:
                loss, tokens = evaluate(self.model, (vstream.next() for _ in range(n)), spec)
            _sync(r.device)
            dt = time.perf_counter() - t0
        r.validation = {"num_batches": n, "loss": loss, "useful_tokens": tokens, "seconds": dt}
        self.log(f"validation pass: {n} batches in {dt:.4f} s, loss {loss:.4f}")

    def _checkpoint(self) -> None:
        """One write of the full training state, timed (then removed: it is a probe)."""
        r = self.r
        self.progress("checkpoint write", 0, None)
        parent = self.run_dir.path / "checkpoints"
        parent.mkdir(parents=True, exist_ok=True)
        from tunepilot.checkpoint import model_and_optimizer_state, save_checkpoint

        msd, osd = model_and_optimizer_state(self.state, r.pilot_spec)  # LoRA: adapters only
        need = tensor_bytes(t for sd in (msd, osd) for t in _tensors_in(sd))
        free = shutil.disk_usage(parent).free
        if need * DISK_MARGIN > free:
            r.checkpoint = {"unavailable": f"not enough free disk in {parent}: the state is about "
                            f"{need:,} bytes, {free:,} free"}
            return
        tmp = Path(tempfile.mkdtemp(prefix=".pilot-probe-", dir=parent))
        target = tmp / "ckpt"
        try:
            _sync(r.device)
            t0 = time.perf_counter()
            info = save_checkpoint(target, self.state, self.stream, r.pilot_spec,
                                   extra={"written_by": "tunepilot pilot (timing probe)"})
            dt = time.perf_counter() - t0
            r.checkpoint = {"seconds": dt, "bytes": int(info.bytes), "files": len(info.files),
                            "kind": getattr(info, "kind", None),
                            "method": "tunepilot.checkpoint.save_checkpoint (the format the "
                                      "run writes: atomic, fsynced, checksummed)"}
        except (OSError, TunepilotError) as exc:  # a failed write is a finding, not a crash
            r.checkpoint = {"unavailable": f"the checkpoint write failed: {exc}"}
            r.notes.append(r.checkpoint["unavailable"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.log(f"checkpoint write: {r.checkpoint}")

    def _search(self) -> None:
        """--find-max-batch: the largest micro-batch whose full steps on the longest batches
        complete; the model is kept, gradients and activations are freed between tries."""
        r, spec = self.r, self.r.pilot_spec
        self.progress("find max micro-batch", 0, None)
        limit = self.options.memory_limit_bytes
        limit_note = "the device's memory" if r.device.kind != "cpu" else None
        free_memory(self.model)
        if self.state is None or not optimizer_state_complete(self.state):
            self.state = make_state(spec, self.model, WARMUP_STEPS + 1)
        base = TensorMemoryTracker(_device_type(r.device))
        base.adopt(state_tensors(self.model, self.state.optimizer))
        if limit is None and r.device.kind == "cpu":
            import psutil

            limit = base.live_bytes + int(CPU_SEARCH_RAM_FRACTION *
                                          psutil.virtual_memory().available)
            limit_note = (f"{CPU_SEARCH_RAM_FRACTION:.0%} of the RAM free at the start of the "
                          f"search ({limit:,} bytes of tensors): running out of RAM kills the "
                          "process instead of raising")
        elif limit is not None:
            limit_note = f"--memory-limit {limit:,} bytes"
        accum = min(spec.gradient_accumulation_steps, 2)  # >= 2 micro-batches all cost the same
        peaks: dict[int, int] = {}
        t0 = time.perf_counter()

        def ok(b: int) -> bool:
            self.progress("find max micro-batch", b, None)
            lb = longest_batch(self.dataset, r.data_info, b)
            tracker = TensorMemoryTracker(_device_type(r.device), limit)
            tracker.adopt(state_tensors(self.model, self.state.optimizer))
            tracker.adopt(lb.values())
            step = InstrumentedStep(spec, _device_type(r.device), tracker=tracker)
            n_steps = 1 if optimizer_state_complete(self.state) else 2
            try:
                for _ in range(n_steps):
                    step(self.state, lambda: lb, accumulation=accum)
                fits = True
            except torch.OutOfMemoryError:
                fits = False
            finally:
                peaks[b] = tracker.peak_bytes
                del tracker, step
                lb = None  # noqa: F841 - frees the batch before the next try
                free_memory(self.model)
            self.log(f"find-max-batch: micro_batch {b} {'fits' if fits else 'does not fit'} "
                     f"(tracked peak {peaks[b]:,} bytes)")
            return fits

        fitted = r.does_not_fit is None
        best, tries = largest_passing(ok, MAX_SEARCH_MICRO_BATCH,
                                      known_ok=spec.micro_batch_size if fitted else None,
                                      known_bad=None if fitted else spec.micro_batch_size)
        r.search = {"max_micro_batch": best, "tries": [{"micro_batch_size": b, "fits": f,
                                                         "tracked_peak_bytes": peaks.get(b)}
                                                        for b, f in tries],
                    "limit": limit_note, "seconds": time.perf_counter() - t0,
                    "capped": bool(best >= MAX_SEARCH_MICRO_BATCH // 2 and
                                   all(f for _, f in tries)),
                    "accumulation_tried": accum,
                    "sequence_length": r.longest["sequence_length"] if r.longest else None}

    # --- memory bookkeeping --------------------------------------------------------------------
    def _reset_allocator_peak(self, segment: str) -> None:
        if self.r.device.kind == "cpu":
            return
        self._note_allocator(segment)
        torch.cuda.reset_peak_memory_stats()

    def _note_allocator(self, segment: str) -> None:
        a = self.r.allocator
        a[f"{segment}_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        a[f"{segment}_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        a["max_reserved_bytes"] = max(a.get("max_reserved_bytes", 0),
                                      torch.cuda.max_memory_reserved())

    def _read_allocator(self) -> None:
        r = self.r
        if self.tracker is not None:
            r.tracked_peak_bytes = self.tracker.peak_bytes
        if r.device.kind == "cpu":
            return
        self._note_allocator("steady")
        s = torch.cuda.memory_stats()
        r.allocator["num_alloc_retries"] = int(s.get("num_alloc_retries", 0))
        r.allocator["num_ooms"] = int(s.get("num_ooms", 0))


# --- helpers -----------------------------------------------------------------------------------


def _single_device_spec(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """The pilot runs one device's step; DDP/FSDP are `tunepilot scale`'s to measure."""
    if spec.parallel.strategy == "single":
        return spec, []
    par = dict(spec.parallel.model_dump(), strategy="single", devices=1, nodes=1)
    return spec.with_changes(parallel=par), [
        f"parallel.strategy is {spec.parallel.strategy} over {spec.parallel.world_size} "
        "devices: the pilot measured the full step on one device (no sharding); "
        "`tunepilot scale` measures the sharded step"]


def _preflight(spec: RunSpec, info: DeviceInfo) -> None:
    """Features the spec needs that this device cannot run: a clear error before any work."""
    if info.kind == "cpu":
        if spec.method.kind == "qlora":
            raise UserError("method.kind", "qlora needs bitsandbytes and a CUDA GPU; this pilot "
                            "runs on the CPU.", "Plan it here (`tunepilot plan` models the NF4 "
                            "base), pilot it on the GPU you intend to rent, or use kind: lora "
                            "for a CPU pilot.")
        if spec.optimizer.name in ("adamw_8bit", "paged_adamw", "paged_adamw_8bit"):
            raise UserError("optimizer.name", f"{spec.optimizer.name} needs bitsandbytes on a "
                            "CUDA GPU; this pilot runs on the CPU.",
                            "Use adamw for a CPU pilot (the plan still models "
                            f"{spec.optimizer.name}).")
        if spec.parallel.cpu_offload:
            raise UserError("parallel.cpu_offload", "FSDP CPU offload needs a GPU to offload from.",
                            "Set cpu_offload: false for a CPU pilot.")
    if info.kind == "cuda" and spec.precision.startswith("bf16") and info.bf16_supported is False:
        raise UserError("precision", f"{info.name} has no bf16 support.",
                        "Use precision: fp16-mixed or fp32 on this GPU.")
    if info.kind == "rocm" and (spec.method.kind == "qlora" or "8bit" in spec.optimizer.name) and \
            any("bitsandbytes" in m for m in info.missing):
        raise UserError("method.kind" if spec.method.kind == "qlora" else "optimizer.name",
                        "this ROCm build has no bitsandbytes, which the spec needs.",
                        "Install the ROCm build of bitsandbytes, or use kind: lora / adamw.")


def _device_type(info: DeviceInfo) -> str:
    """torch's device type: ROCm GPUs are "cuda" to torch too."""
    return "cpu" if info.kind == "cpu" else "cuda"


def _tensors_in(obj):
    """Every tensor in a nested state dict."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def _sync(info: DeviceInfo) -> None:
    if info.kind != "cpu":
        torch.cuda.synchronize()


def _data_provenance(info) -> dict:
    return {"source": info.source, "path": info.path, "size_bytes": info.size_bytes,
            "content_sha256": info.content_sha256, "tokenizer": info.tokenizer,
            "num_samples": info.num_samples}


def _model_provenance(spec: RunSpec, arch, base_dir: Path | None) -> dict:
    cfg = resolve_model_config(spec, base_dir)
    meta = cfg.get("_tunepilot", {}) if isinstance(cfg, dict) else {}
    return {"preset": spec.model.preset, "config": spec.model.config,
            "revision": spec.model.revision, "weights": spec.model.weights,
            "config_sha256": arch.config_hash, "hf_id": arch.hf_id or meta.get("hf_id"),
            "model_type": arch.model_type}
