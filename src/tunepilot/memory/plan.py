"""`plan`: the memory one device needs for a spec, and how it fits each card of the catalog."""

from __future__ import annotations

from pathlib import Path

from tunepilot.arch import Arch, load_config_file, load_preset
from tunepilot.catalog import Catalog, load_catalog
from tunepilot.memory.analytic import MemoryPlan, analytic_plan
from tunepilot.memory.fit import DEFAULT_HEADROOM, fit_card
from tunepilot.spec import RunSpec


def resolve_model_config(spec: RunSpec, base_dir: Path | None = None) -> dict:
    """The model's Hugging Face config dict, from the preset or the local config path."""
    if spec.model.preset is not None:
        return load_preset(spec.model.preset)
    path = Path(spec.model.config or "")
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return load_config_file(path)


def resolve_arch(spec: RunSpec, base_dir: Path | None = None) -> Arch:
    return Arch.from_config(resolve_model_config(spec, base_dir))


def make_plan(spec: RunSpec, *, catalog: Catalog | None = None, card_ids: list[str] | None = None,
              headroom: float = DEFAULT_HEADROOM, arch: Arch | None = None,
              base_dir: Path | None = None) -> MemoryPlan:
    """The analytic plan of `spec`, fitted against `card_ids` (default: every catalog card)."""
    catalog = catalog or load_catalog()
    arch = arch or resolve_arch(spec, base_dir)
    cards = [catalog.get(c) for c in card_ids] if card_ids else list(catalog.cards)
    stack = cards[0].software_stack if cards else "cuda"
    plan = analytic_plan(spec, arch, stack)
    plan.cards = [fit_card(spec, arch, card, analytic_plan, headroom, plan) for card in cards]
    return plan
