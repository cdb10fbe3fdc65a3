"""export.json: a run directory copied off the machine and verified at the destination."""

from __future__ import annotations

from pydantic import Field

from tunepilot.results.base import Model, StageResult
from tunepilot.results.figure import Figure


class ExportedFile(Model):
    path: str
    """relative to the run directory (and to DEST)"""
    bytes: int
    sha256: str
    action: str
    """copied | skipped (already there, same SHA-256) | recopied (there, but wrong size or hash)"""


class ExportResult(StageResult):
    STAGE = "export"
    dest: str
    source: str
    verified: bool = True
    bytes: Figure
    seconds: Figure
    bytes_per_s: Figure
    bytes_copied: Figure
    bytes_skipped: Figure
    files_copied: int
    files_recopied: int
    files_skipped: int
    files: list[ExportedFile]
    checkpoints: int = 0
    """checkpoint directories copied (the run's kept checkpoints)"""
    checkpoint_bytes: Figure | None = None
    """their bytes: what the quote's export term and the host plan project (model/flops.py
    export_bytes); the rest of ``bytes`` is the stage results and logs"""
    notes: list[str] = Field(default_factory=list)

    def count(self, action: str) -> int:
        return sum(1 for f in self.files if f.action == action)
