"""`tunepilot import`: the configs people already have (axolotl, LLaMA-Factory, TRL, HF
TrainingArguments) become run specs that plan; nothing is dropped silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tunepilot.errors import UserError
from tunepilot.integrations.importers import ImportOptions, detect, import_config, read_config
from tunepilot.integrations.importers.common import DataUnavailable
from tunepilot.plan.api import make_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
TOKENIZER = str(ROOT / "src" / "tunepilot" / "resources" / "tiny" / "chat-tokenizer")
EXE = Path(sys.executable).with_name("tunepilot")

CASES = {
    # file: (format, preset, method, sequence_length, micro_batch, accumulation, optimizer)
    "axolotl-lora-8b.yml": ("axolotl", "llama-3-8b", "lora", 4096, 2, 4, "adamw_8bit"),
    "axolotl-qlora-chat.yml": ("axolotl", None, "qlora", None, None, None, None),
    "llamafactory-llama3-lora-sft.yaml": ("llamafactory", "llama-3-8b", "lora", None, 1, 8,
                                          None),
    "llamafactory-qwen-qlora.yaml": ("llamafactory", "qwen2.5-7b", "qlora", 1024, 2, 4,
                                     "paged_adamw_8bit"),
    "trl-sft.yaml": ("trl", None, "lora", None, None, None, None),
    "hf-training-args.json": ("hf", "llama-3.2-1b", "qlora", 4096, 4, 4, "adamw"),
    "litgpt-lora-llama2-7b.yaml": ("litgpt", "llama-2-7b", "lora", 1304, 1, 16, "adamw"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_format_is_detected_imported_and_plans(name):
    fmt, preset, kind, seq, mbs, accum, opt = CASES[name]
    path = CONFIGS / name
    assert detect(read_config(path)) == fmt
    synthetic = name in ("axolotl-lora-8b.yml", "litgpt-lora-llama2-7b.yaml")  # hub datasets
    result = import_config(path, options=ImportOptions(tokenizer=TOKENIZER,
                                                       synthetic_data=synthetic))
    spec = result.spec
    assert result.source == fmt
    assert spec.method.kind == kind
    if preset:
        assert spec.model.preset == preset
    if seq:
        assert spec.sequence_length == seq
    if mbs:
        assert spec.micro_batch_size == mbs
    if accum:
        assert spec.gradient_accumulation_steps == accum
    if opt:
        assert spec.optimizer.name == opt
    # every key is either mapped or listed as ignored
    raw = read_config(path)
    accounted = set(result.mapped) | set(result.ignored) | set(result.defaults) | \
        set(result.not_mapped) | set(result.no_effect)
    assert set(raw) == accounted, set(raw) ^ accounted
    assert not set(result.ignored) & set(result.mapped)
    plan = make_plan(spec, card_ids=["h100-sxm-80gb"], base_dir=path.parent)
    assert plan.per_device.allocated_peak_bytes > 0


def test_the_mapped_fields_of_a_known_config_are_the_right_ones():
    r = import_config(CONFIGS / "axolotl-lora-8b.yml", options=ImportOptions(synthetic_data=True))
    s = r.spec
    assert (s.method.lora_rank, s.method.lora_alpha, s.method.lora_dropout) == (32, 16, 0.05)
    assert s.method.lora_targets == "all-linear"
    assert s.precision == "bf16-mixed"
    assert s.activation_checkpointing == "full"
    assert "wandb_project" in r.ignored and "sample_packing" not in r.ignored
    assert any(n.startswith("sample_packing") or " sample_packing," in n for n in r.notes)


def test_local_chat_data_becomes_the_data_section():
    r = import_config(CONFIGS / "axolotl-qlora-chat.yml",
                      options=ImportOptions(tokenizer=TOKENIZER))
    d = r.spec.data
    assert d.source == "jsonl" and d.data_format == "messages"
    assert d.train_on == "completions" and d.packing is True
    r = import_config(CONFIGS / "llamafactory-llama3-lora-sft.yaml",
                      options=ImportOptions(tokenizer=TOKENIZER))
    assert r.spec.data.data_format == "prompt-completion"
    # LLaMA-Factory checkpoints activations unless disable_gradient_checkpointing
    assert r.spec.activation_checkpointing == "full"


def _write(tmp_path: Path, name: str, body: dict) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body))
    return p


def test_a_typo_is_refused_with_did_you_mean(tmp_path):
    p = _write(tmp_path, "ax.yml", {"base_model": "meta-llama/Meta-Llama-3-8B", "adapter": "lora",
                                     "sequence_len": 1024, "micro_batch_size": 1,
                                     "lora_rnk": 8})
    with pytest.raises(UserError) as e:
        import_config(p, "axolotl")
    assert "lora_rnk" in str(e.value) and "lora_r" in str(e.value)


def test_an_unknown_hub_model_lists_the_presets(tmp_path):
    p = _write(tmp_path, "ax.yml", {"base_model": "someone/Unheard-Of-9B", "adapter": "lora",
                                     "sequence_len": 1024, "micro_batch_size": 1})
    with pytest.raises(UserError) as e:
        import_config(p, "axolotl")
    text = str(e.value)
    assert "someone/Unheard-Of-9B" in text and "llama-3-8b" in text


def test_a_hub_dataset_is_refused_by_import_and_planned_synthetic_on_the_fly(tmp_path):
    with pytest.raises(DataUnavailable) as e:
        import_config(CONFIGS / "axolotl-lora-8b.yml")
    assert "never downloads" in str(e.value) and "--data synthetic" in str(e.value)
    proc = subprocess.run([str(EXE), "plan", str(CONFIGS / "axolotl-lora-8b.yml"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "synthetic tokens" in proc.stderr and "imported" in proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["stage"] == "plan" and plan["params"]["trainable"] == 83_886_080  # 8B, r=32


@pytest.mark.slow
def test_import_cli_writes_a_spec_that_plans_from_its_own_directory(tmp_path):
    out = tmp_path / "sub" / "spec.yaml"
    out.parent.mkdir()
    proc = subprocess.run([str(EXE), "import", str(CONFIGS / "llamafactory-qwen-qlora.yaml"),
                           "--tokenizer", TOKENIZER, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.startswith("# imported by `tunepilot import`")
    proc = subprocess.run([str(EXE), "data", str(out), "--json", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["samples"] > 0


@pytest.mark.slow
def test_bad_input_exits_2_without_a_traceback(tmp_path):
    spec_like = _write(tmp_path, "spec.yaml", {"model": {"preset": "tiny"}})
    empty_model = _write(tmp_path, "ax.yml", {"adapter": "lora", "sequence_len": 512,
                                              "micro_batch_size": 1})
    for args in (["import", str(spec_like)], ["import", str(empty_model), "--from", "axolotl"],
                 ["import", str(CONFIGS / "trl-sft.yaml"), "--from", "nosuch"]):
        proc = subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "error" in proc.stderr.lower()


@pytest.mark.parametrize("name,key", [("llamafactory-llama3-lora-sft.yaml",
                                       "per_device_eval_batch_size"),
                                      ("trl-sft.yaml", "per_device_eval_batch_size"),
                                      ("axolotl-lora-8b.yml", "eval_batch_size")])
def test_the_evaluation_batch_becomes_the_validation_micro_batch(tmp_path, name, key):
    p = tmp_path / name
    p.write_text((CONFIGS / name).read_text() + f"\n{key}: 16\n")
    r = import_config(p, options=ImportOptions(synthetic_data=True))
    assert r.spec.validation.micro_batch_size == 16
    assert key in r.mapped


@pytest.mark.parametrize("name", ["trl-sft.yaml", "axolotl-lora-8b.yml"])
def test_activation_offloading_is_imported(tmp_path, name):
    p = tmp_path / name
    p.write_text((CONFIGS / name).read_text() + "\nactivation_offloading: true\n")
    r = import_config(p, options=ImportOptions(synthetic_data=True))
    assert r.spec.activation_offloading and "activation_offloading" in r.mapped


# --- issue 26: what a new user's own configs hit -----------------------------------------------


def test_a_malformed_fsdp_value_is_a_message_naming_it(tmp_path):
    body = json.loads((CONFIGS / "hf-training-args.json").read_text())
    body["fsdp"] = [{"a": 1}]
    p = tmp_path / "args.json"
    p.write_text(json.dumps(body))
    proc = subprocess.run([str(EXE), "import", str(p), "--from", "hf"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "fsdp" in proc.stderr


@pytest.mark.parametrize("name,key,targets", [
    ("trl-sft.yaml", "lora_target_modules", ["q_proj", "attention_dense"]),
    ("hf-training-args.json", "target_modules", ["q_proj", "embed_tokens"]),
    ("llamafactory-qwen-qlora.yaml", "lora_target", "q_proj,mlp"),
])
def test_lora_targets_that_are_not_linear_layers_are_refused_at_import(tmp_path, name, key,
                                                                      targets):
    raw = read_config(CONFIGS / name)
    raw[key] = targets
    p = tmp_path / name
    p.write_text(json.dumps(raw) if name.endswith(".json") else yaml.safe_dump(raw))
    with pytest.raises(UserError) as e:
        import_config(p, options=ImportOptions(tokenizer=TOKENIZER, synthetic_data=True))
    text = str(e.value)
    assert key in text and "not a linear layer" in text and "all-linear" in text


@pytest.mark.parametrize("name,key", [("trl-sft.yaml", "packing"),
                                      ("llamafactory-qwen-qlora.yaml", "packing"),
                                      ("axolotl-qlora-chat.yml", "sample_packing")])
def test_packing_set_in_the_config_is_listed_as_mapped(tmp_path, name, key):
    raw = read_config(CONFIGS / name)
    raw[key] = True
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    for f in ("data",):
        if (CONFIGS / f).is_dir() and not (tmp_path / f).exists():
            (tmp_path / f).symlink_to(CONFIGS / f)
    r = import_config(p, options=ImportOptions(tokenizer=TOKENIZER))
    assert r.spec.data.packing is True
    assert key in r.mapped and key not in r.defaults


def test_save_eval_keep_and_workers_reach_the_spec_in_every_format():
    """TrainingArguments' save_steps, eval_steps, save_total_limit and dataloader_num_workers,
    shared by the four formats, were listed as ignored: the quote counted the default number of
    checkpoint writes and validations, the host plan no dataloader workers."""
    synth = ImportOptions(synthetic_data=True)
    lf = import_config(CONFIGS / "llamafactory-llama3-lora-sft.yaml", options=synth)
    assert lf.spec.checkpoint.every_steps == 500 and lf.spec.data.num_workers == 4
    assert lf.mapped["save_steps"] == "checkpoint.every_steps"
    assert {"save_steps", "dataloader_num_workers"}.isdisjoint(lf.ignored)
    hf = import_config(CONFIGS / "hf-training-args.json", options=synth)
    assert hf.spec.checkpoint.every_steps == 500 and "save_steps" not in hf.ignored


@pytest.mark.parametrize("value", [0, -3, 2.5, "often", float("inf"), 10**13])
def test_a_bad_save_steps_is_refused_naming_the_key(tmp_path, value):
    body = {"model_name_or_path": "meta-llama/Llama-3.1-8B", "output_dir": "out",
            "save_steps": value, "save_total_limit": 3, "eval_steps": 50}
    with pytest.raises(UserError) as err:
        import_config(_write(tmp_path, "args.json", body))
    assert "save_steps" in err.value.field
    body["save_steps"] = 0.1  # HF: a fraction of the run's steps
    r = import_config(_write(tmp_path, "args.json", body))
    assert r.spec.checkpoint.every_steps == 1000 and any("fraction" in n for n in r.notes)
    assert r.spec.host.checkpoints_kept == 3 and r.spec.validation.every_steps == 50


def test_dataset_keys_under_synthetic_data_are_said_unused_not_ignored():
    r = import_config(CONFIGS / "axolotl-qlora-chat.yml",
                      options=ImportOptions(synthetic_data=True))
    for key in ("sample_packing", "val_set_size", "train_on_inputs", "chat_template"):
        assert key not in r.ignored
    assert any("sample_packing" in n and "not read" in n for n in r.notes)


def test_axolotls_linearized_llama4_is_planned_with_nn_linear_experts(tmp_path):
    """axolotl's own Llama 4 QLoRA example: the linearized checkpoint (llama4_linearized_experts)
    is imported as moe.experts_layout per_expert, so QLoRA's NF4 base holds the experts."""
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan

    p = tmp_path / "scout.yml"
    p.write_text((CONFIGS / "axolotl-qlora-chat.yml").read_text()
                 + "\nbase_model: axolotl-quants/Llama-4-Scout-17B-16E-Linearized-bnb-nf4-bf16"
                 "\nllama4_linearized_experts: true\n")
    r = import_config(p, options=ImportOptions(synthetic_data=True))
    assert r.spec.model.preset == "llama-4-scout-17b-16e"
    assert r.spec.moe.experts_layout == "per_expert" and "llama4_linearized_experts" in r.mapped
    one = r.spec.with_changes(parallel={"strategy": "single"})
    linear = analytic_plan(one, resolve_arch(one)).per_device.weights_bytes
    fused_spec = one.with_changes(moe={"experts_layout": "fused"})
    fused = analytic_plan(fused_spec, resolve_arch(fused_spec)).per_device.weights_bytes
    assert linear < fused / 2.5  # ~97B routed parameters in NF4, not bf16
