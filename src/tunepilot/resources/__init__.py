"""Data files shipped with tunepilot: the catalog, the cost model and runtime constants, the
model presets, the demo spec and the tiny text set. Code reads them through these paths only."""

from pathlib import Path

RESOURCES = Path(__file__).resolve().parent
CATALOG_YAML = RESOURCES / "catalog.yaml"
COST_MODEL_YAML = RESOURCES / "cost_model.yaml"
RUNTIME_YAML = RESOURCES / "runtime.yaml"
DEMO_SPEC_YAML = RESOURCES / "demo.yaml"
PRESETS_DIR = RESOURCES / "presets"
TINY_DIR = RESOURCES / "tiny"
