"""spec/precision.py is the one owner of precision: every question a stage asks is a property of
the spec's Precision, and no other source file compares a precision string (issue 37)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tunepilot.errors import SpecError
from tunepilot.spec import Precision, spec_from_dict
from tunepilot.spec.precision import NAMES

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tunepilot"
OWNER = SRC / "spec" / "precision.py"
STRING_TESTS = ("startswith", "endswith")


def _spec(precision: str, **changes):
    base = {"model": {"preset": "tiny"}, "method": {"kind": "full"}, "precision": precision}
    base.update(changes)
    return spec_from_dict(base)


@pytest.mark.parametrize("name, compute, params, autocast, scaler, peak, mixed", [
    ("fp32", "fp32", "fp32", None, False, "fp32", False),
    ("bf16-mixed", "bf16", "fp32", "bf16", False, "bf16", True),
    ("bf16-true", "bf16", "bf16", None, False, "bf16", False),
    ("fp16-mixed", "fp16", "fp32", "fp16", True, "fp16", True),
    ("fp8-tensorwise", "bf16", "fp32", "bf16", False, "fp8", True),
    ("fp8-rowwise", "bf16", "fp32", "bf16", False, "fp8", True),
    ("fp8-te", "bf16", "fp32", "bf16", False, "fp8", True),
])
def test_each_precision_answers_every_question(name, compute, params, autocast, scaler, peak,
                                               mixed):
    p = _spec(name).precision
    assert isinstance(p, Precision) and p == name
    assert (p.compute_dtype, p.parameter_dtype, p.autocast_dtype) == (compute, params, autocast)
    assert p.compute_bytes == (4 if compute == "fp32" else 2)
    assert p.parameter_bytes == (4 if params == "fp32" else 2)
    assert (p.needs_grad_scaler, p.peak_key, p.mixed) == (scaler, peak, mixed)
    assert p.is_fp8 == name.startswith("fp8")
    assert (p.fp8_recipe is not None) == p.is_fp8
    assert p.stand_in == ("bf16-mixed" if p.is_fp8 else name)
    assert p.frozen_base_dtype == compute  # a LoRA base is loaded in the compute dtype
    assert p.frozen_copy == ("fp32" if name == "fp32" else "bf16-true")


def test_the_spec_stays_a_plain_string_in_yaml_json_and_the_hash():
    s = _spec("fp8-te")
    assert s.model_dump()["precision"] == "fp8-te"
    assert type(s.model_dump()["precision"]) is str
    assert type(s.model_dump(mode="json")["precision"]) is str
    assert s.with_changes(precision=s.precision.stand_in).precision.autocast_dtype == "bf16"
    assert s.model_json_schema()["properties"]["precision"]["enum"] == list(NAMES)
    # the hash is that of the plain string (specs hashed before issue 37 keep their hash)
    assert s.spec_hash() == spec_from_dict(s.model_dump(mode="json")).spec_hash()


def test_an_unknown_precision_is_the_specs_usual_error():
    with pytest.raises(SpecError) as e:
        _spec("bf16-mix")
    assert "precision" in str(e.value) and "bf16-mixed" in str(e.value)
    with pytest.raises(ValueError):
        Precision("fp64")


def test_the_spec_derives_its_dtypes_from_the_precision():
    assert _spec("bf16-true").trainable_dtype == "bf16"
    assert _spec("bf16-mixed").trainable_dtype == "fp32"
    lora = {"kind": "lora", "lora_rank": 4}
    assert _spec("fp16-mixed", method=lora).frozen_base_dtype == "fp16"
    assert _spec("fp32", method=lora).frozen_base_dtype == "fp32"
    assert _spec("fp8-rowwise", method=lora).frozen_base_dtype == "bf16"


# --- no precision string compared outside spec/precision.py --------------------------------

def _mentions_precision(node: ast.AST) -> bool:
    """An expression whose own name says it holds a precision (spec.precision, precision, p_precision)."""
    if isinstance(node, ast.Attribute):
        return "precision" in node.attr.lower()
    if isinstance(node, ast.Name):
        return "precision" in node.id.lower()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
        return any(_mentions_precision(a) for a in node.args)
    return False


def _precision_literal(node: ast.AST) -> bool:
    """A precision name, a piece of one, or a collection of them (FP8_PRECISIONS included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        v = node.value
        return v in NAMES or v in ("-mixed", "-true", "fp8", "bf16", "fp16", "fp32")
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_precision_literal(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id.upper().endswith("PRECISIONS")
    return False


def precision_comparisons(source: str) -> list[int]:
    """The line of each comparison of a precision with a string (==, !=, in, startswith ...)."""
    only_precision = set(NAMES) - {"fp32"}  # "fp32" also names a dtype
    out = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(_mentions_precision(s) for s in sides) and any(
                _precision_literal(s) for s in sides) or any(
                isinstance(s, ast.Constant) and s.value in only_precision for s in sides)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in STRING_TESTS:
            hit = _mentions_precision(node.func.value) or any(
                _precision_literal(a) and not (isinstance(a, ast.Constant) and a.value in
                                               ("fp32", "bf16", "fp16")) for a in node.args)
        elif isinstance(node, ast.Subscript):  # TABLE[spec.precision]: a table keyed by name
            hit = _mentions_precision(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "get" and node.args:  # TABLE.get(spec.precision, ...)
            hit = _mentions_precision(node.args[0])
        elif isinstance(node, ast.Match):  # match spec.precision: case "bf16-true": ...
            hit = _mentions_precision(node.subject)
        if hit:
            out.append(node.lineno)
    return out


def test_the_grep_catches_what_it_should():
    code = ('a = spec.precision == "fp32"\nb = x.precision.endswith("-mixed")\n'
            'c = precision in FP8_PRECISIONS\nd = p != "bf16-true"\n'
            'e = spec.precision.compute_bytes\nf = spec.frozen_base_dtype == "fp32"\n'
            'g = TOLERANCE[spec.precision]\nh = TOLERANCE.get(precision, 1)\n'
            'match spec.precision:\n    case "fp32":\n        pass\n')
    assert sorted(precision_comparisons(code)) == [1, 2, 3, 4, 7, 8, 9]


def test_no_precision_string_is_compared_outside_spec_precision():
    files = [f for d in (SRC, ROOT / "benchmarks", ROOT / "scripts")
             for f in sorted(d.rglob("*.py")) if f != OWNER]
    hits = [f"{f.relative_to(ROOT)}:{line}" for f in files
            for line in precision_comparisons(f.read_text())]
    assert hits == [], ("compare precision through spec.precision's properties "
                        "(spec/precision.py), not its string: " + ", ".join(hits))
