"""What every stage result carries, and how one is read back.

A stage result is a pydantic model with ``stage``, ``spec_hash``, ``created_utc`` (aware UTC)
and ``schema_version``. ``from_dict`` refuses a document of another schema version, or one that
does not validate, with a StaleResult ("written by an older tunepilot; re-run the stage") - never
a KeyError later.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunepilot.errors import UserError
from tunepilot.units import utc_now

SCHEMA_VERSION = 2  # 1: tunepilot 0.1 (figures as {"measured": bool}); 2: Figure.basis
T = TypeVar("T", bound="StageResult")


class StaleResult(UserError):
    """A result file this version cannot read (older schema, or damaged)."""


class Model(BaseModel):
    """A block of a result: unknown keys are an error, so a misspelt field never passes."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # built on first use: start-up


class StageResult(Model):
    """The fields every stage's JSON file has."""

    STAGE: ClassVar[str] = ""
    schema_version: int = SCHEMA_VERSION
    stage: str = ""
    spec_hash: str | None = None
    created_utc: datetime = Field(default_factory=utc_now)

    def model_post_init(self, _context: Any) -> None:
        if not self.stage:
            object.__setattr__(self, "stage", self.STAGE)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls: type[T], data: Any, source: str = "result") -> T:
        """Validate a document read from ``source``; StaleResult when it is not this schema."""
        if not isinstance(data, dict):
            raise StaleResult(None, f"{source} is not a JSON object.", _RERUN.format(cls.STAGE))
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StaleResult(None, f"{source} was written by an older tunepilot (schema version "
                              f"{version!r}, this one reads {SCHEMA_VERSION}).",
                              _RERUN.format(cls.STAGE))
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"]) or "(top level)"
            raise StaleResult(None, f"{source} does not match this tunepilot's {cls.STAGE} "
                              f"schema at {where}: {err['msg']}.",
                              _RERUN.format(cls.STAGE)) from None


_RERUN = "Re-run the {} stage (or pass --force to `tunepilot run`)."


class Manifest(BaseModel):
    """RUN_DIR/manifest.json: the spec, its hash, provenance, which stages completed (updated
    by every stage; other keys a stage adds are kept)."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA_VERSION
    spec_hash: str | None = None
    spec: dict | None = None
    label: str | None = None
    stages: dict[str, str] = Field(default_factory=dict)
    device: dict | None = None
    provenance: dict | None = None
    tunepilot_version: str | None = None
    updated_utc: str | None = None

    def card_id(self) -> str | None:
        return (self.device or {}).get("card_id")
