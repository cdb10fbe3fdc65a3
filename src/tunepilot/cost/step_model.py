"""resources/step_model.yaml as a typed model, read once: the constants of what a step costs
beyond its FLOPs (kernel launches, the host link)."""

from __future__ import annotations

from functools import cache
from typing import Literal

import yaml
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


class StepModel(_Read):
    schema_version: int
    as_of: str
    launch: Launch
    host_link: HostLink


@cache
def step_model() -> StepModel:
    from tunepilot.resources import STEP_MODEL_YAML

    return StepModel.model_validate(
        yaml.safe_load(STEP_MODEL_YAML.read_text(encoding="utf-8")))
