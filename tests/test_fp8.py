"""FP8 training (precision fp8-tensorwise | fp8-rowwise | fp8-te): the spec, which cards run it,
its memory (analytic and on the trace), its time in quote and compare, the CPU pilot that runs
bf16 and says so, and the callbacks that record it."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch

from tunepilot.cost.compare import compare
from tunepilot.cost.quote import quote
from tunepilot.errors import SpecError, UserError
from tunepilot.model.arch import Arch, linear_modules, load_preset, resolve_arch
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LORA_8B = load_spec(EXAMPLES / "llama3-8b-lora.yaml")
FP8_CARDS = ("h100", "h200", "mi300x")


def _spec(**over):
    base = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "full"},
            "sequence_length": 4096, "micro_batch_size": 2}
    return spec_from_dict({**base, **over})


def _phase(plan, name):
    return next(p for p in plan.phases if p.name == name)


def test_fp8_precisions_keep_fp32_master_weights_and_qlora_is_refused():
    s = _spec(precision="fp8-te")
    assert s.precision.is_fp8 and s.precision.mixed and s.trainable_dtype == "fp32"
    with pytest.raises(SpecError, match="QLoRA's frozen base is NF4"):
        _spec(precision="fp8-tensorwise", method={"kind": "qlora"})
    with pytest.raises(SpecError, match="fp8-tensorwise"):  # did you mean
        _spec(precision="fp8")


def test_fp8_memory_by_recipe_against_bf16():
    arch = Arch.from_config(load_preset("llama-3.1-8b"))
    plans = {p: analytic_plan(_spec(precision=p), arch)
             for p in ("bf16-mixed", "fp8-tensorwise", "fp8-rowwise", "fp8-te")}
    bf16 = _phase(plans["bf16-mixed"], "forward-end")
    linear = sum(m.in_features * m.out_features for m in linear_modules(arch)) * arch.num_layers
    # torchao keeps no bf16 copy of the decoder's weights: autocast's 2 B/param cache is gone
    tw = _phase(plans["fp8-tensorwise"], "forward-end")
    assert bf16.activations_bytes - tw.activations_bytes == 2 * linear
    # Transformer Engine keeps FP8 weight + transpose (the same 2 B) but saves inputs in FP8
    te = _phase(plans["fp8-te"], "forward-end")
    tokens = 2 * 4096
    per_token = 4096 + 4096 + 4096 + arch.intermediate_size
    assert bf16.activations_bytes - te.activations_bytes == tokens * arch.num_layers * per_token
    # master weights, gradients and optimizer state as bf16-mixed
    for p in plans.values():
        assert p.per_device.master_weights_bytes == plans["bf16-mixed"].per_device \
            .master_weights_bytes
        assert p.per_device.optimizer_bytes == plans["bf16-mixed"].per_device.optimizer_bytes
    assert any("FP8" in a for a in plans["fp8-te"].assumptions)
    # FSDP: tensorwise all-gathers in FP8 (1 B/param unsharded), rowwise in bf16
    fsdp = {p: analytic_plan(_spec(precision=p, parallel={"strategy": "fsdp", "devices": 8}),
                             arch) for p in ("bf16-mixed", "fp8-tensorwise", "fp8-rowwise")}
    opt = {p: _phase(v, "optimizer-step") for p, v in fsdp.items()}
    fwd = {p: _phase(v, "forward-end").temporary_bytes for p, v in fsdp.items()}
    assert fwd["fp8-tensorwise"] < fwd["fp8-rowwise"]
    assert opt["fp8-tensorwise"].total_bytes == opt["bf16-mixed"].total_bytes


@pytest.mark.slow
def test_fp8_plans_quotes_and_compares_on_h100_h200_mi300x_with_the_time_it_saves():
    fp8 = LORA_8B.with_changes(precision="fp8-tensorwise")
    for card in FP8_CARDS:
        q8 = quote(fp8, card_id=card, count=1, term_s=None)
        q16 = quote(LORA_8B, card_id=card, count=1, term_s=None)
        one8, one16 = q8.throughput.per_card, q16.throughput.per_card
        assert 1.0 < one8.value / one16.value < 2.0  # faster, never the 2x of the peaks
        assert "fp8 peak" in one8.how and q8.job_s.value < q16.job_s.value
        assert q8.precision == "fp8-tensorwise"
    c = compare(LORA_8B, precisions=["bf16-mixed", "fp8-tensorwise"])
    assert c.precisions == ["bf16-mixed", "fp8-tensorwise"]
    by = {(r.card_id, r.count, r.precision): r for r in c.rows}
    for card in ("h100-sxm-80gb", "h200-sxm-141gb", "mi300x-192gb"):
        a, b = by[(card, 1, "fp8-tensorwise")], by[(card, 1, "bf16-mixed")]
        assert a.cost_per_million_term_usd < b.cost_per_million_term_usd
    assert ("a100-sxm-80gb", 1, "bf16-mixed") in by  # bf16 still ranks the A100
    refused = [r for r in c.refused if r.card.startswith("a100")]
    assert refused and "no FP8 tensor cores" in refused[0].reason


def test_a100_refuses_fp8_with_the_reason_and_exit_2(tmp_path, capsys):
    from tunepilot.plan.api import make_plan

    fp8 = LORA_8B.with_changes(precision="fp8-te")
    with pytest.raises(UserError, match="no FP8 tensor cores"):
        quote(fp8, card_id="a100", count=1, term_s=None)
    with pytest.raises(UserError, match="Hopper"):
        make_plan(fp8, card_ids=["a100"])
    plan = make_plan(fp8)  # the whole catalog: the A100 left out, and said
    assert "a100-sxm-80gb" not in [c.card for c in plan.cards]
    assert any("a100-sxm-80gb left out" in a for a in plan.assumptions)
    path = tmp_path / "fp8.yaml"
    path.write_text((EXAMPLES / "llama3-8b-lora.yaml").read_text().replace(
        "precision: bf16-mixed", "precision: fp8-te"), encoding="utf-8")
    from tunepilot.cli import main

    with pytest.raises(SystemExit) as exc:
        import sys

        sys.argv = ["tunepilot", "quote", str(path), "--card", "a100"]
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no FP8 tensor cores" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_trace_runs_bf16_and_models_fp8_on_top():
    from tunepilot.plan.api import make_plan

    spec = load_spec(EXAMPLES / "tiny.yaml").with_changes(precision="fp8-tensorwise")
    plan = make_plan(spec, "traced", card_ids=["h100"])
    assert plan.fidelity == "trace"
    assert any("traced as bf16-mixed" in a and "MODELLED" in a for a in plan.assumptions)
    bf16 = make_plan(spec.with_changes(precision="bf16-mixed"), "traced", card_ids=["h100"])
    arch = resolve_arch(spec)
    delta = (analytic_plan(spec.with_changes(precision="bf16-mixed"), arch)
             .per_device.allocated_peak_bytes - analytic_plan(spec, arch)
             .per_device.allocated_peak_bytes)
    assert delta > 0  # the weight casts FP8 does not keep
    assert plan.per_device.allocated_peak_bytes < bf16.per_device.allocated_peak_bytes


@pytest.mark.slow
def test_the_cpu_pilot_of_an_fp8_spec_runs_bf16_and_says_fp8_is_not_measured(tmp_path):
    from tunepilot.pilot import PilotOptions, run_pilot

    spec = load_spec(EXAMPLES / "tiny.yaml").with_changes(precision="fp8-tensorwise")
    res = run_pilot(spec, tmp_path / "run", PilotOptions(steps=1))
    assert res.run.precision == "bf16-mixed" and res.spec_hash == spec.spec_hash()
    assert any("FP8 is NOT measured" in n for n in res.notes)


@pytest.mark.slow
def test_the_restore_proof_of_an_fp8_spec_says_what_its_bf16_stand_in_could_not_check(tmp_path):
    from tunepilot.restore.proof import verify_restore
    from tunepilot.spec.fp8 import stand_in_note

    tiny = load_spec(EXAMPLES / "tiny.yaml")
    res = verify_restore(tiny.with_changes(precision="fp8-te"), 2, 2, tmp_path / "run")
    assert res.passed and len(res.notes) == 1 and "amax history" in res.notes[0]
    assert verify_restore(tiny, 2, 2, tmp_path / "bf16").notes == []
    # the scaling stage says the same of its efficiencies (scaling/runner.py writes it)
    scale = stand_in_note(tiny.with_changes(precision="fp8-tensorwise"), "scale")
    assert "upper bound" in scale and "all-gather" in scale
    assert stand_in_note(tiny, "scale") is None


class _Grain(enum.Enum):
    TENSORWISE = "tensorwise"
    AXISWISE = "axiswise"


def _float8_linear(grain: _Grain):
    """A module of torchao's Float8Linear type (torchao is not installed here): the callbacks
    match the class by name and module, and read its config's scaling granularity."""
    cls = type("Float8Linear", (torch.nn.Linear,), {"__module__": "torchao.float8.float8_linear"})
    m = cls(8, 8)
    m.config = type("Cfg", (), {"cast_config_input": type("C", (), {
        "scaling_granularity": grain})()})()
    return m


def test_the_callbacks_record_torchao_and_transformer_engine_fp8(tmp_path):
    import sys

    sys.path.insert(0, str(EXAMPLES / "own-loop"))
    from tiny_data import tiny_config
    from transformers import LlamaForCausalLM

    from tunepilot.integrations.derive import derive_spec

    for grain, want in ((_Grain.TENSORWISE, "fp8-tensorwise"), (_Grain.AXISWISE, "fp8-rowwise")):
        model = LlamaForCausalLM(tiny_config())
        model.model.layers[0].mlp.down_proj = _float8_linear(grain)
        spec, _, notes = derive_spec(model, tmp_path / want, micro_batch_size=2,
                                     accumulation=1, sequence_length=32, bf16=True)
        assert spec.precision == want and any("Float8Linear" in n for n in notes)
    te = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module"})
    model = LlamaForCausalLM(tiny_config())
    model.model.layers[0].mlp.up_proj = layer = te(8, 8)
    layer.fp8 = False  # TE modules that ran without fp8_autocast: bf16
    assert derive_spec(model, tmp_path / "te0", micro_batch_size=2, accumulation=1,
                       sequence_length=32, bf16=True)[0].precision == "bf16-mixed"
    layer.fp8 = True
    assert derive_spec(model, tmp_path / "te1", micro_batch_size=2, accumulation=1,
                       sequence_length=32, bf16=True)[0].precision == "fp8-te"


def _import(tmp_path, name: str, text: str):
    from tunepilot.integrations.importers import ImportOptions, import_config

    path = tmp_path / name
    path.write_text(text)
    return import_config(path, options=ImportOptions(synthetic_data=True))


AXOLOTL = ("base_model: meta-llama/Llama-3.1-8B\nsequence_len: 4096\nmicro_batch_size: 2\n"
           "bf16: true\ngradient_checkpointing: true\nadapter: lora\nlora_r: 16\n"
           "lora_target_linear: true\n")
LLAMAFACTORY = ("model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct\nstage: sft\n"
                "finetuning_type: lora\nlora_target: all\ncutoff_len: 2048\n"
                "per_device_train_batch_size: 2\nbf16: true\n")


def test_the_importers_map_fp8_to_the_precision_they_plan(tmp_path):
    """axolotl `fp8` + `fp8_config.recipe` and LLaMA-Factory `fp8` + `fp8_backend` were
    ignored: the FP8 run planned and quoted as bf16."""
    cases = [("a.yml", AXOLOTL, "bf16-mixed"), ("b.yml", AXOLOTL + "fp8: true\n", "fp8-tensorwise"),
             ("c.yml", AXOLOTL + "fp8: true\nfp8_config:\n  recipe: rowwise\n", "fp8-rowwise"),
             ("d.yaml", LLAMAFACTORY + "fp8: true\n", "fp8-tensorwise"),
             ("e.yaml", LLAMAFACTORY + "fp8: true\nfp8_backend: te\n", "fp8-te")]
    for name, text, precision in cases:
        r = _import(tmp_path, name, text)
        assert r.spec.precision == precision, name
        assert "fp8" not in r.ignored
        if precision.startswith("fp8"):
            assert r.mapped["fp8"] == "precision" and r.mapped["bf16"] == "precision"
    fp8 = _import(tmp_path, "f.yml", AXOLOTL + "fp8: true\n").spec
    with pytest.raises(UserError, match="FP8"):
        quote(fp8, card_id="a100", count=1, term_s=None)
    bf16 = _import(tmp_path, "g.yml", AXOLOTL).spec
    faster = quote(fp8, card_id="h100", count=1, term_s=None)
    assert faster.job_s.value < quote(bf16, card_id="h100", count=1, term_s=None).job_s.value


def test_an_fp8_recipe_or_backend_tunepilot_does_not_plan_is_refused_by_name(tmp_path):
    with pytest.raises(UserError) as err:
        _import(tmp_path, "a.yml", AXOLOTL + "fp8: true\nfp8_config:\n  recipe: mxfp8\n")
    assert "fp8_config.recipe" in err.value.field
    with pytest.raises(UserError) as err:
        _import(tmp_path, "b.yaml", LLAMAFACTORY + "fp8: true\nfp8_backend: msamp\n")
    assert "fp8_backend" in err.value.field and "MS-AMP" in err.value.message
