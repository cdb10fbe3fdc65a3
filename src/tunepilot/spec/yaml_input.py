"""Reading a YAML (or JSON) spec or trainer config safely: size-capped, YAML alias expansion and
nesting bounded, so a hostile file is refused in milliseconds with a message naming the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tunepilot.errors import SpecError

MAX_SPEC_BYTES = 1 << 20  # a spec or trainer config is a few KiB; anything near this is not one
MAX_NODES = 20_000  # values after expanding YAML aliases (a billion-laughs file has billions)
MAX_DEPTH = 64


def read_yaml_mapping(path: str | Path, what: str = "spec") -> dict:
    """A YAML (or JSON) file as a mapping: size-capped, alias expansion and nesting bounded, so a
    hostile file is refused in milliseconds - every problem a SpecError naming the file."""
    p = Path(path)
    if not p.exists():
        raise SpecError(None, f"{what} file {str(p)!r} does not exist.",
                        "Check the path, or start from one of the files in examples/.")
    if p.is_dir():
        raise SpecError(None, f"{what} path {str(p)!r} is a directory, not a YAML file.")
    from tunepilot.limits import Refused, read_capped

    try:
        text = read_capped(p, MAX_SPEC_BYTES).decode("utf-8")
    except Refused as exc:
        raise SpecError(None, f"{p.name} {exc}; a {what} is a YAML file of a few KiB.",
                        "Check it is the right file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(None, f"cannot read {what} file {str(p)!r}: {str(exc)[:200]}.",
                        "It must be a UTF-8 YAML file.") from None
    return parse_yaml_mapping(text, p.name, what)


def parse_yaml_mapping(text: str, name: str, what: str = "spec") -> dict:
    """``text`` as read_yaml_mapping reads a file (``name`` in the messages): the one parser
    of specs, also the check `import` makes on the spec it is about to write."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(None, f"{name} is {len(text):,} characters; a {what} is a few KiB "
                        f"(limit {MAX_SPEC_BYTES:,}).", "Check it is the right file.")
    if _flow_depth(text) > MAX_DEPTH:  # before the parser recurses into it (it costs seconds)
        raise SpecError(None, f"{name} is nested more than {MAX_DEPTH} levels deep; a {what} "
                        "is not.")
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(None, f"{name} is not valid YAML{where}: {str(problem)[:200]}.",
                        "Fix the YAML syntax (indentation, a missing ':' or quote).") from None
    except RecursionError:
        raise SpecError(None, f"{name} is nested too deeply to be a {what}.") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise SpecError(None, f"{name} holds a value YAML cannot read: {str(exc)[:120]}.",
                        "Numbers in a spec are ordinary sizes and rates.") from None
    _check_size(data, name, what)
    if data is None:
        raise SpecError(None, f"{name} is empty.", "A spec needs at least 'model: {preset: "
                        "...}'." if what == "spec" else None)
    if not isinstance(data, dict):
        raise SpecError(None, f"{name} must be a YAML mapping of fields, got "
                        f"{type(data).__name__}.", "Start from one of the files in examples/.")
    return data


def yaml_comment(text: str) -> str:
    """``text`` as one YAML comment line: characters a YAML stream may not hold (NUL and other
    controls, lone surrogates, BOMs) and line breaks - which would end the comment and start
    YAML - escaped as \\xNN / \\uNNNN. For headers that quote user input (a path, a name)."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or code in (0x2028, 0x2029) or \
                0xD800 <= code <= 0xDFFF or code in (0xFEFF, 0xFFFE, 0xFFFF):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "# " + "".join(out)


_FLOW_TOKENS = re.compile(r"""[\[\]{}]|'[^']*'|"(?:\\.|[^"\\])*"|(?:^|(?<=\s))#[^\n]*""",
                          re.MULTILINE)


def _flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow collections ([...] and {...}) outside quoted scalars
    and comments, found in one pass: PyYAML's parser recurses once per level, so a 10 kB file
    of brackets took seconds of CPU to refuse (block nesting costs bytes per level and is
    bounded after the parse)."""
    depth = deepest = 0
    for m in _FLOW_TOKENS.finditer(text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif tok in "]}":
            depth = max(0, depth - 1)
    return deepest


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses more than MAX_NODES alias references (billion laughs), and reads
    1e-3 as a number as YAML 1.2 does (PyYAML's 1.1 rules make it a string)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_NODES:
                raise yaml.YAMLError(f"more than {MAX_NODES:,} alias references")
        return super().compose_node(parent, index)


_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _check_size(data: Any, name: str, what: str) -> None:
    """Count the values the document expands to (aliases counted each time they are used,
    memoised per object so a bomb is counted, not expanded) and its depth."""
    sizes: dict[int, int] = {}

    def size(x: Any, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise SpecError(None, f"{name} is nested more than {MAX_DEPTH} levels deep; a {what} "
                            "is not.")
        if not isinstance(x, dict | list):
            return 1
        if id(x) in sizes:
            return sizes[id(x)]
        items = x.values() if isinstance(x, dict) else x
        n = 1
        for v in items:
            n += size(v, depth + 1)
            if n > MAX_NODES:
                raise SpecError(None, f"{name} expands to more than {MAX_NODES:,} values "
                                "(YAML aliases); a " + what + " has a few dozen.",
                                "Remove the anchors/aliases that repeat themselves.")
        sizes[id(x)] = n
        return n

    size(data, 0)
