"""The one base of every message that crosses a process boundary (the trace's job and result,
the restore proof's job and reports, the scaling test's job and rank records): a pydantic model
with unknown keys refused and one version, written and read by proc/child.py's helpers.

A message another version of tunepilot wrote is refused when it is read (the reader names the
file, the child's parent states the reason) - never half-understood.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

MESSAGE_VERSION = 1
"""raise it when any message's fields change meaning or shape"""


class Message(BaseModel):
    """A typed message: validated once on the way in, with the version that wrote it."""

    model_config = ConfigDict(extra="forbid")
    version: int = MESSAGE_VERSION

    @field_validator("version")
    @classmethod
    def _this_version(cls, v: int) -> int:
        if v != MESSAGE_VERSION:
            raise ValueError(f"written by message version {v}, this tunepilot reads "
                             f"{MESSAGE_VERSION}")
        return v
