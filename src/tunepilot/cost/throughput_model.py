"""resources/throughput_model.yaml as a typed model (read once), and the card family a catalog
card belongs to: the data the time model's fit (cost/calibration.py) and its use (cost/mfu.py)
both read."""

from __future__ import annotations

from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Kind = Literal["published", "derived", "assumed", "fitted"]


class _Read(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Factor(_Read):
    factor: float = Field(gt=0)
    kind: Kind | None = None
    source: str | None = None
    runs: list[str] = Field(default_factory=list)
    """the published runs (resources/throughput_runs.yaml ids) the factor is read from: never
    one of a held-out publication (tests/test_time_model.py)"""


class KernelRow(_Read):
    """A kernel's or adapter variant's throughput multiplier (throughput_model.yaml kernels:)."""

    factor: float = Field(gt=0)
    kind: Kind
    source: str
    as_of: str
    applies_to: list[str] = Field(default_factory=list)


class CardRow(_Read):
    """A card family: the group its cells are fitted in, its speed within the group."""

    group: str
    factor: float = Field(default=1.0, gt=0)
    kind: Kind | None = None
    source: str | None = None
    runs: list[str] = Field(default_factory=list)
    """the published runs the factor is read from (as Factor.runs)"""


class Generation(_Read):
    """An implementation's own speed ratio between two card groups, from the same scripts
    published on both (throughput_runs.yaml pairs:): one-card MFU on ``to`` / on ``frm``."""

    implementation: str
    to: str
    frm: str
    factor: float = Field(gt=0)
    kind: Kind
    source: str
    runs: list[str]
    """the generation pairs (throughput_runs.yaml pairs: ids) the factor is the median of"""


class Width(_Read):
    """A rank's width (hidden / tensor parallel) and MFU: x (1 + c / reference) / (1 + c /
    width), c fitted on the runs listed (throughput_model.yaml width:)."""

    constant: float = Field(ge=0)
    reference: float = Field(gt=0)
    kind: Kind
    source: str
    runs: list[str]


class ThroughputModel(_Read):
    """resources/throughput_model.yaml, validated once when first read."""

    schema_version: int
    as_of: str
    cards: dict[str, CardRow]
    hardware: dict[str, Factor]
    default_implementation: str
    mfu_ceiling: float = Field(gt=0, le=1)
    checkpointing: dict[str, Factor]
    torch_compile: Factor
    kernels: dict[str, KernelRow] = Field(default_factory=dict)
    generations: list[Generation] = Field(default_factory=list)
    width: Width


@cache
def throughput_model() -> ThroughputModel:
    from tunepilot.resources import THROUGHPUT_MODEL_YAML, read_yaml

    return ThroughputModel.model_validate(read_yaml(THROUGHPUT_MODEL_YAML))


def card_family(card_id: str) -> str:
    """The family of a catalog card: the longest family (throughput_model.yaml cards:) its id
    starts with (a100-sxm-80gb -> a100), else the id's first word."""
    known = [f for f in throughput_model().cards if card_id.startswith(f)]
    return max(known, key=len) if known else card_id.split("-")[0]
