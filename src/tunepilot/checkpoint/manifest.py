"""A checkpoint's manifest: what it holds, and the SHA-256 and size of every file.

    CKPT/manifest.json  {"format": "tunepilot-checkpoint", "format_version": 1, "step", ...,
                         "world_size": N, "components": {name: [files]},
                         "files": {rel: {"sha256", "bytes", "component", "rank"}},
                         "manifest_sha256": digest of everything else}
A manifest is trusted only for paths inside the checkpoint directory (relative, no '..', no
absolute paths), and one of the wrong shape is a checkpoint problem naming the field - never a
KeyError. It is read as a regular file of at most MAX_MANIFEST_BYTES (a FIFO or /dev/zero in
its place is a problem, not a hang), and every count in it is bounded (world_size <= MAX_CARDS),
so no loop over its ranks can run away. No torch here (export and verify read manifests
without it).

What the digests are for: ``manifest_sha256`` and the files' SHA-256 detect accidental damage -
a torn or partial write, a truncated copy, bit rot, a file edited or added by mistake. They are
not a signature: there is no key, so whoever can edit the files can recompute every digest and
"re-seal" the checkpoint (issue 40, N25). Signing with a key kept beside the checkpoint would
not change that (an attacker who can write the checkpoint reads the key on the same machine);
tamper evidence against a deliberate forger belongs to the user's own signing of the exported
run (export.json lists every file's SHA-256: sign that file with gpg, minisign or cosign).
`verify` says so beside "intact".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tunepilot.limits import MAX_CARDS

FORMAT = "tunepilot-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # ~300,000 file entries: far past any checkpoint's file count
INTEGRITY_NOTE = ("the SHA-256 digests detect accidental damage (torn writes, truncated copies, "
                  "bit rot, edits by mistake); they are not a signature - whoever can edit the "
                  "files can recompute them - so sign the exported run's export.json yourself "
                  "if you need tamper evidence")


def safe_relative(rel: str) -> str:
    """A path inside the checkpoint directory, as stored; ValueError for anything else."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise ValueError(f"{rel!r} is not a relative path inside the checkpoint")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith("~"):
        raise ValueError(f"{rel!r} points outside the checkpoint directory")
    return rel


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)
    component: str
    rank: int | None = Field(default=None, ge=0)


class CheckpointManifest(BaseModel):
    """The manifest, validated: every path safe, every file entry well-formed."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["tunepilot-checkpoint"]
    format_version: Literal[1]
    tensor_encoding: str
    step: int = Field(ge=0)
    useful_tokens_seen: int = Field(ge=0)
    spec_hash: str
    world_size: int = Field(default=1, ge=1, le=MAX_CARDS)
    model: dict[str, Any]
    created_unix_s: float
    torch_version: str
    components: dict[str, list[str]]
    files: dict[str, FileEntry]
    extra: dict[str, Any] = Field(default_factory=dict)
    manifest_sha256: str

    @field_validator("files")
    @classmethod
    def _safe_files(cls, v: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in v:
            safe_relative(rel)
        return v

    @field_validator("components")
    @classmethod
    def _safe_components(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for files in v.values():
            for rel in files:
                safe_relative(rel)
        return v


def digest(body: dict) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest."""
    rest = {k: v for k, v in body.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def read(path: Path) -> tuple[CheckpointManifest | None, tuple[str, str] | None]:
    """(the manifest, None) or (None, (file, problem)) for a missing, unreadable, altered or
    wrong-shaped manifest."""
    from tunepilot.limits import Refused, load_json_capped

    p = Path(path) / MANIFEST
    try:
        raw = load_json_capped(p, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None, (MANIFEST, "is missing (an incomplete checkpoint, or not a tunepilot one)")
    except Refused as exc:
        return None, (MANIFEST, str(exc))
    except OSError as exc:
        return None, (MANIFEST, f"cannot be read ({exc.strerror or exc})")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None, (MANIFEST, f"is not a {FORMAT} manifest")
    if raw.get("format_version") != FORMAT_VERSION:
        return None, (MANIFEST, f"format version {str(raw.get('format_version'))[:20]} (this "
                                f"tunepilot reads {FORMAT_VERSION})")
    if raw.get("manifest_sha256") != digest(raw):
        return None, (MANIFEST, "does not match its own digest (altered on disk)")
    try:
        return CheckpointManifest.model_validate(raw), None
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"])[:120]
        return None, (MANIFEST, f"is not well-formed at {where}: "
                                f"{str(err['msg']).removeprefix('Value error, ')[:200]}")
