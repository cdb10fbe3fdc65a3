"""The inputs benchmarks/fuzz_inputs.py feeds tunepilot, one generator per kind. Each mostly
writes what a user would (a fixture config, a plausible spec, a real dataset row) and now and
then what an adversarial tester would (the hostile values of issue 40's round: NaN, .inf, 2.7
for a count, true for a number, lone surrogates, NUL, deep nesting, FIFOs, /dev/zero, forged
manifests). A generator returns a Case: the command lines to run, what to show for a finding,
and an invariant to check after them (a spec written with exit 0 must plan; export must refuse
what verify rejects; a ledger never holds more cards than its inventory; a count out of range
is never accepted). Pure Python + yaml: tunepilot itself is only run through its CLI."""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VMS = ROOT / "tests" / "fixtures" / "skypilot" / "vms.csv"
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
TOKENIZER = ROOT / "src" / "tunepilot" / "resources" / "tiny" / "chat-tokenizer"
BIGCAT = ROOT / "tests" / "data" / "trust4" / "bigcat.yaml"


@dataclass
class Case:
    steps: list[list[str]]
    shown: object
    check: Callable[[list[tuple[str, int, str]]], str | None] | None = None
    """(outcome, exit code, stdout) of every step -> a broken invariant, or None"""
    notes: dict = field(default_factory=dict)


# --- values ----------------------------------------------------------------------------------

HOSTILE = [None, True, False, 0, -1, 1, 7, 2**31, 10**30, 10**400, 1e308, float("inf"),
           float("-inf"), float("nan"), -0.0, 1e-300, 2.7, "", "x", "-1", "2.7", "1_000",
           "1e400", "5e-5", ".inf", "nan", "true", "all-linear", "\x00", "\ud800", "é" * 50,
           "a\nb: c", "../../etc/passwd", "/dev/zero", [], {}, [1, [2, [3]]], {"a": {"b": None}},
           "9" * 40, [None], [1.5], {"stage": "banana"}, "a" * 5000]
NUMBERS = [0, 1, 2, 4, 8, 16, 64, 512, 2048, 4096, 0.0, 0.05, 0.5, 1.0, 2.0, 1e-5, "5e-5",
           "2e-4", 3.0, 100, 1000]
WORDS = ["auto", "true", "false", "no", "steps", "epoch", "cosine", "linear", "adamw_torch",
         "paged_adamw_8bit", "sdpa", "flash_attention_2", "fa2", "eager", "llama3", "chatml",
         "lora", "qlora", "full", "freeze", "sft", "dpo", "kto", "grpo", "rm", "ppo", "orpo",
         "sigmoid", "ipo", "dapo", "bf16", "bfloat16", "fp8", "te", "tensorwise", "colocate",
         "server", "all", "q_proj,v_proj", "nf4"]


def pick(r: random.Random, good: list, odd: list = HOSTILE, p_odd: float = 0.15):
    """A value a user would write, or (with probability p_odd) one a tester would."""
    return copy.deepcopy(r.choice(odd) if odd and r.random() < p_odd else r.choice(good))


def any_value(r: random.Random):
    return pick(r, NUMBERS + WORDS + [True, False, None, ["q_proj", "v_proj"]], HOSTILE, 0.35)


def deep(depth: int):
    """A value nested ``depth`` lists deep (for YAML/JSON writers: keep it under ~200)."""
    out: object = 1
    for _ in range(depth):
        out = [out]
    return out


def deep_json(depth: int) -> str:
    """JSON text nested ``depth`` deep (any depth: json.dumps itself recurses)."""
    return "[" * depth + "1" + "]" * depth


def dump_yaml(body: object) -> str:
    return yaml.safe_dump(body, allow_unicode=False, sort_keys=False)


# --- trainer configs (import) ------------------------------------------------------------------

_FILES = {"axolotl": ["axolotl-dora-cce.yml", "axolotl-dpo-8b.yml", "axolotl-grpo.yml",
                      "axolotl-liger-fsdp.yml", "axolotl-lora-8b.yml", "axolotl-qlora-chat.yml",
                      "axolotl-sft-8b.yml"],
          "llamafactory": ["llamafactory-liger-eager.yaml", "llamafactory-llama3-lora-dpo.yaml",
                           "llamafactory-llama3-lora-ppo.yaml",
                           "llamafactory-llama3-lora-sft.yaml", "llamafactory-qwen-qlora.yaml",
                           "llamafactory-unsloth.yaml"],
          "trl": ["trl-dpo.yaml", "trl-grpo.yaml", "trl-liger-dora.yaml", "trl-sft.yaml"],
          "hf": ["hf-liger-args.json", "hf-training-args.json"],
          "litgpt": ["litgpt-lora-llama2-7b.yaml"]}
_BASES: dict[str, list[dict]] = {}


def _bases(fmt: str) -> list[dict]:
    if fmt not in _BASES:
        _BASES[fmt] = [yaml.safe_load((CONFIGS / f).read_text()) for f in _FILES[fmt]]
    return _BASES[fmt]


def _known(fmt: str) -> list[str]:
    from tunepilot.integrations.importers import axolotl, litgpt, llamafactory, trl
    from tunepilot.integrations.importers.objectives import TRL_OBJECTIVE_KNOWN

    known = {"axolotl": axolotl.KNOWN, "llamafactory": llamafactory.KNOWN,
             "trl": trl.TRL_KNOWN | TRL_OBJECTIVE_KNOWN, "hf": trl.HF_KNOWN,
             "litgpt": litgpt.KNOWN}[fmt]
    return sorted(known)


def _mutate(r: random.Random, cfg: dict, keys: list[str]) -> None:
    op = r.random()
    if op < 0.45 or not cfg:  # a known key set to something
        cfg[r.choice(keys)] = any_value(r)
    elif op < 0.6:
        cfg.pop(r.choice(list(cfg)), None)
    elif op < 0.75:  # inside a nested block (trl:, fsdp_config:, datasets[0], vllm:)
        nested = [k for k, v in cfg.items() if isinstance(v, dict | list) and v]
        if nested:
            node = cfg[r.choice(nested)]
            if isinstance(node, list):
                node = node[0] if isinstance(node[0], dict) else node
            if isinstance(node, dict):
                node[r.choice(list(node) + ["stage", "num_generations", "path", "type",
                                            "max_seq_length", "micro_batch_size"])] = \
                    any_value(r)
            else:
                node[0] = any_value(r)
    elif op < 0.85:  # an existing key's value made hostile
        cfg[r.choice(list(cfg))] = r.choice(HOSTILE)
    elif op < 0.92:  # a typo of a key, or a stranger
        key = r.choice(keys)
        cfg[key[:-1] + r.choice("xyz") if len(key) > 3 else key + "x"] = any_value(r)
    else:
        cfg[r.choice(["deepspeed", "trl", "fsdp_config", "datasets", "vllm"])] = \
            r.choice([deep(r.choice([3, 70, 150])), {"zero_optimization": {"stage": 3}},
                      [{"path": "data/chat.jsonl", "type": "chat_template"}], "ds.json"])


def config_case(r: random.Random, fmt: str, tmp: Path, i: int) -> Case:
    """`import` of a mutated fixture config of ``fmt`` (sometimes `plan` given it directly)."""
    d = tmp / f"import-{i % 4}"
    d.mkdir(exist_ok=True)
    if not (d / "data").exists():
        (d / "data").symlink_to(CONFIGS / "data")
    cfg = copy.deepcopy(r.choice(_bases(fmt)))
    for _ in range(r.choice([0, 1, 1, 2, 3, 5])):
        _mutate(r, cfg, _known(fmt))
    if r.random() < 0.02:
        cfg = r.choice(HOSTILE)
    path = d / ("config.json" if fmt == "hf" else "config.yaml")
    path.write_text(json.dumps(cfg) if fmt == "hf" else dump_yaml(cfg))
    out = d / "spec.yaml"
    out.unlink(missing_ok=True)
    args = ["import", str(path), "--from", fmt, "--out", str(out), "--json"]
    if r.random() < 0.6:
        args += ["--data", "synthetic"]
    elif r.random() < 0.7:
        args += ["--tokenizer", str(TOKENIZER)]
    if fmt == "trl" and r.random() < 0.5:
        args += ["--objective", pick(r, ["sft", "dpo", "kto", "grpo", "rloo", "reward"],
                                     ["ppo", "nope"], 0.1)]
    if r.random() < 0.1:
        args += ["--devices", pick(r, ["1", "2", "8"], ["0", "5000", "x"], 0.3)]
    if r.random() < 0.1:
        return Case([["plan", str(path), "--card", "h100", "--json"]], cfg)
    return Case([args, ["plan", str(out), "--card", "h100", "--json"]], cfg,
                check=_written_spec_plans(out))


def _written_spec_plans(out: Path):
    def check(results):
        imported, planned = results[0][0], results[1]
        if imported == "exit 0" and out.exists() and planned[0] != "exit 0":
            return f"import exited 0 and wrote a spec that plan refuses ({planned[0]})"
        return None
    return check


def ds_config_case(r: random.Random, tmp: Path, i: int) -> Case:
    """A DeepSpeed config (a file or inline) named by an HF or axolotl config."""
    d = tmp / f"ds-{i % 4}"
    d.mkdir(exist_ok=True)
    zero = {"stage": pick(r, [0, 1, 2, 3, "3"], [4, -1, "auto", "banana", "\x00", 3.0, [3],
                                                   None, True], 0.3)}
    for key in ("offload_param", "offload_optimizer"):
        if r.random() < 0.4:
            zero[key] = pick(r, [{"device": "cpu"}, {"device": "none"}, {"device": "nvme"}],
                             ["cpu", None, [], {"device": ["cpu"]}], 0.3)
    conf: object = {"zero_optimization": zero,
                    "train_micro_batch_size_per_gpu": pick(r, ["auto", 1, 4])}
    shape = r.random()
    nested = None
    if shape < 0.08:
        nested = '{"zero_optimization": ' + deep_json(r.choice([65, 200, 3000])) + "}"
        conf = {"zero_optimization": "(nested)"}
    elif shape < 0.12:
        conf = r.choice(HOSTILE)
    target = d / "ds.json"
    for p in (target,):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        elif p.exists() or p.is_symlink():
            p.unlink()
    kind = r.random()
    if kind < 0.75:
        text = nested or json.dumps(conf)
        if r.random() < 0.05:
            text = text[: len(text) // 2]  # truncated
        elif r.random() < 0.03:
            text = "\x00" + text
        target.write_text(text)
    elif kind < 0.8:
        os.mkfifo(target)
    elif kind < 0.84:
        target.symlink_to("/dev/zero")
    elif kind < 0.88:
        target.mkdir()
    name = pick(r, ["ds.json", "./ds.json", str(target), "zero3.json", "ds_zero2.json"],
                ["", "\x00", 3, ["ds.json"], "a" * 5000], 0.1)
    value = conf if r.random() < 0.2 else name
    cfg = copy.deepcopy(r.choice(_bases("hf") if r.random() < 0.5 else _bases("axolotl")))
    fmt = "hf" if "model_name_or_path" in cfg else "axolotl"
    cfg["deepspeed"] = value
    cfg.pop("fsdp", None)
    path = d / ("config.json" if fmt == "hf" else "config.yaml")
    path.write_text(json.dumps(cfg) if fmt == "hf" else dump_yaml(cfg))
    out = d / "spec.yaml"
    out.unlink(missing_ok=True)
    return Case([["import", str(path), "--from", fmt, "--data", "synthetic", "--out", str(out),
                  "--json"], ["plan", str(out), "--card", "h100", "--json"]],
                {"deepspeed": value, "file": str(conf)[:200]}, check=_written_spec_plans(out))


# --- run specs ---------------------------------------------------------------------------------

PRESETS = ["tiny", "llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "mixtral-8x7b", "gemma-2-2b",
           "phi-3-mini", "llama-3.1-70b", "nope", ""]


def _method(r: random.Random) -> dict:
    kind = pick(r, ["full", "lora", "qlora"], ["dora", 3], 0.03)
    m: dict = {"kind": kind}
    if kind != "full" or r.random() < 0.025:
        m["lora_rank"] = pick(r, [1, 8, 64, 256], [0, -3, 10**9, 2.5], 0.03)
        m["lora_alpha"] = pick(r, [16, 32.0], [0, float("inf")], 0.03)
        m["lora_targets"] = pick(r, ["all-linear", ["o_proj", "down_proj"], ["lm_head"]],
                                 [["embed_tokens"], ["w1"], ["gate"], [], "q_proj", [3]], 0.05)
    return m


FIELDS = {
    "method": _method,
    "precision": lambda r: pick(r, ["fp32", "bf16-mixed", "bf16-true", "fp16-mixed"], ["fp8"],
                                0.03),
    "optimizer": lambda r: {"name": pick(r, ["adamw", "adamw_8bit", "paged_adamw",
                                             "paged_adamw_8bit", "sgd", "adafactor"], ["lion"],
                                         0.03),
                            "impl": pick(r, [None, "foreach", "fused", "for-loop"], ["x"], 0.03)},
    "sequence_length": lambda r: pick(r, [1, 2, 64, 128, 2048, 4096, 32768, 131072],
                                      [0, -5, 2**40, 3.5], 0.03),
    "micro_batch_size": lambda r: pick(r, [1, 2, 8, 64, 512], [0, 2**31, "4"], 0.03),
    "gradient_accumulation_steps": lambda r: pick(r, [1, 4, 64], [0, 10**6], 0.03),
    "activation_checkpointing": lambda r: pick(r, ["none", "full", "selective", "selective-op"],
                                               [True, "some"], 0.03),
    "parallel": lambda r: {"strategy": pick(r, ["ddp", "fsdp"], ["tp", "single"], 0.03),
                           "devices": pick(r, [1, 2, 8, 64, 4096], [0, 5000], 0.03),
                           "nodes": pick(r, [1, 2], [0], 0.03),
                           "cpu_offload": r.choice([False, True])},
    "kernels": lambda r: {"attention": pick(r, ["sdpa", "eager", "flash-attention-2", "flex"],
                                            ["flash_attention_2"], 0.03),
                          "liger": pick(r, [[], ["rms_norm"], ["fused_linear_cross_entropy"],
                                            ["rms_norm", "swiglu", "rope"]],
                                        [["rms_norm", "rms_norm"], ["x"]], 0.03),
                          "cut_cross_entropy": pick(r, [False], [True], 0.1)},
    "objective": lambda r: {"kind": pick(r, ["sft", "dpo", "kto", "reward", "grpo"], ["x"],
                                         0.03),
                            "num_generations": pick(r, [1, 8, 64], [0, 4097], 0.03),
                            "loss_type": pick(r, [None, "sigmoid", "dapo", "grpo", "kto"],
                                              ["banana", 3], 0.05)},
    "target": lambda r: pick(r, [{"tokens": 1e9}, {"tokens": 1e12}, {"tokens": 5e5}],
                             [{"tokens": -1}, {"tokens": 1e30}, {"epochs": 2}], 0.03),
    "validation": lambda r: {"micro_batch_size": pick(r, [None, 1, 64], [0], 0.03),
                             "enabled": pick(r, [True, False], ["no", 0], 0.03)},
    "chunked_loss": lambda r: pick(r, [True, False], ["yes"], 0.03),
}


def random_spec(r: random.Random) -> object:
    """Mostly a plausible spec with random choices (huge models on thousands of devices, 128k
    tokens, every optimizer and kernel), now and then a hostile value, rarely not a spec."""
    if r.random() < 0.03:
        return r.choice(HOSTILE)
    spec: dict = {"model": {"preset": pick(r, PRESETS[:-2], PRESETS[-2:], 0.03)}}
    if r.random() < 0.03:
        spec["model"] = r.choice(HOSTILE)
    for name, make in FIELDS.items():
        if r.random() < 0.5:
            spec[name] = make(r)
    if r.random() < 0.15:
        name = r.choice([*FIELDS, "model", "bogus", "name", "seed"])
        if isinstance(spec.get(name), dict) and spec[name] and r.random() < 0.6:
            spec[name][r.choice(list(spec[name]))] = r.choice(HOSTILE)
        else:
            spec[name] = r.choice(HOSTILE)
    return spec


def _model_config(r: random.Random) -> dict:
    """An HF config.json of a small Llama, a field made hostile now and then (N7/N8)."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
           "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
           "tie_word_embeddings": False}
    for _ in range(r.choice([0, 1, 1, 2])):
        cfg[r.choice(list(cfg) + ["head_dim", "rope_scaling"])] = pick(
            r, [1, 2, 64, 128, 4096, True, "llama"], HOSTILE + [float("inf"), "8k"], 0.5)
    return cfg


def spec_case(r: random.Random, tmp: Path, i: int) -> Case:
    d = tmp / f"spec-{i % 4}"
    d.mkdir(exist_ok=True)
    body = random_spec(r)
    if isinstance(body, dict) and r.random() < 0.15:
        (d / "config.json").write_text(json.dumps(_model_config(r)))
        body["model"] = {"config": "config.json"}
    p = d / "spec.yaml"
    p.write_text(dump_yaml(body))
    if r.random() < 0.2:
        return Case([["quote", str(p), "--card", "h100", "--count", r.choice(["1", "8"]),
                      "--json"]], body)
    return Case([["plan", str(p), "--card", "h100", "--json"]], body)
