"""The floor of a step: the kernels it launches times what one launch costs the host
(resources/step_model.yaml launch:). A step whose kernels are tiny - a small model, a small
batch - runs at the rate the host can launch them, not at the card's FLOPs: the time model takes
the longer of the two.

    kernels per optimizer step = micro-batches x (layers x (forward + backward [+ recomputed
        forward]) + adapters x (forward + backward) + the head's) + the optimizer's launches
    floor = kernels x per-launch cost
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.cost.step_model import step_model


@dataclass(frozen=True)
class LaunchFloor:
    """Kernels one rank launches per optimizer step and the seconds they take at least."""

    kernels: int
    seconds: float
    how: str


def _adapters_per_layer(arch, spec) -> int:
    if not spec.method.is_lora:
        return 0
    from tunepilot.model.arch import lora_targets

    # fused MoE experts take one adapter (PEFT's ParamWrapper: batched over the experts);
    # an MoE model's matrices held by some layers only count for their share of the layers
    return round(sum((1 if lin.peft_kind == "parameter" else lin.count_per_layer)
                     * arch.layer_share(lin)
                     for lin in lora_targets(arch, spec.method.lora_targets)
                     if lin.group != "head"))


def forward_kernels(arch, spec) -> int:
    """Kernels of one forward pass (a decode step of transformers' generate is one)."""
    k = step_model().launch
    return (arch.num_layers * (k.kernels_per_layer["forward"]
                               + _adapters_per_layer(arch, spec) * k.kernels_per_adapter["forward"])
            + k.kernels_head["forward"])


def optimizer_launches(spec, tensors: int, elements: int) -> int:
    """Kernel launches of one optimizer step over ``tensors`` parameter tensors of ``elements``
    elements: per tensor (for-loop), or per multi-tensor launch (foreach, fused)."""
    from tunepilot.model.flops import default_optimizer_impl

    k = step_model().launch
    impl = default_optimizer_impl(spec, "cuda")
    ops = k.optimizer_ops.get(impl, k.optimizer_ops["foreach"])
    if impl == "for-loop":
        return ops * tensors
    groups = max(-(-tensors // k.tensors_per_multi_tensor_launch),
                 -(-elements // k.elements_per_multi_tensor_launch), 1)
    return ops * groups


def step_floor(arch, spec, micro_batches: int, trainable_tensors: int,
               trainable_elements: int) -> LaunchFloor:
    """The launch floor of one optimizer step of ``micro_batches`` micro-batches on one rank."""
    k = step_model().launch
    per_layer = k.kernels_per_layer["forward"] + k.kernels_per_layer["backward"]
    if spec.activation_checkpointing != "none":
        per_layer += k.kernels_per_layer["forward"]  # the recomputed forward
    adapters = _adapters_per_layer(arch, spec)
    per_adapter = k.kernels_per_adapter["forward"] + k.kernels_per_adapter["backward"]
    per_micro = (arch.num_layers * (per_layer + adapters * per_adapter)
                 + k.kernels_head["forward"] + k.kernels_head["backward"])
    opt = optimizer_launches(spec, trainable_tensors, trainable_elements)
    kernels = micro_batches * per_micro + opt
    seconds = kernels * k.per_launch_s
    return LaunchFloor(kernels, seconds, (
        f"{micro_batches} micro-batch(es) x {per_micro:,} kernels ({arch.num_layers} layers x "
        f"{per_layer + adapters * per_adapter} + the head's {k.kernels_head['forward'] + k.kernels_head['backward']})"
        f" + {opt:,} optimizer launches = {kernels:,} kernels x {k.per_launch_s * 1e6:g} us "
        f"per launch ({k.kind}: resources/step_model.yaml launch) = {seconds * 1e3:.3g} ms"))
