"""The typed result of every stage: the run directory's schema.

    figure    Figure(value, unit, basis: measured | projected | not measured, how)
    base      StageResult: stage, spec_hash, created_utc, schema_version; reading checks them
    plan      MemoryPlan (plan.json)          pilot    PilotResult (pilot.json)
    restore   RestoreResult (restore.json)    scale    ScalingResult (scale.json)
    quote     Quote, Comparison, TermCost     export   ExportResult (export.json)
    decision  Decision (decision.json)        data     DataProfile (data.json)
Each is a pydantic model: ``to_dict()`` is what the file holds, ``from_dict()`` reads it back
equal. No torch here.
"""

from tunepilot.results.base import SCHEMA_VERSION, Manifest, StageResult, StaleResult
from tunepilot.results.figure import Figure, value_of

__all__ = ["SCHEMA_VERSION", "Figure", "Manifest", "StageResult", "StaleResult", "value_of"]
