"""Data files shipped with tunepilot: the catalog, the cost model and runtime constants, the
model presets, the demo spec, the tiny text, chat, preference and prompt sets and their
tokenizers. Code reads them through these paths only."""

from functools import cache
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent
CATALOG_YAML = RESOURCES / "catalog.yaml"
COST_MODEL_YAML = RESOURCES / "cost_model.yaml"
THROUGHPUT_MODEL_YAML = RESOURCES / "throughput_model.yaml"
THROUGHPUT_RUNS_YAML = RESOURCES / "throughput_runs.yaml"
STEP_MODEL_YAML = RESOURCES / "step_model.yaml"
RUNTIME_YAML = RESOURCES / "runtime.yaml"
DEMO_SPEC_YAML = RESOURCES / "demo.yaml"
PRESETS_DIR = RESOURCES / "presets"
TINY_DIR = RESOURCES / "tiny"
TINY_TEXT = TINY_DIR / "train.jsonl"
TINY_TOKENIZER = TINY_DIR / "tokenizer"
TINY_CHAT = TINY_DIR / "chat.jsonl"
TINY_CHAT_TOKENIZER = TINY_DIR / "chat-tokenizer"
TINY_PREFERENCE = TINY_DIR / "preference.jsonl"  # read with the chat tokenizer
TINY_PROMPTS = TINY_DIR / "prompts.jsonl"


@cache
def runtime_constants() -> dict:
    """runtime.yaml (the runtime context, workspaces, the allocator's reserve), read once."""
    import yaml

    return yaml.safe_load(RUNTIME_YAML.read_text())
