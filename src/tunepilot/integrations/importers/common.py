"""What every importer shares: a Mapper that records which key of the user's config became which
spec field (and which were ignored), the hub id -> preset lookup, the optimizer and precision
tables, and the mapping of a local dataset.

No torch, no transformers: importing a config is pure data.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunepilot.errors import UserError
from tunepilot.spec.precision import Precision

# Hugging Face TrainingArguments.optim names -> (tunepilot optimizer, impl)
OPTIMIZERS = {
    "adamw_torch": ("adamw", None), "adamw_hf": ("adamw", None), "adamw": ("adamw", None),
    "adamw_torch_fused": ("adamw", "fused"), "adamw_apex_fused": ("adamw", "fused"),
    "adamw_torch_xla": ("adamw", None), "adamw_torch_npu_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw_8bit", None), "adamw_8bit": ("adamw_8bit", None),
    "bnb_8bit": ("adamw_8bit", None),
    "paged_adamw_32bit": ("paged_adamw", None), "paged_adamw": ("paged_adamw", None),
    "paged_adamw_8bit": ("paged_adamw_8bit", None), "adafactor": ("adafactor", None),
    "adamw_torch_8bit": ("adamw_8bit_torchao", None), "adamw_torch_4bit": ("adamw_4bit", None),
    "sgd": ("sgd", None),
}
SCHEDULERS = {"cosine": "cosine", "cosine_with_restarts": "cosine", "cosine_with_min_lr":
              "cosine", "linear": "linear", "constant": "constant",
              "constant_with_warmup": "constant", "warmup_stable_decay": "linear"}
_SUFFIXES = re.compile(r"(-(instruct|chat|hf|it|base|sft|dpo))+$|(-v\d+(\.\d+)*)$")


@dataclass
class ImportResult:
    """A trainer's config read as a tunepilot spec: what became what, and what was ignored."""

    source: str
    path: str
    spec_dict: dict
    mapped: dict[str, str] = field(default_factory=dict)  # their key -> spec field
    ignored: list[str] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)  # read; their value is the spec's default
    notes: list[str] = field(default_factory=list)
    spec: Any = None  # the validated RunSpec
    no_effect: list[str] = field(default_factory=list)
    """read, and known not to change memory or time (loss coefficients, sampling, logging)"""
    not_mapped: list[str] = field(default_factory=list)
    """read and set (not off/empty) in the config, the spec's default kept: its value is what
    tunepilot models anyway (stage: sft), or a note says why it changes nothing (tf32)"""

    def to_dict(self) -> dict:
        return {"source": self.source, "path": self.path, "spec": self.spec_dict,
                "mapped": self.mapped, "ignored": self.ignored,
                "defaults": self.defaults, "notes": self.notes, "no_effect": self.no_effect,
                "not_mapped": self.not_mapped}


class Mapper:
    """Reads keys of ``raw`` (each read marks the key used) and sets spec fields."""

    def __init__(self, source: str, raw: dict, path: Path, known: set[str]):
        self.source, self.raw, self.path, self.known = source, raw, path, known
        self.used: set[str] = set()
        self.spec: dict = {}
        self.mapped: dict[str, str] = {}
        self.notes: list[str] = []
        self.no_effect_keys: set[str] = set()
        self.options = None

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def set(self, dotted: str, value: Any, *keys: str) -> None:
        node = self.spec
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        for k in keys:
            self.used.add(k)
            if k in self.raw:
                self.mapped[k] = dotted

    def maps(self, dotted: str, *keys: str) -> None:
        """Record that ``keys`` of the config became ``dotted`` (a field set inside a section
        written as a whole, e.g. data.packing inside data)."""
        for k in keys:
            self.used.add(k)
            if k in self.raw:
                self.mapped[k] = dotted

    def note(self, text: str) -> None:
        self.notes.append(text)

    def no_effect(self, *keys: str) -> None:
        """Keys read and known not to change memory or time."""
        for k in keys:
            self.used.add(k)
            if k in self.raw and k not in self.mapped:
                self.no_effect_keys.add(k)

    def fail(self, key: str | None, message: str, hint: str | None = None,
             error: type[UserError] = UserError) -> None:
        where = f"{self.path.name}" + (f": {key}" if key else "")
        raise error(where, message, hint)

    def data_unavailable(self, key: str, message: str, hint: str) -> None:
        """The dataset cannot be read here (hub-only, or no local tokenizer): `import` stops;
        a plan of the config given directly falls back to synthetic tokens and says why."""
        self.fail(key, message, hint, error=DataUnavailable)

    def check_typos(self) -> list[str]:
        """The keys not used: an unknown key close to a known one is a typo (exit 2); the rest
        are returned as ignored."""
        ignored = []
        for key in self.raw:
            if key in self.used:
                continue
            if key not in self.known:
                close = difflib.get_close_matches(key, sorted(self.known), n=1, cutoff=0.8)
                if close:
                    self.fail(key, f"is not a {self.source} key.",
                              f"Did you mean {close[0]!r}? Fix the config, then import again.")
            ignored.append(key)
        return ignored


def is_off(value: Any) -> bool:
    """A config value that turns its feature off or leaves it empty: the spec's default is
    what the trainer does (null, false, 0, "", "no", "none", an empty list or mapping)."""
    if value is None or value is False or (isinstance(value, int | float) and value == 0):
        return not (isinstance(value, float) and value != value)
    if isinstance(value, str):
        return value.strip().lower() in ("", "false", "no", "none", "null", "0")
    return isinstance(value, list | dict) and not value


def truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "auto", "yes"))


def model_source(m: Mapper, key: str, value: Any) -> dict:
    """A hub id of a shipped preset -> {preset}; a local directory or config.json -> {config}."""
    if not isinstance(value, str) or not value.strip():
        m.fail(key, "is missing: the config names no model.",
               "Set it to a hub id (e.g. meta-llama/Meta-Llama-3-8B) or a local model directory.")
    local = Path(value)
    if not local.is_absolute():
        local = m.path.parent / local
    if local.exists() and (local.is_file() or (local / "config.json").exists()):
        return {"config": str(value)}
    preset = hub_preset(value)
    if preset is None:
        from tunepilot.model.arch import list_presets

        m.fail(key, f"{value!r} is neither a shipped preset's hub id nor a local model.",
               f"Presets: {', '.join(p for p in list_presets() if p != 'tiny')}. For another "
               "model, download its config.json and point the config (or model.config in the "
               "spec) at that local directory.")
    return {"preset": preset}


def hub_preset(hub_id: str) -> str | None:
    """The preset whose hub id (or name) matches ``hub_id``, ignoring the organisation and
    suffixes such as -Instruct, -chat, -hf, -it, -v0.2."""
    from tunepilot.model.arch import list_presets, load_preset
    from tunepilot.model.arch.files import hub_ids

    want = _norm(hub_id)
    for name in list_presets():  # the hub id, or an alias (an -Instruct variant's id)
        if hub_id.lower() in {i.lower() for i in hub_ids(load_preset(name))}:
            return name
    for name in list_presets():
        hf = (load_preset(name).get("_tunepilot") or {}).get("hf_id")
        if want in {_norm(name), _norm(hf or "")}:
            return name
    return None


def _norm(hub_id: str) -> str:
    name = hub_id.rsplit("/", 1)[-1].lower()
    for _ in range(3):
        name = _SUFFIXES.sub("", name)
    return name.removeprefix("meta-")


def optimizer(m: Mapper, key: str, name: Any) -> None:
    if name is None:
        return
    got = OPTIMIZERS.get(str(name).lower())
    if got is None:
        m.fail(key, f"optimizer {name!r} is not one tunepilot models.",
               f"Use one of {', '.join(sorted(OPTIMIZERS))} (or edit the spec's optimizer).")
    m.set("optimizer.name", got[0], key)
    if got[1]:
        m.set("optimizer.impl", got[1], key)


def scheduler(m: Mapper, key: str, name: Any) -> None:
    if name is None:
        return
    kind = SCHEDULERS.get(str(name).lower())
    if kind is None:
        m.note(f"{key}: {name!r} is not modelled; the spec uses cosine (the schedule does not "
               "change memory or speed)")
        return
    m.set("scheduler.kind", kind, key)


_NUMBER_TEXT = re.compile(r"^[-+]?(\d[\d_]*)?(\.\d*)?([eE][-+]?\d+)?$")
# the largest whole number a config key may hold: past 2^53 a float no longer holds every
# integer, and no batch, rank, step or token count is near it
MAX_CONFIG_INT = 1 << 53


def parse_number(value: Any, where: str, kind: type = int, *, least: float | None = None,
                 most: float | None = None) -> int | float:
    """The one reading of a number in a trainer's config, for every importer: an int or a
    float, or text the trainer would parse as one ("5e-5": PyYAML reads that as a string); a
    whole number where ``kind`` is int (2.7 is not 2, 2.0 is 2), finite, between ``least`` and
    ``most``. true/false, a list, NaN or infinity are refused: UserError naming ``where``."""
    shown = repr(value[:40]) if isinstance(value, str) else reprlib.repr(value)
    what = "a whole number" if kind is int else "a number"
    got: float | int | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        got = value
    elif isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        if _NUMBER_TEXT.match(text) and any(c.isdigit() for c in text):
            try:
                got = int(text) if re.fullmatch(r"[-+]?\d+", text) else float(text)
            except (ValueError, OverflowError):
                got = None
    if got is None:
        raise UserError(where, f"is {shown[:60]}, not {what}.",
                        "Write it as a plain number (e.g. 8, 0.05, 5e-5).")
    if isinstance(got, float) and not math.isfinite(got):
        raise UserError(where, f"is {shown[:60]}: {what} must be finite.",
                        "Write the number the run uses.")
    if kind is int:
        if isinstance(got, float) and got != int(got):
            raise UserError(where, f"is {shown[:60]}, not a whole number.",
                            "The trainer takes a count here: write it without a fraction.")
        if abs(got) > MAX_CONFIG_INT:
            raise UserError(where, f"is {shown[:60]}: larger than any count a run has "
                            f"(at most {MAX_CONFIG_INT:,}).", "Check the value.")
        out: int | float = int(got)
    else:
        try:
            out = float(got)
        except OverflowError:
            raise UserError(where, f"is {shown[:60]}: too large to be a rate or a ratio.",
                            "Check the value.") from None
    if least is not None and out < least:
        raise UserError(where, f"is {out:g}: it must be at least {least:g}.", None)
    if most is not None and out > most:
        raise UserError(where, f"is {out:g}: it must be at most {most:g}.", None)
    return out


def number(m: Mapper, key: str, kind: type = int, *, least: float | None = None,
           most: float | None = None) -> Any:
    """The top-level ``key`` of the config as a number (parse_number), None when unset."""
    value = m.get(key)
    if value is None:
        return None
    return parse_number(value, f"{m.path.name}: {key}", kind, least=least, most=most)


def value_number(m: Mapper, where: str, value: Any, kind: type = int, *,
                 least: float | None = None, most: float | None = None) -> Any:
    """A number found inside a block of the config (``where``: e.g. trl.num_generations)."""
    if value is None:
        return None
    return parse_number(value, f"{m.path.name}: {where}", kind, least=least, most=most)


def text(m: Mapper, key: str, default: str | None = None) -> str | None:
    """The top-level ``key`` as a string (a name, a path, a mode), None when unset; a number,
    a list or a mapping there is refused naming the key."""
    value = m.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        m.fail(key, f"is {str(value)[:60]}, not a name or a path.")
    return str(value)


def config_path(m: Mapper, key: str, value: Any) -> Path:
    """A path the config names (a dataset directory, a DeepSpeed JSON), relative to the
    config's own directory; a non-string or a path no file system can hold is refused."""
    if not isinstance(value, str) or not value.strip():
        m.fail(key, f"is {str(value)[:60]}, not a path.",
               "Write the path as a string, relative to the config's directory or absolute.")
    if "\x00" in value or len(value) > 4096:
        m.fail(key, "is not a path a file system can hold (a NUL character, or over 4096 "
               "characters).")
    p = Path(value)
    return p if p.is_absolute() else m.path.parent / p


def lora_targets(value: Any) -> list[str] | str | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("all", "all-linear", "all_linear"):
            return "all-linear"
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return list(value)
    return None


class DataUnavailable(UserError):
    """The config's dataset is not readable offline (see Mapper.data_unavailable)."""


def local_data(m: Mapper, path_value: str, *, fmt: str | None, fields: dict, tokenizer: str
               | None, key: str) -> dict | None:
    """A local dataset -> the spec's data section (format peeked from the first row when the
    trainer infers it); None when ``path_value`` is not a local path (a hub dataset)."""
    p = config_path(m, key, path_value)
    if not p.exists():
        return None
    if p.is_dir():
        source = "hf-disk"
    else:
        source = {".parquet": "parquet", ".arrow": "arrow"}.get(p.suffix.lower(), "jsonl")
    bad = [k for k, v in fields.items() if v is not None and not isinstance(v, str)]
    if bad:
        m.fail(key, f"names the dataset's {bad[0].removesuffix('_field')} field as "
               f"{str(fields[bad[0]])[:40]}, not a column name.")
    data = {"source": source, "path": path_value}
    data.update({k: v for k, v in fields.items() if v})
    data["format"] = fmt or _peek_format(p, source, fields) or "text"
    if tokenizer is None:
        m.data_unavailable(key, "names a local dataset, but the tokenizer is the hub model's, which "
               "tunepilot does not download.", "Pass --tokenizer DIR (a local tokenizer "
               "directory), or --data synthetic to plan without the data.")
    data["tokenizer"] = tokenizer
    return data


def _peek_format(p: Path, source: str, fields: dict) -> str | None:
    if source != "jsonl":
        return None
    from tunepilot.limits import read_capped, read_head

    try:
        head = read_head(p, 1 << 16).lstrip()
        first = json.loads(head.splitlines()[0]) if not head.startswith(b"[") else \
            json.loads(read_capped(p))[0]
    except (OSError, ValueError, IndexError, KeyError, RecursionError):
        return None  # read_head's Refused is a ValueError; the data stage names the problem
    if not isinstance(first, dict):
        return None
    if "chosen" in first and "rejected" in first:
        return "preference"
    if fields.get("messages_field", "messages") in first or "conversations" in first:
        return "messages"
    if fields.get("prompt_field", "prompt") in first:
        return "prompt-completion"
    return "text"


def relative_to(path: str, base: Path, out_dir: Path) -> str:
    """A path of the config (relative to its directory) as seen from ``out_dir``."""
    import os

    p = Path(path)
    if p.is_absolute():
        return path
    return os.path.relpath((base / p).resolve(), out_dir.resolve())


# FP8 as the configs name it -> the spec's precision (spec/fp8.py): axolotl `fp8` + `fp8_config.recipe`
# (torchao Float8Linear; axolotl docs/mixed_precision.qmd), LLaMA-Factory `fp8` + `fp8_backend`
# (hparams/training_args.py Fp8Arguments: auto | torchao | te | msamp; auto and torchao build
# torchao's default recipe, tensorwise)
_FP8_NAMES = {"tensorwise": "fp8-tensorwise", "rowwise": "fp8-rowwise",
              "rowwise_with_gw_hp": "fp8-rowwise", "auto": "fp8-tensorwise",
              "torchao": "fp8-tensorwise", "te": "fp8-te"}


def fp8_precision(m: Mapper, key: str, name: Any, default: str) -> bool:
    """Map ``fp8: true`` and the recipe or backend its config names at ``key`` (``default``
    when unset) to ``precision``; True when it did. FP8 here is FP8 matmuls on top of bf16
    mixed precision: fp32 master weights and optimizer state."""
    if not truthy(m.get("fp8")):
        return False
    name = str(name or default).lower()
    precision = _FP8_NAMES.get(name)
    if precision is None:
        m.fail(key, f"{name!r}: tunepilot plans FP8 as torchao's Float8Linear (tensorwise, "
               "rowwise) or Transformer Engine (te); other recipes and MS-AMP's FP8 optimizer "
               "state and weights are not modelled.", "Use one of "
               f"{', '.join(_FP8_NAMES)}, or set precision: fp8-tensorwise | fp8-rowwise | "
               "fp8-te in the imported spec.")
    if name == "rowwise_with_gw_hp":
        m.note("fp8 recipe rowwise_with_gw_hp (the weight gradient in high precision) is "
               "planned as rowwise")
    m.set("precision", precision, "fp8", key)
    m.no_effect("fp8_enable_fsdp_float8_all_gather")
    gather = truthy(m.get("fp8_enable_fsdp_float8_all_gather"))
    fp8_gather = Precision(precision).fp8_recipe.all_gather_fp8
    if not fp8_gather and gather:
        m.note("fp8_enable_fsdp_float8_all_gather applies to the tensorwise recipe only: the "
               "all-gather stays bf16")
    elif fp8_gather and not gather:
        m.note("fp8-tensorwise is planned with FSDP's FP8 all-gather (1 B/param); without "
               "fp8_enable_fsdp_float8_all_gather an FSDP run gathers bf16 (2 B/param)")
    m.note(f"fp8: {precision} - FP8 matmuls in the decoder's linear layers on top of bf16 mixed "
           "precision (fp32 master weights and optimizer state); the plan models its casts and "
           "saves, the quote the card's FP8 peak; a card without FP8 tensor cores is refused")
    return True
