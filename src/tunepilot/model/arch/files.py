"""Where a model's config comes from: a bundled preset (``resources/presets/<name>.json``, the
hub's ``config.json`` plus our ``_tunepilot`` block), or the user's own ``config.json``.
Presets are found by name or hub id, with case, ``-``, ``_``, ``.``, ``/`` and spaces ignored."""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tunepilot.errors import SpecError, did_you_mean
from tunepilot.resources import PRESETS_DIR

META_KEY = "_tunepilot"  # our block inside a preset; never part of the HF config or its hash


def _norm_name(name: str) -> str:
    """'Llama-3.1_8B' -> 'llama318b': case, '-', '_', '.', '/' and spaces do not matter."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def list_presets() -> list[str]:
    """Names of the bundled model presets, e.g. ['gemma-2-27b', ..., 'tiny', 'tinyllama-1.1b']."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


@lru_cache(maxsize=1)
def _preset_index() -> dict[str, str]:
    """Normalised preset name, hub id and hub aliases (the -Instruct variants of the same layout,
    ``_tunepilot.hf_aliases``) -> preset file stem. A hub id also resolves without its
    organisation ('Qwen3-8B' for 'Qwen/Qwen3-8B')."""
    index: dict[str, str] = {}
    for name in list_presets():
        index[_norm_name(name)] = name
    for name in list_presets():
        for hf_id in hub_ids(_read_json(PRESETS_DIR / f"{name}.json", "model.preset")):
            index.setdefault(_norm_name(hf_id), name)
            index.setdefault(_norm_name(hf_id.rsplit("/", 1)[-1]), name)
    return index


def hub_ids(preset: dict[str, Any]) -> list[str]:
    """The hub ids a preset stands for: its hf_id, then its aliases."""
    meta = preset.get(META_KEY) or {}
    ids = [meta.get("hf_id")] + list(meta.get("hf_aliases") or [])
    return [i for i in ids if isinstance(i, str) and i]


def load_preset(name: str) -> dict[str, Any]:
    """The preset's config dict (a fresh copy, including ``_tunepilot``); also accepts its hub id."""
    stem = _preset_index().get(_norm_name(name))
    if stem is None:
        raise SpecError(
            field="model.preset",
            message=f"unknown model preset {name!r}.",
            hint=did_you_mean(name.lower(), list_presets())
            + " Or point model.config at a config.json to plan any other model.",
        )
    return _read_json(PRESETS_DIR / f"{stem}.json", "model.preset")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json``, given the file or the model directory that holds it."""
    path = Path(path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SpecError(
            field="model.config",
            message=f"no config.json at {str(file)!r}.",
            hint="Pass a model directory containing config.json, or the config.json file itself.",
        )
    return _read_json(file, "model.config")


_MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB (a tokenizer's vocab is elsewhere)


def _read_json(file: Path, field: str) -> dict[str, Any]:
    from tunepilot.limits import Refused, read_capped

    try:
        data = json.loads(read_capped(file, _MAX_CONFIG_BYTES).decode("utf-8"))
    except Refused as exc:
        raise SpecError(field=field, message=f"{str(file)!r} {exc}.",
                        hint="A Hugging Face config.json is a small JSON file.") from None
    except json.JSONDecodeError as exc:
        raise SpecError(
            field=field,
            message=f"{str(file)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).",
            hint="A Hugging Face config.json is one JSON object.",
        ) from exc
    except OSError as exc:
        raise SpecError(field=field, message=f"cannot read {str(file)!r}: {exc.strerror}.") from exc
    except UnicodeDecodeError:
        raise SpecError(field=field, message=f"{str(file)!r} is not UTF-8 text.",
                        hint="A Hugging Face config.json is UTF-8 JSON.") from None
    except RecursionError:
        raise SpecError(field=field, message=f"{str(file)!r} is nested too deeply.") from None
    if not isinstance(data, dict):
        raise SpecError(
            field=field, message=f"{str(file)!r} holds a JSON {type(data).__name__}, not an object."
        )
    return data


def config_hash(cfg: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the config without our ``_tunepilot`` block."""
    body = {k: v for k, v in cfg.items() if k != META_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def resolve_model_config(spec, base_dir: Path | None = None) -> dict[str, Any]:
    """The model's Hugging Face config dict, from the preset or the local config path (relative
    paths are tried as given, then against ``base_dir``: the spec file's directory)."""
    if spec.model.preset is not None:
        return with_experts_layout(load_preset(spec.model.preset), spec)
    path = Path(spec.model.config or "")
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return with_experts_layout(load_config_file(path), spec)


def with_experts_layout(cfg: dict[str, Any], spec) -> dict[str, Any]:
    """The config with the spec's moe.experts_layout in tunepilot's block, where the counting
    rules read it (a linearized checkpoint's experts are nn.Linear modules); unchanged for the
    default fused layout."""
    layout = spec.moe.experts_layout
    if layout == "fused":
        return cfg
    return {**cfg, META_KEY: {**(cfg.get(META_KEY) or {}), "experts_layout": layout}}
