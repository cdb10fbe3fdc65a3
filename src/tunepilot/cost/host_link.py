"""The link between a card and its host (the catalog's host_link, resources/step_model.yaml
host_link: PCIe per direction x the measured achieved share): what an offloaded optimizer step
and vLLM's sleep mode move state over."""

from __future__ import annotations

from tunepilot.cost.step_model import step_model

DEFAULT_LINK = "pcie4"  # a card whose catalog entry names none: the slower, said


def host_link_of(card) -> str:
    return getattr(card, "host_link", None) or DEFAULT_LINK


def host_link_bytes_per_s(card) -> float:
    """Achieved bytes/s one way between ``card`` and its host."""
    return step_model().host_link.bytes_per_s(host_link_of(card))
