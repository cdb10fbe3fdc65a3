"""Before a pilot builds anything: the device, what the spec needs of it, whether the plan fits
the device's memory at all (host RAM on a CPU), the data, and the provenance."""

from __future__ import annotations

import time
from pathlib import Path

from tunepilot.catalog import Catalog
from tunepilot.device import DeviceInfo, probe_device
from tunepilot.errors import DoesNotFit, UserError
from tunepilot.model.arch import resolve_arch, resolve_model_config
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.spec import RunSpec
from tunepilot.units import fmt_bytes

# A plan whose peak passes the device's free memory by this factor is refused before the build:
# the plan's error is a few percent, and on a CPU running out of RAM kills the process (no
# exception to catch) - usually after minutes of building the model.
PLAN_MARGIN = 1.10


def needs_bitsandbytes(spec: RunSpec) -> bool:
    """QLoRA and every 8-bit or paged optimizer need bitsandbytes (the one rule, used by the
    device probe, the pilot's preflight and the ROCm check)."""
    from tunepilot.training.build import BNB_OPTIMIZERS

    return spec.method.kind == "qlora" or spec.optimizer.name in BNB_OPTIMIZERS


def prepare(spec: RunSpec, options, catalog: Catalog, log, progress, run_dir: Path):
    """Probe, check and read everything the pilot needs; a Session ready to build the run."""
    from tunepilot.dataset import build_dataset
    from tunepilot.pilot.measurements import Measurements
    from tunepilot.pilot.provenance import collect_provenance
    from tunepilot.pilot.session import PilotOutOfMemory, Session
    from tunepilot.training.step import OWN_STEP_OBJECTIVES

    if spec.objective.kind not in OWN_STEP_OBJECTIVES:
        raise UserError("objective.kind", f"{spec.objective.kind}: tunepilot's own pilot runs "
                        f"{', '.join(OWN_STEP_OBJECTIVES)}.", "Plan it (`tunepilot plan` "
                        f"models {spec.objective.kind}), and pilot your own run with "
                        "TunepilotCallback in its trainer (examples/own-loop).")
    if spec.model.task != "causal-lm" and spec.objective.kind != "reward":
        raise UserError("model.task", f"{spec.model.task}: tunepilot's own pilot trains causal "
                        "language models and reward models (objective.kind: reward).",
                        "Plan it (`tunepilot plan` models the classification "
                        "head), and pilot your own classification run with TunepilotCallback in "
                        "its Trainer.")
    progress("probe device", 0, None)
    t0 = time.perf_counter()
    info = probe_device(catalog, ["bitsandbytes"] if needs_bitsandbytes(spec) else [],
                        device=options.device)
    log(f"device: {info.kind} {info.name!r} card={info.card_id} torch {info.torch_version} "
        f"cuda={info.cuda_version} hip={info.hip_version}")
    pilot_spec, notes = (sharded_spec(spec, options.ranks) if options.ranks else
                         single_device_spec(spec))
    pilot_spec, modelled = without_modelled_levers(pilot_spec)
    notes += modelled
    with_kernels = pilot_spec
    pilot_spec, kernels = without_gpu_kernels(pilot_spec, info)
    notes += kernels
    check_device_features(pilot_spec, info)
    arch = resolve_arch(pilot_spec, options.base_dir)
    plan = analytic_plan(pilot_spec, arch, info.kind)
    m = Measurements(spec=pilot_spec, arch=arch, device=info, catalog=catalog,
                     notes=notes + info.missing)
    s = Session(spec=spec, m=m, options=options, plan=plan, log=log, progress=progress,
                run_dir=run_dir)
    shared = options.ranks if (options.ranks and info.kind == "cpu") else 1  # one host's RAM
    problem = plan_fit_problem(pilot_spec, plan, info, ranks=shared) \
        if options.check_memory else None
    if problem and with_kernels != pilot_spec:
        problem = _kernels_would_fit(with_kernels, arch, info, shared, problem)
    if problem:
        s.does_not_fit = PilotOutOfMemory("memory check before building (plan vs local memory)",
                                     RuntimeError(problem), simulated=False)
        log(f"refused before building: {problem}")
        return s
    if options.memory_limit_bytes:
        m.notes.append(f"--memory-limit {options.memory_limit_bytes} bytes: every step ran "
                       "under the tensor tracker, which raises torch.OutOfMemoryError past the "
                       "limit; step times include the tracker's per-op cost")
    progress("read data", 0, None)
    s.dataset, s.data_info = build_dataset(pilot_spec, arch.vocab_size, options.base_dir)
    if len(s.dataset) < pilot_spec.micro_batch_size:
        raise UserError("micro_batch_size", f"the dataset has {len(s.dataset)} samples, fewer "
                        f"than one micro-batch of {pilot_spec.micro_batch_size}.",
                        "Add samples, or lower micro_batch_size.")
    m.notes += s.data_info.notes
    for n in s.data_info.notes:
        log(f"data: {n}")
    m.times.setup_s = time.perf_counter() - t0
    s.provenance = collect_provenance(
        spec, device=info.to_dict(), data=s.data_info.provenance(),
        model=_model_provenance(spec, arch, options.base_dir))
    return s


def sharded_spec(spec: RunSpec, ranks: int) -> tuple[RunSpec, list[str]]:
    """The spec a sharded pilot runs: its FSDP on ``ranks`` ranks of this machine (one node)."""
    if spec.parallel.world_size == ranks and spec.parallel.nodes == 1:
        return spec, []
    one_node = spec.with_changes(parallel=dict(spec.parallel.model_dump(), devices=ranks,
                                               nodes=1))
    return one_node, [f"parallel: FSDP over {spec.parallel.world_size} ranks on "
                      f"{spec.parallel.nodes} nodes; the pilot ran one node's {ranks} ranks "
                      "(each rank holds 1/" + str(ranks) + " of the states, not 1/"
                      + str(spec.parallel.world_size) + ")"]


def single_device_spec(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """The pilot runs one device's step; DDP/FSDP are `tunepilot scale`'s to measure."""
    if spec.parallel.strategy == "single":
        return spec, []
    par = dict(spec.parallel.model_dump(), strategy="single", devices=1, nodes=1)
    from pydantic import ValidationError

    try:
        one = spec.with_changes(parallel=par)
    except ValidationError as exc:  # e.g. num_generations divides N ranks' batch, not one's
        msg = str(exc.errors(include_url=False)[0].get("msg", exc)).removeprefix(
            "Value error, ")
        raise UserError("parallel", f"on one device (the pilot) the spec is not valid: {msg}.",
                        "Pilot a single-device variant of the spec (e.g. a larger "
                        "gradient_accumulation_steps), or measure the N-rank run with "
                        "`tunepilot scale`.") from None
    return one, [
        f"parallel.strategy is {spec.parallel.strategy} over {spec.parallel.world_size} "
        "devices: the pilot measured the full step on one device (no sharding); "
        "`tunepilot scale` measures the sharded step"]


def check_device_features(spec: RunSpec, info: DeviceInfo) -> None:
    """Features the spec needs that this device cannot run: a clear error before any work."""
    bnb = needs_bitsandbytes(spec)
    if info.kind == "cpu":
        if spec.method.kind == "qlora":
            raise UserError("method.kind", "qlora needs bitsandbytes and a CUDA GPU; this pilot "
                            "runs on the CPU.", "Plan it here (`tunepilot plan` models the NF4 "
                            "base), pilot it on the GPU you intend to rent, or use kind: lora "
                            "for a CPU pilot.")
        if bnb:
            raise UserError("optimizer.name", f"{spec.optimizer.name} needs bitsandbytes on a "
                            "CUDA GPU; this pilot runs on the CPU.",
                            "Use adamw for a CPU pilot (the plan still models "
                            f"{spec.optimizer.name}).")
        if spec.parallel.cpu_offload:
            raise UserError("parallel.cpu_offload", "FSDP CPU offload needs a GPU to offload from.",
                            "Set cpu_offload: false for a CPU pilot.")
    if info.kind == "cuda" and spec.precision.computes_in_bf16 and info.bf16_supported is False:
        raise UserError("precision", f"{info.name} has no bf16 support.",
                        "Use precision: fp16-mixed or fp32 on this GPU.")
    if info.kind == "rocm" and bnb and any("bitsandbytes" in m for m in info.missing):
        raise UserError("method.kind" if spec.method.kind == "qlora" else "optimizer.name",
                        "this ROCm build has no bitsandbytes, which the spec needs.",
                        "Install the ROCm build of bitsandbytes, or use kind: lora / adamw.")


MODELLED_LEVERS = {
    "torch_compile": "the pilot runs the model eager (not compiled)",
    "optimizer_in_backward": "the pilot steps the optimizer after the backward",
    "activation_offloading": "the pilot keeps saved activations on the device",
}


def without_modelled_levers(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """The spec the pilot really runs: levers the plan models but tunepilot's step does not
    implement are turned off, each with a note (the measured figures and the plan they are
    compared with are both of the plain step)."""
    on = [k for k in MODELLED_LEVERS if getattr(spec, k)]
    if not on:
        return spec, []
    notes = [f"{k}: {MODELLED_LEVERS[k]}; its effect is modelled in the plan, not measured here"
             for k in on]
    return spec.with_changes(**{k: False for k in on}), notes


def without_gpu_kernels(spec: RunSpec, info: DeviceInfo | None = None
                        ) -> tuple[RunSpec, list[str]]:
    """The spec the pilot runs with the spec's kernels (model/kernels.py): those that run on
    this device - a GPU that supports them, their package installed - stay; the rest (every
    Triton/CUDA kernel on a CPU) are left out for transformers' stock path (SDPA attention,
    bf16-mixed for FP8), with a note of what that leaves unmeasured. Eager attention, DoRA,
    rsLoRA and modules_to_save run for real (transformers and PEFT build them)."""
    from tunepilot.model.kernels import choose

    choice = choose(spec, info)
    if not choice.stand_ins:
        return spec, choice.notes()
    return spec.with_changes(kernels=choice.kernels, precision=choice.precision), choice.notes()


def _kernels_would_fit(spec: RunSpec, arch, info: DeviceInfo, ranks: int, problem: str,
                       has=None) -> str:
    """A run that fits only with its kernels is refused naming what keeps them from running
    here (the missing package, or the device). ``has``: is a package installed (tests)."""
    from tunepilot.model.kernels import choose

    if plan_fit_problem(spec, analytic_plan(spec, arch, info.kind), info, ranks=ranks):
        return problem  # it does not fit with its kernels either
    choice = choose(spec, info, has) if has is not None else choose(spec, info)
    missing = [f"{k}: pip install {pip}" for k, pip in choice.missing_packages.items()]
    other = [f"{k}: {why}" for k, why in choice.stand_ins.items()
             if k not in choice.missing_packages]
    return (f"{problem}. With the spec's kernels the plan fits, but here they cannot run - "
            + "; ".join(missing + other) + ". Install the missing packages, or pilot on the "
            "card you mean to rent")


def local_memory(info: DeviceInfo) -> tuple[int, str]:
    """(bytes the run can have on the local device, what that is): free host RAM on a CPU, the
    device's free memory on a GPU."""
    if info.kind == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), (f"the local CPU's available RAM ({fmt_bytes(vm.available)} of "
                                   f"{fmt_bytes(vm.total)})")
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(free), f"{info.torch_device} ({info.name}: {fmt_bytes(free)} free of " \
                      f"{fmt_bytes(total)})"


def plan_fit_problem(spec: RunSpec, plan, info: DeviceInfo, *, what: str = "pilot",
                     ranks: int = 1) -> str | None:
    """Why a run whose planned peak (or model-load peak) cannot fit the local device is refused
    in seconds, before minutes of building the model; None when it may fit."""
    need = max(plan.per_device.allocated_peak_bytes, plan.per_device.load_peak_bytes) * ranks
    have, where = local_memory(info)
    if need > have * PLAN_MARGIN:
        return (
            f"does not fit at micro_batch={spec.micro_batch_size}, seq={spec.sequence_length}: "
            f"the plan needs {fmt_bytes(need)} (projected, {plan.fidelity} plan"
            + (f", {ranks} ranks" if ranks > 1 else "") + f") but {where} has "
            f"{fmt_bytes(have)}; checked before building anything. Lower micro_batch_size or "
            "sequence_length, turn on activation_checkpointing, or pilot on the card you mean "
            f"to rent (the {what} on a GPU runs there); --no-memory-check skips this check")
    return None


def check_plan_fits_device(spec: RunSpec, plan, info: DeviceInfo, *, what: str,
                           ranks: int = 1) -> None:
    """plan_fit_problem as an error (restore, scale): DoesNotFit, exit code 1."""
    problem = plan_fit_problem(spec, plan, info, what=what, ranks=ranks)
    if problem:
        raise DoesNotFit(problem)


def _model_provenance(spec: RunSpec, arch, base_dir: Path | None) -> dict:
    cfg = resolve_model_config(spec, base_dir)
    meta = cfg.get("_tunepilot", {}) if isinstance(cfg, dict) else {}
    return {"preset": spec.model.preset, "config": spec.model.config,
            "revision": spec.model.revision, "weights": spec.model.weights,
            "config_sha256": arch.config_hash, "hf_id": arch.hf_id or meta.get("hf_id"),
            "model_type": arch.model_type}
