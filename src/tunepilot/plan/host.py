"""The host plan: what one node holds in host RAM and on its local disk, beside the device plan.

Runs die on the host too: a checkpoint read into every rank's RAM before it is sharded, FSDP's
CPU offload (the sharded parameters, gradients and optimizer state pinned in host memory),
offloaded activations, dataloader workers, the staging copy of an asynchronous checkpoint save.
Per node, for ``ranks_per_node`` processes (every figure projected; bytes):

  process            runtime.yaml host.process_bytes_per_rank per rank (Python, torch, the CUDA
                     runtime's host side, NCCL)
  model load         the checkpoint as read (2 B/param as Hugging Face ships it, 4 under fp32):
                     per-rank x every rank | rank0 x 1 (node 0) | mmap: the node's page cache once;
                     QLoRA quantizing on load holds one 5 GB shard per rank
  cpu offload        FSDP2 CPUOffloadPolicy: each rank's shard of weights + master + gradients +
                     optimizer state (the device plan's states, /world), pinned
  activation offload the saved activations that leave the device (activation_offloading), pinned
  dataloader workers data.num_workers per rank x (a worker's private pages + prefetch_factor
                     batches); without workers, one batch in the rank
  tokenized dataset  Arrow, memory-mapped: 8 B/position once per node; data_in_memory: Python
                     lists, 72 B/position in every rank and every worker that reads them
  async checkpoint   host.async_checkpoint: the node's ranks' checkpoint shards staged in RAM
                     while the save runs

Phases: model-load (process + load + dataset), training (process + offloads + workers +
dataset), checkpoint-save (training without the activation offload, + staging). The peak is the
largest phase. Disk per node: the weights once, (checkpoints_kept + 1) checkpoints (the node's
shards; one more while a save runs), the tokenized dataset, the export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunepilot.catalog import Card
from tunepilot.model.arch import Arch
from tunepilot.model.flops import (
    checkpoint_bytes,
    export_bytes,
    load_bytes,
    source_checkpoint_bytes_per_param,
)
from tunepilot.plan.analytic.activations import precision_bytes, saved_activations
from tunepilot.plan.analytic.core import runtime_constants, state_bytes
from tunepilot.results.host import DiskItem, HostComponent, HostFit, HostPhase, HostPlan
from tunepilot.spec import RunSpec
from tunepilot.units import fmt_bytes

GPUS_PER_NODE = 8
HF_SHARD_BYTES = 5 * 10**9  # transformers save_pretrained max_shard_size default "5GB"
LOAD, TRAIN, SAVE = "model-load", "training", "checkpoint-save"


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: ``world`` ranks, ``per_node`` on each node, under ``strategy``."""

    world: int
    per_node: int
    strategy: str
    micro_batch_size: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.per_node)

    @classmethod
    def of_spec(cls, spec: RunSpec) -> Layout:
        p = spec.parallel
        return cls(p.world_size, p.devices, p.strategy, spec.micro_batch_size)

    @classmethod
    def on_cards(cls, spec: RunSpec, count: int, strategy: str) -> Layout:
        """``count`` cards in nodes of up to 8, the spec's global batch held (spec/batch.py)."""
        split = spec.batch.on(count, exact=False)
        return cls(count, min(count, GPUS_PER_NODE), strategy, split.micro_batch_size)


def resolved_load(spec: RunSpec, strategy: str) -> str:
    if spec.host.load != "auto":
        return spec.host.load
    return "rank0" if strategy == "fsdp" else "per-rank"


def host_plan(spec: RunSpec, arch: Arch, stack: str = "cuda", layout: Layout | None = None,
              dataset_positions: float | None = None) -> HostPlan:
    """The host RAM and local disk one node needs (the node holding rank 0: the fullest)."""
    lay = layout or Layout.of_spec(spec)
    rt = runtime_constants()["host"]
    n, notes = lay.per_node, []
    load = resolved_load(spec, lay.strategy)
    comps = [HostComponent(
        name="process", bytes_per_rank=rt["process_bytes_per_rank"][stack], holders=n,
        bytes_per_node=n * rt["process_bytes_per_rank"][stack], phases=[LOAD, TRAIN, SAVE],
        how="Python, torch, the device runtime's host side, the collective library "
            "(runtime.yaml host.process_bytes_per_rank)")]
    comps.append(_load(spec, arch, lay, load, notes))
    comps += _offloads(spec, arch, stack, lay, notes)
    comps += _data(spec, lay, rt, dataset_positions, notes)
    ckpt = checkpoint_bytes(arch, spec, state_bytes(spec, arch, stack).trainable)
    node_ckpt = _node_share(ckpt, lay)
    if spec.host.async_checkpoint:
        comps.append(HostComponent(
            name="async checkpoint staging", bytes_per_rank=ckpt // lay.world
            if lay.strategy == "fsdp" else ckpt, holders=n if lay.strategy == "fsdp" else 1,
            bytes_per_node=node_ckpt, phases=[SAVE], pinned=True,
            how=f"host.async_checkpoint: the node's checkpoint shards ({fmt_bytes(ckpt)} in all) "
                "copied to host RAM before the background write (DCP async_save stages the "
                "whole state dict)"))
    comps = [c for c in comps if c.bytes_per_node > 0 or c.name == "process"]
    phases = [HostPhase(name=ph, bytes_per_node=sum(c.bytes_per_node for c in comps
                                                    if ph in c.phases))
              for ph in (LOAD, TRAIN, SAVE)]
    peak = max(phases, key=lambda p: p.bytes_per_node)
    disk = _disk(spec, arch, lay, node_ckpt, dataset_positions, rt)
    needs = any(c.name in ("cpu offload", "activation offload", "async checkpoint staging")
                for c in comps)
    return HostPlan(ranks_per_node=n, nodes=lay.nodes, load=load, components=comps,
                    phases=phases, peak_bytes_per_node=peak.bytes_per_node, peak_phase=peak.name,
                    disk=disk, disk_bytes_per_node=sum(d.bytes_per_node for d in disk),
                    export_bytes=export_bytes(spec, ckpt), needs_host_ram=needs, notes=notes)


def _node_share(total: int, lay: Layout) -> int:
    """A sharded state's bytes on one node (FSDP: its ranks' shards), else the whole (rank 0)."""
    return total * lay.per_node // lay.world if lay.strategy == "fsdp" else total


def _load(spec: RunSpec, arch: Arch, lay: Layout, load: str, notes: list[str]) -> HostComponent:
    per = source_checkpoint_bytes_per_param(spec)
    whole = load_bytes(arch, spec)
    what = f"{fmt_bytes(whole)} checkpoint ({per} B/param)"
    if spec.method.kind == "qlora" and spec.method.quantize_on_load:
        each = min(whole, HF_SHARD_BYTES)
        return HostComponent(name="model load", bytes_per_rank=each, holders=lay.per_node,
                             bytes_per_node=each * lay.per_node, phases=[LOAD],
                             how=f"QLoRA quantizing on load: one {fmt_bytes(each)} checkpoint "
                                 "shard at a time per rank (transformers' 5 GB shards)")
    if load == "per-rank":
        if lay.per_node > 1:
            notes.append(f"host.load per-rank: each of the {lay.per_node} ranks reads the whole "
                         f"{what} into host RAM before moving or sharding it; rank-0 loading "
                         "(host.load: rank0, accelerate's fsdp_cpu_ram_efficient_loading) reads "
                         f"it once: {fmt_bytes(whole * (lay.per_node - 1))} less on the node")
        return HostComponent(name="model load", bytes_per_rank=whole, holders=lay.per_node,
                             bytes_per_node=whole * lay.per_node, phases=[LOAD],
                             how=f"per-rank: every rank reads the {what} (from_pretrained, "
                                 "low_cpu_mem_usage: 1x the model per process)")
    if load == "rank0":
        notes.append(f"host.load {spec.host.load}: rank 0 reads the {what}, the other ranks "
                     "build on the meta device and receive it by broadcast (accelerate: "
                     "fsdp_cpu_ram_efficient_loading + sync_module_states); every rank reading "
                     f"it (host.load: per-rank) would need {fmt_bytes(whole * lay.per_node)} "
                     "on the node")
        return HostComponent(name="model load", bytes_per_rank=whole, holders=1,
                             bytes_per_node=whole, phases=[LOAD],
                             how=f"rank0: rank 0 reads the {what}; the node of rank 0")
    return HostComponent(name="model load", bytes_per_rank=0, holders=1, bytes_per_node=whole,
                         phases=[LOAD], how=f"mmap: the {what} memory-mapped (safetensors), "
                         "in the node's page cache once, shared by its ranks")


def _zero_offload(spec: RunSpec, arch: Arch, stack: str, lay: Layout) -> list[HostComponent]:
    """DeepSpeed ZeRO-Offload / ZeRO-Infinity to the CPU: what each rank's offload_optimizer /
    offload_param move to host memory (plan/analytic/parallel.py zero_states), pinned."""
    ds = spec.parallel.deepspeed
    if lay.strategy != "deepspeed" or "cpu" not in (ds.offload_optimizer, ds.offload_param):
        return []
    from tunepilot.plan.analytic.core import offloaded_bytes

    each = offloaded_bytes(spec, arch, stack)
    if not each:
        return []
    n = lay.per_node
    return [HostComponent(
        name="zero offload", bytes_per_rank=each, holders=n, bytes_per_node=each * n,
        phases=[TRAIN, SAVE], pinned=True,
        how=f"DeepSpeed ZeRO-{ds.stage} offload (optimizer: {ds.offload_optimizer}, "
            f"parameters: {ds.offload_param}): master weights, optimizer state, gradient and "
            "parameter partitions in host memory, pinned")]


def _offloads(spec: RunSpec, arch: Arch, stack: str, lay: Layout, notes: list[str]
              ) -> list[HostComponent]:
    out = []
    n = lay.per_node
    if spec.parallel.cpu_offload and lay.strategy == "fsdp":
        s = state_bytes(spec, arch, stack)
        each = s.model_states // lay.world
        out.append(HostComponent(
            name="cpu offload", bytes_per_rank=each, holders=n, bytes_per_node=each * n,
            phases=[TRAIN, SAVE], pinned=True,
            how=f"FSDP2 CPUOffloadPolicy: weights + master + gradients + optimizer state "
                f"({fmt_bytes(s.model_states)} in all, {s.model_states / max(s.params, 1):.1f} "
                f"B/param) / {lay.world} ranks, pinned (pin_memory=True)"))
    elif spec.parallel.cpu_offload:
        notes.append(f"parallel.cpu_offload applies to FSDP; under {lay.strategy} nothing is "
                     "offloaded")
    out += _zero_offload(spec, arch, stack, lay)
    if spec.activation_offloading:
        cb, sb, _ = precision_bytes(spec)
        tokens = lay.micro_batch_size * spec.sequence_length
        plain = spec.with_changes(activation_offloading=False)
        full, _ = saved_activations(arch, plain, cb, sb, tokens)
        kept, _ = saved_activations(arch, spec, cb, sb, tokens)
        each = max(0, full - kept)
        out.append(HostComponent(
            name="activation offload", bytes_per_rank=each, holders=n, bytes_per_node=each * n,
            phases=[TRAIN], pinned=True,
            how=f"activation_offloading: {fmt_bytes(full)} of saved activations per rank, "
                f"{fmt_bytes(kept)} left on the device (micro-batch {lay.micro_batch_size} x "
                f"{spec.sequence_length} tokens)"))
    return out


def _data(spec: RunSpec, lay: Layout, rt: dict, positions: float | None, notes: list[str]
          ) -> list[HostComponent]:
    n, d = lay.per_node, spec.data
    workers = d.num_workers
    batch = lay.micro_batch_size * spec.sequence_length * rt["batch_bytes_per_token"]
    out = []
    if workers:
        each = rt["dataloader_worker_bytes"] + spec.host.prefetch_factor * batch
        out.append(HostComponent(
            name="dataloader workers", bytes_per_rank=each, holders=n * workers,
            bytes_per_node=each * n * workers, phases=[TRAIN, SAVE],
            how=f"{workers} worker(s) per rank x ({fmt_bytes(rt['dataloader_worker_bytes'])} "
                f"private pages + {spec.host.prefetch_factor} prefetched batches of "
                f"{fmt_bytes(batch)})"))
    else:
        out.append(HostComponent(
            name="batches", bytes_per_rank=batch, holders=n, bytes_per_node=batch * n,
            phases=[TRAIN, SAVE], pinned=True,
            how="no dataloader workers (data.num_workers 0): one collated batch per rank"))
    if positions is None:
        positions = _positions(spec, notes)
    if positions:
        if spec.host.data_in_memory:
            each = int(positions * rt["python_list_bytes_per_token"])
            holders = n * (1 + workers)
            out.append(HostComponent(
                name="tokenized dataset", bytes_per_rank=each, holders=holders,
                bytes_per_node=each * holders, phases=[LOAD, TRAIN, SAVE],
                how=f"host.data_in_memory: {positions:,.0f} positions as Python lists "
                    f"({rt['python_list_bytes_per_token']} B each) in every rank and worker "
                    "(copy-on-access after fork)"))
        else:
            out.append(HostComponent(
                name="tokenized dataset", bytes_per_rank=0, holders=1,
                bytes_per_node=int(positions * rt["arrow_bytes_per_token"]),
                phases=[LOAD, TRAIN, SAVE],
                how=f"{positions:,.0f} positions memory-mapped as Arrow "
                    f"({rt['arrow_bytes_per_token']} B each), the node's page cache once"))
    return out


def _positions(spec: RunSpec, notes: list[str]) -> float:
    """The dataset's token positions when the spec alone says them (else 0, with a note)."""
    if spec.data.source == "synthetic":
        return 0.0
    if spec.target.dataset_tokens is not None:
        notes.append("tokenized dataset sized from target.dataset_tokens (supervised tokens: a "
                     "lower bound on its positions)")
        return spec.target.dataset_tokens
    notes.append("the tokenized dataset's size is not known here: `tunepilot data SPEC` "
                 "profiles it (quote --from RUN_DIR uses the profile)")
    return 0.0


def _disk(spec: RunSpec, arch: Arch, lay: Layout, node_ckpt: int,
          positions: float | None, rt: dict) -> list[DiskItem]:
    kept = spec.host.checkpoints_kept
    items = [DiskItem(name="model weights", bytes_per_node=load_bytes(arch, spec),
                      how="the checkpoint the run starts from, once per node"),
             DiskItem(name="checkpoints", bytes_per_node=node_ckpt * (kept + 1),
                      how=f"{kept} kept (host.checkpoints_kept) + 1 being written, "
                          f"{fmt_bytes(node_ckpt)} each on this node; the kept ones are the "
                          "export (`tunepilot export` copies them off, nothing more is written)")]
    if positions:
        items.insert(2, DiskItem(name="tokenized dataset",
                                 bytes_per_node=int(positions * rt["arrow_bytes_per_token"]),
                                 how="the tokenized Arrow cache"))
    return items


# --- the plan against an offer -------------------------------------------------------------


def attach_host(plan, spec: RunSpec, arch: Arch, cards: list[Card], headroom: float) -> None:
    """Put the host plan of the spec's layout on ``plan`` (a MemoryPlan) and fit it on every
    row of its fit table, beside the device fit."""
    plan.host = host_plan(spec, arch, plan.stack)
    by_id = {c.id: c for c in cards}
    for row in plan.cards:
        use = row.device_peak_bytes / (row.capacity_bytes * (1.0 - headroom))
        row.host = host_fit(plan.host, by_id[row.card], use)


def host_fit(plan: HostPlan, card: Card, device_use: float) -> HostFit:
    """``plan`` against ``card``'s offer (pricing.host): the node's share of the instance's RAM
    at runtime.yaml host.usable_fraction, its local disk; ``device_use`` = device peak / usable
    device memory. The binding resource is the one nearest its limit. Host RAM refuses the offer (``reason``);
    a local disk too small only warns: checkpoints can go to network storage."""
    offer = card.pricing.host
    k = plan.ranks_per_node
    use = {"device memory": device_use}
    ram = usable = disk = None
    host_ok = disk_ok = None
    reason = None
    if offer is not None:
        ram = offer.ram_bytes(k)
        usable = int(ram * runtime_constants()["host"]["usable_fraction"])
        host_ok = plan.peak_bytes_per_node <= usable
        use["host RAM"] = plan.peak_bytes_per_node / usable
        disk = offer.disk_bytes(k)
        if disk is not None:
            disk_ok = plan.disk_bytes_per_node <= disk
            use["local disk"] = plan.disk_bytes_per_node / max(disk, 1)
    binds = max(use, key=use.get)
    if offer is None and plan.needs_host_ram:
        reason = (f"{card.id}'s offer lists no host RAM (catalog pricing.host.ram_gib), and this "
                  f"plan keeps {fmt_bytes(plan.peak_bytes_per_node)} per node in host memory "
                  f"({_held(plan)})")
    elif host_ok is False:
        reason = (f"host RAM binds: the node needs {fmt_bytes(plan.peak_bytes_per_node)} at "
                  f"{plan.peak_phase} ({_top(plan)}); {k} x {card.id} get "
                  f"{fmt_bytes(ram)} of {offer.instance_type or 'the instance'}'s "
                  f"{offer.ram_gib:g} GiB, {fmt_bytes(usable)} usable")
    warning = None
    if disk_ok is False:
        need = fmt_bytes(plan.disk_bytes_per_node, decimal=True)
        warning = (f"local disk binds: the node needs {need} (weights, checkpoints, export) and "
                  f"{k} x {card.id} get {fmt_bytes(disk, decimal=True)}; put checkpoints on "
                  "network storage (option storage_gb_month) or keep fewer "
                  "(host.checkpoints_kept)")
    return HostFit(cards_per_node=k, host_peak_bytes_per_node=plan.peak_bytes_per_node,
                   host_ram_bytes_per_node=ram, host_usable_bytes_per_node=usable,
                   host_fits=host_ok, disk_bytes_per_node=plan.disk_bytes_per_node,
                   export_bytes=plan.export_bytes,
                   local_disk_bytes_per_node=disk, disk_fits=disk_ok, utilisation=use,
                   binds=binds, reason=reason, hint=_hint(plan, offer) if reason else None,
                   warning=warning,
                   instance=offer.instance_type if offer else None,
                   source=offer.source if offer else None)


def _hint(plan: HostPlan, offer) -> str:
    """What would make the node fit, from what sets its peak."""
    if offer is None:
        return ("Add the instance's host RAM to the card's pricing.host (ram_gib, accelerators, "
                "source, as_of) in --catalog; `tunepilot catalog import` reads SkyPilot's "
                "MemoryGiB.")
    alive = {c.name for c in plan.components if plan.peak_phase in c.phases}
    fixes = []
    if plan.peak_phase == LOAD and plan.load == "per-rank":
        fixes.append("load on rank 0 (host.load: rank0) or memory-mapped (host.load: mmap)")
    if "cpu offload" in alive:
        fixes.append("spread the offloaded state over more nodes (each rank holds 1/N of it), "
                     "or parallel.cpu_offload: false on cards that hold the states")
    if "activation offload" in alive:
        fixes.append("activation_offloading: false or a smaller micro_batch_size")
    if "async checkpoint staging" in alive:
        fixes.append("host.async_checkpoint: false")
    if "tokenized dataset" in alive and any(c.name == "tokenized dataset" and c.bytes_per_rank
                                            for c in plan.components):
        fixes.append("a memory-mapped dataset (host.data_in_memory: false)")
    fixes.append("an offer with more host RAM per card (`tunepilot compare SPEC`)")
    return "To fit: " + "; or ".join(fixes) + "."


def _held(plan: HostPlan) -> str:
    return ", ".join(f"{c.name} {fmt_bytes(c.bytes_per_node)}" for c in plan.components
                     if c.name in ("cpu offload", "activation offload",
                                   "async checkpoint staging"))


def _top(plan: HostPlan) -> str:
    """The two largest components of the peak phase."""
    alive = sorted((c for c in plan.components if plan.peak_phase in c.phases),
                   key=lambda c: -c.bytes_per_node)
    return ", ".join(f"{c.name} {fmt_bytes(c.bytes_per_node)}" for c in alive[:2])
