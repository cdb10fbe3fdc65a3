"""How a model is sharded with FSDP: the one rule the scaling worker runs on real ranks and the
traced plan runs on one rank under a fake process group.

  FSDP2 (parallel.fsdp_version: 2, the default)  ``fully_shard`` on each decoder layer, then on
      the root (embeddings, final norm, lm_head), with the spec's reshard_after_forward; each
      parameter sharded on dim 0; CPUOffloadPolicy when parallel.cpu_offload (on a GPU).
  FSDP1 (parallel.fsdp_version: 1)  ``FullyShardedDataParallel``: one flat parameter per decoder
      layer - and, for LoRA, per module whose own weight trains (PEFT's fsdp_auto_wrap_policy, as
      accelerate and answer.ai's fsdp_qlora wrap LoRA) - then the root; FULL_SHARD (SHARD_GRAD_OP when
      reshard_after_forward is false), backward prefetch BACKWARD_PRE, limit_all_gathers,
      CPUOffload(offload_params=True) when parallel.cpu_offload.
Under *-mixed precision the unsharded parameters are gathered in the 16-bit compute dtype and
gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy, as torchtitan sets it) or in the compute
dtype (FSDP1 MixedPrecision, as accelerate and the HF Trainer set it); autocast still runs the step. (A QLoRA base packed in
uint8 is left uncast.) Gradients are reduce-scattered every micro-batch (no no_sync): see
scaling/worker.py.
"""

from __future__ import annotations

import functools

# FSDP2 keeps the current and the prefetched layer unsharded while resharding after forward.
FSDP_UNSHARDED_LAYERS = 2


def decoder_layers(model) -> list:
    """The model's decoder layers: the classes transformers will not split (_no_split_modules),
    else the children of a ModuleList called 'layers'."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for name, m in model.named_modules():
        if name.endswith("layers") and isinstance(m, torch.nn.ModuleList):
            return list(m)
    return []


def shard_model(model, spec, *, mesh=None, device=None, offload: bool = False,
                materialize=None):
    """`model` sharded as the spec's parallel.fsdp_version does it (FSDP2 in place; FSDP1 returns
    the wrapper). `mesh`: the 1-D device mesh (default: the whole default process group);
    `device`: FSDP1's device_id; `offload`: CPU offload of the sharded states.

    `materialize` (model/materialize.Materializer): the model is on the meta device and each
    unit is materialised whole just before it is sharded - a decoder layer, then the root's
    remaining modules - so a rank holds its shards plus one unsharded unit, never the model
    (FSDP1: its param_init_fn, called per unit before the unit is flattened)."""
    import torch

    if spec.parallel.fsdp_version == 1:
        return _fsdp1(model, spec, mesh, device, offload, materialize)
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    compute = compute_dtype(spec)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) \
        if compute is not None else MixedPrecisionPolicy()
    kw = {"mesh": mesh, "reshard_after_forward": spec.parallel.reshard_after_forward,
          "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(), "mp_policy": mp}
    for layer in decoder_layers(model):
        if materialize is not None:
            materialize(layer)
        fully_shard(layer, **kw)
    if materialize is not None:
        materialize(model)
    if spec.loss_calls_head_apart:
        # a chunked loss (LitGPT's too) calls the decoder body and lm_head apart (step.py), never
        # the root's forward: each is its own unit so its own hooks gather it (torchtune shards
        # tok_embeddings and output as their own units too: custom_sharded_layers)
        from tunepilot.model.build import output_head

        body, head = output_head(model)
        fully_shard(head, **kw)
        fully_shard(body, **kw)
    fully_shard(model, **kw)
    return model


def compute_dtype(spec):
    """The dtype FSDP gathers parameters in under *-mixed precision (None: as stored)."""
    from tunepilot.model.build import torch_dtype

    name = spec.precision.autocast_dtype
    if name is None:
        return None
    if spec.method.kind == "qlora" and spec.quant_storage_dtype == "uint8":
        return None  # the packed codes must not be cast
    return torch_dtype(name)



def _fsdp1(model, spec, mesh, device, offload: bool, materialize=None):
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    layer_classes = {type(m) for m in decoder_layers(model)}

    def own_weight_trains(m) -> bool:  # PEFT's fsdp_auto_wrap_policy: LoRA's A and B linears
        w = getattr(m, "weight", None)
        return not list(m.children()) and w is not None and w.requires_grad

    policies = [functools.partial(transformer_auto_wrap_policy,
                                  transformer_layer_cls=layer_classes)]
    if spec.method.is_lora:  # a flat parameter holds one dtype and one requires_grad
        policies.append(functools.partial(lambda_auto_wrap_policy, lambda_fn=own_weight_trains))
    policy = functools.partial(_or_policy, policies=policies)
    strategy = (ShardingStrategy.FULL_SHARD if spec.parallel.reshard_after_forward
                else ShardingStrategy.SHARD_GRAD_OP)
    compute = compute_dtype(spec)
    # accelerate's FSDP1 plugin (set_mixed_precision): param, reduce and buffer dtype all bf16
    mp = MixedPrecision(param_dtype=compute, reduce_dtype=compute,
                        buffer_dtype=compute) if compute is not None else None
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, mixed_precision=mp,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True,
                cpu_offload=CPUOffload(offload_params=True) if offload else None,
                device_id=device, use_orig_params=False, param_init_fn=materialize,
                process_group=mesh.get_group() if mesh is not None else None)
