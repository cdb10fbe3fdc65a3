"""The sharded pilot: the spec's FSDP ranks on this machine under torchrun, every rank measured.

    parent: prepare (device, per-rank plan vs local memory - on a CPU the ranks share its RAM -,
            data, provenance) -> torchrun N x ``python -m tunepilot.pilot.ranks JOB.json``
    rank:   the pilot of pilot/runner.py on its own rank (gloo on the CPU, NCCL on its GPU): the
            model built on meta and sharded unit by unit (training/build.py), the longest batch
            twice (warm-up step 2 under the tensor tracker, FSDP's in-place resizes followed),
            measured steps until the slowest rank's step time converges (every rank stops on
            the same all-reduced times), validation, one sharded checkpoint write; its own
            pilot.json document -> OUT/rank{R}.json
    parent: one pilot.json: ``world_size``, ``ranks`` (each rank's allocator / device peaks,
            step time, plan), the memory figures of the rank with the largest peak, the step
            time of the slowest rank (the run goes at its pace), throughput per device (all
            ranks' useful tokens / the slowest rank's time / N)

``--memory-limit`` applies per rank. A rank that runs out of memory writes its record and exits
(torchrun stops the others, which wait on it in a collective): the pilot "does not fit" with that
rank's phase and error.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from tunepilot.proc.messages import Message
from tunepilot.results.figure import Figure
from tunepilot.results.pilot import PilotResult, RankPilot

LAUNCH_TIMEOUT_S = 3600
DOES_NOT_FIT_EXIT = 3
M = Figure.measured


class RankPilotJob(Message):
    """What every rank of a sharded pilot runs."""

    spec: dict[str, Any]
    device: str  # "cpu" | "cuda"
    threads: int = 1
    steps: int | None = None
    max_steps: int
    memory_limit_bytes: int | None = None
    base_dir: str | None = None
    catalog_path: str | None = None
    run_dir: str
    out: str
    probe_dir: str


def run_sharded_pilot(spec, run_dir, options, ranks: int, progress=None) -> PilotResult:
    """Pilot ``spec`` on ``ranks`` FSDP ranks; write pilot.json (one document, every rank)."""
    import dataclasses

    from tunepilot.catalog import load_catalog
    from tunepilot.pilot.prepare import prepare
    from tunepilot.pilot.runner import _finish, _RunLog

    say = progress or (lambda *_: None)
    t0 = time.perf_counter()
    run_dir.path.mkdir(parents=True, exist_ok=True)
    log = _RunLog(run_dir.logs_dir() / "pilot.log")
    try:
        catalog = options.catalog or load_catalog()
        s = prepare(spec, dataclasses.replace(options, ranks=ranks), catalog, log, say,
                    run_dir.path)
        s.world_size = ranks
        if s.does_not_fit is not None:  # refused by the memory check: nothing launched
            s.m.times.total_s = time.perf_counter() - t0
            result = _finish(s, run_dir)
            result.world_size = ranks
            run_dir.write(result)
            return result
        docs, failure = _launch(s, run_dir, options, catalog, ranks, say, log)
        result = merge_ranks(docs, ranks, failure)
        result.spec_hash = spec.spec_hash()
        result.timings.pilot_total_s = M(time.perf_counter() - t0, "s",
                                         covers="the whole sharded pilot: preparation, the "
                                                "torchrun launch and every rank")
        run_dir.write(result)
        from tunepilot.pilot.provenance import tunepilot_version

        run_dir.update_manifest(spec=spec.model_dump(mode="json"), device=s.device.summary(),
                                provenance=s.provenance, tunepilot_version=tunepilot_version())
        log(f"result: {result.verdict}; wrote {run_dir.file('pilot')}")
        return result
    finally:
        log.close()


def _launch(s, run_dir, options, catalog, ranks: int, say, log):
    """torchrun N ranks; (their documents, the launch failure or None)."""
    import shutil

    from tunepilot.catalog import DEFAULT_CATALOG_PATH
    from tunepilot.proc.child import read_message, write_message
    from tunepilot.scaling.launch import LaunchError, launch

    gpu = s.gpu
    work = run_dir.path / "pilot-ranks"
    shutil.rmtree(work, ignore_errors=True)  # never read a previous pilot's rank files
    threads = 1 if gpu else max(1, (os.cpu_count() or 1) // ranks)
    paths = [p for p in getattr(catalog, "_paths", ()) if Path(p) != DEFAULT_CATALOG_PATH]
    job = RankPilotJob(
        spec=s.spec.model_dump(mode="json"), device="cuda" if gpu else "cpu", threads=threads,
        steps=options.steps, max_steps=options.max_steps,
        memory_limit_bytes=options.memory_limit_bytes,
        base_dir=str(options.base_dir) if options.base_dir is not None else None,
        catalog_path=str(paths[-1]) if paths else None, run_dir=str(run_dir.path),
        out=str(work), probe_dir=str(run_dir.path / "checkpoints" / ".pilot-probe-sharded"))
    job_file = write_message(work / "job.json", job)
    env = {"OMP_NUM_THREADS": str(threads)} if not gpu else {}
    say(f"{ranks} FSDP ranks under torchrun ({'NCCL' if gpu else 'gloo'}), every rank "
        "measured", 0, None)
    log(f"sharded pilot: {ranks} ranks, {threads} thread(s) each; job {job_file}")
    failure = None
    try:
        res = launch("pilot", "tunepilot.pilot.ranks", [str(job_file)], nproc=ranks,
                     log_dir=run_dir.logs_dir() / "pilot-ranks", timeout_s=LAUNCH_TIMEOUT_S,
                     env=env)
        log(f"torchrun: {ranks} ranks in {res.wall_s:.1f} s")
    except LaunchError as exc:
        failure = exc
        log(f"torchrun failed: {str(exc).splitlines()[0]}")
    docs: dict[int, PilotResult] = {}
    for r in range(ranks):
        p = work / f"rank{r}.json"
        if p.exists():
            docs[r] = read_message(PilotResult, p)
    if failure is not None and not any(not d.fits for d in docs.values()):
        raise failure  # a crash, not an out-of-memory: the rank's log tail says why
    return docs, failure


# --- one pilot.json of every rank --------------------------------------------------------------
def _allocated(d: PilotResult) -> int | None:
    """A rank's steady-state allocated peak, as one device's pilot compares it with its plan."""
    pvm = d.plan_vs_measured
    row = pvm.components.get("allocated_peak") if pvm else None
    return row.measured.value if row is not None else None


def rank_row(rank: int, d: PilotResult) -> RankPilot:
    pvm = d.plan_vs_measured
    row = pvm.components.get("allocated_peak") if pvm else None
    planned = row.planned if row is not None else Figure.missing("bytes", "no plan")
    mem = d.memory
    return RankPilot(
        rank=rank, fits=d.fits,
        allocated_peak_bytes=M(_allocated(d), "bytes", why="the rank did not reach warm-up "
                               "step 2", how=row.what if row is not None else None),
        reserved_peak_bytes=mem.allocator.peak_reserved_bytes,
        device_peak_bytes=mem.device.peak_minus_baseline_bytes,
        step_time_median_s=d.step_time.p50_s, step_time_mean_s=d.step_time.mean_s,
        planned_allocated_peak_bytes=planned,
        plan_ratio=row.ratio if row is not None and row.ratio is not None else
        Figure.missing("ratio", "not measured"),
        tracked_peak_bytes=mem.tracked.peak_bytes, peak_rss_bytes=mem.process.peak_rss_bytes,
        useful_tokens=d.throughput.useful_tokens or Figure.missing("tokens", "no steps"),
        error=d.does_not_fit.message if d.does_not_fit else None)


def merge_ranks(docs: dict[int, PilotResult], world: int, failure=None) -> PilotResult:
    """One pilot.json: the memory figures of the rank with the largest allocated peak, the
    step time of the slowest rank, the throughput of all ranks per device, and every rank."""
    ranks = [rank_row(r, docs[r]) for r in sorted(docs)]
    missing = [r for r in range(world) if r not in docs]
    for r in missing:
        ranks.append(RankPilot(rank=r, fits=False, error="no record: torchrun stopped this rank "
                               "when another ran out of memory (it waited on it in a "
                               "collective)"))
    ranks.sort(key=lambda x: x.rank)
    failed = [r for r in sorted(docs) if not docs[r].fits]
    mem_rank = failed[0] if failed else max(docs, key=lambda r: _allocated(docs[r]) or 0)
    out = docs[mem_rank].model_copy(deep=True)
    out.world_size, out.ranks = world, ranks
    if failed:
        d = out.does_not_fit
        out.verdict = f"does not fit at micro_batch={d.micro_batch_size}, " \
                      f"seq={d.sequence_length} on rank {mem_rank} of {world}"
        out.does_not_fit = d.model_copy(update={"message": d.message + f" (rank {mem_rank} of "
                                                f"{world} FSDP ranks)"})
        out.notes.append(f"sharded pilot on {world} ranks: rank {mem_rank} ran out of memory "
                         f"({d.phase})" + (f"; ranks {missing} were stopped" if missing else ""))
        return out
    slow = max(docs, key=lambda r: docs[r].step_time.p50_s.value or 0.0)
    _take_time(out, docs[slow])
    _throughput_per_device(out, docs, slow, world)
    out.verdict = out.verdict + f" on each of {world} FSDP ranks"
    spread = [docs[r].step_time.p50_s.value for r in docs]
    out.notes.insert(0, (
        f"sharded pilot: {world} FSDP ranks under torchrun, every rank measured (ranks[]); "
        f"memory figures of rank {mem_rank} (the largest allocated peak), step times of rank "
        f"{slow} (the slowest: the run goes at its pace); median step time spread "
        f"{min(spread):.4g}-{max(spread):.4g} s over the ranks; throughput per device"))
    return out


def _take_time(out: PilotResult, slow: PilotResult) -> None:
    for key in ("steps", "step_time", "split", "data_wait", "per_step", "mfu", "loss",
                "generation", "machine_load"):
        setattr(out, key, getattr(slow, key).model_copy(deep=True)
                if getattr(slow, key) is not None else None)


def _throughput_per_device(out: PilotResult, docs: dict[int, PilotResult], slow: int,
                           world: int) -> None:
    """All ranks' useful (and padded) tokens over the slowest rank's measured time, per device:
    what one card of the N contributes (the quote's per-card rate at this rank count)."""
    wall = sum(docs[slow].per_step.wall_s.value or [])
    if not wall:
        return
    useful = sum(sum(d.per_step.useful_tokens.value or []) for d in docs.values())
    padded = sum(sum(d.per_step.padded_tokens.value or []) for d in docs.values())
    t = out.throughput
    rule = (f"all {world} ranks' tokens of the measured steps / the slowest rank's summed wall "
            f"time / {world} ranks: per device at {world} FSDP ranks")
    t.useful_tokens_per_s = M(useful / wall / world, "tokens/s", rule=rule)
    t.padded_tokens_per_s = M(padded / wall / world, "tokens/s", rule=rule)
    t.useful_fraction = M(useful / padded if padded else None, "fraction")
    t.useful_tokens = M(useful, "tokens", covers=f"all {world} ranks")
    t.padded_tokens = M(padded, "tokens", covers=f"all {world} ranks")
    n = len(docs[slow].per_step.wall_s.value or [])
    t.optimizer_steps_per_s = M(n / wall, "steps/s")


# --- one rank ----------------------------------------------------------------------------------
def rank_main(job: RankPilotJob) -> int:
    """One rank: its pilot, its document in OUT/rank{R}.json; DOES_NOT_FIT_EXIT when it ran out
    of memory (torchrun then stops the ranks waiting on it)."""
    import warnings

    import torch.distributed as dist

    from tunepilot.catalog import load_catalog
    from tunepilot.device import make_sampler, nvml_used_by_uuid
    from tunepilot.pilot.blocks import pilot_document
    from tunepilot.pilot.prepare import prepare
    from tunepilot.pilot.runner import _execute, _RunLog
    from tunepilot.pilot.session import PilotOptions
    from tunepilot.proc.child import call_hook, write_message
    from tunepilot.scaling.worker import init_group, progress
    from tunepilot.spec import spec_from_dict

    baselines = nvml_used_by_uuid() if job.device == "cuda" else None  # before CUDA starts
    rank, _, _ = init_group(job.device, job.threads)
    world = dist.get_world_size()
    progress(rank, "start", f"pid {os.getpid()} sharded pilot")
    progress(rank, "init", f"world {world} backend {dist.get_backend()}")
    call_hook()
    spec = spec_from_dict(job.spec, source="the sharded pilot's job")
    options = PilotOptions(
        steps=job.steps, max_steps=job.max_steps, memory_limit_bytes=job.memory_limit_bytes,
        device="cpu" if job.device == "cpu" else None,
        base_dir=Path(job.base_dir) if job.base_dir else None,
        catalog=load_catalog(Path(job.catalog_path) if job.catalog_path else None),
        check_memory=False, ranks=world, probe_dir=job.probe_dir)
    out = Path(job.out)
    log = _RunLog(out / f"rank{rank}.log")
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            s = prepare(spec, options, options.catalog, log,
                        lambda what, *_: progress(rank, "model" if "load" in what else "train",
                                                  what), Path(job.run_dir))
            s.rank, s.world_size = rank, world
            s.sampler = make_sampler(s.device, baselines)
            if s.sampler is not None:
                s.sampler.start()
            _execute(s)
        s.m.times.total_s = time.perf_counter() - t0
        doc = pilot_document(s)
        doc.spec_hash = spec.spec_hash()
        write_message(out / f"rank{rank}.json", doc)
    finally:
        log.close()
    progress(rank, "report", "does not fit" if s.does_not_fit else "fits")
    if s.does_not_fit is not None:
        return DOES_NOT_FIT_EXIT  # the others may wait on this rank in a collective
    dist.destroy_process_group()
    progress(rank, "done")
    return 0


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from tunepilot.proc.child import read_job
    from tunepilot.proc.spawn import LAUNCHERS, die_with_parent

    die_with_parent(parent_runs=LAUNCHERS)
    job = read_job(argv, RankPilotJob)
    return record(rank_main)(job)


if __name__ == "__main__":
    code = main()
    # as tunepilot.scaling.worker: every record is on disk; gloo's C++ threads can abort the
    # interpreter's teardown after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
