"""The published runs the time model is calibrated on (resources/throughput_runs.yaml): each a
real training run's throughput as its source published it, in the spec's terms, validated once.

Held out by publication: every row of a held-out publication (``held_out_publication``: the
sha256 of its name modulo HELD_OUT_MODULUS is 0, a rule fixed before any fit) is kept out of the
fit and out of every factor, and only projected, so the benchmark reports the error on runs from
documents the model has never seen. The same rule holds out the RL step rows
(benchmarks/data/rl_steps.yaml) by their publication.
"""

from __future__ import annotations

import hashlib
import math
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tunepilot.spec import Implementation, Precision
from tunepilot.spec.method import MethodKind

HELD_OUT_MODULUS = 3


class _Read(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraAt(_Read):
    rank: int = Field(gt=0)
    targets: list[str] | Literal["all-linear"]


class PublishedRun(_Read):
    """One published training run: what ran (in the spec's terms) and how fast, per GPU."""

    id: str
    publication: str
    """the document the row was read from (one README, one performance page, one MLPerf
    submitter's round): the unit the held-out rule keeps out whole"""
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
    tensor_parallel: int = Field(default=1, gt=0)
    context_parallel: int = Field(default=1, gt=0)
    pipeline_parallel: int = Field(default=1, gt=0)
    pipeline_stages_per_rank: int = Field(default=1, gt=0)
    """the interleaved schedule's virtual stages per rank (Megatron's vp; torchtitan's looped
    schedules: 2 unless split points say otherwise)"""
    pipeline_microbatches: int | None = Field(default=None, gt=0)
    """micro-batches per pipeline per step (Megatron: global batch / (data parallel x micro
    batch); torchtitan: its default, the pipeline degree)"""
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

    @model_validator(mode="after")
    def _replica_is_its_parallelism(self) -> PublishedRun:
        if self.tensor_parallel * self.pipeline_parallel * self.context_parallel != \
                self.replica_gpus:
            raise ValueError(f"{self.id}: replica_gpus {self.replica_gpus} is not tensor x "
                             "pipeline x context parallel")
        if (self.pipeline_parallel > 1) != (self.pipeline_microbatches is not None):
            raise ValueError(f"{self.id}: pipeline_microbatches goes with pipeline_parallel > 1")
        return self

    @property
    def pipeline_bubble(self) -> float:
        """The pipeline's idle share over its ideal time, (p - 1) / (v x m): p stages, v
        interleaved stages per rank, m micro-batches (Narayanan et al., SC'21, 2.2)."""
        if self.pipeline_parallel <= 1:
            return 0.0
        return (self.pipeline_parallel - 1) / (self.pipeline_stages_per_rank
                                               * self.pipeline_microbatches)

    @property
    def tokens_per_replica_step(self) -> float:
        """Token positions one model replica processes per optimizer step: what the gradient
        synchronisation of a step is amortised over (the scaling rule's measure)."""
        return self.global_batch_size * self.sequence_length * self.replica_gpus / self.count


class ExcludedRun(_Read):
    id: str
    publication: str
    why: str
    source: str


class OnCard(_Read):
    """One side of a generation pair: the card it ran on and its throughput."""

    card: str
    """the catalog card it is projected on"""
    count: int = Field(gt=0)
    tokens_per_s_per_gpu: float = Field(gt=0)


class GenerationPair(_Read):
    """The same scripts and configuration published on two card generations: the stack's own
    speed ratio between them (throughput_model.yaml generations:), not a run to fit a cell on."""

    id: str
    publication: str
    stack: str
    model: str
    config: str
    """what both sides ran, as published (strategy, compile, checkpointing, batch, length)"""
    cards: list[OnCard] = Field(min_length=2, max_length=2)
    published: str
    source: str


class RunsFile(_Read):
    schema_version: int
    as_of: str
    runs: list[PublishedRun]
    excluded: list[ExcludedRun]
    pairs: list[GenerationPair] = Field(default_factory=list)


@cache
def published_runs() -> RunsFile:
    from tunepilot.resources import THROUGHPUT_RUNS_YAML, read_yaml

    return RunsFile.model_validate(read_yaml(THROUGHPUT_RUNS_YAML))


HELD_OUT_RESIDUE = 0
"""which residue of the rule is held out (throughput_accuracy.py --splits tries the others)"""


def held_out_publication(publication: str) -> bool:
    """The split rule: a publication is held out when the sha256 of its name, modulo
    HELD_OUT_MODULUS, is HELD_OUT_RESIDUE - every row read from it, whatever its position."""
    digest = int(hashlib.sha256(publication.encode("utf-8")).hexdigest(), 16)
    return digest % HELD_OUT_MODULUS == HELD_OUT_RESIDUE


def held_out(run: PublishedRun | ExcludedRun | GenerationPair) -> bool:
    """Whether the run's publication is held out of the fit and of every factor."""
    return held_out_publication(run.publication)


def held_out_ids() -> set[str]:
    """Ids of every throughput row (projected, not projected or a generation pair) of a
    held-out publication."""
    f = published_runs()
    return {r.id for r in (*f.runs, *f.excluded, *f.pairs) if held_out(r)}


def fit_runs() -> list[PublishedRun]:
    return [r for r in published_runs().runs if not held_out(r)]


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
