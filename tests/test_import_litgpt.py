"""`tunepilot import` of LitGPT's `litgpt finetune_lora|finetune_full --config` YAML: its LoRA
flags become this model's module names (split q/k/v, or a fused qkv's parts), its devices its
FSDP run, and a value LitGPT cannot run (or tunepilot cannot plan) is refused by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunepilot.errors import UserError
from tunepilot.integrations.importers import ImportOptions, import_config

ROOT = Path(__file__).resolve().parents[1]
LORA = ROOT / "tests" / "fixtures" / "configs" / "litgpt-lora-llama2-7b.yaml"
NEOX = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 1024,
        "vocab_size": 512, "max_position_embeddings": 2048, "rotary_pct": 0.25,
        "use_parallel_residual": True}


def _config(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(LORA.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        elif value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    p = tmp_path / "litgpt.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _import(path: Path):
    return import_config(path, options=ImportOptions(synthetic_data=True)).spec


def test_litgpts_default_lora_config_is_the_run_the_accuracy_benchmark_plans():
    spec = _import(LORA)
    assert spec.model.implementation == "litgpt" and spec.model.preset == "llama-2-7b"
    assert spec.method.lora_targets == ["q_proj", "v_proj"]  # lora_query, lora_value
    assert spec.method.adapter_dtype == "bf16" and spec.precision == "bf16-true"
    assert (spec.sequence_length, spec.micro_batch_size, spec.gradient_accumulation_steps) == \
        (1304, 1, 16)
    assert spec.checkpoint.every_steps == 200 and spec.validation.every_steps == 100
    assert spec.parallel.strategy == "single" and spec.activation_checkpointing == "none"
    assert spec.validation.num_batches == 100  # eval.max_iters


def test_every_key_inside_train_and_eval_is_read_or_said(tmp_path):
    result = import_config(_config(tmp_path, train={"max_tokens": 10**9, "max_norm": 1.0,
                                                    "warmup_typo": 3}),
                           options=ImportOptions(synthetic_data=True))
    assert result.spec.target.tokens == 10**9
    notes = " ".join(result.notes)
    assert "train.max_norm" in notes and "no effect on memory or time" in notes
    assert "train.warmup_typo" in notes and "ignored" in notes
    assert "eval.max_new_tokens" in notes


def test_a_fused_qkv_model_gets_its_parts_and_the_mlp_flag_every_mlp_matrix(tmp_path):
    model = tmp_path / "neox"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(NEOX))
    spec = _import(_config(tmp_path, checkpoint_dir="neox", lora_mlp=True,
                           lora_projection=True))
    assert spec.method.lora_targets == ["query_key_value", "dense", "dense_h_to_4h",
                                        "dense_4h_to_h"]
    assert spec.method.lora_qkv_parts == ["q", "v"]


def test_devices_become_litgpts_fsdp_runs_and_nf4_dq_its_qlora(tmp_path):
    lora = _import(_config(tmp_path, devices=4,
                           train={"global_batch_size": 16, "micro_batch_size": 2}))
    assert (lora.parallel.strategy, lora.parallel.devices, lora.parallel.fsdp_version) == \
        ("fsdp", 4, 2)  # finetune_lora: fully_shard per Block
    assert lora.activation_checkpointing == "full"
    assert lora.gradient_accumulation_steps == 2  # 16 / (2 x 4)
    full = _import(_config(tmp_path, devices=2, **{k: None for k in (
        "lora_r", "lora_alpha", "lora_dropout", "lora_query", "lora_key", "lora_value",
        "lora_projection", "lora_mlp", "lora_head")}))
    assert full.parallel.fsdp_version == 1  # finetune_full: Lightning's FSDPStrategy
    q = _import(_config(tmp_path, quantize="bnb.nf4-dq"))
    assert q.method.kind == "qlora" and q.method.double_quant and q.method.quantize_lm_head
    assert not q.method.quantize_on_load and q.optimizer.name == "paged_adamw"


def test_a_full_fine_tune_config_has_no_adapters(tmp_path):
    path = _config(tmp_path, **{k: None for k in ("lora_r", "lora_alpha", "lora_dropout",
                                                  "lora_query", "lora_key", "lora_value",
                                                  "lora_projection", "lora_mlp", "lora_head")})
    assert _import(path).method.kind == "full"


@pytest.mark.parametrize("changes,key", [
    ({"train": {"max_seq_length": None}}, "train.max_seq_length"),
    ({"quantize": "bnb.fp4"}, "quantize"),
    ({"lora_query": False, "lora_value": False}, "lora_query"),
    ({"devices": "auto"}, "devices"),
    ({"precision": "transformer-engine"}, "precision"),
    ({"train": {"global_batch_size": 3, "micro_batch_size": 2}}, "train.global_batch_size"),
    ({"optimizer": "Lion"}, "optimizer"),
    ({"train": {"tie_embeddings": True}}, "train.tie_embeddings"),
    ({"quantize": "bnb.nf4", "devices": 2}, "quantize"),
    ({"quantize": "bnb.nf4", "precision": "bf16-mixed"}, "quantize"),
    ({"quantize": "bnb.nf4", "optimizer": "SGD"}, "optimizer"),
])
def test_what_litgpt_or_the_plan_cannot_take_is_refused_naming_the_key(tmp_path, changes, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        _import(_config(tmp_path, **changes))


def test_the_cli_takes_from_litgpt_and_writes_a_spec_that_plans(tmp_path):
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("tunepilot")
    out = tmp_path / "spec.yaml"
    done = subprocess.run([str(exe), "import", str(LORA), "--from", "litgpt", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = subprocess.run([str(exe), "plan", str(out), "--card", "a100-sxm-80gb", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    notes = json.loads(plan.stdout)["assumptions"]
    assert any(n.startswith("model.implementation litgpt") for n in notes)
