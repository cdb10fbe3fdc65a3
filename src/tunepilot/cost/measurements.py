"""What a run directory measured, and on which device, for the quote (``--from RUN_DIR``).

The stage results are read as typed models (tunepilot.results); a stage file that is missing,
of an older schema or damaged leaves its terms projected and the quote says why. A stage result
made for another spec is refused: its measurements are of another run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tunepilot.catalog import Catalog
from tunepilot.errors import UserError
from tunepilot.results.figure import Figure
from tunepilot.results.quote import RunSource
from tunepilot.spec import RunSpec

if TYPE_CHECKING:  # read on use: a quote without --from reads no stage result (start-up)
    from tunepilot.results.base import Manifest, StageResult
    from tunepilot.results.export import ExportResult
    from tunepilot.results.pilot import PilotResult
    from tunepilot.results.restore import RestoreResult
    from tunepilot.results.scale import ScalingResult, StrategyResult
    from tunepilot.store import RunDir


def measured_value(fig: Figure | None) -> float | None:
    """A non-negative finite measured value, or None (not measured, projected, absent)."""
    if fig is None or not fig.is_measured:
        return None
    v = fig.value
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) and v >= 0 else None


@dataclass
class RunMeasurements:
    """A run directory's stage results, and the catalog card they were measured on."""

    path: Path
    card_id: str | None  # the catalog card the measurements were made on; None: not a card
    device: str
    pilot: PilotResult | None = None
    restore: RestoreResult | None = None
    scale: ScalingResult | None = None
    export: ExportResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return [f"{name}.json" for name in ("pilot", "restore", "scale", "export")
                if getattr(self, name) is not None]

    def strategy(self, name: str) -> StrategyResult | None:
        return self.scale.strategies.get(name) if self.scale else None

    def source(self) -> RunSource:
        return RunSource(path=str(self.path), card_id=self.card_id, device=self.device,
                         files=self.files, notes=self.notes)


def _read(run: RunDir, cls: type[StageResult], notes: list[str]) -> StageResult | None:
    if not run.has(cls.STAGE):
        notes.append(f"no {cls.STAGE}.json: its terms are projected")
        return None
    try:
        return run.read(cls)
    except UserError as exc:
        notes.append(f"{cls.STAGE}.json was not used ({exc.message}): its terms are projected")
        return None


def read_run_dir(path: Path | str, spec: RunSpec, catalog: Catalog) -> RunMeasurements:
    """Read the stage results in ``path``; UserError when they belong to another spec."""
    from tunepilot.results.export import ExportResult
    from tunepilot.results.pilot import PilotResult
    from tunepilot.results.restore import RestoreResult
    from tunepilot.results.scale import ScalingResult
    from tunepilot.store import RunDir

    path = Path(path)
    if not path.is_dir():
        raise UserError("from", f"run directory {str(path)!r} does not exist or is not a "
                        "directory.", "Pass the --out directory of `tunepilot pilot`.")
    run = RunDir(path)
    notes: list[str] = []
    results = {cls.STAGE: _read(run, cls, notes)
               for cls in (PilotResult, RestoreResult, ScalingResult, ExportResult)}
    manifest = run.manifest()
    _check_hashes(path, spec, manifest, results)
    if not manifest.spec_hash and not any(r and r.spec_hash for r in results.values()):
        notes.append("no spec_hash in the run directory: its measurements cannot be tied to "
                     "this spec and are not used")
        results = dict.fromkeys(results)
    pilot = results["pilot"]
    device = manifest.device or (pilot.device.model_dump() if pilot else {}) or {}
    name = device.get("name") or device.get("kind") or "unknown device"
    card_id = _card(device.get("card_id"), catalog, notes)
    if card_id is None and not device.get("card_id") and any(results.values()):
        notes.append(f"measured on {name}, not a catalog card: throughput and validation are "
                     "projected from FLOPs; its machine-bound timings are carried over "
                     "(projected) and its sizes used as measured")
    return RunMeasurements(path, card_id, str(name), results["pilot"], results["restore"],
                           results["scale"], results["export"], notes)


def _check_hashes(path: Path, spec: RunSpec, manifest: Manifest, results: dict) -> None:
    want = spec.spec_hash()
    hashes = {n: r.spec_hash for n, r in results.items() if r is not None and r.spec_hash}
    if manifest.spec_hash:
        hashes["manifest"] = manifest.spec_hash
    for name, got in hashes.items():
        if got != want:
            raise UserError("from", f"{path}/{name}.json was made for another spec (spec_hash "
                            f"{str(got)[:12]}..., this spec is {want[:12]}...).",
                            "Pass the run directory of this spec, or re-run the pilot for it.")


def _card(raw: str | None, catalog: Catalog, notes: list[str]) -> str | None:
    if not raw:
        return None
    try:
        return catalog.get(str(raw)).id
    except UserError:
        notes.append(f"measured on {raw!r}, which is not a catalog card")
        return None
