"""The published runs the time model is calibrated on (resources/throughput_runs.yaml): each a
real training run's throughput as its source published it, in the spec's terms, validated once.

``held_out`` is the split rule, by position in the file and fixed before any fit: every third
run (rows 3, 6, 9, ... counting from 1) is kept out of the fit and only projected, so the
benchmark can report the error on runs the model has not seen apart from the rest.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tunepilot.spec import Implementation, Precision
from tunepilot.spec.method import MethodKind

HELD_OUT_EVERY = 3


class _Read(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraAt(_Read):
    rank: int = Field(gt=0)
    targets: list[str] | Literal["all-linear"]


class PublishedRun(_Read):
    """One published training run: what ran (in the spec's terms) and how fast, per GPU."""

    id: str
    implementation: Implementation
    stack: str
    """the training stack as the source names it (HF Trainer + FSDP1 + PEFT, NeMo 24.12, ...)"""
    model: str
    """a shipped model preset"""
    method: MethodKind
    lora: LoraAt | None = None
    precision: Precision
    card: str
    """the catalog card it is projected on"""
    hardware: str | None = None
    """a variant of the catalog card it ran on (throughput_model.yaml hardware:)"""
    count: int = Field(gt=0)
    nodes: int = Field(gt=0)
    strategy: Literal["single", "ddp", "fsdp"]
    parallelism: str | None = None
    """as published (tensor / pipeline / context parallel sizes the spec does not express)"""
    replica_gpus: int = Field(default=1, gt=0)
    """GPUs that hold one model replica (tensor x pipeline x context parallel); 1 for data
    parallel and FSDP, as every run the spec describes"""
    sequence_length: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    global_batch_size: int = Field(gt=0)
    activation_checkpointing: str
    torch_compile: bool
    cpu_offload: bool = False
    tokens_per_s_per_gpu: float = Field(gt=0)
    published: str
    source: str
    note: str | None = None

    @property
    def tokens_per_replica_step(self) -> float:
        """Token positions one model replica processes per optimizer step: what the gradient
        synchronisation of a step is amortised over (the scaling rule's measure)."""
        return self.global_batch_size * self.sequence_length * self.replica_gpus / self.count


class ExcludedRun(_Read):
    id: str
    why: str
    source: str


class RunsFile(_Read):
    schema_version: int
    as_of: str
    runs: list[PublishedRun]
    excluded: list[ExcludedRun]


@cache
def published_runs() -> RunsFile:
    from tunepilot.resources import THROUGHPUT_RUNS_YAML

    return RunsFile.model_validate(
        yaml.safe_load(THROUGHPUT_RUNS_YAML.read_text(encoding="utf-8")))


def held_out(position: int) -> bool:
    """The split rule: the run at 0-based ``position`` in the file is held out of the fit."""
    return position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def fit_runs() -> list[PublishedRun]:
    return [r for i, r in enumerate(published_runs().runs) if not held_out(i)]


def run_spec(run: PublishedRun):
    """The RunSpec of a published run (for its FLOPs per token and the projection)."""
    from tunepilot.spec import spec_from_dict

    method: dict = {"kind": run.method}
    if run.lora is not None:
        method.update(lora_rank=run.lora.rank, lora_targets=run.lora.targets)
    ac = run.activation_checkpointing
    return spec_from_dict({
        "name": run.id, "model": {"preset": run.model, "implementation": run.implementation},
        "method": method, "precision": run.precision,
        "sequence_length": run.sequence_length, "micro_batch_size": run.micro_batch_size,
        "activation_checkpointing": "selective" if ac == "selective-layer" else ac,
        "torch_compile": run.torch_compile,
        "parallel": _parallel(run)})


def _parallel(run: PublishedRun) -> dict:
    if run.count == 1:
        return {"strategy": "single"}
    per_node = math.ceil(run.count / run.nodes)
    return {"strategy": run.strategy, "devices": per_node, "nodes": run.nodes,
            "cpu_offload": run.cpu_offload}
