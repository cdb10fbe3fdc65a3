"""DeepSpeed itself, where it is installed and a GPU is at hand: the ds_config a spec with
``parallel.strategy: deepspeed`` runs under, and the engine wrapping tunepilot's model and
optimizer. DeepSpeed is imported only inside ``engine`` (an optional integration); ``ds_config``
is pure data (the plan's reading of the same fields is plan/analytic/parallel.py).
"""

from __future__ import annotations

from typing import Any

from tunepilot.spec import RunSpec
from tunepilot.training.step import MAX_GRAD_NORM


def ds_config(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config of the spec: its zero_optimization block (bucket sizes in elements,
    "auto" left for DeepSpeed's HF-style resolution only where the spec keeps it), bf16 or fp16
    by the spec's precision, the micro-batch and accumulation, tunepilot's gradient clipping;
    no optimizer block (the engine wraps the spec's own optimizer, as the HF Trainer does)."""
    if spec.parallel.strategy != "deepspeed":
        raise ValueError("ds_config needs parallel.strategy: deepspeed")
    ds = spec.parallel.deepspeed
    zero: dict[str, Any] = {"stage": ds.stage, "contiguous_gradients": ds.contiguous_gradients,
                            "overlap_comm": ds.overlaps,
                            "allgather_bucket_size": ds.allgather_bucket_size,
                            "sub_group_size": ds.sub_group_size}
    for name in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold"):
        value = getattr(ds, name)
        if value != "auto":  # DeepSpeed alone does not resolve "auto": leave its default
            zero[name] = value
    zero["stage3_max_live_parameters"] = ds.stage3_max_live_parameters
    zero["stage3_max_reuse_distance"] = ds.stage3_max_reuse_distance
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(ds, name)
        if device != "none":
            zero[name] = {"device": device, "pin_memory": True}
    p = spec.precision
    return {"train_micro_batch_size_per_gpu": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.gradient_accumulation_steps,
            "gradient_clipping": MAX_GRAD_NORM,
            "bf16": {"enabled": p.mixed and p.compute_dtype == "bf16"},
            "fp16": {"enabled": p.needs_grad_scaler},
            "zero_optimization": zero}


def engine(spec: RunSpec, model, optimizer):
    """deepspeed.initialize over the model and the spec's optimizer (needs deepspeed, an
    initialised process group and a GPU); the engine runs engine.backward(loss) and
    engine.step()."""
    import deepspeed

    eng, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=ds_config(spec))
    return eng, opt
