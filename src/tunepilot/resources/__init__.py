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
LAUNCH_YAML = RESOURCES / "launch.yaml"
DEMO_SPEC_YAML = RESOURCES / "demo.yaml"
PRESETS_DIR = RESOURCES / "presets"
TINY_DIR = RESOURCES / "tiny"
TINY_TEXT = TINY_DIR / "train.jsonl"
TINY_TOKENIZER = TINY_DIR / "tokenizer"
TINY_CHAT = TINY_DIR / "chat.jsonl"
TINY_CHAT_TOKENIZER = TINY_DIR / "chat-tokenizer"
TINY_PREFERENCE = TINY_DIR / "preference.jsonl"  # read with the chat tokenizer
TINY_PROMPTS = TINY_DIR / "prompts.jsonl"


def read_yaml(path: Path) -> object:
    """A shipped data file, parsed with libyaml's safe loader where PyYAML has it (the same
    documents as yaml.safe_load, in a tenth of the CPU: throughput_runs.yaml in 20 ms, not
    200; every `quote` reads it)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 - safe loader


@cache
def runtime_constants() -> dict:
    """runtime.yaml (the runtime context, workspaces, the allocator's reserve), read once."""
    return read_yaml(RUNTIME_YAML)


@cache
def launch_constants() -> dict:
    """launch.yaml (the pilot job's allowances, SkyPilot's idle safety net), read once."""
    return read_yaml(LAUNCH_YAML)
