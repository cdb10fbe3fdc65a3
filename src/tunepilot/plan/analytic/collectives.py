"""The collectives one rank takes part in per optimizer step, by group: what the time model
(cost/) reads to price communication for DDP, FSDP, DeepSpeed ZeRO-0..3, tensor / sequence,
context and expert parallel. Pure arithmetic, no torch; the same sharding rules as the memory
plan (plan/analytic/parallel.py).

Each entry is a payload and a count: ``bytes_per_call`` is the whole buffer the collective
operates on (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer, one
ring step's send), before any algorithm's factor - a ring all-reduce moves
2 (n - 1) / n of it per rank, an all-gather or reduce-scatter (n - 1) / n, a point-to-point send
all of it. ``overlapped`` says whether the framework overlaps it with compute (DDP's buckets,
FSDP's prefetch, ZeRO's overlap_comm, the ring's next chunk) or it sits on the critical path
(tensor parallel's all-reduces inside every block).

Sources: DDP and FSDP as model/shard.py and scaling/worker.py run them (gradients reduced every
micro-batch); ZeRO per Rajbhandari et al. 2020 section 7 (stage 1/2: reduce-scatter of the
gradients, all-gather of the updated 16-bit parameters, once per step for stage 1 and per
micro-batch's reduction for stage 2; stage 3: parameters all-gathered for the forward and again
for the backward, gradients reduce-scattered); tensor parallel per Shoeybi et al. 2019 (two
all-reduces in the forward and two in the backward of every block) and Korthikanti et al. 2022
(with sequence parallel each all-reduce becomes an all-gather and a reduce-scatter of the same
volume); context parallel as ring attention (c - 1 K/V chunk sends per layer in the forward,
K/V and their gradients in the backward); expert parallel as Megatron-core's all-to-all token
dispatcher (dispatch and combine, forward and backward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tunepilot.model.arch import Arch, tensor_slice
from tunepilot.plan.analytic.activations import precision_bytes
from tunepilot.plan.analytic.parallel import fp32_grad_buffer, rank_view
from tunepilot.plan.analytic.states import split_params
from tunepilot.spec import RunSpec


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank takes part in, per optimizer step."""

    op: str  # all-reduce | all-gather | reduce-scatter | all-to-all | send-recv | host-copy
    group: str  # data | tensor | context | expert | host (PCIe to the host's memory)
    ranks: int  # the group's size (1 for host copies)
    bytes_per_call: int  # the whole buffer per call (see the module docstring)
    calls_per_step: int
    overlapped: bool
    what: str

    @property
    def bytes_per_step(self) -> int:
        return self.bytes_per_call * self.calls_per_step

    def to_dict(self) -> dict:
        return dict(asdict(self), bytes_per_step=self.bytes_per_step)


def collectives(spec: RunSpec, arch: Arch) -> list[Collective]:
    """Every collective of one rank's optimizer step (empty on one device)."""
    view = rank_view(spec, arch)
    out = _data_parallel(spec, view.states_arch)
    out += _tensor_parallel(spec, arch)
    out += _context_parallel(spec, arch)
    out += _expert_parallel(spec, arch)
    return out


def _passes(spec: RunSpec) -> int:
    """Forward passes over each layer per micro-batch: 1, or 2 with full checkpointing (the
    recompute in the backward)."""
    return 2 if spec.activation_checkpointing == "full" else 1


def _data_parallel(spec: RunSpec, arch: Arch) -> list[Collective]:
    par = spec.parallel
    n, A = par.replicas, spec.gradient_accumulation_steps
    if n == 1 or par.strategy == "single":
        return []
    params = split_params(arch, spec)
    trained = params.trainable
    cb = spec.precision.compute_bytes
    if par.strategy == "ddp":
        gb = spec.precision.parameter_bytes
        return [Collective("all-reduce", "data", n, trained * gb, A, True,
                           "DDP: the gradients, in buckets, every micro-batch")]
    if par.strategy == "fsdp":
        gb = spec.precision.parameter_bytes  # FSDP2 reduce_dtype fp32
        gathers = 1 + (1 if par.reshard_after_forward else 0)
        return [Collective("all-gather", "data", n, params.total * cb, gathers * A, True, "FSDP: the parameters of each unit, for the "
                           "forward" + (" and again for the backward" if gathers > 1 else "")),
                Collective("reduce-scatter", "data", n, trained * gb, A, True,
                           "FSDP: the gradients, every micro-batch")]
    return _zero(spec, arch, n, A, trained, params.total)


def _zero(spec: RunSpec, arch: Arch, n: int, A: int, trained: int, total: int
          ) -> list[Collective]:
    ds = spec.parallel.deepspeed
    b16 = spec.precision.compute_bytes  # DeepSpeed's module: its 16-bit engine, or fp32
    gb = 4 if fp32_grad_buffer(spec) else b16  # reduced in the dtype they accumulate in
    overlap = ds.overlaps
    if ds.stage == 0:
        return [Collective("all-reduce", "data", n, trained * gb, 1, False,
                           "ZeRO-0: the gradients, at the end of the step's backward")]
    out = [Collective("reduce-scatter", "data", n, trained * gb, A if ds.stage >= 2 else 1,
                      overlap, f"ZeRO-{ds.stage}: the gradients, "
                      + ("every micro-batch, bucket by bucket" if ds.stage >= 2 else
                         "once per step"))]
    if ds.stage < 3:
        out.append(Collective("all-gather", "data", n, trained * b16, 1, False,
                              f"ZeRO-{ds.stage}: the updated 16-bit parameters after the step"))
    else:
        out.append(Collective("all-gather", "data", n, total * b16, 2 * A, overlap,
                              "ZeRO-3: the parameters of each module for the forward and again "
                              "for the backward (prefetched)"))
    if ds.offload_optimizer != "none":
        out.append(Collective("host-copy", "host", 1, trained * (b16 + b16) // n, 1, False,
                              f"offload_optimizer {ds.offload_optimizer}: gradient partitions "
                              "out, updated 16-bit parameters back, each step"))
    if ds.offload_param != "none":
        out.append(Collective("host-copy", "host", 1, total * b16 // n, 2 * A, False,
                              f"offload_param {ds.offload_param}: the parameter partitions in "
                              "for every gather"))
    return out


def _tensor_parallel(spec: RunSpec, arch: Arch) -> list[Collective]:
    par = spec.parallel
    t = par.tensor
    if t == 1:
        return []
    cb, _, _ = precision_bytes(spec)
    tokens = spec.batch.positions_per_micro_batch // par.context  # this replica's tokens per rank group
    block = cb * arch.hidden_size * tokens
    A, L = spec.gradient_accumulation_steps, arch.num_layers
    per_layer = 2 * (_passes(spec) + 1)  # 2 per block: forward (+ recompute) and backward
    if par.sequence_parallel:
        return [Collective("all-gather", "tensor", t, block, per_layer * L * A, False,
                           "sequence parallel: each block's input gathered (attention, MLP)"),
                Collective("reduce-scatter", "tensor", t, block, per_layer * L * A, False,
                           "sequence parallel: each block's output reduce-scattered")]
    return [Collective("all-reduce", "tensor", t, block, per_layer * L * A, False,
                       "tensor parallel: each block's row-parallel output (attention and MLP), "
                       "forward and backward")]


def _context_parallel(spec: RunSpec, arch: Arch) -> list[Collective]:
    par = spec.parallel
    c = par.context
    if c == 1:
        return []
    cb, _, _ = precision_bytes(spec)
    local = tensor_slice(arch, par.tensor)
    tokens = spec.batch.positions_per_micro_batch // c
    kv = 2 * cb * local.kv_dim * tokens  # one K and V chunk
    A, L = spec.gradient_accumulation_steps, arch.num_layers
    return [Collective("send-recv", "context", c, kv, (c - 1) * L * A * _passes(spec), True,
                       "context parallel: K/V chunks round the ring, forward"),
            Collective("send-recv", "context", c, 2 * kv, (c - 1) * L * A, True,
                       "context parallel: K/V and their gradients round the ring, backward")]


def _expert_parallel(spec: RunSpec, arch: Arch) -> list[Collective]:
    e = spec.parallel.expert
    if e == 1 or arch.num_experts <= 1:
        return []
    cb, _, _ = precision_bytes(spec)
    par = spec.parallel
    tokens = spec.batch.positions_per_micro_batch // par.context
    routed = cb * arch.hidden_size * tokens * arch.experts_per_token
    A, L = spec.gradient_accumulation_steps, arch.num_layers
    calls = 2 * (_passes(spec) + 1) * L * A  # dispatch + combine; forward(s) and backward
    return [Collective("all-to-all", "expert", e, routed, calls, False,
                       "expert parallel: tokens to their experts' ranks and back")]


def collectives_table(spec: RunSpec, arch: Arch) -> list[dict]:
    """collectives() as dicts (the plan's JSON and the time model)."""
    return [c.to_dict() for c in collectives(spec, arch)]
