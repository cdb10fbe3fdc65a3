"""The FP8 recipe a user's live model trains with, read from its modules (for the callbacks'
derived spec): torchao's Float8Linear (its config's scaling granularity: tensorwise or
axiswise, i.e. rowwise) or Transformer Engine modules that ran under te.fp8_autocast (their
``fp8`` flag, set by TE on each forward). No import of either library: classes are matched by
name and module."""

from __future__ import annotations

from typing import Any


def fp8_in_use(model: Any) -> tuple[str | None, str | None]:
    """(the spec's FP8 precision, a note saying what was seen), or (None, None)."""
    float8, te, grains = 0, 0, set()
    for m in model.modules():
        cls = type(m)
        where = cls.__module__ or ""
        if cls.__name__ == "Float8Linear" and where.startswith("torchao"):
            float8 += 1
            cast = getattr(getattr(m, "config", None), "cast_config_input", None)
            grain = getattr(cast, "scaling_granularity", None)
            grains.add(str(getattr(grain, "value", grain)).lower())
        elif where.startswith("transformer_engine") and getattr(m, "fp8", False) is True:
            te += 1
    if float8:
        recipe = "fp8-rowwise" if "axiswise" in grains else "fp8-tensorwise"
        return recipe, (f"{float8} torchao Float8Linear modules ({', '.join(sorted(grains))} "
                        f"scaling): precision {recipe}")
    if te:
        return "fp8-te", (f"{te} Transformer Engine modules ran in FP8 (te.fp8_autocast): "
                          "precision fp8-te")
    return None, None
