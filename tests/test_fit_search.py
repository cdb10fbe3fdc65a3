"""The plan's inverse queries as a user reads them: max seq len searched up from the shortest
length the spec is valid at (a DPO pair is longer than its prompt), and stopped at the model's
context unless the spec scales RoPE; a sequence past the context is warned about by plan and
quote, naming rope scaling as the way to go longer (issue 40 items 2 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.cost.quote import quote
from tunepilot.integrations.importers import ImportOptions, import_config
from tunepilot.model.arch import resolve_arch
from tunepilot.model.context import run_context
from tunepilot.plan.api import make_plan
from tunepilot.plan.fit import _shortest_valid_sequence
from tunepilot.spec import spec_from_dict

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def test_an_imported_dpo_spec_with_a_long_prompt_gets_its_max_seq_len_not_0():
    """axolotl max_prompt_len 1024: every length up to 1024 is invalid, so a search from 1 found
    nothing and printed 0 on every card while the run fits at 2048 with 65-85% free."""
    spec = import_config(CONFIGS / "axolotl-dpo-8b.yml",
                         options=ImportOptions(synthetic_data=True)).spec
    assert spec.objective.max_prompt_length == 1024 and spec.sequence_length == 2048
    assert _shortest_valid_sequence(spec) == 1025
    plan = make_plan(spec)
    for row in plan.cards:
        assert row.fits and row.headroom_fraction > 0.5
        assert row.max_sequence_length > 2048, row
    row = plan.card("h100-sxm-80gb")  # the answer is the largest that fits: one more does not
    longer = spec.with_changes(sequence_length=row.max_sequence_length + 1)
    assert row.max_sequence_length < run_context(resolve_arch(spec), spec).tokens
    assert not make_plan(longer, card_ids=[row.card]).cards[0].fits


def test_a_pair_that_fits_nowhere_at_its_shortest_valid_length_says_0():
    spec = spec_from_dict({"model": {"preset": "llama-3.1-70b"}, "method": {"kind": "full"},
                           "objective": {"kind": "dpo", "max_prompt_length": 1024},
                           "sequence_length": 2048})
    row = make_plan(spec, card_ids=["a100"]).cards[0]
    assert not row.fits and row.max_sequence_length == 0


def test_sft_still_searches_from_1():
    spec = spec_from_dict({"model": {"preset": "tiny"}})
    assert _shortest_valid_sequence(spec) == 1


def test_max_seq_len_stops_at_the_models_context_and_the_plan_says_so():
    """tiny's max_position_embeddings is 512: max seq len printed 1,100,077 on an H100."""
    spec = spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 128})
    plan = make_plan(spec, card_ids=["h100", "mi300x"])
    assert {row.max_sequence_length for row in plan.cards} == {512}
    assert any("stops at the model's context, 512 tokens" in a for a in plan.assumptions)
    assert plan.warnings == []


def test_rope_scaling_in_the_spec_stretches_the_cap():
    spec = spec_from_dict({"model": {"preset": "tiny", "rope_scaling": 4},
                           "sequence_length": 1024})
    plan = make_plan(spec, card_ids=["h100"])
    assert plan.cards[0].max_sequence_length == 2048
    assert plan.warnings == []  # 1024 <= 512 x 4


def test_a_sequence_past_the_context_warns_in_plan_and_quote_naming_rope_scaling(tmp_path):
    """Llama-2-7B (context 4096) at 8192 planned and quoted without a word."""
    spec = spec_from_dict({"model": {"preset": "llama-2-7b"}, "method": {"kind": "lora"},
                           "sequence_length": 8192})
    plan = make_plan(spec, card_ids=["h100"])
    [warning] = plan.warnings
    assert "sequence_length 8,192 is past the model's context, 4,096 tokens" in warning
    assert "model.rope_scaling: 2" in warning
    assert plan.cards[0].max_sequence_length == 4096
    q = quote(spec, card_id="h100", count=1, term_s=None, catalog=load_catalog())
    assert warning in q.notes
    scaled = spec_from_dict({**spec.model_dump(mode="json"),
                             "model": {"preset": "llama-2-7b", "rope_scaling": 2.0}})
    assert make_plan(scaled, card_ids=["h100"]).warnings == []


def test_the_plan_view_and_json_carry_the_warning(capsys):
    from tunepilot.cli.common import show
    from tunepilot.views.plan import render_plan

    spec = spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 600})
    plan = make_plan(spec, card_ids=["h100"])
    show(plan, False, lambda r: render_plan(r, spec, 0.1))
    assert "warning: sequence_length 600 is past the model's context" in \
        " ".join(capsys.readouterr().out.split())
    show(plan, True)
    assert json.loads(capsys.readouterr().out)["warnings"] == plan.warnings


def test_a_config_that_scales_rope_itself_names_its_longer_context(tmp_path):
    """Qwen2.5's YaRN: original_max_position_embeddings 32768 x factor 4 over
    max_position_embeddings 32768 - the context is 131072."""
    from tunepilot.model.arch import load_preset

    cfg = load_preset("qwen2.5-7b")
    cfg.update(max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = spec_from_dict({"model": {"config": str(path)}, "sequence_length": 65536})
    assert run_context(resolve_arch(spec), spec).tokens == 131072
    assert make_plan(spec, card_ids=["mi300x"]).warnings == []


def test_rope_scaling_is_a_factor_above_1():
    from tunepilot.errors import SpecError

    with pytest.raises(SpecError, match="rope_scaling"):
        spec_from_dict({"model": {"preset": "tiny", "rope_scaling": 0.5}})


@pytest.mark.slow
def test_the_pilot_builds_the_model_with_the_specs_rope_scaling():
    pytest.importorskip("transformers")
    from tunepilot.model.build import hf_config

    spec = spec_from_dict({"model": {"preset": "tiny", "rope_scaling": 2}})
    rope = hf_config(spec).to_dict()
    rope = rope.get("rope_parameters") or rope.get("rope_scaling")
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0
    llama31 = hf_config(spec_from_dict({"model": {"preset": "llama-3.1-8b",
                                                   "rope_scaling": 2}})).to_dict()
    rope = llama31.get("rope_parameters") or llama31.get("rope_scaling")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 16.0  # its own 8 x 2
