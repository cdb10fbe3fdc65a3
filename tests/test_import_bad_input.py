"""`tunepilot import` (and `plan` given a trainer's config) on the adversarial round's inputs
(issue 40 item 12, N1-N6): one number parser for every importer, a bound on a nested DeepSpeed
config, paths that must be strings, and never a spec written with exit 0 that `plan` refuses or
that is not YAML. Issue 40 item 5: axolotl's val_set_size 0 turns validation off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from support.cli import run_cli
from tunepilot.errors import UserError
from tunepilot.integrations.importers import ImportOptions, import_config, write_spec
from tunepilot.integrations.importers.common import parse_number

DATA = Path(__file__).resolve().parent / "data" / "trust4"
CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
TOKENIZER = Path(__file__).resolve().parents[1] / "src" / "tunepilot" / "resources" / "tiny" / \
    "chat-tokenizer"


@pytest.mark.parametrize("name,args,key", [
    ("trl_num_generations_abc.yaml", ["--from", "trl", "--objective", "grpo"], "num_generations"),
    ("trl_beta_list.yaml", ["--from", "trl", "--objective", "dpo"], "beta"),
    ("axo_trl_nan.yml", ["--from", "axolotl"], "trl.num_generations"),
    ("hf_batch_inf.json", ["--from", "hf"], "per_device_train_batch_size"),
    ("lf_ppo_epochs_inf.yaml", ["--from", "llamafactory"], "ppo_epochs"),
    ("axo_ds_deep.yml", ["--from", "axolotl"], "deepspeed"),
    ("lf_dataset_dir_int.yaml", ["--from", "llamafactory"], "dataset_dir"),
    ("lf_additional_target.yaml", ["--from", "llamafactory"], "additional_target"),
    ("axo_ds_nul.yml", ["--from", "axolotl"], "deepspeed.zero_optimization.stage"),
    ("axo_ds_banana.yml", ["--from", "axolotl"], "deepspeed.zero_optimization.stage"),
])
def test_each_bad_config_is_one_paragraph_naming_its_key_and_nothing_is_written(
        tmp_path, name, args, key):
    out = tmp_path / "spec.yaml"
    synthetic = [] if name == "lf_dataset_dir_int.yaml" else ["--data", "synthetic"]
    code, _, err = run_cli("import", DATA / name, *args, *synthetic, "--out", out)
    assert code == 2, err
    assert f"{key}:" in err or f"{key} (the spec's" in err, err
    assert "Traceback" not in err and not out.exists()


def test_plan_given_the_config_directly_refuses_it_the_same_way():
    code, _, err = run_cli("plan", DATA / "trl_num_generations_abc.yaml", "--card", "h100")
    assert code == 2 and "num_generations" in err and "not a whole number" in err


@pytest.mark.parametrize("value,kind,expect", [
    (8, int, 8), (2.0, int, 2), ("16", int, 16), ("5e-5", float, 5e-5), (".5", float, 0.5),
    (3, float, 3.0), ("1_000", int, 1000),
])
def test_the_number_parser_reads_what_trainers_read(value, kind, expect):
    got = parse_number(value, "k", kind)
    assert got == expect and type(got) is kind


@pytest.mark.parametrize("value,kind,words", [
    (2.7, int, "not a whole number"), (True, int, "not a whole number"),
    (False, float, "not a number"), ([1], float, "not a number"), ({}, int, "not a whole"),
    (float("nan"), float, "finite"), (float("inf"), int, "finite"), ("inf", float, "not a"),
    ("abc", int, "not a whole number"), ("", int, "not a whole number"),
    (10**400, float, "too large"), (2**60, int, "larger than any count"), ("e5", float, "not"),
])
def test_the_number_parser_refuses_what_is_not_a_number(value, kind, words):
    with pytest.raises(UserError) as err:
        parse_number(value, "cfg.yml: key", kind)
    assert words in str(err.value) and err.value.field == "cfg.yml: key"


def test_silent_coercions_are_refused(tmp_path):
    """N6: 2.7 was read as 2, true as 1, quantization_bit -1 as plain LoRA."""
    cases = [
        ("ax.yml", {"base_model": "meta-llama/Llama-3.1-8B", "adapter": "lora",
                    "micro_batch_size": 2.7}, "micro_batch_size"),
        ("ax2.yml", {"base_model": "Qwen/Qwen2.5-7B-Instruct", "adapter": "lora", "rl": "grpo",
                     "trl": {"num_generations": True}}, "trl.num_generations"),
        ("lf.yaml", {"model_name_or_path": "meta-llama/Llama-3.2-1B", "stage": "sft",
                     "finetuning_type": "lora", "quantization_bit": -1}, "quantization_bit"),
        ("lf2.yaml", {"model_name_or_path": "meta-llama/Llama-3.2-1B", "stage": "sft",
                      "finetuning_type": "lora", "quantization_bit": 2}, "quantization_bit"),
    ]
    for name, body, key in cases:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(body))
        with pytest.raises(UserError) as err:
            import_config(p, options=ImportOptions(synthetic_data=True))
        assert key in err.value.field, (name, err.value)


def test_a_written_spec_reads_back_even_when_a_note_holds_control_characters(tmp_path):
    """N5: a note quoting the config (here a dataset path with a NUL and a line break) was
    written raw into the spec's header, which is then not YAML."""
    body = {"base_model": "meta-llama/Llama-3.1-8B", "adapter": "lora",
            "datasets": [{"path": "hub/one"}, {"path": "hub\x00two\nmodel: {preset: x}"}]}
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump(body))
    result = import_config(p, options=ImportOptions(synthetic_data=True))
    result.notes.append("quoted: \x00 \x85 \u2028 \ud800 end\nmodel: {preset: nope}")
    out = tmp_path / "spec.yaml"
    write_spec(result, out)
    code, _, err = run_cli("plan", out, "--card", "h100", "--json")
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["model"] == {"preset": "llama-3.1-8b"}


# --- item 5: axolotl val_set_size 0 runs no evaluation ------------------------------------


def _axolotl(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load((CONFIGS / "axolotl-lora-8b.yml").read_text())
    raw.update(changes)
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_val_set_size_0_turns_validation_off_and_the_quote_bills_none(tmp_path):
    p = _axolotl(tmp_path, val_set_size=0.0, tf32=True)
    result = import_config(p, options=ImportOptions(synthetic_data=True))
    assert result.spec.validation.enabled is False
    assert result.mapped["val_set_size"] == "validation.enabled"
    assert any("val_set_size 0" in n and "validation off" in n for n in result.notes)
    out = tmp_path / "spec.yaml"
    write_spec(result, out)
    code, body, err = run_cli("quote", out, "--card", "h100", "--count", "8", "--json")
    assert code == 0, err
    terms = {t["name"]: t for t in json.loads(body)["time_terms"]}
    assert terms["validation"]["times"] == 0 and terms["validation"]["total"]["value"] == 0
    on = import_config(_axolotl(tmp_path, val_set_size=0.05),
                       options=ImportOptions(synthetic_data=True))
    assert on.spec.validation.enabled is True


def test_the_summary_does_not_call_set_keys_off(tmp_path):
    """pad_to_sequence_len: true and tf32: true were listed as "off/empty in the config"."""
    p = _axolotl(tmp_path, val_set_size=0.0, tf32=True, pad_to_sequence_len=True)
    result = import_config(p, options=ImportOptions(synthetic_data=True))
    assert "tf32" not in result.defaults and "pad_to_sequence_len" not in result.defaults
    assert "tf32" in result.not_mapped
    assert any(n.startswith("tf32: true") for n in result.notes)
    code, out, _ = run_cli("import", p, "--data", "synthetic")
    assert code == 0
    off_line = next((line for line in out.splitlines() if "off/empty" in line), "")
    assert "tf32" not in off_line and "pad_to_sequence_len" not in off_line


@pytest.mark.parametrize("datasets", [[{"path": [], "type": "chat_template"}],
                                      [{"path": None}], [{"data_files": [], "path": 3}]])
def test_a_dataset_without_a_path_is_refused_naming_it(tmp_path, datasets):
    """Found by the fuzzer (seed 2861090967): datasets[0].path [] was indexed (IndexError)."""
    p = tmp_path / "ax.yml"
    p.write_text(yaml.safe_dump({"base_model": "meta-llama/Llama-3.1-8B", "adapter": "lora",
                                 "datasets": datasets}))
    code, _, err = run_cli("import", p, "--tokenizer", TOKENIZER)
    assert code == 2 and "datasets" in err, err


def test_save_only_model_and_group_by_length_are_said_not_ignored(tmp_path):
    """Both change the run where set true - checkpoints that cannot resume, less padding - and
    the spec has no field for either: import listed them as ignored."""
    p = _axolotl(tmp_path, save_only_model=True, group_by_length=True)
    result = import_config(p, options=ImportOptions(synthetic_data=True))
    assert "save_only_model" not in result.ignored and "group_by_length" not in result.ignored
    assert any(n.startswith("save_only_model: true") and "cannot resume" in n
               for n in result.notes)
    assert any(n.startswith("group_by_length: true") and "upper bound" in n
               for n in result.notes)
    off = import_config(_axolotl(tmp_path, save_only_model=False),
                        options=ImportOptions(synthetic_data=True))
    assert not any("save_only_model" in n for n in off.notes)
