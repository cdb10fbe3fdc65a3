"""The presets of issue 40 item 13 (the usual GRPO and fine-tuning sizes, the MoE and the new
architectures): a config naming one by its hub id imports with no hub, `tunepilot presets` lists
it, and resources/presets/SOURCES.yaml says where each came from and at which revision. Their
counts against transformers are tests/test_arch.py's (every preset)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tunepilot.model.arch import META_KEY, Arch, list_presets, load_preset, param_counts
from tunepilot.resources import PRESETS_DIR

# preset -> a hub id a user's config names it by (an -Instruct/-it variant where one exists)
ITEM_13 = {
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-1.7b": "Qwen/Qwen3-1.7B", "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-14b": "Qwen/Qwen3-14B", "qwen3-32b": "Qwen/Qwen3-32B",
    "gemma-3-1b": "google/gemma-3-1b-it", "gemma-3-4b": "google/gemma-3-4b-it",
    "gemma-3-12b": "google/gemma-3-12b-pt", "gemma-3-27b": "google/gemma-3-27b-it",
    "phi-4": "microsoft/phi-4",
    "mistral-small-24b": "mistralai/Mistral-Small-24B-Instruct-2501",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-4-scout-17b-16e": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "gpt-oss-20b": "openai/gpt-oss-20b", "gpt-oss-120b": "openai/gpt-oss-120b",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3-0324",
    "apertus-8b": "swiss-ai/Apertus-8B-Instruct-2509", "olmo-3-7b": "allenai/Olmo-3-7B-Think",
}


@pytest.mark.parametrize("name", sorted(ITEM_13))
def test_an_imported_config_naming_the_model_resolves_to_its_preset_with_no_hub(tmp_path, name):
    from tunepilot.integrations.importers import ImportOptions, import_config

    config = tmp_path / "axolotl.yml"
    config.write_text(yaml.safe_dump({
        "base_model": ITEM_13[name], "adapter": "lora", "lora_r": 8, "lora_target_linear": True,
        "sequence_len": 1024, "micro_batch_size": 1}))
    result = import_config(config, options=ImportOptions(synthetic_data=True))
    assert result.spec_dict["model"] == {"preset": name}
    from tunepilot.model.arch.files import hub_ids

    for hub_id in hub_ids(load_preset(name)):  # model.preset takes the hub id and its aliases
        assert load_preset(hub_id) == load_preset(name)


def test_the_presets_command_lists_them_with_active_parameters():
    proc = subprocess.run([sys.executable, "-m", "tunepilot", "presets", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["preset"]: r for r in json.loads(proc.stdout)}
    assert set(ITEM_13) <= set(rows)
    moe = rows["qwen3-30b-a3b"]
    assert moe["params"] == 30_532_122_624 and moe["active_params"] == 3_353_032_704
    assert rows["qwen3-8b"]["active_params"] == rows["qwen3-8b"]["params"]


def test_sources_lists_every_preset_with_its_hub_id_and_revision():
    sources = yaml.safe_load((PRESETS_DIR / "SOURCES.yaml").read_text())["presets"]
    assert set(sources) == set(list_presets())
    for name, entry in sources.items():
        meta = load_preset(name)[META_KEY]
        assert entry["hf_id"] == meta["hf_id"], name
        revision = str(entry["revision"])
        assert re.fullmatch(r"[0-9a-f]{40}", revision) or revision in ("unknown", "none"), name
        assert entry["config"] in ("verbatim", "copied", "reconstructed", "adapted") or \
            name == "tiny", name


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "deepseek-v3",
                                  "deepseek-v2-lite"])
def test_presets_plan_the_bf16_model_not_the_checkpoints_storage(name):
    cfg = load_preset(name)
    assert "quantization_config" not in cfg and "auto_map" not in cfg
    assert "left out" in cfg[META_KEY]["source"]


def test_gemma3_presets_hold_the_vision_tower_and_the_wider_vocabulary():
    small = Arch.from_config(load_preset("gemma-3-1b"))
    large = Arch.from_config(load_preset("gemma-3-4b"))
    assert (small.vocab_size, small.vision) == (262_144, None)
    assert large.vocab_size == 262_208 and param_counts(large).vision == 419_816_304


def test_deepseek_v3_counts_its_mtp_module_apart_from_the_model_transformers_builds():
    v3 = param_counts(Arch.from_config(load_preset("deepseek-v3")))
    assert v3.total == 671_026_404_352  # the README's 671B
    assert v3.mtp == 11_610_067_968  # README_WEIGHTS: 685B on the hub = 671B + the MTP module
