"""How the run is spread over devices: data parallel (DDP, FSDP, DeepSpeed ZeRO), tensor and
sequence parallel (Megatron-style), context parallel (ring attention) and expert parallel.

The ranks factor as world_size = data_parallel x tensor x context (expert parallel is carved out
of the data-parallel ranks for the MoE layers, as Megatron-core does). The global batch is over
the data-parallel ranks only: the tensor- and context-parallel ranks of one replica see the same
samples.

DeepSpeed ZeRO (``strategy: deepspeed``) keeps the field names and defaults of DeepSpeed's own
``zero_optimization`` block (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig @03dc2b92):
bucket sizes are counts of elements, not bytes. Three of them accept "auto", which Hugging Face's
integration resolves from the model's hidden size h (transformers integrations/deepspeed.py
HfTrainerDeepSpeedConfig.trainer_config_finalize): reduce_bucket_size h x h,
stage3_prefetch_bucket_size 0.9 x h x h, stage3_param_persistence_threshold 10 x h.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Strategy = Literal["single", "ddp", "fsdp", "deepspeed"]
OffloadDevice = Literal["none", "cpu", "nvme"]
Auto = Literal["auto"]
BUCKET_MAX = 10**12  # elements; DeepSpeed's own sizes are at most ~1e9
Elements = Annotated[int, Field(ge=0, le=BUCKET_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class DeepSpeedSpec(_Strict):
    """DeepSpeed ZeRO: which model states each rank keeps a 1/N slice of, where the optimizer
    and the parameters live, and the communication buckets (elements), as in a ds_config's
    zero_optimization block."""

    stage: Literal[0, 1, 2, 3] = 2
    """0: none sharded (DDP-like, fp32 master copy kept whole); 1: optimizer state and master
    weights sharded; 2: + gradients; 3: + the 16-bit parameters (gathered per module)"""
    offload_optimizer: OffloadDevice = "none"
    """cpu/nvme: the master weights and optimizer state (and the optimizer's step) leave the
    device (ZeRO-Offload / ZeRO-Infinity)"""
    offload_param: OffloadDevice = "none"
    """stage 3 only: the 16-bit parameter partitions leave the device"""
    overlap_comm: bool | None = None
    """None: DeepSpeed's default - true for stage 3, false otherwise; stage 1/2 allocate a second
    reduce bucket when true"""
    contiguous_gradients: bool = True
    """stage 1/2: gradients copied into the reduce bucket as they are made"""
    reduce_bucket_size: Elements | Auto = 500_000_000
    allgather_bucket_size: int = Field(default=500_000_000, ge=0, le=BUCKET_MAX)
    stage3_prefetch_bucket_size: Elements | Auto = 50_000_000
    stage3_max_live_parameters: int = Field(default=1_000_000_000, ge=0, le=BUCKET_MAX)
    stage3_max_reuse_distance: int = Field(default=1_000_000_000, ge=0, le=BUCKET_MAX)
    stage3_param_persistence_threshold: Elements | Auto = 100_000
    sub_group_size: int = Field(default=1_000_000_000, gt=0, le=BUCKET_MAX)
    """stage 3: the optimizer steps this many elements of the partition at a time (the fp32
    gradient of one sub-group exists at once)"""
    zero3_init: bool = True
    """stage 3: the model is built partitioned (deepspeed.zero.Init, as the HF Trainer and
    accelerate's zero3_init_flag do); false: every rank loads it whole first"""

    @model_validator(mode="after")
    def _param_offload_needs_stage3(self) -> DeepSpeedSpec:
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param {self.offload_param!r} needs stage 3 (only ZeRO-3 "
                             f"partitions the parameters); this is stage {self.stage}: set "
                             "stage: 3 or offload_param: none")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
        return self

    @property
    def overlaps(self) -> bool:
        """overlap_comm as DeepSpeed resolves None (its validator overlap_comm_valid)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def elements(self, name: str, hidden_size: int) -> int:
        """A bucket size in elements, "auto" resolved as the HF integration does."""
        value = getattr(self, name)
        if value != "auto":
            return int(value)
        h = hidden_size
        return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                "stage3_param_persistence_threshold": 10 * h}[name]


class ParallelSpec(_Strict):
    """How the run is spread over devices."""

    strategy: Strategy = "single"
    """single | ddp | fsdp | deepspeed (ZeRO, see parallel.deepspeed)"""
    devices: int = Field(default=1, gt=0, le=4096)
    nodes: int = Field(default=1, gt=0, le=4096)
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_version: Literal[1, 2] = 2
    """fsdp: 2 = fully_shard per decoder layer; 1 = FullyShardedDataParallel (model/shard.py)"""
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    """strategy deepspeed: the ZeRO stage, offload and buckets (a ds_config's zero_optimization)"""
    tensor: int = Field(default=1, gt=0, le=1024)
    """tensor-parallel ranks (Megatron-style: attention heads and the MLP's intermediate
    dimension split, one all-reduce - or with sequence_parallel an all-gather and a
    reduce-scatter - per block in forward and in backward)"""
    sequence_parallel: bool = False
    """with tensor > 1: the norms', dropouts' and residual's activations split over the tensor
    ranks too (Megatron's sequence parallel, Korthikanti et al. 2022)"""
    context: int = Field(default=1, gt=0, le=1024)
    """context-parallel ranks: each holds sequence_length / context tokens of every sample and
    passes K/V around a ring for attention"""
    expert: int = Field(default=1, gt=0, le=1024)
    """expert-parallel ranks for an MoE model's routed experts (taken from the data-parallel
    ranks; each holds num_experts / expert of them)"""

    @model_validator(mode="after")
    def _shape(self) -> ParallelSpec:
        if self.strategy == "single" and (self.devices > 1 or self.nodes > 1):
            raise ValueError(
                f"strategy 'single' uses one device but devices={self.devices}, "
                f"nodes={self.nodes}; set strategy: ddp or fsdp (or deepspeed), or devices: 1"
            )
        if self.strategy != "deepspeed" and self.deepspeed != DeepSpeedSpec():
            raise ValueError(f"deepspeed settings are given but strategy is {self.strategy!r}; "
                             "set strategy: deepspeed, or remove the deepspeed block")
        model = self.tensor * self.context
        if self.world_size % model:
            raise ValueError(f"tensor x context = {self.tensor} x {self.context} = {model} ranks "
                             f"per replica does not divide the {self.world_size} devices; use "
                             "a device count that is a multiple of it")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence_parallel splits the tensor-parallel group's activations; "
                             "it needs tensor > 1 (or set sequence_parallel: false)")
        if self.data_parallel % self.expert:
            raise ValueError(f"expert = {self.expert} does not divide the {self.data_parallel} "
                             "data-parallel ranks it is carved from; use a divisor of it")
        return self

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def data_parallel(self) -> int:
        """Ranks holding different samples: world_size / (tensor x context)."""
        return self.world_size // (self.tensor * self.context)

    @property
    def replicas(self) -> int:
        """Ranks holding the same slice of the model, whose gradients are reduced together:
        data_parallel x context (context-parallel ranks hold the whole slice and see different
        tokens; torchtitan's dp_shard_cp mesh, Megatron's DP x CP gradient group)."""
        return self.data_parallel * self.context

    @property
    def state_shards(self) -> int:
        """Ranks over which the data-parallel strategy shards the model states it shards
        (FSDP and ZeRO over the replicas; 1 for single and DDP)."""
        return self.replicas if self.strategy in ("fsdp", "deepspeed") else 1

    @property
    def shards_parameters(self) -> bool:
        """The parameters themselves are sharded over several ranks (FSDP, ZeRO-3)."""
        sharding = self.strategy == "fsdp" or (self.strategy == "deepspeed" and
                                               self.deepspeed.stage == 3)
        return sharding and self.replicas > 1

    @property
    def model_parallel(self) -> bool:
        """Tensor or context parallel in use."""
        return self.tensor > 1 or self.context > 1


def check_sequence_split(parallel: ParallelSpec, sequence_length: int) -> None:
    """Context parallel (and sequence parallel over the tensor ranks) divide every sample's
    tokens evenly over their ranks."""
    split = parallel.context * (parallel.tensor if parallel.sequence_parallel else 1)
    if sequence_length % split:
        over = " x ".join(([f"context {parallel.context}"] if parallel.context > 1 else []) + (
            [f"tensor {parallel.tensor} (sequence parallel)"] if parallel.sequence_parallel
            else []))
        raise ValueError(f"sequence_length {sequence_length} cannot be split evenly over "
                         f"{over} = {split} ranks; use a multiple of {split}")
