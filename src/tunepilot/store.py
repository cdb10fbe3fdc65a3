"""Run directories: one JSON file per stage plus a manifest, written atomically.

    RUN_DIR/
      manifest.json   spec, spec hash, provenance, which stages completed
      plan.json  pilot.json  restore.json  scale.json  quote.json  export.json
      checkpoints/    training state written by the pilot / restore stages
      logs/           one log per stage (and per rank for scale)
      report.html  report.md
A stage result is a JSON object with at least {"stage", "spec_hash", "created_utc"}.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunepilot.errors import UserError

MANIFEST = "manifest.json"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are ordinary files
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(None, f"{str(path)!r} does not exist.") from None
    except json.JSONDecodeError as exc:
        raise UserError(None, f"{str(path)!r} is not valid JSON ({exc.msg}).",
                        "It may be from an interrupted run; re-run that stage.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(None, f"cannot read {str(path)!r}: {exc}.",
                        "Check the path and its permissions.") from None


class RunDir:
    """A run directory for one spec (its hash is recorded and checked)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def file(self, stage: str) -> Path:
        return self.path / f"{stage}.json"

    def has(self, stage: str) -> bool:
        return self.file(stage).exists()

    def read(self, stage: str) -> dict:
        return read_json(self.file(stage))

    def write_stage(self, stage: str, result: dict, spec_hash: str) -> Path:
        result = dict(result, stage=stage, spec_hash=spec_hash)
        result.setdefault("created_utc", utc_now())
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.file(stage), result)
        self._mark(stage, spec_hash)
        return self.file(stage)

    def manifest(self) -> dict:
        p = self.path / MANIFEST
        return read_json(p) if p.exists() else {}

    def update_manifest(self, **fields: Any) -> dict:
        m = self.manifest()
        m.update(fields)
        m["updated_utc"] = utc_now()
        write_json(self.path / MANIFEST, m)
        return m

    def check_spec(self, spec_hash: str) -> None:
        """Refuse a directory that belongs to another spec (exit 2, nothing written)."""
        got = self.manifest().get("spec_hash")
        if got is not None and got != spec_hash:
            raise UserError("--from" if self.path.exists() else None,
                            f"run directory {str(self.path)!r} belongs to another spec "
                            f"(spec hash {got[:12]}, this spec {spec_hash[:12]}).",
                            "Use the run directory made for this spec, or a new --out.")

    def stage_done(self, stage: str, spec_hash: str) -> bool:
        if not self.has(stage):
            return False
        try:
            return self.read(stage).get("spec_hash") == spec_hash
        except UserError:
            return False

    def logs_dir(self) -> Path:
        d = self.path / "logs"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _mark(self, stage: str, spec_hash: str) -> None:
        m = self.manifest()
        done = dict(m.get("stages", {}))
        done[stage] = utc_now()
        self.update_manifest(spec_hash=spec_hash, stages=done)
