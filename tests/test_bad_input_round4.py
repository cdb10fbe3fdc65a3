"""The adversarial round's inputs to plan, quote, data, cards and catalog import (issue 40 item
12: N7-N13): each a one-paragraph refusal naming the field (exit 2) - never a traceback, a
division by zero or a silent wrong number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from support.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "trust4"
TOKENIZER = ROOT / "src" / "tunepilot" / "resources" / "tiny" / "chat-tokenizer"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `data` writes runs/ under the working directory


@pytest.mark.parametrize("case,words", [
    ("hfcfg_inf", "'num_hidden_layers' is inf"),
    ("hfcfg_maxpos", "'max_position_embeddings' is '8k'"),
])
def test_a_model_config_with_non_numbers_is_refused_naming_the_key(case, words):
    code, _, err = run_cli("plan", DATA / case / "spec.yaml", "--card", "h100")
    assert code == 2 and words in err, err


@pytest.mark.parametrize("change,words", [
    ({"max_position_embeddings": 1}, "'max_position_embeddings' is 1"),
    ({"tie_word_embeddings": "maybe"}, "'tie_word_embeddings' is 'maybe', not true or false"),
    ({"num_attention_heads": float("nan")}, "'num_attention_heads' is nan"),
])
def test_a_model_config_out_of_range_is_refused(tmp_path, change, words):
    cfg = json.loads((DATA / "hfcfg_inf" / "config.json").read_text())
    cfg.update({"num_hidden_layers": 2, **change})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "spec.yaml").write_text("model: {config: config.json}\nmethod: {kind: lora}\n")
    code, _, err = run_cli("plan", tmp_path / "spec.yaml", "--card", "h100")
    assert code == 2 and words in err, err


def test_an_unknown_loss_type_is_refused_for_every_objective_trl_checks(tmp_path):
    p = tmp_path / "grpo.yaml"
    p.write_text("model: {preset: tiny}\nobjective: {kind: grpo, loss_type: banana}\n")
    code, _, err = run_cli("plan", p, "--card", "h100")
    assert code == 2 and "'banana' is not one of TRL's grpo losses" in err
    p.write_text("model: {preset: tiny}\nmicro_batch_size: 8\nobjective: {kind: grpo, "
                 "loss_type: dr_grpo}\n")
    assert run_cli("plan", p, "--card", "h100")[0] == 0


def test_a_quote_for_a_trillion_cards_is_refused():
    code, _, err = run_cli("quote", ROOT / "examples" / "tiny.yaml", "--card", "h200",
                           "--count", str(10**12), "--hours", "1")
    assert code == 2 and "count" in err and "131,072" in err


def _data_spec(tmp_path: Path, rows: list[str], fmt: str, skip: bool) -> Path:
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n")
    spec = {"name": "s", "model": {"preset": "tiny"}, "method": {"kind": "full"},
            "precision": "fp32", "sequence_length": 64,
            "data": {"source": "jsonl", "path": "data.jsonl", "tokenizer": str(TOKENIZER),
                     "format": fmt, "skip_bad_rows": skip}, "target": {"epochs": 1}}
    if fmt == "preference":
        spec["objective"] = {"kind": "dpo"}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


_GOOD = {"text": '{"text": "a row long enough to train several tokens of text"}',
         "messages": '{"messages": [{"role": "user", "content": "hi there"}, {"role": '
                     '"assistant", "content": "hello, a reply long enough to train on"}]}',
         "preference": '{"prompt": "pick one", "chosen": "the better answer here", '
                       '"rejected": "the worse answer here"}'}
_SURROGATE = {"text": '{"text": "hello \\ud800 world"}',
              "messages": '{"messages": [{"role": "user", "content": "hi \\udfff"}, '
                          '{"role": "assistant", "content": "ok"}]}',
              "preference": '{"prompt": "p", "chosen": "a \\ud800", "rejected": "b"}'}


@pytest.mark.parametrize("fmt", ["text", "messages", "preference"])
def test_a_lone_surrogate_is_skipped_with_skip_bad_rows_and_named_without(tmp_path, fmt):
    rows = [_SURROGATE[fmt], _GOOD[fmt]]
    code, out, err = run_cli("data", _data_spec(tmp_path, rows, fmt, True), "--json")
    assert code == 0, err
    assert json.loads(out)["skipped_rows"] == 1
    code, _, err = run_cli("data", _data_spec(tmp_path, rows, fmt, False))
    assert code == 2 and "row 1" in err and "lone surrogate" in err, err


def test_a_dataset_with_nothing_supervised_fails_data_and_quote():
    spec = DATA / "zero_supervised" / "spec.yaml"
    code, _, err = run_cli("data", spec)
    assert code == 2 and "no token of the dataset's 1 samples is trained" in err
    for args in (["quote", spec, "--card", "h100", "--hours", "1"], ["compare", spec]):
        code, _, err = run_cli(*args)
        assert code == 2 and "no token" in err, (args, err)


def test_a_catalog_with_a_memory_of_1e308_gb_is_refused():
    code, _, err = run_cli("cards", "--catalog", DATA / "catalog_memory_gb_1e308.yaml")
    assert code == 2 and "memory_gb" in err and "Also" not in err


def test_catalog_import_does_not_divide_by_a_count_the_row_contradicts(tmp_path):
    out = tmp_path / "c.yaml"
    code, stdout, err = run_cli("catalog", "import", DATA / "sky_count_mismatch.csv", "--out",
                                out)
    assert code == 2 and "AcceleratorCount 100" in err and "8 GPUs" in err, err
    assert not out.exists()  # a catalog of no cards would be refused by --catalog
    fixed = tmp_path / "ok.csv"
    fixed.write_text((DATA / "sky_count_mismatch.csv").read_text().replace(",H200,100,",
                                                                            ",H200,8,"))
    code, stdout, err = run_cli("catalog", "import", fixed, "--out", out, "--json")
    price = json.loads(stdout)["cards"][0]["pricing"]["on_demand_usd_per_hour"]
    assert code == 0 and price == "15"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_dataset_path_that_is_not_a_regular_file_is_refused_not_read(tmp_path, kind):
    """Found by the fuzzer: `data` blocked on a FIFO (and would read /dev/zero forever)."""
    import os

    spec = _data_spec(tmp_path, [_GOOD["text"]], "text", True)
    (tmp_path / "data.jsonl").unlink()
    if kind == "fifo":
        os.mkfifo(tmp_path / "data.jsonl")
    else:
        (tmp_path / "data.jsonl").symlink_to("/dev/zero")
    code, _, err = run_cli("data", spec)
    assert code == 2 and "not a regular file" in err, err


def test_axolotl_plugins_that_are_not_a_list_are_refused(tmp_path):
    """Found by the fuzzer: plugins: 7 was iterated (TypeError)."""
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump({"base_model": "meta-llama/Llama-3.1-8B", "adapter": "lora",
                                 "plugins": 7}))
    code, _, err = run_cli("import", p, "--data", "synthetic")
    assert code == 2 and "plugins" in err, err


def test_a_deeply_nested_flow_spec_is_refused_before_the_parser_recurses(tmp_path):
    """Still open from round 3: a 10 kB spec of brackets took seconds of CPU to refuse (PyYAML
    recursed to its limit); the one-pass bracket count refuses it first. Brackets in quoted
    scalars and comments do not count."""
    from tunepilot.spec.yaml_input import _flow_depth

    p = tmp_path / "deep.yaml"
    p.write_text("model: {preset: tiny}\nname: " + "[" * 5000 + "]" * 5000 + "\n")
    code, _, err = run_cli("plan", p, "--card", "h100")
    assert code == 2 and "nested more than 64 levels deep" in err
    assert _flow_depth("a: '[[['\nb: \"{{\"\nc: [1, [2, {d: 3}]]  # [[[[\n") == 3


@pytest.mark.parametrize("target,words", [
    ({"tokens": 1e-300}, "target.tokens: is 1e-300 but must be at least 1"),
    ({"epochs": 1e-300, "dataset_tokens": 1e9}, "target.epochs"),
    ({"epochs": 1, "dataset_tokens": 0.5}, "target.dataset_tokens"),
])
def test_a_target_under_one_token_is_refused_naming_the_field(tmp_path, target, words):
    # the fuzzer's seed 20261206 (spec, case 469): 1e-300 tokens ended in decimal's
    # InvalidOperation when the quote divided the term's cost by them
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "target": target}))
    code, _, err = run_cli("quote", spec, "--card", "h100", "--count", "1")
    assert code == 2 and words in err and "Traceback" not in err


def test_the_cost_per_million_keeps_its_digits_for_any_term_over_any_useful_output():
    from decimal import Decimal

    from tunepilot.cost.quote import _cost_per_million

    assert _cost_per_million(10**12, 1e-6) == Decimal("1e22")  # $1e10 over a millionth of a token, per million
    assert _cost_per_million(0, 1.0) == 0


def test_a_dataset_with_no_whole_micro_batch_is_refused_by_the_quote(tmp_path):
    # the fuzzer's seed 20261206 (dataset, case 6): one pair at micro_batch_size 2 profiled to
    # 0 steps per epoch, and the quote multiplied by its missing useful fraction
    (tmp_path / "data.jsonl").write_text('{"prompt": "a short answer", "chosen": "yes", '
                                         '"rejected": "no"}\n')
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "one-pair", "model": {"preset": "tiny"}, "method": {"kind": "lora"},
        "sequence_length": 16, "micro_batch_size": 2, "objective": {"kind": "dpo"},
        "data": {"source": "jsonl", "path": "data.jsonl", "tokenizer": str(TOKENIZER),
                 "format": "preference"}, "target": {"epochs": 1}}))
    assert run_cli("data", spec)[0] == 0
    code, _, err = run_cli("quote", spec, "--card", "h100", "--hours", "1")
    assert code == 2 and "micro_batch_size" in err and "fills no whole micro-batch" in err
    assert "Traceback" not in err
