"""The restore proof: a checkpoint counts only if a fresh process resumes the run exactly.

1. This process trains K steps, records a digest of every component (the SHA-256 of every model
   and optimizer tensor, the scheduler state and current LR, each RNG stream, the data position,
   the step count), saves a checkpoint, and trains M more steps recording, per step, the loss as
   exact bits (float.hex), the batch fingerprint(s) and the LR.
2. A fresh Python process (`python -m tunepilot.restore --worker JOB`) builds the run from the
   spec, loads the checkpoint (checksums first), digests every component the same way before it
   trains, then trains the same M steps recording the same.
3. The verdict compares component by component, then step by step: batch fingerprints and LRs
   identical, losses bit-identical on CPU (deterministic algorithms on in both processes). On a
   GPU it reports the largest absolute loss difference and whether deterministic mode held.

Save and load time and bytes go into RUN_DIR/restore.json (they are what a term pays per
checkpoint). Test-only fault injection (`_fault=`) breaks one component on purpose so the tests can
prove the proof fails and names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunepilot.checkpoint import (
    DATA,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    SCALER,
    SCHEDULER,
    CheckpointError,
    CheckpointInfo,
    data_position,
    load_checkpoint,
    model_and_optimizer_state,
    read_manifest,
    rng_state,
    save_checkpoint,
)
from tunepilot.errors import UserError
from tunepilot.figures import measured, unavailable
from tunepilot.spec import RunSpec
from tunepilot.store import RunDir, write_json

DEFAULT_STEPS_BEFORE = 4
DEFAULT_STEPS_AFTER = 4
WORKER_TIMEOUT_S = 1800  # the fresh process builds the model and trains M steps; generous
CHECKSUMS, FRESH, BATCHES, LR, LOSS = "checksums", "fresh_process", "batches", "lr", "loss"
# on a GPU without deterministic kernels, losses may differ by reduction order; beyond this
# relative difference it is not reduction order (bf16 has ~3 significant digits, fp32 ~7)
GPU_LOSS_RTOL = 1e-3
_NONDETERMINISTIC_WARNING = "does not have a deterministic implementation"
# test-only breakages, each aimed at one component (see tests/test_restore.py)
FAULTS = ("drop-rng", "drop-data-position", "reset-scheduler", "perturb-optimizer",
          "truncate-file:", "flip-byte:")


@dataclass
class StepRecord:
    """One optimizer step as a resumed run must reproduce it."""

    step: int
    loss: float
    loss_bits: str
    """float.hex of the loss: exact (the fp32 loss is held exactly in a Python float)."""
    lr: float
    lr_bits: str
    fingerprints: list[str]
    useful_tokens: int


@dataclass
class ComponentCheck:
    name: str
    passed: bool
    detail: str


@dataclass
class RestoreResult:
    """The verdict of one restore proof."""

    passed: bool
    components: list[ComponentCheck]
    steps_before: int
    steps_after: int
    checkpoint: str
    save: CheckpointInfo
    load_s: float | None
    device: dict
    deterministic: dict
    loss_max_abs_diff: float | None
    first_divergence: dict | None = None
    original: list[StepRecord] = field(default_factory=list)
    restored: list[StepRecord] = field(default_factory=list)
    fault: str | None = None

    @property
    def failed(self) -> list[ComponentCheck]:
        return [c for c in self.components if not c.passed]

    def to_dict(self) -> dict:
        """restore.json: save_s, load_s, checkpoint_bytes (figures), passed, components, ..."""
        b = self.save.bytes
        load = measured(self.load_s, "s") if self.load_s is not None else unavailable(
            "s", "the fresh process did not load the checkpoint")
        out = {
            "passed": self.passed,
            "failed_components": [c.name for c in self.failed],
            "components": [asdict(c) for c in self.components],
            "first_divergence": self.first_divergence,
            "save_s": measured(self.save.seconds, "s", includes="fsync and SHA-256 of every file"),
            "load_s": load if self.load_s is None else dict(
                load, includes="SHA-256 verification of every file"),
            "checkpoint_bytes": measured(b, "bytes", kind=self.save.kind),
            "save_bytes_per_s": measured(b / self.save.seconds if self.save.seconds else None,
                                         "B/s"),
            "load_bytes_per_s": measured(b / self.load_s, "B/s") if self.load_s else unavailable(
                "B/s", "no load"),
            "steps_before": self.steps_before,
            "steps_after": self.steps_after,
            "checkpoint": {"path": self.checkpoint, "kind": self.save.kind,
                           "files": len(self.save.files), "step": self.save.step},
            "device": self.device,
            "deterministic": self.deterministic,
            "loss_max_abs_diff": measured(self.loss_max_abs_diff, "nats/token")
            if self.loss_max_abs_diff is not None else unavailable("nats/token", "no restored steps"),
            "steps": {"original": [asdict(s) for s in self.original],
                      "restored": [asdict(s) for s in self.restored]},
        }
        if self.fault:
            out["fault_injected"] = self.fault
        return out


def verify_restore(spec: RunSpec, steps_before: int = DEFAULT_STEPS_BEFORE,
                   steps_after: int = DEFAULT_STEPS_AFTER, run_dir: Path | str | None = None, *,
                   base_dir: Path | None = None, device: str | None = None, catalog=None,
                   _fault: str | None = None) -> RestoreResult:
    """Train, save, train on; resume in a fresh process; compare. Writes RUN_DIR/restore.json."""
    if steps_before < 1 or steps_after < 1:
        raise UserError("--steps-before" if steps_before < 1 else "--steps-after",
                        f"needs at least 1 step (got {min(steps_before, steps_after)}).",
                        "The proof saves after K >= 1 steps and compares M >= 1 steps after.")
    _check_fault(_fault)
    if run_dir is None:
        raise UserError("--out", "the restore proof needs a run directory for its checkpoint.")
    run = RunDir(run_dir)
    spec_hash = spec.spec_hash()
    run.check_spec(spec_hash)
    from tunepilot.catalog import load_catalog
    from tunepilot.pilot.device import probe_device

    info = probe_device(catalog or load_catalog(), device=device)
    original = _run_original(spec, steps_before, steps_after, run.path, base_dir,
                             info.torch_device)
    original["device_info"] = dict(info.summary(), torch_device=info.torch_device)
    _damage_files(Path(original["checkpoint"]), _fault)
    fresh = _run_fresh(original, run.path, _fault)
    result = _verdict(original, fresh, _fault)
    run.write_stage("restore", result.to_dict(), spec_hash)
    if "device" not in run.manifest():  # the pilot writes it; the cost stage reads card_id there
        run.update_manifest(device=info.summary(), spec=spec.model_dump(mode="json"))
    return result


# --- 1. the original run -----------------------------------------------------------------------


def _run_original(spec: RunSpec, steps_before: int, steps_after: int, run_path: Path,
                  base_dir: Path | None, device: str) -> dict:
    """Train K steps, digest, save, train M steps; everything the fresh process must match."""
    import torch

    total_steps = steps_before + steps_after
    ckpt = run_path / spec.checkpoint.dir / f"restore-step-{steps_before:06d}"
    with _deterministic(device) as det:
        _seed_everything(spec.seed)
        state, stream = _build(spec, total_steps, base_dir, device)
        _train(state, stream, spec, steps_before)
        digest = state_digest(state, stream, spec)
        info = save_checkpoint(ckpt, state, stream, spec, extra={"purpose": "restore proof"})
        steps = _train(state, stream, spec, steps_after)
    return {"spec": spec.model_dump(mode="json"), "spec_hash": spec.spec_hash(),
            "base_dir": str(base_dir) if base_dir is not None else None, "device": device,
            "threads": torch.get_num_threads(), "total_steps": total_steps,
            "steps_before": steps_before, "steps_after": steps_after,
            "checkpoint": str(ckpt), "save": info.to_dict(), "digest": digest,
            "steps": [asdict(s) for s in steps], "deterministic": det}


# --- 2. the fresh process ----------------------------------------------------------------------


def _run_fresh(original: dict, run_path: Path, fault: str | None) -> dict:
    """Run the fresh process on the original's checkpoint; its report (or why it failed)."""
    logs = RunDir(run_path).logs_dir()
    job_path, out_path = logs / "restore-fresh-job.json", logs / "restore-fresh.json"
    out_path.unlink(missing_ok=True)
    job = {k: original[k] for k in ("spec", "spec_hash", "base_dir", "device", "threads",
                                     "total_steps", "steps_after", "checkpoint")}
    job.update(out=str(out_path), fault=fault)
    write_json(job_path, job)
    env = dict(os.environ)
    # the fresh process imports this very copy of tunepilot, installed or not
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    if original["device"].startswith("cuda"):
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    log = logs / "restore-fresh.log"
    with open(log, "wb") as err:
        try:
            proc = subprocess.run([sys.executable, "-m", "tunepilot.restore", "--worker",
                                   str(job_path)], stdout=err, stderr=subprocess.STDOUT, env=env,
                                  timeout=WORKER_TIMEOUT_S, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    if out_path.exists():
        return json.loads(out_path.read_text())
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    why = "timed out" if rc is None else f"exited with code {rc}"
    return {"crashed": f"the fresh process {why} without a report: " + " | ".join(tail)}


def _worker(job: dict) -> dict:
    """The fresh process: build, load (checksums first), digest, train M steps."""
    spec = RunSpec.model_validate(job["spec"])
    if spec.spec_hash() != job["spec_hash"]:
        return {"error": {"component": FRESH, "message": "the spec did not survive the trip to "
                          "the fresh process (spec hash differs)"}}
    import torch

    torch.set_num_threads(int(job["threads"]))
    base_dir = Path(job["base_dir"]) if job["base_dir"] else None
    fault = job.get("fault")
    with _deterministic(job["device"]) as det:
        _seed_everything(spec.seed)
        state, stream = _build(spec, job["total_steps"], base_dir, job["device"])
        before = _capture_for_fault(fault, state, stream)
        try:
            info = load_checkpoint(Path(job["checkpoint"]), state, stream, spec)
        except CheckpointError as exc:
            return {"error": exc.to_dict()}
        _apply_fault(fault, state, stream, before)
        digest = state_digest(state, stream, spec)
        steps = _train(state, stream, spec, job["steps_after"])
    return {"load": info.to_dict(), "digest": digest, "steps": [asdict(s) for s in steps],
            "deterministic": det}


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--worker":
        sys.stderr.write("usage: python -m tunepilot.restore --worker JOB.json (internal: started "
                         "by `tunepilot restore`)\n")
        return 2
    job = json.loads(Path(argv[1]).read_text())
    report = _worker(job)
    write_json(Path(job["out"]), report)
    return 0


# --- 3. the verdict ----------------------------------------------------------------------------


def _verdict(original: dict, fresh: dict, fault: str | None) -> RestoreResult:
    save = CheckpointInfo(**original["save"])
    device = original.get("device_info") or {"torch_device": original["device"]}
    ref_steps = [StepRecord(**s) for s in original["steps"]]
    base = dict(steps_before=original["steps_before"], steps_after=original["steps_after"],
                checkpoint=original["checkpoint"], save=save, device=device,
                original=ref_steps, fault=fault)
    names = _component_names(original)
    if "crashed" in fresh or "error" in fresh:
        checks = _load_failure(fresh, names)
        return RestoreResult(False, checks, load_s=None,
                             deterministic=_determinism(original["deterministic"], None),
                             loss_max_abs_diff=None, **base)
    a, b = original["digest"], fresh["digest"]
    checks = [ComponentCheck(CHECKSUMS, True, f"{len(save.files)} files, "
                             f"{save.bytes:,} bytes: every SHA-256 matches the manifest")]
    checks.append(_compare_hashes(MODEL, a[MODEL], b[MODEL], "tensors"))
    checks.append(_compare_hashes(OPTIMIZER, a[OPTIMIZER], b[OPTIMIZER], "entries"))
    checks.append(_compare_scheduler(a[SCHEDULER], b[SCHEDULER]))
    if SCALER in names:
        checks.append(_compare_plain(SCALER, a[SCALER], b[SCALER], "GradScaler state"))
    checks.append(_compare_hashes(RNG, a[RNG], b[RNG], "streams"))
    checks.append(_compare_plain(DATA, a[DATA], b[DATA], "data position", _describe_position))
    checks.append(_compare_plain(PROGRESS, a[PROGRESS], b[PROGRESS], "step and useful tokens"))
    got_steps = [StepRecord(**s) for s in fresh["steps"]]
    det = _determinism(original["deterministic"], fresh["deterministic"])
    on_gpu = original["device"].startswith("cuda")
    traj, divergence, max_diff = _compare_steps(ref_steps, got_steps, on_gpu, det["held"])
    checks += traj
    return RestoreResult(all(c.passed for c in checks), checks, load_s=fresh["load"]["seconds"],
                         deterministic=det, loss_max_abs_diff=max_diff,
                         first_divergence=divergence, restored=got_steps, **base)


def _component_names(original: dict) -> list[str]:
    names = [CHECKSUMS, MODEL, OPTIMIZER, SCHEDULER]
    if original["digest"].get(SCALER) is not None:
        names.append(SCALER)
    return names + [RNG, DATA, PROGRESS, BATCHES, LR, LOSS]


def _load_failure(fresh: dict, names: list[str]) -> list[ComponentCheck]:
    if "crashed" in fresh:
        checks = [ComponentCheck(FRESH, False, fresh["crashed"])]
        return checks + [ComponentCheck(n, False, "not checked: the fresh process failed")
                         for n in names]
    err = fresh["error"]
    culprit = err.get("component") or CHECKSUMS
    problems = err.get("problems") or []
    checks = []
    for n in names:
        if n == CHECKSUMS:
            if problems:
                checks.append(ComponentCheck(n, False, "; ".join(
                    f"{p['file'] or p['component']} ({p['component']}): {p['problem']}"
                    for p in problems)))
            else:
                checks.append(ComponentCheck(n, True, "every SHA-256 matches the manifest"))
        elif n == culprit or any(p["component"] == n for p in problems):
            checks.append(ComponentCheck(n, False, f"did not load: {err['message']}"))
        else:
            checks.append(ComponentCheck(n, False, "not checked: the checkpoint did not load"))
    if culprit not in names:  # e.g. the manifest itself
        checks.insert(1, ComponentCheck(culprit, False, err["message"]))
    # the cause first, so the first failed component is the one to fix
    return sorted(checks, key=lambda c: not (c.name == culprit or (c.name == CHECKSUMS and
                                                                   problems)))


def _compare_hashes(name: str, a: dict, b: dict, what: str) -> ComponentCheck:
    missing = [k for k in a if k not in b]
    extra = [k for k in b if k not in a]
    differ = [k for k in a if k in b and a[k] != b[k]]
    if not (missing or extra or differ):
        return ComponentCheck(name, True, f"{len(a)} {what} identical (SHA-256)")
    parts = []
    if differ:
        parts.append(f"{len(differ)} of {len(a)} {what} differ (first: {differ[0]})")
    if missing:
        parts.append(f"{len(missing)} missing after restore (first: {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} not in the saved state (first: {extra[0]})")
    return ComponentCheck(name, False, "; ".join(parts))


def _compare_scheduler(a: dict, b: dict) -> ComponentCheck:
    if a == b:
        return ComponentCheck(SCHEDULER, True, f"state identical (last_epoch {a['last_epoch']}), "
                              f"current LR {float.fromhex(a['lr'][0]):.6g} bit-identical")
    diffs = [k for k in a if a[k] != b.get(k)]
    return ComponentCheck(SCHEDULER, False, "differs in " + ", ".join(diffs) + f": saved "
                          f"last_epoch {a['last_epoch']}, LR {_hex_list(a['lr'])}; restored "
                          f"last_epoch {b['last_epoch']}, LR {_hex_list(b['lr'])}")


def _compare_plain(name: str, a: Any, b: Any, what: str, show=None) -> ComponentCheck:
    show = show or _short
    if a == b:
        return ComponentCheck(name, True, f"{what} identical: {show(a)}")
    if show(a) == show(b):  # the summary hides the difference: show the raw values
        show = _short
    return ComponentCheck(name, False, f"{what} differs: saved {show(a)}; restored {show(b)}")


def _describe_position(p: dict) -> str:
    """'epoch 0, 16 samples in (4 batches), iterator open' from a data_position() dict."""
    stream = p.get("stream", {})
    loader = stream.get("loader", {}) or {}
    it = loader.get("_sampler_iter_state") or {}
    samples = it.get("samples_yielded")
    sampler = (it.get("sampler_state") or {}).get("yielded")
    text = f"epoch {stream.get('epoch')}, {samples} samples in ({loader.get('_num_yielded')} " \
           f"batches)" if samples is not None else f"epoch {stream.get('epoch')}, at the start"
    if sampler is not None and sampler != samples:
        text += f", sampler at {sampler}"
    return text + (", iterator open" if p.get("iterator_open") else "")


def _compare_steps(ref: list[StepRecord], got: list[StepRecord], on_gpu: bool,
                   deterministic: bool) -> tuple[list[ComponentCheck], dict | None, float | None]:
    n = len(ref)
    first: dict | None = None
    bad = {BATCHES: 0, LR: 0, LOSS: 0}
    max_diff = 0.0
    tol_pass = True
    for i in range(max(n, len(got))):
        if i >= len(got) or i >= n:
            what = [BATCHES, LR, LOSS]
        else:
            r, g = ref[i], got[i]
            max_diff = max(max_diff, abs(r.loss - g.loss))
            what = []
            if r.fingerprints != g.fingerprints or r.useful_tokens != g.useful_tokens:
                what.append(BATCHES)
            if r.lr_bits != g.lr_bits:
                what.append(LR)
            if r.loss_bits != g.loss_bits:
                close = abs(r.loss - g.loss) <= GPU_LOSS_RTOL * max(1.0, abs(r.loss))
                if not (on_gpu and not deterministic and close):
                    what.append(LOSS)
                tol_pass = tol_pass and close
        for w in what:
            bad[w] += 1
        if what and first is None:
            first = {"step": ref[i].step if i < n else got[i].step, "index": i, "diverged": what,
                     "original": asdict(ref[i]) if i < n else None,
                     "restored": asdict(got[i]) if i < len(got) else None}
    checks = []
    fp = first and f" (first at step {first['step']})"
    checks.append(ComponentCheck(BATCHES, bad[BATCHES] == 0, f"{n} steps: batch fingerprints "
                                 "identical" if not bad[BATCHES] else
                                 f"{bad[BATCHES]} of {n} steps saw other data{fp}"))
    checks.append(ComponentCheck(LR, bad[LR] == 0, f"{n} steps: LR bit-identical" if not bad[LR]
                                 else f"{bad[LR]} of {n} steps had another LR{fp}"))
    if bad[LOSS]:
        loss = ComponentCheck(LOSS, False, f"{bad[LOSS]} of {n} steps differ; max |diff| "
                              f"{max_diff:.3g}{fp}")
    elif max_diff == 0.0:
        loss = ComponentCheck(LOSS, True, f"{n} steps: losses bit-identical")
    else:
        loss = ComponentCheck(LOSS, tol_pass, f"{n} steps: max |diff| {max_diff:.3g} (GPU, "
                              "deterministic mode not possible; within relative "
                              f"{GPU_LOSS_RTOL:g})")
    checks.append(loss)
    return checks, first, max_diff


# --- the state digest --------------------------------------------------------------------------


def state_digest(state, stream, spec: RunSpec) -> dict:
    """A hash per tensor of model and optimizer, the scheduler state and LR, a hash per RNG
    stream, the data position, the step: what a resumed run must reproduce before it trains."""
    _, osd = model_and_optimizer_state(state, spec)
    opt: dict[str, str] = {}
    for fqn, per_param in osd["state"].items():
        for k, v in per_param.items():
            opt[f"{fqn}.{k}"] = _value_sha(v)
    # the current LR is the scheduler's (checked there); the rest of each group is the optimizer's
    opt["param_groups"] = _value_sha([{k: v for k, v in g.items() if k != "lr"}
                                      for g in osd["param_groups"]])
    sched = state.scheduler.state_dict()
    return {
        MODEL: {k: _value_sha(v) for k, v in state.model.state_dict().items()},
        OPTIMIZER: opt,
        SCHEDULER: {"last_epoch": sched.get("last_epoch"),
                    "lr": [float(g["lr"]).hex() for g in state.optimizer.param_groups],
                    "last_lr": [float(x).hex() for x in sched.get("_last_lr", [])],
                    "state_sha": _value_sha(sched)},
        SCALER: _value_sha(state.scaler.state_dict()) if state.scaler is not None else None,
        RNG: {name: _value_sha(s) for name, s in rng_state().items() if s != []},
        DATA: data_position(stream),
        PROGRESS: {"step": state.step, "useful_tokens_seen": state.useful_tokens_seen},
    }


def _value_sha(v: Any) -> str:
    """SHA-256 (16 hex) of a tensor's dtype, shape and bytes, or of a value's canonical JSON."""
    import torch

    h = hashlib.sha256()
    if isinstance(v, torch.Tensor):
        t = v.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        from tunepilot.checkpoint import _to_json

        h.update(json.dumps(_to_json(v), sort_keys=True, default=repr,
                            separators=(",", ":")).encode())
    return h.hexdigest()[:16]


# --- shared by both processes ------------------------------------------------------------------


def _build(spec: RunSpec, total_steps: int, base_dir: Path | None, device: str):
    from tunepilot.data import DataStream, build_dataset, make_loader
    from tunepilot.models import build_model
    from tunepilot.training import make_state

    model = build_model(spec, device, base_dir=base_dir)
    dataset, info = build_dataset(spec, model.config.vocab_size, base_dir)
    stream = DataStream(make_loader(spec, dataset, info))
    return make_state(spec, model, total_steps), stream


def _train(state, stream, spec: RunSpec, n: int) -> list[StepRecord]:
    from tunepilot.data import batch_fingerprint
    from tunepilot.training import train_step

    out = []
    for _ in range(n):
        s = train_step(state, stream.next, spec, fingerprint=batch_fingerprint)
        out.append(StepRecord(s.step, s.loss, float(s.loss).hex(), float(s.lr),
                              float(s.lr).hex(), list(s.fingerprints), s.useful_tokens))
    return out


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def _deterministic(device: str):
    """Deterministic algorithms on (warn-only, so an op without a deterministic kernel is
    recorded rather than fatal); the caller's settings come back afterwards."""
    import torch

    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    prev_bench = torch.backends.cudnn.benchmark
    report: dict = {"requested": True, "held": True, "nondeterministic_ops": []}
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    _set_deterministic(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield report
        ops = sorted({str(w.message).split(" does not")[0] for w in caught
                      if _NONDETERMINISTIC_WARNING in str(w.message)})
        report["nondeterministic_ops"] = ops
        report["held"] = not ops
    finally:
        _set_deterministic(prev[0], warn_only=prev[1])
        torch.backends.cudnn.benchmark = prev_bench


def _set_deterministic(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms, without importing the compiler just to set its flag
    (torch 2.13 imports torch._inductor for that: 1.4 s per process); nothing here compiles."""
    import torch

    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def _determinism(a: dict, b: dict | None) -> dict:
    ops = sorted(set(a["nondeterministic_ops"]) | set((b or {}).get("nondeterministic_ops", [])))
    return {"requested": True, "held": not ops, "nondeterministic_ops": ops}


def _hex_list(xs: list[str]) -> str:
    return ", ".join(f"{float.fromhex(x):.6g}" for x in xs)


def _short(v: Any) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


# --- test-only fault injection -----------------------------------------------------------------


def _check_fault(fault: str | None) -> None:
    if fault is not None and not any(fault == f or (f.endswith(":") and fault.startswith(f))
                                     for f in FAULTS):
        raise UserError("_fault", f"unknown test fault {fault!r}.", f"Known: {', '.join(FAULTS)}")


def _damage_files(ckpt: Path, fault: str | None) -> None:
    """truncate-file:COMPONENT / flip-byte:COMPONENT: damage that component's largest file."""
    if not fault or ":" not in fault:
        return
    action, component = fault.split(":", 1)
    manifest = read_manifest(ckpt)
    files = manifest["components"].get(component)
    if not files:
        raise UserError("_fault", f"the checkpoint has no component {component!r}.")
    target = ckpt / max(files, key=lambda r: manifest["files"][r]["bytes"])
    data = bytearray(target.read_bytes())
    if action == "truncate-file":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))


def _capture_for_fault(fault: str | None, state, stream) -> dict:
    """What the fresh process looks like before the load (a 'dropped' component stays so)."""
    if fault == "drop-rng":
        return {"rng": rng_state()}
    if fault == "drop-data-position":
        return {"data": stream.state_dict()}
    if fault == "reset-scheduler":
        return {"scheduler": state.scheduler.state_dict(),
                "lr": [g["lr"] for g in state.optimizer.param_groups]}
    return {}


def _apply_fault(fault: str | None, state, stream, before: dict) -> None:
    import torch

    from tunepilot.checkpoint import set_rng_state

    if fault == "drop-rng":
        set_rng_state(before["rng"])
    elif fault == "drop-data-position":
        stream.load_state_dict(before["data"])
    elif fault == "reset-scheduler":
        state.scheduler.load_state_dict(before["scheduler"])
        for g, lr in zip(state.optimizer.param_groups, before["lr"], strict=True):
            g["lr"] = lr
    elif fault == "perturb-optimizer":
        # the smallest possible change: one element of one state tensor, one ULP up
        for per_param in state.optimizer.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    flat = v.view(-1)
                    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=v.dtype))
                    return


def failure_message(result: RestoreResult) -> str:
    """One line for stderr: which components failed and why (the first is the cause)."""
    parts = [f"{c.name} ({c.detail})" for c in result.failed[:3]]
    more = f" and {len(result.failed) - 3} more" if len(result.failed) > 3 else ""
    return "restore proof failed: " + "; ".join(parts) + more


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
