"""Start-up: the plain values of a command line without a pydantic TypeAdapter each, so that
`plan`, `quote` and `book` start fast (issue 40 item 14; benchmarks/plan_speed.py measures them).

typer (0.2x) coerces every parameter of the command invoked - given or not - through a
TypeAdapter it builds on first use: importing its adapter module and building 7-12 adapters
costs tens of ms of CPU before the command starts. Most values need none of it: an absent option
(None), a string for a ``str``, digits for an ``int`` or ``float`` inside its range, a path, a
list of strings, a default already of its type. Those are coerced here to exactly what typer's
adapter returns; every other value (a malformed number, one out of range, a choice, a custom
parser, a file) goes to typer's own coercion, so its result and its error message are typer's.
Where typer has no such layer (older versions), nothing is changed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SLOW = object()  # this value needs typer's own coercion
_PATH = object()  # a string for a plain Path: typer's own path checks on Path(value)
_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?[0-9]{1,15}(?:\.[0-9]{1,15})?")


def prepare() -> None:
    """Coerce the plain values of every typer parameter here, the rest through typer (a no-op
    on a typer without a runtime-coercion layer, or where it is done already); and let pydantic
    skip its plugin discovery where plugins are off."""
    _no_plugin_discovery()
    try:
        from typer._param_types import coerce_cli_path
        from typer.core import _TyperParameter
    except ImportError:
        return
    original = getattr(_TyperParameter, "get_runtime_param", None)
    if original is None or getattr(original, "quick", False):
        return

    def get_runtime_param(self: Any) -> Any:
        if getattr(self, "_runtime_param", None) is None:
            self._runtime_param = _Quick(original, coerce_cli_path)
        return self._runtime_param

    get_runtime_param.quick = True  # type: ignore[attr-defined]
    _TyperParameter.get_runtime_param = get_runtime_param


_PLUGIN_LOADER = "pydantic.plugin._loader"


def _no_plugin_discovery() -> None:
    """pydantic imports its plugin loader (and with it importlib.metadata, ~15 ms) the first
    time it builds a validator, to look for plugins. With PYDANTIC_DISABLE_PLUGINS=__all__ (the
    command line sets it) the loader only ever returns (): a module that returns () stands in
    for it. Any other name asked of it loads the real loader (a pydantic that asks more)."""
    import os
    import sys
    import types

    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") != "__all__" or _PLUGIN_LOADER in sys.modules:
        return
    stand_in = types.ModuleType(_PLUGIN_LOADER)
    stand_in.get_plugins = lambda: ()  # type: ignore[attr-defined]

    def real(name: str) -> Any:
        import importlib

        if name.startswith("__"):  # the import system asking (__path__ ...): not the loader's
            raise AttributeError(name)
        del sys.modules[_PLUGIN_LOADER]
        return getattr(importlib.import_module(_PLUGIN_LOADER), name)

    stand_in.__getattr__ = real  # type: ignore[attr-defined]
    sys.modules[_PLUGIN_LOADER] = stand_in


class _Quick:
    """A parameter's coercion: plain values here, the first other value hands the parameter to
    typer's own runtime coercion for good."""

    def __init__(self, original: Any, coerce_path: Any):
        self.original = original
        self.coerce_path = coerce_path

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        quick = _plain(value, param)
        if quick is _SLOW:
            param._runtime_param = None
            return self.original(param).coerce(value, param=param, ctx=ctx)
        if quick is _PATH:
            return self.coerce_path(Path(value), param.type_descriptor.parameter_info,
                                    path_type=Path, param=param, ctx=ctx)
        return quick


def _plain(value: Any, param: Any) -> Any:
    """What typer's adapter returns for ``value``, or _SLOW where only typer can tell."""
    descriptor = getattr(param, "type_descriptor", None)
    info = getattr(descriptor, "parameter_info", None)
    if descriptor is None or info is None or getattr(descriptor, "file_annotation", 1) is not None \
            or getattr(info, "parser", 1) is not None:
        return _SLOW
    multi = param.multiple or param.nargs == -1
    if value is None:
        return () if multi else None
    annotation = descriptor.annotation
    if multi:
        plain = annotation == list[str] and isinstance(value, (list, tuple)) \
            and all(type(v) is str for v in value)
        return list(value) if plain else _SLOW
    if annotation is str:
        return value if type(value) is str else _SLOW
    if annotation is int or annotation is float:
        return _number(value, annotation, info)
    plain_path = annotation is Path and getattr(info, "path_type", 1) is None
    return _PATH if plain_path and type(value) is str and value and "\0" not in value else _SLOW


def _number(value: Any, kind: type, info: Any) -> Any:
    """An int or float given as itself or as plain digits, inside the option's range."""
    if type(value) is kind:
        number = value
    elif type(value) is str and (_INT if kind is int else _FLOAT).fullmatch(value):
        number = kind(value)
    else:
        return _SLOW
    low, high = getattr(info, "min", None), getattr(info, "max", None)
    if getattr(info, "clamp", True) or (low is not None and number < low) \
            or (high is not None and number > high):
        return _SLOW
    return number
