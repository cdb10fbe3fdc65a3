"""Reading a Hugging Face ``config.json`` by key: whole numbers, flags and lists, each with the
default transformers' configuration class gives when the key is absent, and an error that names
the key (``text_config.hidden_size``) when a value cannot be used. No torch, no transformers."""

from __future__ import annotations

from typing import Any

from tunepilot.errors import SpecError

_HINT = "Use the model's own config.json from the Hugging Face hub, unedited."


class ConfigView:
    """One config dict (or its ``text_config``), read with the type's defaults.

    ``prefix`` is how the keys are named in errors ("" for the top level, "text_config." inside
    a multimodal config); ``defaults`` holds transformers' class defaults for keys a hub config
    may leave out (model/arch/layouts.py cites them per model_type)."""

    def __init__(self, cfg: dict[str, Any], prefix: str = "",
                 defaults: dict[str, Any] | None = None):
        self.cfg = cfg
        self.prefix = prefix
        self.defaults = defaults or {}

    def _raw(self, key: str) -> Any:
        """The config's value; the class default only where the key is absent (an explicit
        null stays None: DeepSeek-V2-Lite's q_lora_rank null means no query compression)."""
        return self.cfg[key] if key in self.cfg else self.defaults.get(key)

    def has(self, key: str) -> bool:
        return self._raw(key) is not None

    def name(self, key: str) -> str:
        return self.prefix + key

    def need(self, *keys: str) -> int:
        """The first of ``keys`` present, as a whole number >= 1; else an error naming them."""
        for key in keys:
            if self._raw(key) is not None:
                return self.count(key)
        alts = f" (or {', '.join(repr(self.name(k)) for k in keys[1:])})" if len(keys) > 1 else ""
        raise SpecError(field="model.config",
                        message=f"config has no {self.name(keys[0])!r}{alts}, which the memory "
                                "plan needs.", hint=_HINT)

    def count(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        """A dimension: a whole number >= ``minimum`` (and below 2^40), else a SpecError naming
        the key - never a ValueError or a plan of a negative model."""
        value = self._raw(key)
        if value is None:
            if default is None:
                return self.need(key)
            return default
        # the range first: NaN and infinity fail it before int() could raise on them
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not minimum <= value < 2**40 or value != int(value):
            self.refuse(key, f"is {repr(value)[:40]}, not a whole number of at least {minimum}")
        return int(value)

    def optional(self, key: str, *, minimum: int = 1) -> int | None:
        """A dimension that may be absent (or null): None then."""
        return None if self._raw(key) is None else self.count(key, minimum=minimum)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self._raw(key)
        if value is None:
            return default
        if not isinstance(value, bool | int) or value not in (0, 1):
            self.refuse(key, f"is {repr(value)[:40]}, not true or false")
        return bool(value)

    def indices(self, key: str) -> list[int] | None:
        """A list of layer indices (mlp_only_layers, moe_layers), or None when absent."""
        value = self._raw(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**20 for v in value):
            self.refuse(key, f"is {repr(value)[:40]}, not a list of layer indices")
        return list(value)

    def strings(self, key: str) -> list[str] | None:
        value = self._raw(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.refuse(key, f"is {repr(value)[:40]}, not a list of names")
        return list(value)

    def text(self, key: str, default: str = "") -> str:
        value = self._raw(key)
        return value.lower()[:64] if isinstance(value, str) and value else default

    def refuse(self, key: str, what: str, hint: str = _HINT) -> None:
        """Stop: this key's value is one the layout rules cannot count."""
        raise SpecError(field="model.config", message=f"config {self.name(key)!r} {what}.",
                        hint=hint)

    def nested(self, key: str, defaults: dict[str, Any] | None = None) -> ConfigView:
        """The sub-config at ``key`` (text_config, vision_config), which must be an object."""
        value = self.cfg.get(key)
        if not isinstance(value, dict):
            self.refuse(key, f"is {repr(value)[:40]}, not an object" if value is not None else
                        "is missing; a multimodal config nests its text model there")
        return ConfigView(value, f"{self.prefix}{key}.", defaults)
