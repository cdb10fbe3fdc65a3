"""The per-rank entry point of the scaling test, started by torchrun:

    python -m torch.distributed.run --nproc-per-node N -m tunepilot.scaling.worker JOB.json

(the job: spec, strategy, micro-batch, accumulation, global batch, steps, device, out dir).

Each rank builds the spec's model (same seed, so the same weights everywhere), wraps it -
`DistributedDataParallel`, or FSDP as tunepilot.model.shard.shard_model does it (FSDP2
`fully_shard` per decoder layer then the root, or FSDP1 where the spec says so), or nothing for
the 1-rank baseline - and runs warm-up + measured optimizer steps with
tunepilot.training.step.train_step. Its shard of the data comes from tunepilot.dataset's
StatefulDistributedSampler, so the ranks together read the single-device order: sample k of
rank r is sample k*N + r of the baseline. It writes OUT/rank{R}.json and, on local rank 0,
OUT/all_ranks.json with every rank's record (gathered over the process group, so the first
node of a multi-node run holds all of them).

Communication time (DDP, on CPU/gloo): a comm hook wraps the default all-reduce and times each
bucket from the moment DDP hands it over until its all-reduce completes. `comm_inflight_s` sums
those times (they overlap the backward pass); `comm_exposed_s` is the time from the last bucket
handed over until the last all-reduce finished: the tail the backward pass could not hide. On
CUDA the future's callback fires when the kernel is enqueued, not when it ends, so it is not
reported there; FSDP has no such hook. The runner adds a profiler-free estimate for every
strategy: step time minus the baseline's time for the same number of micro-batches.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from pathlib import Path

from tunepilot.scaling.messages import GatheredRanks, RankRecord, RankStep, ScaleJob

DOES_NOT_FIT_EXIT = 3
STRATEGIES = ("single", "ddp", "fsdp")


def progress(rank: int, phase: str, detail: str = "") -> None:
    """One progress line (tunepilot.scaling.launch.PROGRESS_RE) in the rank's log."""
    print(f"[tunepilot rank {rank}] {phase}" + (f" {detail}" if detail else ""), file=sys.stderr,
          flush=True)


def sample_fingerprints(batch: dict, rows_per_sample: int = 1) -> list[str]:
    """One fingerprint per sample, of its unpadded ids and labels (tunepilot.dataset.
    batch_fingerprint of the sample's rows), so batches cut differently can be compared. A
    sample of several rows (a preference pair: the chosen rows come first, then the rejected
    ones, TRL's concatenated layout) is one fingerprint of all its rows: the ranks' orders
    interleave per sample, not per row (scaling/analysis.py interleave)."""
    import torch

    from tunepilot.dataset import batch_fingerprint

    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch["attention_mask"].bool() if "attention_mask" in batch else \
        packed_mask(ids, labels, batch.get("position_ids"))  # packed rows: the row is the unit
    samples = ids.shape[0] // rows_per_sample
    out = []
    for b in range(samples):
        rows = [b + j * samples for j in range(rows_per_sample)]
        out.append(batch_fingerprint({
            "input_ids": torch.cat([ids[r, mask[r]] for r in rows])[None],
            "labels": torch.cat([labels[r, mask[r]] for r in rows])[None]}))
    return out


def packed_mask(ids, labels, positions):
    """The real tokens of packed rows, which carry no attention mask: a row shorter than its
    batch's longest is padded as one more position run (dataset/loader.collate) of one token
    id with ignored labels - left out, so a row's fingerprint does not depend on the rows it
    was batched with."""
    import torch

    from tunepilot.dataset import IGNORE_INDEX

    mask = torch.ones_like(ids, dtype=torch.bool)
    if positions is None:
        return mask
    for r in range(ids.shape[0]):
        starts = (positions[r] == 0).nonzero()
        start = int(starts[-1]) if len(starts) else 0
        tail_ids, tail_labels = ids[r, start:], labels[r, start:]
        if start > 0 and bool((tail_labels == IGNORE_INDEX).all()) and \
                bool((tail_ids == tail_ids[0]).all()):
            mask[r, start:] = False
    return mask


class CommTimer:
    """Times the DDP gradient all-reduce of each bucket (see the module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.inflight_s = 0.0
        self.buckets = 0
        self.last_start: float | None = None
        self.last_end: float | None = None

    def exposed_s(self) -> float | None:
        if self.last_start is None or self.last_end is None:
            return None
        return max(0.0, self.last_end - self.last_start)


def timed_allreduce_hook(timer: CommTimer, bucket):
    """DDP's default allreduce_hook (divide by world size, all-reduce), timed."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    timer.last_start = t0 if timer.last_start is None else max(timer.last_start, t0)
    timer.buckets += 1
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        t1 = time.perf_counter()
        timer.inflight_s += t1 - t0
        timer.last_end = t1 if timer.last_end is None else max(timer.last_end, t1)
        return f.value()[0]

    return fut.then(done)


def wrap(model, strategy: str, spec, device, timer: CommTimer | None):
    """(model, no_sync) for the strategy; no_sync skips gradient sync on all but the last
    micro-batch of a step (DDP no_sync). FSDP2 reduce-scatters every micro-batch instead:
    skipping it (set_requires_gradient_sync(False)) keeps the UNSHARDED gradients between
    micro-batches - the whole model's gradients on every rank, which defeats the sharding (for a
    70B model in fp32, ~263 GiB per rank) - so tunepilot trades that communication for memory,
    as the plan assumes."""
    if strategy == "single":
        return model, None
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids)
        if timer is not None:
            ddp.register_comm_hook(timer, timed_allreduce_hook)
        return ddp, ddp.no_sync
    from tunepilot.model.shard import shard_model

    return shard_model(model, spec, device=device, offload=_offload(spec, device)), None


def _offload(spec, device) -> bool:
    return spec.parallel.cpu_offload and device.type == "cuda"  # nothing to offload from on CPU


def placement(strategy: str, spec, device, timer: CommTimer | None = None) -> dict:
    """build_run's keywords for the strategy: FSDP builds the model on meta and shards each unit
    as it is materialised (training/build.py: no rank holds the whole model); DDP and the
    single rank build it whole and wrap it."""
    if strategy == "fsdp":
        from tunepilot.training.build import Shard

        return {"shard": Shard(offload=_offload(spec, device))}
    return {"prepare": lambda m: wrap(m, strategy, spec, device, timer)}


def launch_spec(spec, job: ScaleJob):
    """The spec one launch runs. A generative objective (GRPO/RLOO) takes its generation batch
    from the spec's micro-batch x accumulation (x steps_per_generation / accumulation), so the
    launch's micro-batch and accumulation become the spec's: each rank then generates for its
    share of the global batch (G / W completions per step), and the 1-rank baseline for all of
    it - the same prompts per optimizer step on both sides."""
    if not spec.objective.generative:
        return spec
    o = spec.objective
    changes: dict = {"micro_batch_size": job.micro_batch,
                     "gradient_accumulation_steps": job.accumulation}
    if o.steps_per_generation is not None:
        per_step = o.steps_per_generation // spec.gradient_accumulation_steps
        changes["objective"] = o.model_copy(
            update={"steps_per_generation": per_step * job.accumulation}).model_dump()
    return spec.with_changes(**changes)


class MemoryWatch:
    """Peak memory of this rank over the training steps (from after the model is wrapped, so a
    sharded model's full pre-shard copy is not counted): the caching allocator's peak on CUDA;
    on the CPU the pilot's RSS sampler (tunepilot.device.MemorySampler: the kernel's exact
    VmHWM after a reset, plus samples), and the whole process's peak RSS beside it."""

    def __init__(self, device):
        import torch

        self.device = device
        self.sampler = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            import psutil

            from tunepilot.device import MemorySampler

            proc = psutil.Process()
            self.sampler = MemorySampler("rss", lambda: proc.memory_info().rss,
                                         interval_s=0.25).start()

    def stop(self) -> dict:
        import torch

        from tunepilot.results.figure import Figure

        def measured(value, unit, what):
            return Figure.measured(value, unit, what=what).to_dict()

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        host = measured(int(rss), "bytes", what="the rank's host RAM: whole-process peak RSS "
                        "(ru_maxrss), model load included")
        if self.device.type == "cuda":
            return {"peak_bytes": measured(int(torch.cuda.max_memory_allocated(self.device)),
                                           "bytes", what="torch.cuda.max_memory_allocated over "
                                           "the training steps"),
                    "reserved_peak_bytes": measured(
                        int(torch.cuda.max_memory_reserved(self.device)), "bytes",
                        what="torch.cuda.max_memory_reserved"),
                    "host_peak_rss_bytes": host}
        reading = self.sampler.stop()
        what = ("peak RSS over the training steps (VmHWM after a reset)" if reading.hwm_bytes
                else "peak RSS over the training steps (sampled every 0.25 s)")
        return {"peak_bytes": measured(int(reading.peak_bytes), "bytes", what=what),
                "before_training_bytes": measured(int(reading.baseline_bytes), "bytes",
                                                  what="RSS after the model was built and "
                                                  "wrapped"),
                "process_peak_bytes": measured(int(rss), "bytes",
                                               what="whole-process peak RSS (ru_maxrss)"),
                "host_peak_rss_bytes": host}


def init_group(device_kind: str, threads: int) -> tuple[int, int, object]:
    """(rank, local rank, torch device) after joining the process group torchrun set up."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads)
        dist.init_process_group("gloo")
    return rank, local_rank, device


def _step_record(i: int, job: ScaleJob, st, timer, batches: list, device,
                 rows_per_sample: int) -> RankStep:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    loss = torch.tensor([st.loss], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(loss)  # SUM (gloo has no AVG): the global mean is sum / world
    return RankStep(step=i, measured=i >= job.warmup_steps, loss_local=st.loss,
                    loss_global=float(loss.item()) / world, wall_s=st.wall_s,
                    useful_tokens=st.useful_tokens, padded_tokens=st.padded_tokens,
                    data_wait_s=st.data_wait_s, forward_s=st.forward_s,
                    backward_s=st.backward_s, optimizer_s=st.optimizer_s,
                    comm_inflight_s=timer.inflight_s if timer else None,
                    comm_exposed_s=timer.exposed_s() if timer else None,
                    comm_buckets=timer.buckets if timer else None,
                    samples=[f for b in batches
                             for f in sample_fingerprints(b, rows_per_sample)])


def run(job: ScaleJob) -> RankRecord:
    """One rank of a scaling launch: build, wrap, train warm-up + measured steps, report."""
    import torch
    import torch.distributed as dist

    from tunepilot.proc.child import call_hook
    from tunepilot.spec import spec_from_dict
    from tunepilot.training.build import build_run
    from tunepilot.training.step import train_step

    rank, local_rank, device = init_group(job.device, job.threads)
    world = dist.get_world_size()
    progress(rank, "start", f"pid {os.getpid()} strategy {job.strategy}")
    progress(rank, "init", f"world {world} backend {dist.get_backend()}")
    call_hook()  # tests/support faults: a rank that crashes or hangs here
    if job.micro_batch * job.accumulation * world != job.global_batch:
        raise SystemExit(f"rank {rank}: micro-batch {job.micro_batch} x accumulation "
                         f"{job.accumulation} x {world} ranks != global batch "
                         f"{job.global_batch}")
    spec = launch_spec(spec_from_dict(job.spec, source="the scaling job"), job)
    timer = CommTimer() if (job.strategy == "ddp" and device.type == "cpu") else None
    progress(rank, "model")
    run_ = build_run(spec, device, total_steps=job.warmup_steps + job.steps,
                     base_dir=Path(job.base_dir) if job.base_dir else None,
                     rank=rank, world_size=world,
                     micro_batch_size=None if spec.objective.generative else job.micro_batch,
                     **placement(job.strategy, spec, device, timer))
    state, stream = run_.state, run_.stream
    params_local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                       for p in state.model.parameters())
    watch = MemoryWatch(device)
    batches: list[dict] = []

    def next_batch():
        b = stream.next()
        batches.append(b)  # fingerprinted after the step: hashing is not part of its time
        return b

    steps = []
    total = job.warmup_steps + job.steps
    for i in range(total):
        progress(rank, "train", f"step {i + 1}/{total}")
        if timer is not None:
            timer.reset()
        batches.clear()
        st = train_step(state, next_batch, spec, accumulation=job.accumulation)
        steps.append(_step_record(i, job, st, timer, batches, device,
                                  spec.batch.sequences_per_sample))
    progress(rank, "report")
    record = RankRecord(
        rank=rank, local_rank=local_rank, world_size=world, host=socket.gethostname(),
        pid=os.getpid(), strategy=job.strategy, device=str(device),
        backend=dist.get_backend(), threads=torch.get_num_threads(),
        cpu_affinity=sorted(os.sched_getaffinity(0)), micro_batch_size=job.micro_batch,
        accumulation=job.accumulation, global_batch_samples=job.global_batch,
        warmup_steps=job.warmup_steps,
        reshard_after_forward=spec.parallel.reshard_after_forward
        if job.strategy == "fsdp" else None,
        params_local=int(params_local), memory=watch.stop(),
        comm_measure=("ddp comm hook (see tunepilot.scaling.worker)" if timer else
                      "not measured directly on this strategy/device"),
        status="ok", steps=steps)
    _report(Path(job.out), record, rank, local_rank, world)
    dist.destroy_process_group()
    progress(rank, "done")
    return record


def _report(out: Path, record: RankRecord, rank: int, local_rank: int, world: int) -> None:
    """rank{R}.json, and on local rank 0 every rank's record (gathered over the group)."""
    import torch.distributed as dist

    from tunepilot.proc.child import write_message

    write_message(out / f"rank{rank}.json", record)
    gathered: list = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, record.model_dump(mode="json"))
        ranks = [RankRecord.model_validate(g) for g in gathered]
    else:
        ranks = [record]
    if local_rank == 0:
        write_message(out / "all_ranks.json", GatheredRanks(world_size=world, ranks=ranks))


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from tunepilot.proc.child import read_job
    from tunepilot.proc.spawn import LAUNCHERS, die_with_parent

    die_with_parent(parent_runs=LAUNCHERS)  # torchrun gone (tunepilot killed): this rank goes too
    job = read_job(argv, ScaleJob)

    @record
    def _main() -> None:
        import torch

        try:
            run(job)
        except torch.OutOfMemoryError as exc:
            rank = int(os.environ.get("RANK", "0"))
            from tunepilot.proc.child import write_message

            write_message(Path(job.out) / f"rank{rank}.json",
                          RankRecord(rank=rank, strategy=job.strategy, status="does_not_fit",
                                     error=str(exc).splitlines()[0]))
            progress(rank, "report", "out of memory")
            sys.exit(DOES_NOT_FIT_EXIT)

    _main()
    return 0


if __name__ == "__main__":
    code = main()
    # Every result is on disk (fsynced) and the process group is destroyed. Skip the interpreter's
    # teardown: with gloo on CPU a C++ worker thread can still be joinable when torch's statics
    # are destroyed, which aborts the process ("terminate called without an active exception")
    # after the work is done - seen intermittently on 2 loaded cores - and would fail the launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
