"""Communication in a training step: the collectives of data parallelism (FSDP's all-gathers and
reduce-scatters, DDP's all-reduce) over the offer's fabric, tensor and context parallelism's
inside the node, and CPU offload's optimizer step over the host link - each as seconds one rank
spends per optimizer step, and what of it the compute cannot hide.

A collective of B bytes over N ranks on k nodes of g cards (ring / hierarchical, as NCCL runs it):
    inside the node   B x (g - 1) / g / the node's measured all-reduce bus bandwidth
    across the nodes  B x (k - 1) / N / one GPU's achieved share of the fabric
                      (per-accelerator rate = busbw x (k - 1) / (n - 1), stas00/ml-engineering)
    + the fabric's latency; the longer of the two parts (they pipeline).
Data parallel per optimizer step: FSDP (and ZeRO-3) all-gathers the weights for the forward and,
resharded after it, for the backward, and reduce-scatters the gradients, every micro-batch; DDP
all-reduces the gradients once. Exposed = max(0, traffic - the compute it overlaps) + one
layer's share (the first gather, the last reduce-scatter) (step_model.yaml collectives).

The published multi-node runs behind cost_model.yaml's node-scaling columns ran on 400 Gb/s per
GPU (step_model.yaml collectives reference): an offer on another fabric pays the difference of
its exposed time against that one (``fabric_penalty_s``), so the calibrated columns hold for the
fabric they were measured on and the physics carries them to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.cost.step_model import step_model

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Link:
    """What one rank's collectives run over."""

    inter_bytes_per_s: float  # one GPU's achieved share of the fabric
    latency_s: float
    intra_bytes_per_s: float  # the node's all-reduce bus bandwidth
    how: str


def link_of(card, *, reference: bool = False) -> Link:
    """The offer's fabric (catalog pricing.fabric) and NVLink, or the reference fabric."""
    c = step_model().collectives
    intra = (card.scale_up.busbw_gbps or card.scale_up.bandwidth_gbps or 100.0) * 1e9
    fabric = None if reference else card.pricing.fabric
    if fabric is None:
        bw = c.reference_gbps_per_gpu / 8 * 1e9 * c.reference_achieved_fraction
        said = ("the published multi-node runs' fabric" if reference else
                f"{card.id}'s offer lists no fabric: taken as the published runs'")
        return Link(bw, c.reference_latency_us * 1e-6, intra,
                    f"{said}, {c.reference_gbps_per_gpu:g} Gb/s per GPU x "
                    f"{c.reference_achieved_fraction:g}")
    return Link(fabric.bytes_per_s_per_gpu(GPUS_PER_NODE), fabric.latency_us * 1e-6, intra,
                f"{fabric.kind} {fabric.gbps_per_node:,.0f} Gb/s per node x "
                f"{fabric.achieved_fraction:g} (catalog pricing.fabric)")


def collective_s(nbytes: float, ranks: int, nodes: int, link: Link) -> float:
    """An all-gather or a reduce-scatter of ``nbytes`` (the whole tensor) over ``ranks``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(GPUS_PER_NODE, -(-ranks // max(nodes, 1))))
    intra = nbytes * (per_node - 1) / per_node / link.intra_bytes_per_s
    if nodes <= 1:
        return intra
    inter = nbytes * (nodes - 1) / ranks / link.inter_bytes_per_s + link.latency_s
    return max(intra, inter)


@dataclass(frozen=True)
class Traffic:
    seconds: float  # one rank's collective time per optimizer step
    exposed_s: float  # what the compute cannot hide
    how: str


def data_parallel(spec, arch, strategy: str, count: int, nodes: int, link: Link,
                  compute_s: float, weight_bytes: float, grad_bytes: float) -> Traffic:
    """FSDP's or DDP's collectives per optimizer step of one rank, and the exposed part."""
    if count <= 1 or strategy == "single":
        return Traffic(0.0, 0.0, "one card: no collectives")
    micro = spec.batch.on(count, exact=False).accumulation
    if strategy == "fsdp":
        gathers = 2 if spec.parallel.reshard_after_forward else 1
        t = micro * (gathers * collective_s(weight_bytes, count, nodes, link)
                     + collective_s(grad_bytes, count, nodes, link))
        what = (f"FSDP: {micro} micro-batch(es) x ({gathers} all-gather(s) of "
                f"{weight_bytes / 1e9:,.1f} GB + a reduce-scatter of {grad_bytes / 1e9:,.1f} GB)")
    else:
        t = 2 * collective_s(grad_bytes, count, nodes, link)  # reduce-scatter + all-gather
        what = f"DDP: one all-reduce of {grad_bytes / 1e9:,.2f} GB of gradients"
    exposed = max(0.0, t - compute_s) + t / max(arch.num_layers, 1)
    return Traffic(t, exposed, f"{what} over {count} ranks on {nodes} node(s) ({link.how}): "
                   f"{t:,.3g} s, {exposed:,.3g} s not hidden by {compute_s:,.3g} s of compute")


def fabric_penalty_s(spec, arch, card, strategy: str, count: int, nodes: int, compute_s: float,
                     weight_bytes: float, grad_bytes: float) -> tuple[float, str]:
    """Seconds per optimizer step the offer's fabric adds over the published runs' fabric
    (0 on one node, or on a fabric as fast; a faster one is not credited)."""
    if nodes <= 1 or count <= 1:
        return 0.0, ""
    mine = data_parallel(spec, arch, strategy, count, nodes, link_of(card), compute_s,
                         weight_bytes, grad_bytes)
    ref = data_parallel(spec, arch, strategy, count, nodes, link_of(card, reference=True),
                        compute_s, weight_bytes, grad_bytes)
    extra = max(0.0, mine.exposed_s - ref.exposed_s)
    return extra, (f"{mine.how}; against the published runs' fabric {ref.exposed_s:,.3g} s: "
                   f"+{extra:,.3g} s per step")


def model_parallel_s(spec, arch, card, count: int, tokens_per_micro: float, compute_s: float
                     ) -> tuple[float, str]:
    """Tensor and context parallel inside the node, per optimizer step of one rank: tensor
    parallel all-reduces each block's output twice forward and twice backward (or, with
    sequence parallel, all-gathers and reduce-scatters the same bytes), exposed; context
    parallel passes each layer's K and V around the ring, hidden behind attention as far as
    attention lasts (Megatron-LM, Korthikanti et al. 2022; ring attention, Liu et al. 2023)."""
    tp = int(getattr(spec.parallel, "tensor", 1) or 1)
    cp = int(getattr(spec.parallel, "context", 1) or 1)
    if tp <= 1 and cp <= 1:
        return 0.0, ""
    link = link_of(card)
    micro = spec.batch.on(count, exact=False).accumulation if count > 1 else \
        spec.gradient_accumulation_steps
    act = tokens_per_micro / cp * arch.hidden_size * 2  # bf16 activations of one rank's share
    out, how = 0.0, []
    if tp > 1:
        per = 4 * 2 * act * (tp - 1) / tp / link.intra_bytes_per_s  # 4 all-reduces per layer
        out += micro * arch.num_layers * per
        how.append(f"tensor {tp}: 4 all-reduces of {act / 1e6:,.1f} MB per layer")
    if cp > 1:
        kv = tokens_per_micro / cp * 2 * arch.num_kv_heads * arch.head_dim * 2
        ring = micro * arch.num_layers * 3 * kv * (cp - 1) / link.intra_bytes_per_s
        attention = compute_s * 0.5  # what the ring hides: attention's share of the step, bound
        out += max(0.0, ring - attention)
        how.append(f"context {cp}: K/V ring of {kv / 1e6:,.1f} MB per layer x {cp - 1} hops "
                   "(forward, backward x 2), hidden behind attention")
    return out, "; ".join(how) + f" at the node's {link.intra_bytes_per_s / 1e9:,.0f} GB/s"


def offload_s(spec, trainable: int, count: int, card) -> tuple[float, str]:
    """CPU offload's optimizer step per optimizer step of one rank: its share of the gradients
    to the host and the updated weights back over the host link, and the host's Adam."""
    from tunepilot.cost.host_link import host_link_bytes_per_s, host_link_of

    if not spec.parallel.cpu_offload:
        return 0.0, ""
    hl = step_model().host_link
    per_rank = trainable / max(count, 1)
    link = host_link_bytes_per_s(card)
    moved = per_rank * (4 + 2)  # fp32 gradients out, 16-bit weights back
    seconds = moved / link + per_rank * hl.cpu_adam_s_per_param
    return seconds, (f"CPU offload: {per_rank / 1e9:,.2f}B parameters per rank - "
                     f"{moved / 1e9:,.1f} GB over {host_link_of(card)} at {link / 1e9:,.0f} GB/s "
                     f"+ the host's Adam at {hl.cpu_adam_s_per_param * 1e9:g} ns per parameter "
                     f"({hl.cpu_adam_kind}: DeepSpeed's CPU Adam; PyTorch's is slower) = "
                     f"{seconds:,.2f} s per step")


def step_terms(spec, arch, card, count: int, strategy: str, compute_s: float, params
               ) -> tuple[float, str]:
    """Seconds the step's communication adds to one rank's optimizer step of ``compute_s``
    on ``count`` x ``card`` (nodes of up to 8), and how: the fabric over the published runs',
    tensor/context parallel, CPU offload."""
    nodes = max(1, -(-count // GPUS_PER_NODE))
    p = spec.precision
    fp8_gather = p.fp8_recipe is not None and p.fp8_recipe.all_gather_fp8  # 1 B per weight
    weights = params.total * (1 if fp8_gather else p.compute_bytes)
    grads = params.trainable * (4 if p.mixed else p.compute_bytes)
    parts = [fabric_penalty_s(spec, arch, card, strategy, count, nodes, compute_s, weights,
                              grads)]
    tokens = spec.micro_batch_size * spec.batch.positions_per_sample
    parts.append(model_parallel_s(spec, arch, card, count, tokens, compute_s))
    parts.append(offload_s(spec, params.trainable, count, card))
    extra = sum(s for s, _ in parts)
    return extra, "; ".join(h for s, h in parts if s)
