"""The run spec: defaults, derived figures, and bad input that names the field and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunepilot.cli import main
from tunepilot.errors import SpecError
from tunepilot.spec import load_spec, spec_from_dict

EXAMPLES = sorted(Path(__file__).resolve().parent.parent.glob("examples/*.yaml"))


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    old = sys.argv
    sys.argv = ["tunepilot", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


def test_defaults_everything_but_model():
    s = spec_from_dict({"model": {"preset": "tiny"}})
    assert s.method.kind == "lora" and s.method.lora_rank == 16 and s.method.lora_alpha == 32
    assert s.optimizer.name == "adamw" and s.optimizer_state_dtype == "fp32"
    assert s.parallel.strategy == "single" and s.parallel.world_size == 1
    assert s.target.useful_tokens == 1e9


def test_state_dtype_follows_the_trained_parameters():
    def state(**kw):
        return spec_from_dict({"model": {"preset": "tiny"}, **kw}).optimizer_state_dtype

    assert state(precision="bf16-true", method={"kind": "full"}) == "bf16"
    assert state(precision="bf16-mixed", method={"kind": "full"}) == "fp32"
    # LoRA: PEFT keeps the adapters in fp32 (autocast_adapter_dtype) unless adapter_dtype: bf16
    assert state(precision="bf16-true", method={"kind": "lora"}) == "fp32"
    assert state(precision="bf16-true", method={"kind": "lora", "adapter_dtype": "bf16"}) == \
        "bf16"


def test_spec_hash_ignores_the_label_but_not_settings():
    a = spec_from_dict({"model": {"preset": "tiny"}, "name": "a"})
    b = spec_from_dict({"model": {"preset": "tiny"}, "name": "b"})
    c = spec_from_dict({"model": {"preset": "tiny"}, "micro_batch_size": 2})
    assert a.spec_hash() == b.spec_hash() != c.spec_hash()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_plan(path, capsys):
    load_spec(path)
    code, out, err = run_cli(["plan", str(path)], capsys)
    assert code == 0, err
    for card in ("a100-sxm-80gb", "h100-sxm-80gb", "h200-sxm-141gb", "mi300x-192gb"):
        assert card in out
    assert "GiB" in out and "projected" in out


BAD = [
    ("model: {preset: llama-3-8b}\nmethd: {kind: full}\n", "methd", "method"),
    ("model: {preset: llama-3-8bb}\n", "model.preset", "llama-3-8b"),
    ("model: {preset: tiny, config: x.json}\n", "model", "exactly one"),
    ("model: {preset: tiny}\nmethod: {kind: full, lora_rank: 8}\n", "method", "lora_rank"),
    ("model: {preset: tiny}\nsequence_length: 0\n", "sequence_length", "greater than 0"),
    ("model: {preset: tiny}\nmicro_batch_size: -2\n", "micro_batch_size", "greater than 0"),
    ("model: {preset: tiny}\nmicro_batch_size: lots\n", "micro_batch_size", "integer"),
    ("model: {preset: tiny}\nprecision: bf16\n", "precision", "bf16-mixed"),
    ("model: {preset: tiny}\nparallel: {devices: 8}\n", "parallel", "ddp or fsdp"),
    ("model: {preset: tiny}\nmethod: {lora_targets: [q_prj]}\n", "method.lora_targets", "q_proj"),
    ("model: [\n", None, "not valid YAML at line"),
    ("", None, "empty"),
    ("- a\n- b\n", None, "mapping"),
]


@pytest.mark.parametrize(("text", "field", "needle"), BAD)
def test_bad_spec_exits_2_naming_the_field(tmp_path, capsys, text, field, needle):
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    code, out, err = run_cli(["plan", str(p)], capsys)
    assert code == 2
    assert "Traceback" not in err
    assert needle in err
    if field:
        assert f"{field}:" in err


def test_missing_file_and_unknown_card(tmp_path, capsys):
    code, _, err = run_cli(["plan", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(["plan", str(EXAMPLES[0]), "--card", "h1000"], capsys)
    assert code == 2 and "Did you mean" in err and "h100" in err


def test_json_error_payload(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("model: {preset: tiny}\nsequence_length: 0\n")
    code, out, _ = run_cli(["plan", str(p), "--json"], capsys)
    assert code == 2
    payload = yaml.safe_load(out)
    assert payload["field"] == "sequence_length" and payload["error"] == "SpecError"


def test_spec_error_is_a_one_paragraph_message():
    with pytest.raises(SpecError) as info:
        spec_from_dict({"model": {"preset": "tiny"}, "optimizer": {"nme": "sgd"}})
    assert "\n" not in str(info.value) and "optimizer.nme" in str(info.value)


# --- property test: malformed specs never escape as tracebacks --------------------------------

keys = st.sampled_from(["model", "method", "optimizer", "precision", "sequence_length",
                        "micro_batch_size", "gradient_accumulation_steps", "parallel", "data",
                        "activation_checkpointing", "target", "preset", "kind", "lora_rank",
                        "devices", "strategy", "bogus", "name", "chunked_loss"])
leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=12), st.sampled_from(["tiny", "full", "lora", "qlora", "fsdp",
                                                          "bf16-true", "llama-3-8b", "-1"]))
trees = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(keys, inner, max_size=4)),
                     max_leaves=12)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.one_of(trees, st.dictionaries(keys, trees, max_size=6).map(
    lambda d: {"model": {"preset": "tiny"}, **d})))
def test_malformed_specs_never_raise_a_traceback(tmp_path, capsys, data):
    p = tmp_path / "fuzz.yaml"
    p.write_text(yaml.safe_dump(data))
    code, out, err = run_cli(["plan", str(p), "--card", "h100"], capsys)
    assert code in (0, 2), err
    assert "Traceback" not in err


HOSTILE = [
    ("alias bomb", "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
     "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
     "model: {preset: tiny}\nname: *f\n", "expands to more than"),
    ("deep nesting", "model: {preset: tiny}\nname: " + "[" * 1000 + "]" * 1000 + "\n", "nested"),
    ("5000-digit integer", "model: {preset: tiny}\nseed: " + "9" * 5000 + "\n", "cannot read"),
    ("not UTF-8", b"model: {preset: tiny}\nname: \xff\xfe\n", "UTF-8"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,text,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_yaml_is_refused_with_a_bounded_message(tmp_path, capsys, name, text, needle):
    """(That it is refused within 5 s is benchmarks/timing_targets.py's.)"""
    p = tmp_path / "hostile.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = run_cli(["plan", str(p)], capsys)
    assert code == 2 and needle in err and "Traceback" not in err
    assert len(err) < 2000


STRICT = [
    ("sequence_length: '64'", "sequence_length"),
    ("micro_batch_size: 18446744073709551617", "micro_batch_size"),
    ("sequence_length: 1.0e30", "sequence_length"),
    ("optimizer: {lr: .inf}", "optimizer.lr"),
    ("target: {tokens: .inf}", "target.tokens"),
    ("gradient_accumulation_steps: true", "gradient_accumulation_steps"),
    ("checkpoint: {dir: \"a\\0b\"}", "checkpoint.dir"),
    ("seed: -1", "seed"),
]


@pytest.mark.parametrize("line,field", STRICT, ids=[s[0] for s in STRICT])
def test_wrong_types_and_unbounded_values_are_refused(tmp_path, capsys, line, field):
    p = tmp_path / "s.yaml"
    p.write_text(f"model: {{preset: tiny}}\n{line}\n")
    code, out, err = run_cli(["plan", str(p)], capsys)
    assert code == 2 and f"{field}:" in err and "Traceback" not in err


def test_scientific_notation_without_a_dot_is_a_number(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("model: {preset: tiny}\noptimizer: {lr: 1e-3}\ntarget: {tokens: 5e8}\n")
    spec = load_spec(p)
    assert spec.optimizer.lr == 1e-3 and spec.target.tokens == 5e8


@pytest.mark.parametrize("key,value", [("vocab_size", "abc"), ("vocab_size", []),
                                       ("vocab_size", -5), ("num_attention_heads", 0),
                                       ("head_dim", 0), ("num_hidden_layers", 2.5)])
def test_a_model_config_with_impossible_dimensions_is_refused(tmp_path, capsys, key, value):
    import json

    cfg = json.loads((Path(__file__).resolve().parents[1] / "src/tunepilot/resources/presets/"
                      "tiny.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {{config: {tmp_path / 'config.json'}}}\n")
    code, _, err = run_cli(["plan", str(spec)], capsys)
    assert code == 2 and f"config {key!r} is" in err and "Traceback" not in err


def test_a_model_config_that_is_not_utf8_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {{config: {tmp_path / 'config.json'}}}\n")
    code, _, err = run_cli(["plan", str(spec)], capsys)
    assert code == 2 and "not UTF-8" in err
