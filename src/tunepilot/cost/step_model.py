"""resources/step_model.yaml as a typed model, read once: the constants of what a step costs
beyond its FLOPs (kernel launches, decode, weight sync, the host link)."""

from __future__ import annotations

from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Kind = Literal["published", "derived", "assumed", "fitted"]


class _Read(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Launch(_Read):
    per_launch_s: float = Field(gt=0)
    kind: Kind
    source: str
    kernels_per_layer: dict[Literal["forward", "backward"], int]
    kernels_per_adapter: dict[Literal["forward", "backward"], int]
    kernels_head: dict[Literal["forward", "backward"], int]
    kernels_source: str
    optimizer_ops: dict[str, int]
    tensors_per_multi_tensor_launch: int = Field(gt=0)
    elements_per_multi_tensor_launch: int = Field(gt=0)


class HostLink(_Read):
    gbps_per_direction: dict[str, float]
    achieved_fraction: float = Field(gt=0, le=1)
    source: str
    cpu_adam_s_per_param: float = Field(gt=0)
    cpu_adam_kind: Kind
    cpu_adam_source: str

    def bytes_per_s(self, link: str) -> float:
        """Achieved bytes/s one way over ``link`` (pcie4, pcie5)."""
        return self.gbps_per_direction[link] * 1e9 * self.achieved_fraction


class Decode(_Read):
    hbm_fraction: float = Field(gt=0, le=1)
    hbm_source: str
    engine_step_s: float | None = Field(default=None, ge=0)
    tp_allreduce_s: float | None = Field(default=None, ge=0)
    engine_kind: Kind
    engine_runs: list[str] = Field(default_factory=list)
    engine_source: str | None = None
    eager_op_host_s: float = Field(gt=0)
    """host seconds to dispatch one op of an eager PyTorch forward (transformers' generate)"""
    eager_kind: Kind
    eager_source: str


class WeightSync(_Read):
    colocated_gb_per_s: float | None = Field(default=None, gt=0)
    colocated_kind: Kind
    colocated_runs: list[str] = Field(default_factory=list)
    colocated_source: str | None = None
    server_gb_per_s: float = Field(gt=0)
    server_kind: Kind
    server_source: str
    sleep_wake: str


class Collectives(_Read):
    reference_gbps_per_gpu: float = Field(gt=0)
    reference_achieved_fraction: float = Field(gt=0, le=1)
    reference_latency_us: float = Field(gt=0)
    reference_source: str
    overlap_source: str


class StepModel(_Read):
    schema_version: int
    as_of: str
    launch: Launch
    host_link: HostLink
    decode: Decode
    weight_sync: WeightSync
    collectives: Collectives

    def fitted_runs(self) -> dict[str, list[str]]:
        """Each fitted constant -> the published RL runs it was fitted on."""
        return {"decode.engine": list(self.decode.engine_runs),
                "weight_sync.colocated": list(self.weight_sync.colocated_runs)}


@cache
def step_model() -> StepModel:
    from tunepilot.resources import STEP_MODEL_YAML, read_yaml

    return StepModel.model_validate(read_yaml(STEP_MODEL_YAML))
