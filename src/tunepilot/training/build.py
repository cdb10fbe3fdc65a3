"""The one way to build a run: model, optimizer, scheduler, scaler and data stream.

``build_run(spec, device)``: the pilot times what it builds, restore replays it, the scaling
worker runs it under DDP / FSDP, and the traced plan builds it on fake tensors. The model is
built on the meta device and materialised on ``device`` (model/build.py, model/materialize.py):
whole for one device or DDP; one FSDP unit at a time, each sharded before the next is
materialised, under FSDP (``shard``) - a rank holds its shards plus one unsharded unit, never the
model - with random init seeded per module, so the unsharded model is the same on any number of
ranks, or the unit's tensors read from a local safetensors checkpoint a tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tunepilot.dataset import DataInfo, DataStream
from tunepilot.errors import UserError
from tunepilot.model.build import build_model, torch_dtype, trainable_parameters
from tunepilot.spec import RunSpec
from tunepilot.training.step import TrainState

BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw", "paged_adamw_8bit")
TORCHAO_OPTIMIZERS = ("adamw_8bit_torchao", "adamw_4bit")

OptimizerFactory = Callable[[RunSpec, torch.nn.Module], torch.optim.Optimizer]
Prepare = Callable[[torch.nn.Module], tuple[torch.nn.Module, Callable | None]]


@dataclass
class Shard:
    """FSDP as the spec's parallel section says (model/shard.py), on the default process group
    unless ``mesh`` names one; ``offload``: CPU offload of the sharded states (a GPU run)."""

    mesh: object = None
    offload: bool = False


def build_policy(spec: RunSpec, device, base_dir: Path | None, config: dict | None,
                 shard: Shard | None = None, kernels: bool = False) -> torch.nn.Module:
    """The spec's model on ``device``: whole, or sharded as it is materialised (``shard``);
    ``kernels``: with the spec's kernels that run there (the pilot), else the stock path."""
    if shard is None:
        return build_model(spec, device, base_dir=base_dir, config=config, kernels=kernels)
    from tunepilot.model.build import build_sharded_model

    return build_sharded_model(spec, device, mesh=shard.mesh, offload=shard.offload,
                               base_dir=base_dir, config=config, kernels=kernels)


def build_optimizer(spec: RunSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The spec's optimizer over the trainable parameters. PyTorch keeps optimizer state in the
    parameter dtype, so a state_dtype that differs from it is refused rather than ignored."""
    params = trainable_parameters(model)
    o = spec.optimizer
    if not params:
        raise UserError("method", "the model has no trainable parameters.",
                        "Check method.lora_targets names modules of this model.")
    pdtype = params[0].dtype
    want = torch_dtype(spec.optimizer_state_dtype)
    if o.name in ("adamw", "sgd") and want != pdtype and o.state_dtype is not None:
        raise UserError("optimizer.state_dtype", f"{o.state_dtype} states on {pdtype} "
                        "parameters: PyTorch keeps optimizer state in the parameter dtype.",
                        "Remove optimizer.state_dtype, or change precision (or set "
                        "method.adapter_dtype to the state dtype for LoRA).")
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True},
            "for-loop": {"foreach": False}}.get(o.impl or "", {})
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, **impl)
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=0.9, weight_decay=o.weight_decay, **impl)
    if o.name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=o.lr, scale_parameter=False, relative_step=False,
                         warmup_init=False, weight_decay=o.weight_decay)
    if o.name in TORCHAO_OPTIMIZERS:
        return _torchao_optimizer(spec, params)
    return _bnb_optimizer(spec, params)


def _torchao_optimizer(spec: RunSpec, params: list) -> torch.optim.Optimizer:
    """torchao's 8- and 4-bit AdamW (resources/optimizers.yaml); its step is torch.compile'd."""
    import importlib.util

    o = spec.optimizer
    if importlib.util.find_spec("torchao") is None:
        raise UserError("optimizer.name", f"{o.name} needs torchao (pip install torchao).",
                        "Install torchao, or use adamw for the pilot (the plan still models "
                        f"{o.name}).")
    from torchao import optim as ao

    cls = {"adamw_8bit_torchao": ao.AdamW8bit, "adamw_4bit": ao.AdamW4bit}[o.name]
    return cls(params, lr=o.lr, weight_decay=o.weight_decay)


def _bnb_optimizer(spec: RunSpec, params: list) -> torch.optim.Optimizer:
    """8-bit and paged optimizers live in bitsandbytes, which needs CUDA."""
    import importlib.util

    o = spec.optimizer
    if importlib.util.find_spec("bitsandbytes") is None or params[0].device.type != "cuda":
        raise UserError("optimizer.name", f"{o.name} needs bitsandbytes on a CUDA device.",
                        "Use adamw for a pilot on this machine (the plan still models "
                        f"{o.name}).")
    import bitsandbytes as bnb

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
           "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[o.name]
    return cls(params, lr=o.lr, weight_decay=o.weight_decay)


def build_scheduler(spec: RunSpec, optimizer: torch.optim.Optimizer, total_steps: int):
    """Linear warm-up, then constant / linear decay / cosine decay to zero at total_steps."""
    warm = spec.scheduler.warmup_steps
    kind = spec.scheduler.kind
    total = max(total_steps, warm + 1)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_scaler(spec: RunSpec, device_type: str):
    """fp16 needs loss scaling; the scaler's state is part of the training state."""
    if not spec.precision.needs_grad_scaler:
        return None
    return torch.amp.GradScaler(device_type)



def make_state(spec: RunSpec, model: torch.nn.Module, total_steps: int, *,
               optimizer: OptimizerFactory | None = None, no_sync: Callable | None = None
               ) -> TrainState:
    opt = (optimizer or build_optimizer)(spec, model)
    device_type = next(model.parameters()).device.type
    return TrainState(model, opt, build_scheduler(spec, opt, total_steps),
                      make_scaler(spec, device_type), no_sync=no_sync)


@dataclass
class Run:
    """A run built from a spec: the training state and (unless data=False) its data."""

    spec: RunSpec
    state: TrainState
    stream: DataStream | None
    dataset: object | None
    data_info: DataInfo | None

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model


def build_run(spec: RunSpec, device: str | torch.device, *, total_steps: int,
              base_dir: Path | None = None, config: dict | None = None, data: bool = True,
              rank: int = 0, world_size: int = 1, micro_batch_size: int | None = None,
              prepare: Prepare | None = None, optimizer: OptimizerFactory | None = None,
              dataset: tuple[object, DataInfo] | None = None,
              prepare_reference: Prepare | None = None, shard: Shard | None = None,
              kernels: bool = False) -> Run:
    """The spec's model on ``device`` (seeded), its dataset and loader (this rank's shard of
    ``world_size``), optimizer, scheduler and scaler. ``shard``: FSDP as model/shard.py does it,
    the model built on the meta device and materialised one unit at a time, sharded as it goes
    (no rank ever holds the whole model). ``prepare`` wraps the model before the optimizer sees
    its parameters (DDP, or the trace's fake tensors) and may return a no_sync context;
    ``optimizer`` replaces the spec's optimizer factory (the trace's bitsandbytes stand-in);
    ``dataset`` is a (dataset, info) read beforehand; ``kernels``: the spec's kernels that run on
    ``device`` go into the model (the pilot, which chose them: model/kernels.py)."""
    from tunepilot.dataset import build_dataset, make_loader

    model = build_policy(spec, device, base_dir, config, shard, kernels)
    info = stream = None
    if data:
        from tunepilot.spec.objective import prompts_per_generation

        ds, info = dataset or build_dataset(spec, model.config.vocab_size, base_dir)
        if spec.objective.generative and micro_batch_size is None:  # a batch of prompts
            micro_batch_size = prompts_per_generation(spec)
        stream = DataStream(make_loader(spec, ds, info, micro_batch_size=micro_batch_size,
                                        rank=rank, world_size=world_size))
        dataset = ds
    no_sync = None
    if prepare is not None:
        model, no_sync = prepare(model)
    state = make_state(spec, model, total_steps, optimizer=optimizer, no_sync=no_sync)
    state.reference = build_reference(spec, device, base_dir, config, prepare_reference, shard)
    if info is not None:
        state.pad_token_id, state.eos_token_id = info.pad_token_id, info.eos_token_id
    return Run(spec, state, stream, dataset, info)


def build_reference(spec: RunSpec, device, base_dir: Path | None, config: dict | None,
                    prepare: Prepare | None = None, shard: Shard | None = None
                    ) -> torch.nn.Module | None:
    """The reference as a frozen copy (objective.reference copy; auto for a full run): the
    same model without adapters, in the compute dtype (as TRL and axolotl load it: bf16 unless
    the run is fp32), in eval mode, no gradients - the policy's starting weights (the same
    seeds per module), sharded like the policy under FSDP. ``prepare``: the trace's fake
    tensors."""
    if spec.objective.reference_kind(spec.method.kind) != "copy":
        return None
    ref_spec = spec.with_changes(
        method={"kind": "full"}, optimizer={"name": "adamw"}, activation_checkpointing="none",
        precision=spec.precision.frozen_copy)
    ref = build_policy(ref_spec, device, base_dir, config, shard)
    if prepare is not None:
        ref, _ = prepare(ref)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


