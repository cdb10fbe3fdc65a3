"""Run directories: one typed JSON file per stage plus a manifest, written atomically.

    RUN_DIR/
      manifest.json   spec, spec hash, provenance, which stages completed
      plan.json  pilot.json  restore.json  scale.json  quote.json  compare.json  export.json
      data.json  decision.json
      checkpoints/    training state written by the pilot / restore stages
      logs/           one log per stage (and per rank for scale)
      report.html  report.md
Each stage file is a results model (tunepilot.results): ``write`` stores one, ``read`` returns
the model again, or a StaleResult naming the file when it is of another schema.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from tunepilot.errors import UserError
from tunepilot.results.base import Manifest, StageResult
from tunepilot.units import iso_utc, utc_now

MANIFEST = "manifest.json"
T = TypeVar("T", bound=StageResult)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except (NotADirectoryError, FileExistsError):
        raise UserError("--out", f"{str(path.parent)!r} is a file, not a directory.",
                        "Give a directory path (it is created when missing).") from None
    except PermissionError:
        raise UserError("--out", f"{str(path.parent)!r} is not writable.",
                        "Give a directory you can write to.") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are ordinary files
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UserError("--out", f"cannot write {str(path)!r}: {exc.strerror or exc}.",
                        "Free disk space or choose another --out; nothing already written "
                        "was changed.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


MAX_RESULT_BYTES = 256 << 20  # a stage result with every per-step figure is a few MiB


def read_json(path: Path) -> Any:
    """A stage result or manifest of a run directory: a regular file of at most
    MAX_RESULT_BYTES and valid JSON (a FIFO or /dev/zero in its place is refused at once)."""
    from tunepilot.limits import Refused, read_capped

    try:
        data = read_capped(path, MAX_RESULT_BYTES)
        value = json.loads(data)
    except FileNotFoundError:
        raise UserError(None, f"{str(path)!r} does not exist.") from None
    except Refused as exc:
        raise UserError(None, f"{str(path)!r} {exc}.", "Point at a run directory a stage "
                        "wrote.") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise UserError(None, f"{str(path)!r} is not valid JSON ({msg}).",
                        "It may be from an interrupted run; re-run that stage.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(None, f"cannot read {str(path)!r}: {exc}.",
                        "Check the path and its permissions.") from None
    return value


def default_run_dir(spec) -> Path:
    """runs/<spec label>-<spec hash[:8]> under the working directory."""
    return Path("runs") / f"{spec.label}-{spec.spec_hash()[:8]}"


class RunDir:
    """A run directory for one spec (its hash is recorded and checked)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise UserError("--out", f"{str(self.path)!r} is a file, not a run directory.",
                            "Give a directory path (it is created when missing).")

    def file(self, stage: str) -> Path:
        return self.path / f"{stage}.json"

    def has(self, stage: str) -> bool:
        return self.file(stage).exists()

    def read(self, cls: type[T]) -> T:
        """The stage result of type ``cls`` (StaleResult when it is of another schema)."""
        p = self.file(cls.STAGE)
        return cls.from_dict(read_json(p), source=str(p))

    def read_if(self, cls: type[T]) -> T | None:
        """The result, or None when the file is missing or unreadable (a partial run)."""
        if not self.has(cls.STAGE):
            return None
        try:
            return self.read(cls)
        except UserError:
            return None

    def write(self, result: StageResult, spec_hash: str | None = None) -> Path:
        """Store ``result`` as STAGE.json (atomically) and mark the stage done."""
        h = spec_hash or result.spec_hash
        if h is not None and result.spec_hash != h:
            result = result.model_copy(update={"spec_hash": h})
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.file(result.stage), result.to_dict())
        self._mark(result.stage, result.spec_hash)
        return self.file(result.stage)

    def manifest(self) -> Manifest:
        """The run's manifest.json (an empty one when there is none); a manifest of the wrong
        shape is a UserError naming the file and the field, never a pydantic traceback."""
        from pydantic import ValidationError

        p = self.path / MANIFEST
        if not p.exists():
            return Manifest()
        data = read_json(p)
        if not isinstance(data, dict):
            raise UserError(None, f"{str(p)!r} is not a run manifest (a JSON object).",
                            "Point at a run directory a stage wrote, or remove the file.")
        try:
            return Manifest.model_validate(data)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"])[:80]
            raise UserError(None, f"{str(p)!r} is not a run manifest tunepilot can read: "
                            f"{where}: {str(err['msg'])[:160]}.", "It was edited or written "
                            "by another tool; re-run a stage into a fresh directory.") from None

    def update_manifest(self, **fields: Any) -> Manifest:
        m = self.manifest().model_dump(mode="json")
        m.update(fields)
        m["updated_utc"] = iso_utc(utc_now())
        write_json(self.path / MANIFEST, m)
        return Manifest.model_validate(m)

    def check_spec(self, spec_hash: str) -> None:
        """Refuse a directory that belongs to another spec (exit 2, nothing written)."""
        got = self.manifest().spec_hash
        if got is not None and got != spec_hash:
            raise UserError("--from" if self.path.exists() else None,
                            f"run directory {str(self.path)!r} belongs to another spec "
                            f"(spec hash {got[:12]}, this spec {spec_hash[:12]}).",
                            "Use the run directory made for this spec, or a new --out.")

    def stage_done(self, stage: str, spec_hash: str) -> bool:
        """The stage's file exists, is of this schema and belongs to ``spec_hash``."""
        from tunepilot.results.base import SCHEMA_VERSION

        if not self.has(stage):
            return False
        try:
            d = read_json(self.file(stage))
        except UserError:
            return False
        return isinstance(d, dict) and d.get("spec_hash") == spec_hash and \
            d.get("schema_version") == SCHEMA_VERSION

    def logs_dir(self) -> Path:
        d = self.path / "logs"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _mark(self, stage: str, spec_hash: str | None) -> None:
        done = dict(self.manifest().stages)
        done[stage] = iso_utc(utc_now())
        fields: dict[str, Any] = {"stages": done}
        if spec_hash:
            fields["spec_hash"] = spec_hash
        self.update_manifest(**fields)
