"""A DeepSpeed config (axolotl's and LLaMA-Factory's ``deepspeed:``, TrainingArguments'
``deepspeed``: a path to a ds_config JSON or the dict itself) as ``parallel.strategy:
deepspeed`` with its zero_optimization block: the stage, offload_optimizer / offload_param and
the bucket sizes (elements). Sizes DeepSpeed's JSON writes as floats (2e8) are whole numbers;
"auto" is kept where the Hugging Face integration resolves it from the model (reduce_bucket_size,
stage3_prefetch_bucket_size, stage3_param_persistence_threshold), DeepSpeed's default elsewhere.
Pure data, no deepspeed import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tunepilot.integrations.importers.common import Mapper, config_path, value_number
from tunepilot.spec.parallel import BUCKET_MAX

# zero_optimization keys -> parallel.deepspeed fields (same names), and those "auto" may keep
_SIZES = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
          "stage3_max_live_parameters", "stage3_max_reuse_distance",
          "stage3_param_persistence_threshold", "sub_group_size")
_AUTO_OK = ("reduce_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold")
_FLAGS = ("overlap_comm", "contiguous_gradients")
# what the plan does not model, said rather than silently dropped
_UNMODELLED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
               "zero_quantized_gradients", "zero_hpz_partition_size", "mics_shard_size")


def deepspeed_strategy(m: Mapper, key: str, value: Any) -> None:
    """Map the config's DeepSpeed setting to parallel.strategy deepspeed + parallel.deepspeed."""
    conf, where = _read(m, key, value)
    zero = conf.get("zero_optimization", {}) if isinstance(conf, dict) else {}
    if isinstance(zero, bool):  # DeepSpeed's deprecated form: true means stage 1
        zero = {"stage": 1 if zero else 0}
    if not isinstance(zero, dict):
        m.fail(f"{key}.zero_optimization", f"is {str(zero)[:60]} in {where}, not a mapping of "
               "ZeRO settings.", "E.g. zero_optimization: {stage: 3}.")
    ds: dict[str, Any] = {"stage": _stage(m, key, zero.get("stage", 0), where)}
    for name in ("offload_optimizer", "offload_param"):
        device = _offload_device(m, key, zero.get(name), name, where)
        if device != "none":
            ds[name] = device
    for name in _SIZES:
        size = _size(m, key, zero.get(name), name, where)
        if size is not None:
            ds[name] = size
    for name in _FLAGS:
        flag = zero.get(name)
        if isinstance(flag, bool):
            ds[name] = flag
    if ds.get("offload_param") and ds["stage"] != 3:
        m.note(f"{where}: offload_param applies to ZeRO-3 only; DeepSpeed ignores it at stage "
               f"{ds['stage']}, and so does the plan")
        ds.pop("offload_param")
    unmodelled = [k for k in _UNMODELLED if zero.get(k) not in (None, False, 0, 1, -1)]
    if unmodelled:
        m.note(f"{where}: {', '.join(unmodelled)} not modelled (the plan assumes unquantized "
               "16-bit communication and one partition group)")
    m.set("parallel.strategy", "deepspeed", key)
    m.set("parallel.deepspeed", ds, key)
    m.note(f"DeepSpeed ZeRO-{ds['stage']} from {where}: planned per rank with the states "
           "this stage shards (parallel.deepspeed)")


def _read(m: Mapper, key: str, value: Any) -> tuple[dict, str]:
    """The ds_config as a dict (read from its path, size- and depth-bounded, when a string)
    and where it came from. A path that is not there gives the stage its file name says
    (zero2.json, ds_z3_config.json), noted."""
    if isinstance(value, dict):
        return value, key
    p = config_path(m, key, value)
    conf = _deepspeed_file(m, key, p)
    if conf is not None:
        if not isinstance(conf, dict):
            m.fail(key, f"{p.name} holds {type(conf).__name__}, not a DeepSpeed config object.",
                   "A ds_config is a JSON object with a zero_optimization block.")
        return conf, value
    stage = re.search(r"(?:zero|_z)[_-]?(\d)", p.name.lower())
    m.note(f"{key}: {value} is not a readable file here: ZeRO stage "
           + (f"{stage.group(1)} read from its file name" if stage else "0 assumed")
           + ", DeepSpeed's default buckets and no offload assumed - give the file for its "
           "own settings")
    return {"zero_optimization": {"stage": int(stage.group(1)) if stage else 0}}, value


def _deepspeed_file(m: Mapper, key: str, p: Path) -> Any:
    """The DeepSpeed JSON at ``p`` (size- and depth-bounded); None when there is no such file;
    a file that is there but not a readable DeepSpeed config is refused naming ``key``."""
    from tunepilot.limits import Refused, load_json_capped
    from tunepilot.spec.yaml_input import MAX_SPEC_BYTES

    try:
        return load_json_capped(p, MAX_SPEC_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Refused as exc:
        m.fail(key, f"{p.name} {exc}: not a DeepSpeed config.",
               "Point it at the run's ds_config JSON.")
    except OSError as exc:
        m.fail(key, f"{p.name} cannot be read ({exc.strerror or exc}).")
    return None


def _stage(m: Mapper, key: str, value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or str(value).strip() not in ("0", "1", "2", "3", "0.0", "1.0",
                                                              "2.0", "3.0"):
        m.fail(f"{key}.zero_optimization.stage", f"is {str(value)[:40]!r} in {where}, not a "
               "ZeRO stage.", "DeepSpeed's stages are 0, 1, 2 and 3.")
    return int(float(value))


def _offload_device(m: Mapper, key: str, value: Any, name: str, where: str) -> str:
    """offload_optimizer / offload_param: {"device": "cpu"|"nvme"|"none"} (or null)."""
    if value is None:
        return "none"
    device = value.get("device") if isinstance(value, dict) else None
    if device in (None, "none"):
        return "none"
    if device not in ("cpu", "nvme"):
        m.fail(f"{key}.zero_optimization.{name}.device", f"is {str(device)[:40]!r} in {where}, "
               "not cpu, nvme or none.", "Set the offload device to cpu, nvme or none.")
    return device


def _size(m: Mapper, key: str, value: Any, name: str, where: str) -> int | str | None:
    """A bucket size in elements: a whole number (DeepSpeed's JSON writes 2e8 as a float), or
    "auto" where the HF integration resolves it; None (DeepSpeed's default) otherwise."""
    if value is None:
        return None
    if value == "auto":
        if name in _AUTO_OK:
            return "auto"
        m.note(f"{where}: {name} 'auto' is not resolved by the Hugging Face integration; "
               "DeepSpeed's default assumed")
        return None
    return value_number(m, f"{key}.zero_optimization.{name}", value, int, least=0,
                        most=BUCKET_MAX)
