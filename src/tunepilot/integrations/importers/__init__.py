"""A trainer's config -> a tunepilot run spec (`tunepilot import`, and `plan`/`run`/`quote` given
such a file directly).

    axolotl       axolotl YAML                          (axolotl.py)
    llamafactory  LLaMA-Factory YAML                    (llamafactory.py)
    trl           `trl sft --config` YAML               (trl.py)
    hf            TrainingArguments (+ LoraConfig, BitsAndBytesConfig) fields, JSON or YAML
    litgpt        `litgpt finetune_lora|finetune_full --config` YAML   (litgpt.py)
Every key of the config is either mapped to a spec field (listed) or ignored (listed); a key that
is close to a known key but not one is a typo and refused. Nothing is downloaded: a hub model id
must be a shipped preset's, a dataset must be local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepilot.errors import SpecError, UserError
from tunepilot.integrations.importers import axolotl, litgpt, llamafactory, trl
from tunepilot.integrations.importers.common import (
    ImportResult,
    Mapper,
    is_off,
    number,
    relative_to,
    truthy,
)
from tunepilot.spec.precision import Precision

FORMATS = ("axolotl", "llamafactory", "trl", "hf", "litgpt")
_YAML_LIMIT_BYTES = 4 << 20


@dataclass(frozen=True)
class ImportOptions:
    tokenizer: str | None = None
    """a local tokenizer directory (the hub model's own is not downloaded)"""
    synthetic_data: bool = False
    """plan with synthetic tokens instead of the config's dataset"""
    devices: int | None = None
    """GPUs per node for a DDP/FSDP/DeepSpeed config (the launcher decides; default 8)"""
    objective: str | None = None
    """the trainer a TRL config is for (`trl dpo|grpo|... --config`: the file does not say);
    None: guessed from its keys"""


def read_config(path: Path) -> dict:
    """The config as a mapping (YAML or JSON), with every problem a UserError."""
    from tunepilot.spec.yaml_input import read_yaml_mapping

    return read_yaml_mapping(path, what="config")


def detect(raw: dict) -> str | None:
    """Which trainer wrote ``raw``: None for a tunepilot spec (or nothing recognisable)."""
    if isinstance(raw.get("model"), dict):
        return None  # a tunepilot spec: model: {preset|config}
    if litgpt.looks_like(raw):
        return "litgpt"
    if axolotl.looks_like(raw):
        return "axolotl"
    if llamafactory.looks_like(raw):
        return "llamafactory"
    if trl.looks_like_trl(raw):
        return "trl"
    if trl.looks_like_hf(raw) or "model_name_or_path" in raw:
        return "hf"
    return None


def looks_imported(path: Path) -> bool:
    """Whether ``path`` is a trainer's config rather than a tunepilot spec (cheap: no spec
    validation; an unreadable file is left for load_spec to explain)."""
    try:
        if not path.is_file() or path.stat().st_size > _YAML_LIMIT_BYTES:
            return False
        raw = read_config(path)
    except UserError:
        return False
    return detect(raw) is not None


def import_config(path: Path, source: str | None = None,
                  options: ImportOptions | None = None) -> ImportResult:
    """Read ``path`` as a ``source`` config (detected when None) into a validated spec."""
    from tunepilot.spec import spec_from_dict

    options = options or ImportOptions()
    path = Path(path)
    raw = read_config(path)
    found = detect(raw)
    source = source or found
    if source is None:
        what = "a tunepilot spec already" if isinstance(raw.get("model"), dict) else \
            "not an axolotl, LLaMA-Factory, TRL or TrainingArguments config"
        raise UserError("--from", f"{path.name} is {what}.",
                        f"Pass --from one of {', '.join(FORMATS)} to read it as one."
                        if found is None and not isinstance(raw.get("model"), dict) else None)
    if source not in FORMATS:
        raise UserError("--from", f"{source!r} is not one of {', '.join(FORMATS)}.")
    module, known, convert = _converters()[source]
    m = Mapper(source, raw, path, known)
    m.options = options
    convert(m)
    _finish(m, options)
    ignored = m.check_typos()
    name = path.stem
    spec_dict = {"name": f"{name}", **m.spec}
    try:
        spec = spec_from_dict(spec_dict, source=f"{path.name} (imported from {source})")
    except SpecError as exc:
        _refuse_as_config(m, exc)
    _check_plannable(m, spec, path)
    read = [k for k in raw if k in m.used and k not in m.mapped and k not in m.no_effect_keys]
    no_effect = [k for k in raw if k in m.no_effect_keys and k not in m.mapped]
    return ImportResult(source, str(path), spec_dict, dict(m.mapped), ignored,
                        [k for k in read if is_off(raw[k])], m.notes, spec, no_effect,
                        [k for k in read if not is_off(raw[k])])


def _refuse_as_config(m: Mapper, exc: SpecError) -> None:
    """A spec field the config set that the spec (or the plan) refuses: the same message,
    naming the config's key it came from - import never writes a spec `plan` refuses."""
    field = exc.field or ""
    keys = [k for k, f in m.mapped.items() if f == field or field.startswith(f + ".")
            or f.startswith(field + ".")]
    where = f"{keys[0]} (the spec's {field})" if keys else (field or None)
    m.fail(where, exc.message, exc.hint)


def _check_plannable(m: Mapper, spec, path: Path) -> None:
    """What `plan` checks before it sizes anything - the LoRA targets are linear layers of this
    model, modules_to_save are modules it can size, the objective's lengths fit - made here, on
    the analytic plan (no torch), so that import never writes a spec the plan refuses."""
    from tunepilot.model.arch import lora_targets, resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan

    try:
        arch = resolve_arch(spec, path.parent)
        if spec.method.is_lora:
            lora_targets(arch, spec.method.lora_targets)
        analytic_plan(spec, arch, "cuda")
    except SpecError as exc:
        _refuse_as_config(m, exc)


def _converters() -> dict[str, tuple[Any, set[str], Any]]:
    return {"axolotl": (axolotl, axolotl.KNOWN, axolotl.convert),
            "llamafactory": (llamafactory, llamafactory.KNOWN, llamafactory.convert),
            "trl": (trl, trl.TRL_KNOWN, trl.convert_trl),
            "hf": (trl, trl.HF_KNOWN, trl.convert_hf),
            "litgpt": (litgpt, litgpt.KNOWN, litgpt.convert)}


def _finish(m: Mapper, options: ImportOptions) -> None:
    """What every format shares once its keys are read: devices for a sharded run, and a
    max_steps target in tokens."""
    par = m.spec.get("parallel")
    if m.source == "litgpt":  # its config says the devices (and the strategy they imply)
        if options.devices and par:
            par["devices"] = options.devices
    elif par and par.get("strategy") in ("ddp", "fsdp", "deepspeed"):
        par["devices"] = options.devices or 8
        if options.devices is None:
            m.note("parallel.devices 8 assumed (one 8-GPU node; the launcher decides): pass "
                   "--devices N for yours")
    elif options.devices and options.devices > 1:
        m.spec["parallel"] = {"strategy": "ddp", "devices": options.devices}
        m.note(f"--devices {options.devices}: planned as DDP")
    if par and par.get("strategy") == "deepspeed" and m.spec.get("precision"):
        from tunepilot.spec.precision import Precision

        p = Precision(m.spec["precision"])
        if p.deepspeed_engine != p:
            m.spec["precision"] = str(p.deepspeed_engine)
            m.note(f"precision {p.deepspeed_engine} under DeepSpeed, not {p}: its bf16 engine "
                   "holds the module in bf16 and keeps an fp32 master copy and fp32 optimizer "
                   "state in the ZeRO optimizer, whatever dtype the model was loaded in")
    _schedule(m)
    _tf32(m)
    _unplanned(m)
    if m.spec.get("data", {}).get("source") in (None, "synthetic"):
        _data_keys_unused(m)
    steps = m.spec.pop("_max_steps", None)
    m.spec.pop("_epochs", None)
    if steps:
        m.spec.setdefault("target", {})["steps"] = int(steps)
        m.mapped["max_steps"] = "target.steps"
        m.note(f"max_steps {steps}: target.steps {steps} optimizer steps (the quote counts their "
               "useful tokens: steps x tokens per step x the useful share the pilot measures)")


# TrainingArguments' names, which axolotl, LLaMA-Factory and TRL configs share: what each sets
# in the spec (the quote counts checkpoint writes and validation passes; the host plan counts
# dataloader workers and the checkpoints kept on disk), and its least value
_SCHEDULE = (("save_steps", "checkpoint.every_steps", 1),
             ("eval_steps", "validation.every_steps", 1),
             ("save_total_limit", "host.checkpoints_kept", 1),
             ("dataloader_num_workers", "data.num_workers", 0))


def _schedule(m: Mapper) -> None:
    """How often the run saves and validates, how many checkpoints it keeps, how many workers
    load its data - read where the config sets them."""
    for key, dotted, least in _SCHEDULE:
        value = m.raw.get(key)
        if value is None:
            continue
        if isinstance(value, float) and 0 < value < 1 and key.endswith("_steps"):
            m.get(key)
            m.note(f"{key} {value:g} is a fraction of the run's steps: not mapped; "
                   f"{dotted} keeps its default")
            continue
        n = number(m, key, float)
        if not math.isfinite(n) or n < least or n != int(n) or n > 10**12:
            m.fail(key, f"is {value!r}: it must be a whole number from {least} to 10^12.")
        m.set(dotted, int(n), key)
    _fsdp_save(m)
    evaluates = _evaluation(m)
    for key, steps_key, dotted in (
            ("save_strategy", "save_steps", "checkpoint.every_steps"),
            ("eval_strategy", "eval_steps", "validation.every_steps"),
            ("saves_per_epoch", "save_steps", "checkpoint.every_steps"),
            ("evals_per_epoch", "eval_steps", "validation.every_steps")):
        value = m.get(key)
        if dotted.startswith("validation") and not evaluates:
            continue
        per_epoch = key.endswith("_per_epoch") and value is not None
        if (per_epoch and not m.has(steps_key)) or str(value).lower() in ("no", "epoch"):
            m.note(f"{key} {value!r}: planned with {dotted} (a pass every so many steps); set "
                   "it from your run's steps per epoch")


def _fsdp_save(m: Mapper) -> None:
    """How an FSDP1 run's checkpoints build their state dict (checkpoint.state_dict): the
    fsdp_config's state_dict_type (SHARDED_STATE_DICT clones each rank's chunks on the device,
    FULL_STATE_DICT gathers to rank 0's CPU), none when the run saves nothing."""
    conf = m.raw.get("fsdp_config")
    kind = conf.get("fsdp_state_dict_type", conf.get("state_dict_type")) \
        if isinstance(conf, dict) else None
    if kind is not None:
        m.set("checkpoint.state_dict", "full" if "FULL" in str(kind).upper() else "sharded",
              "fsdp_config")
    if str(m.raw.get("save_strategy", "")).lower() == "no":
        m.set("checkpoint.state_dict", "none", "save_strategy")


def _unplanned(m: Mapper) -> None:
    """TrainingArguments switches that change what the run writes or pads, which the spec has
    no field for: said, never dropped in silence."""
    if truthy(m.get("save_only_model")):
        m.note("save_only_model: true - the trainer's checkpoints hold the weights only (no "
               "optimizer state, scheduler, RNG or data position): a run that stops cannot "
               "resume exactly from them. tunepilot plans, quotes and proves (restore) full "
               "checkpoints, which are larger and slower to write than these; set it false "
               "to rent a term you can resume")
    if truthy(m.get("group_by_length")):
        m.note("group_by_length: true - batches of similar lengths pad less than the data "
               "profile's random batches: the quote's padding, and so its hours, are an upper "
               "bound")


def _tf32(m: Mapper) -> None:
    """tf32: true lets fp32 matmuls use TF32 tensor cores: no effect on memory; the quote
    prices an fp32 run at the fp32 peak (spec.precision.peak_key), an upper bound on its time
    with TF32 on."""
    if not truthy(m.get("tf32")):
        return
    precision = m.spec.get("precision", "fp32")
    try:
        all_fp32 = Precision(precision).all_fp32
    except ValueError:  # not a precision tunepilot plans: the spec's own check names it
        all_fp32 = False
    m.note("tf32: true - fp32 matmuls on TF32 tensor cores: no effect on memory; " + (
        "the quote prices this fp32 run at the fp32 peak, so its time is an upper bound"
        if all_fp32 else f"precision {precision} runs the matmuls in 16 or 8 bit, "
        "so TF32 touches only the few fp32 ones (not modelled)"))


def _evaluation(m: Mapper) -> bool:
    """Whether the run evaluates at all; when it does not, validation is turned off in the
    spec (no validation pass planned, piloted or billed). axolotl evaluates when val_set_size
    > 0 (its default is 0) or test_datasets are given; LLaMA-Factory, TRL and TrainingArguments
    when eval_strategy is steps or epoch (TrainingArguments' default is no)."""
    if m.source == "litgpt":  # LitGPT validates every eval.interval steps (litgpt/args.py)
        return True
    strategy = m.get("eval_strategy")
    if strategy is None:
        strategy = m.get("evaluation_strategy")  # TrainingArguments' name before 4.46
    off = str(strategy).lower() == "no"
    if m.source == "axolotl":
        size = number(m, "val_set_size", float, least=0)
        tests = m.get("test_datasets")
        if not off and (size or tests):
            m.maps("validation.enabled", "val_set_size", "test_datasets")
            return True
        why = "eval_strategy no" if off else (
            f"val_set_size {size:g}" if size is not None else "no val_set_size (axolotl's "
            "default 0)") + " and no test_datasets"
        keys = ("val_set_size", "test_datasets", "eval_strategy")
    else:
        if strategy is not None and not off:
            return True
        why = "eval_strategy no" if off else "no eval_strategy (TrainingArguments' default no)"
        keys = ("eval_strategy", "evaluation_strategy")
    m.set("validation.enabled", False, *keys)
    m.note(f"{why}: the run does no evaluation - validation off (no validation pass planned "
           "or billed)")
    return False


# Keys that describe the dataset (how it is split, packed, templated and labelled): they shape
# the tokens the plan and the quote count when the data is read, and nothing otherwise
_DATA_KEYS = ("datasets", "dataset", "dataset_name", "dataset_dir", "dataset_prepared_path",
              "val_set_size", "val_size", "sample_packing", "eval_sample_packing",
              "pad_to_sequence_len", "packing", "neat_packing", "train_on_inputs",
              "train_on_prompt", "assistant_only_loss", "completion_only_loss", "chat_template",
              "template", "max_samples", "dataset_text_field")


def _data_keys_unused(m: Mapper) -> None:
    """With synthetic tokens (``--data synthetic``, or no readable dataset) the dataset's keys
    are said to be unused for that reason, not listed as ignored by the model."""
    keys = [k for k in _DATA_KEYS if m.has(k) and k not in m.used]
    if keys:
        m.used.update(keys)
        m.note(f"{', '.join(keys)}: describe the dataset, which is not read (synthetic tokens, "
               "every position trained, no padding); import with the data to plan them")


def write_spec(result: ImportResult, out: Path) -> None:
    """SPEC.yaml with a header saying where it came from and what was ignored; paths in it are
    made relative to ``out``'s directory."""
    import yaml

    from tunepilot.spec.yaml_input import yaml_comment
    from tunepilot.store import atomic_write_bytes

    spec = dict(result.spec_dict)
    base, out_dir = Path(result.path).parent, out.parent
    model = dict(spec.get("model", {}))
    if "config" in model:
        model["config"] = relative_to(model["config"], base, out_dir)
    spec["model"] = model
    if "data" in spec:
        data = dict(spec["data"])
        for key in ("path", "tokenizer"):
            if data.get(key):
                data[key] = relative_to(data[key], base, out_dir)
        spec["data"] = data
    head = [f"imported by `tunepilot import` from {result.path} ({result.source} config)"]
    head += [f"note: {n}" for n in result.notes]
    if result.ignored:
        head.append("ignored (not modelled): " + ", ".join(result.ignored))
    body = yaml.safe_dump(spec, sort_keys=False, default_flow_style=False)
    text = "".join(yaml_comment(line) + "\n" for line in head) + body
    _check_written(text, spec, out)
    atomic_write_bytes(out, text.encode("utf-8"))


def _check_written(text: str, spec: dict, out: Path) -> None:
    """Read the spec about to be written back through the spec reader - it must parse, be the
    very spec imported, and validate - before anything is written (exit 0 means usable)."""
    from tunepilot.spec import spec_from_dict
    from tunepilot.spec.yaml_input import parse_yaml_mapping

    try:
        again = parse_yaml_mapping(text, out.name)
        spec_from_dict(again, source=out.name)
    except UserError as exc:
        raise UserError("--out", f"the spec import would write does not read back ({exc}); "
                        "nothing was written.", "Report this with the config: it is a bug "
                        "in tunepilot's importer.") from None
    if again != spec:
        raise UserError("--out", "the spec import would write reads back differently from the "
                        "imported one; nothing was written.", "Report this with the config: "
                        "it is a bug in tunepilot's importer.")
