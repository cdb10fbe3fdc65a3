"""What a checkpoint holds besides tensors: every RNG stream, the data position, the model
reference a LoRA adapter belongs to, and state dicts as exact JSON (floats round-trip: repr)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import TYPE_CHECKING, Any

from tunepilot.errors import TunepilotError

if TYPE_CHECKING:
    import torch

    from tunepilot.dataset import DataStream
    from tunepilot.spec import RunSpec

# component names (state keys are constants: the verdicts and the tests name them)
MODEL, OPTIMIZER, SCHEDULER, SCALER = "model", "optimizer", "scheduler", "grad_scaler"
RNG, DATA, PROGRESS = "rng", "data_position", "progress"
COMPONENTS = (MODEL, OPTIMIZER, SCHEDULER, SCALER, RNG, DATA, PROGRESS)
REQUIRED = (MODEL, OPTIMIZER, SCHEDULER, RNG, DATA, PROGRESS)  # grad_scaler only under fp16
PER_RANK = (RNG, DATA)  # one file per rank: rng.rank{R}.json, data.rank{R}.json
# drop these from the config hash: they name the copy or the library, not the architecture
_CONFIG_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


class CheckpointError(TunepilotError):
    """A checkpoint that cannot be written or loaded; names the component and file at fault."""

    def __init__(self, message: str, *, component: str | None = None, file: str | None = None,
                 problems: list | None = None, rank: int | None = None):
        self.component = component
        self.file = file
        self.rank = rank
        self.problems = list(problems or [])
        super().__init__(message)

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "message": str(self), "component": self.component,
                "file": self.file, "rank": self.rank,
                "problems": [p.to_dict() for p in self.problems]}


def per_rank_file(component: str, rank: int) -> str:
    return {RNG: f"rng.rank{rank}.json", DATA: f"data.rank{rank}.json"}[component]


def model_reference(model: torch.nn.Module, spec: RunSpec) -> dict:
    """full/lora, and the base model this state belongs to (for LoRA the base is not saved)."""
    m = spec.model
    ref: dict[str, Any] = {
        "kind": "lora" if spec.method.is_lora else "full",
        "base": {"preset": m.preset, "config": m.config, "revision": m.revision,
                 "weights": m.weights, "seed": spec.seed if m.weights == "random" else None,
                 "config_sha256": config_sha256(model)},
    }
    if spec.method.is_lora:
        ref["adapter"] = {"rank": spec.method.lora_rank, "alpha": spec.method.lora_alpha,
                          "targets": spec.method.lora_targets, "method": spec.method.kind}
    return ref


def config_sha256(model: torch.nn.Module) -> str | None:
    """SHA-256 of the model's Hugging Face config (canonical JSON), None for a plain module."""
    cfg = getattr(model, "config", None)
    if cfg is None:  # DDP / FSDP wrappers keep the model in .module (or are the model)
        cfg = getattr(getattr(model, "module", None), "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return None
    data = {k: v for k, v in to_dict().items() if k not in _CONFIG_VOLATILE_KEYS}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def check_model_reference(saved: dict, model: torch.nn.Module, spec: RunSpec) -> list[str]:
    """Refuse a state that belongs to another model; notes for what differs but loads."""
    here = model_reference(model, spec)
    if saved["kind"] != here["kind"]:
        raise CheckpointError(f"the checkpoint is a {saved['kind']} fine-tune but this run is "
                              f"{here['kind']}.", component=MODEL)
    notes = []
    a, b = saved["base"], here["base"]
    if a.get("config_sha256") and b.get("config_sha256") and \
            a["config_sha256"] != b["config_sha256"]:
        raise CheckpointError(
            f"the checkpoint was trained on a base model with config sha256 "
            f"{a['config_sha256'][:12]} but this run builds {b['config_sha256'][:12]} "
            f"({b.get('preset') or b.get('config')}).", component=MODEL)
    for key in ("revision", "weights", "seed"):
        if a.get(key) != b.get(key):
            if saved["kind"] == "lora":
                raise CheckpointError(f"the adapter was trained on base {key} {a.get(key)!r} but "
                                      f"this run's base has {b.get(key)!r}.", component=MODEL)
            notes.append(f"base {key} was {a.get(key)!r}, now {b.get(key)!r}")
    return notes


# --- RNG streams -------------------------------------------------------------------------------


def rng_state() -> dict:
    """Every RNG stream training draws from, as JSON (torch states as hex bytes)."""
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch_cpu": torch.get_rng_state().numpy().tobytes().hex(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


_PY_STATE_WORDS = 625  # random.getstate()[1]: Mersenne Twister's 624 words + the position
_NP_STATE_WORDS = 624  # numpy's MT19937 key


def rng_state_problem(saved: object) -> str | None:
    """What is wrong with the shape of an RNG state as rng_state() writes it; None when it has
    that shape (set_rng_state then checks the byte lengths torch wants)."""
    if not isinstance(saved, dict):
        return f"is {type(saved).__name__}, not the RNG streams (a JSON object)"
    missing = [k for k in ("python", "numpy", "torch_cpu") if k not in saved]
    if missing:
        return (f"has no {', '.join(missing)} stream (keys: "
                f"{', '.join(sorted(map(str, saved))[:5]) or 'none'})")
    py = saved["python"]
    if not (isinstance(py, list) and len(py) == 3 and isinstance(py[0], int)
            and isinstance(py[1], list) and len(py[1]) == _PY_STATE_WORDS
            and all(isinstance(w, int) and 0 <= w < 2**32 for w in py[1])
            and (py[2] is None or isinstance(py[2], float))):
        return "python: not a random.getstate() of Mersenne Twister (version, 625 words, gauss)"
    n = saved["numpy"]
    if not (isinstance(n, list) and len(n) == 5 and n[0] == "MT19937"
            and isinstance(n[1], list) and len(n[1]) == _NP_STATE_WORDS
            and all(isinstance(w, int) and 0 <= w < 2**32 for w in n[1])
            and isinstance(n[2], int) and isinstance(n[3], int)
            and isinstance(n[4], int | float)):
        return "numpy: not an MT19937 state (name, 624 words, position, has_gauss, gauss)"
    hexes = [("torch_cpu", saved["torch_cpu"])] + [
        (f"cuda[{i}]", h) for i, h in enumerate(saved.get("cuda") or [])]
    if not isinstance(saved.get("cuda", []), list):
        return "cuda: not a list of generator states"
    for name, h in hexes:
        if not isinstance(h, str) or not h or len(h) % 2:
            return f"{name}: not a generator state (hex bytes)"
        try:
            bytes.fromhex(h)
        except ValueError:
            return f"{name}: not a generator state (hex bytes)"
    return None


def progress_problem(saved: object, step: int, useful_tokens_seen: int) -> str | None:
    """progress.json against the manifest's own step and token count."""
    if not isinstance(saved, dict) or not all(
            isinstance(saved.get(k), int) and not isinstance(saved.get(k), bool)
            for k in ("step", "useful_tokens_seen")):
        return "is not {\"step\": int, \"useful_tokens_seen\": int}"
    if saved["step"] != step:
        return f"says step {saved['step']}, the manifest step {step}"
    if saved["useful_tokens_seen"] != useful_tokens_seen:
        return (f"says {saved['useful_tokens_seen']:,} useful tokens seen, the manifest "
                f"{useful_tokens_seen:,}")
    return None


def scheduler_state_problem(saved: object) -> str | None:
    """What is wrong with a saved LR scheduler state (LambdaLR.state_dict() as to_json writes
    it): the keys a load_state_dict needs, of their types (the epoch is not compared with the
    manifest's step: a library caller's TrainState may step its scheduler its own way). None
    when it fits; the fresh load then loads it into a real LambdaLR."""
    if not isinstance(saved, dict):
        return f"is {type(saved).__name__}, not an LR scheduler state (a JSON object)"
    missing = [k for k in ("base_lrs", "last_epoch", "_step_count") if k not in saved]
    if missing:
        return f"has no {', '.join(missing)} (not an LR scheduler state)"
    lrs = saved["base_lrs"]
    if not isinstance(lrs, list) or not lrs or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            and x >= 0 for x in lrs):
        return "base_lrs is not a list of learning rates (finite numbers >= 0)"
    for key in ("last_epoch", "_step_count"):
        if isinstance(saved[key], bool) or not isinstance(saved[key], int):
            return f"{key} is {str(saved[key])[:30]}, not a whole number"
    lambdas = saved.get("lr_lambdas", [None] * len(lrs))
    if not isinstance(lambdas, list) or len(lambdas) != len(lrs):
        return f"lr_lambdas does not have one entry per parameter group ({len(lrs)})"
    if saved["last_epoch"] < -1 or saved["_step_count"] < 0:
        return "last_epoch / _step_count are negative (not a scheduler's count of steps)"
    return None


def data_position_problem(saved: object) -> str | None:
    if not isinstance(saved, dict) or not isinstance(saved.get("stream"), dict) or \
            not isinstance(saved.get("iterator_open", False), bool):
        return "is not a data position ({\"stream\": {...}, \"iterator_open\": bool})"
    return None


def set_rng_state(saved: dict) -> None:
    import numpy as np
    import torch

    problem = rng_state_problem(saved)
    if problem:
        raise CheckpointError(f"the RNG state {problem}.", component=RNG)
    try:
        _set_rng_state(saved, np, torch)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise CheckpointError(f"the RNG state does not load: {exc}", component=RNG) from None


def _set_rng_state(saved: dict, np, torch) -> None:
    py = saved["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = saved["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(bytes_tensor(saved["torch_cpu"]))
    cuda = saved.get("cuda") or []
    if cuda:
        if not torch.cuda.is_available():
            raise CheckpointError(f"the checkpoint holds RNG state for {len(cuda)} CUDA devices "
                                  "but this process has none.", component=RNG)
        if len(cuda) > torch.cuda.device_count():
            raise CheckpointError(f"the checkpoint holds RNG state for {len(cuda)} CUDA devices "
                                  f"but this process sees {torch.cuda.device_count()}.",
                                  component=RNG)
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(bytes_tensor(s), i)


# --- the data position -------------------------------------------------------------------------


def data_position(stream: DataStream) -> dict:
    """The stream's position: epoch + loader state, and whether an epoch's iterator was open."""
    return {"stream": to_json(stream.state_dict()), "iterator_open": stream.iterator_open}


def load_data_position(saved: dict, stream: DataStream, file: str) -> None:
    """Restore a position written by data_position (before the RNG streams are restored: opening
    an epoch's iterator draws a base seed from torch's global RNG)."""
    try:
        stream.load_state_dict(from_json(saved["stream"]),
                               open_iterator=bool(saved.get("iterator_open")))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"data position does not fit this data loader: {exc}",
                              component=DATA, file=file) from None


def samples_consumed(saved: dict) -> int | None:
    """Samples this rank had drawn in the saved epoch (for loading on another rank count)."""
    loader = (saved.get("stream") or {}).get("loader") or {}
    it = loader.get("_sampler_iter_state") or {}
    return it.get("samples_yielded")


# --- exact JSON --------------------------------------------------------------------------------


def bytes_tensor(hex_str: str):
    import torch

    return torch.frombuffer(bytearray(bytes.fromhex(hex_str)), dtype=torch.uint8).clone()


def to_json(obj: Any) -> Any:
    """State dicts as JSON: tensors tagged with dtype, shape and hex bytes; tuples as lists."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "hex": t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_json(v) for v in obj]
    return obj


def from_json(obj: Any) -> Any:
    import torch

    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["__tensor__"])
            raw = bytes_tensor(obj["hex"])
            return raw.view(dtype).reshape(obj["shape"]).clone()
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj
