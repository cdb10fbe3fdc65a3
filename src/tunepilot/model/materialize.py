"""Build a model without allocating it, then materialise it a piece at a time on its device.

    with parameters_on_meta():           # parameters on the meta device (no bytes); buffers are
        model = from_config(...)         # computed by the model's own code (rotary inv_freq)
    fill = Materializer(model, spec, device, weights)
    fill(model)                          # everything; or fill(layer) one unit at a time, as
                                         # model/shard.py does before it shards that unit

Every rank of a sharded run builds the same meta model, then materialises one FSDP unit (a
decoder block, then the root) at a time, whole, on its device - random init or the unit's
tensors read from a local safetensors checkpoint - and shards it before the next: no rank ever
holds more than its shard plus one unsharded unit (FSDP1 flattens the unit: plus its flat copy).

Random init is seeded per module by name (``module_seed``: the spec's seed and the module's
name with PEFT's wrappers taken out), so a module's values do not depend on what was built before
it, on how the model is cut into units, or on the rank count: the unsharded model is the same
on 1, 2 or N ranks (on the same device type: CPU and CUDA generators differ), LoRA's base is the
full model's, and a DPO reference copy is the policy's starting point. Each module is initialised
by transformers' own ``_init_weights`` (the model's rule: normal(0, initializer_range) linears and
embeddings, ones for norms, rotary buffers recomputed); LoRA adapters by PEFT's
``reset_lora_parameters`` (A Kaiming-uniform, B zero) and DoRA's magnitude from its base weight; a
parameter no rule wrote is initialised normal(0, initializer_range) and counted in ``fallbacks``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from tunepilot.errors import UserError

PEFT_WRAPPERS = ("base_layer", "original_module", "_fsdp_wrapped_module",
                 "_checkpoint_wrapped_module")
LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
              "lora_magnitude_vector")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside are moved to the meta device as they are registered (the
    module's own init then runs on meta: no bytes, no work); buffers stay where the module's code
    computed them. accelerate's init_empty_weights(include_buffers=False) does the same."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = parameter_like(param, param.to("meta"))

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def parameter_like(p: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A parameter of p's class (and attributes) holding ``data``. Subclasses (bitsandbytes'
    Params4bit) take their attributes as constructor arguments, as accelerate builds them."""
    extra = {k: v for k, v in p.__dict__.items() if k != "requires_grad"}
    if type(p) is torch.nn.Parameter:
        out = torch.nn.Parameter(data, requires_grad=p.requires_grad)
        out.__dict__.update(extra)
        return out
    return type(p)(data, requires_grad=p.requires_grad, **extra)


def canonical_name(name: str) -> str:
    """A module or parameter name without PEFT's and FSDP's wrappers: the name the plain model
    (and its checkpoint) gives the same tensor ('base_model.model.model.layers.0.mlp.up_proj.
    base_layer.weight' -> 'model.layers.0.mlp.up_proj.weight')."""
    parts = name.split(".")
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    out, skip = [], 0
    for i, p in enumerate(parts):
        if skip:
            skip -= 1
            continue
        if p in PEFT_WRAPPERS:
            continue
        if p == "modules_to_save" and i + 1 < len(parts):  # modules_to_save.<adapter>
            skip = 1
            continue
        out.append(p)
    return ".".join(out)


def module_seed(seed: int, name: str) -> int:
    """The seed of one module's random init: the spec's seed and the module's canonical name."""
    digest = hashlib.sha256(f"{seed}:{canonical_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_device(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s own (not every GPU's, as torch.manual_seed)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _hf_root(model):
    """The transformers PreTrainedModel inside a PEFT wrapper (its _init_weights is the rule)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if hasattr(base, "_init_weights") else None


def _init_std(root) -> float:
    cfg = getattr(root, "config", None)
    return float(getattr(cfg, "initializer_range", None) or 0.02)


class Materializer:
    """Materialises what is still on the meta device under a module, on ``device``: random
    init seeded per module, or read from ``weights`` (a WeightSource). Callable once per unit;
    what is already materialised (or already sharded) is left alone."""

    def __init__(self, model, seed: int, device: str | torch.device, weights=None):
        self.device = torch.device(device)
        self.seed = seed
        self.weights = weights
        self.root = _hf_root(model)
        self.std = _init_std(self.root)
        self.names = {id(m): n for n, m in model.named_modules()}
        self.by_name = {n: m for n, m in model.named_modules()}
        self._memo: dict[int, tuple[torch.Tensor, weakref.ref]] = {}
        """meta parameter -> its materialised parameter (weakly: a unit sharded frees its
        unsharded tensors), so tied parameters stay tied"""
        self.fallbacks: list[str] = []
        """parameters no init rule wrote (initialised normal(0, initializer_range))"""
        self.loaded = 0
        """tensors read from the checkpoint"""
        self._quantized: set[int] = set()

    def __call__(self, module) -> None:
        module = self._lora_layer_of(module)
        self._quantize(module)
        new = self._allocate(module)
        if not new:
            return
        gpu = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpu), torch.no_grad():
            if self.weights is not None:
                self._load(new)
            else:
                self._init(new)
            self._adapters(module, new)
            self._check(new)

    # --- allocation -------------------------------------------------------------------------
    def _allocate(self, module) -> dict[int, tuple[torch.nn.Module, list[str], list[str]]]:
        """Empty tensors on the device for every meta parameter under ``module`` (tied
        parameters stay tied) and its buffers moved there; {id(module): (module, params,
        buffers)} of the modules that got any."""
        new = {}
        for sub in module.modules():
            params = [n for n, p in sub._parameters.items() if is_meta(p)]
            buffers = [n for n, b in sub._buffers.items()
                       if isinstance(b, torch.Tensor) and b.device != self.device
                       and not (self.device.type == "cuda" and b.device.type == "cuda")]
            for name in params:
                p = sub._parameters[name]
                hit = self._memo.get(id(p))
                done = hit[1]() if hit is not None else None
                if done is None:
                    t = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    if t.is_floating_point():
                        t.fill_(float("nan"))  # a parameter no rule writes is found by _check
                    done = parameter_like(p, t)
                    self._memo[id(p)] = (p, weakref.ref(done))
                sub._parameters[name] = done
            for name in buffers:
                b = sub._buffers[name]
                sub._buffers[name] = (torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                                      if is_meta(b) else b.to(self.device))
            if params or buffers:
                new[id(sub)] = (sub, params, buffers)
        return new

    def _lora_layer_of(self, module):
        """A part of a LoRA layer (FSDP1 wraps each adapter linear as its own unit) stands for
        the whole layer: its adapters' init needs the base weight (DoRA's magnitude) and one
        seed for A and B together."""
        name = self._name(module)
        for part in LORA_PARTS:
            if f".{part}." in f".{name}.":
                layer = name[:f".{name}.".index(f".{part}.")].rstrip(".")
                return self.by_name.get(layer, module)
        return module

    def _quantize(self, module) -> None:
        """bitsandbytes Linear4bit layers on meta (QLoRA): the bf16 weight made on the device
        (normal(0, initializer_range) seeded by the module's name, or read from the
        checkpoint), then quantized there and packed in the layer's quant_storage dtype -
        Params4bit quantizes on its move to CUDA."""
        for sub in module.modules():
            w = sub._parameters.get("weight") if hasattr(sub, "_parameters") else None
            if not (is_meta(w) and type(w).__name__ == "Params4bit"):
                continue
            name = self._name(sub)
            full = torch.empty(w.shape, dtype=torch.bfloat16, device=self.device)
            with torch.no_grad():
                if self.weights is not None:
                    self.weights.copy_into(canonical_name(f"{name}.weight"), full)
                    self.loaded += 1
                else:
                    gpu = [self.device] if self.device.type == "cuda" else []
                    with torch.random.fork_rng(devices=gpu):
                        seed_device(module_seed(self.seed, name), self.device)
                        full.normal_(0.0, self.std)
            q = type(w)(full, requires_grad=False, quant_type=w.quant_type,
                        blocksize=w.blocksize, compress_statistics=w.compress_statistics,
                        quant_storage=w.quant_storage, module=sub)
            sub._parameters["weight"] = q.to(self.device)
            del full
            self._quantized.add(id(sub))

    def _name(self, module) -> str:
        return self.names.get(id(module), "")

    # --- random init --------------------------------------------------------------------------
    def _init(self, new: dict) -> None:
        for sub, params, _buffers in new.values():
            if self._in_adapter(sub):
                continue  # LoRA's own rule (_adapters), after its base layer
            if id(sub) in self._quantized:  # its weight is quantized: only a bias is new
                for name in params:
                    sub._parameters[name].zero_()
                continue
            seed_device(module_seed(self.seed, self._name(sub)), self.device)
            if self.root is not None:
                self.root._init_weights(sub)
            for name in params:  # a copy made by PEFT (modules_to_save) may be marked done
                p = sub._parameters[name]
                if getattr(p, "_is_hf_initialized", False):
                    del p._is_hf_initialized

    def _in_adapter(self, module) -> bool:
        name = self._name(module)
        return any(f".{part}." in f".{name}." for part in LORA_PARTS)

    def _adapters(self, module, new: dict) -> None:
        """PEFT's init of every LoRA layer under ``module`` whose adapters were just allocated:
        A Kaiming-uniform and B zero (reset_lora_parameters), DoRA's magnitude from the base
        weight - seeded by the layer's name."""
        for sub in module.modules():
            lora_a = getattr(sub, "lora_A", None)
            if not isinstance(lora_a, torch.nn.ModuleDict) or not hasattr(
                    sub, "reset_lora_parameters"):
                continue
            for adapter in list(lora_a.keys()):
                if id(lora_a[adapter]) not in new:  # done before (a unit already sharded)
                    continue
                seed_device(module_seed(self.seed, self._name(sub) + ".lora"), self.device)
                sub.reset_lora_parameters(adapter, True)
                self._dora(sub, adapter)

    def _dora(self, layer, adapter: str) -> None:
        mags = getattr(layer, "lora_magnitude_vector", None)
        if not mags or adapter not in mags:
            return
        old = mags[adapter].weight
        layer.lora_variant[adapter].init(layer, adapter_name=adapter)  # the norm of W + BA
        fresh = layer.lora_magnitude_vector[adapter].weight
        fresh.data = fresh.data.to(device=self.device, dtype=old.dtype)

    def _check(self, new: dict) -> None:
        """Parameters still NaN were written by no rule: normal(0, initializer_range)."""
        for sub, params, _ in new.values():
            for name in params:
                p = sub._parameters[name]
                if p.is_floating_point() and bool(torch.isnan(p).any()):
                    seed_device(module_seed(self.seed, f"{self._name(sub)}.{name}"), self.device)
                    p.normal_(0.0, self.std)
                    self.fallbacks.append(canonical_name(f"{self._name(sub)}.{name}"))

    # --- a checkpoint -------------------------------------------------------------------------
    def _load(self, new: dict) -> None:
        """The unit's tensors read from the checkpoint, one at a time; adapters (not in a base
        checkpoint) get their own init."""
        for sub, params, buffers in new.values():
            if self._in_adapter(sub):
                continue
            prefix = self._name(sub)
            for name in params:
                key = canonical_name(f"{prefix}.{name}" if prefix else name)
                self.weights.copy_into(key, sub._parameters[name])
                self.loaded += 1
            for name in buffers:
                key = canonical_name(f"{prefix}.{name}" if prefix else name)
                if self.weights.has(key):
                    self.weights.copy_into(key, sub._buffers[name])


class SafetensorsWeights:
    """A local Hugging Face checkpoint (model.safetensors, or the shards its index names) read a
    tensor at a time through safetensors' memory map: the host holds one tensor, not the model.
    A tied weight absent from the file (lm_head when tie_word_embeddings) is the tensor it is
    tied to, which materialisation keeps tied."""

    def __init__(self, path: Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            mapping = json.loads(index.read_text())["weight_map"]
            self.files = {k: self.path / v for k, v in mapping.items()}
        else:
            from safetensors import safe_open

            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise UserError("model.weights", f"{str(self.path)!r} has no *.safetensors "
                                "files.", "Save the checkpoint with save_pretrained("
                                "safe_serialization=True), or use weights: random.")
            self.files = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    self.files.update({k: f for k in h.keys()})  # noqa: SIM118 - not a dict

    def has(self, key: str) -> bool:
        return key in self.files

    def copy_into(self, key: str, target: torch.Tensor) -> None:
        from safetensors import safe_open

        if key not in self.files:
            raise UserError("model.weights", f"the checkpoint in {str(self.path)!r} has no "
                            f"tensor {key!r}, which the model needs.",
                            "Use the checkpoint of this model's architecture (model.config / "
                            "preset), or weights: random.")
        with safe_open(str(self.files[key]), framework="pt") as h:
            t = h.get_tensor(key)
            if tuple(t.shape) != tuple(target.shape):
                raise UserError("model.weights", f"tensor {key!r} is {tuple(t.shape)} in the "
                                f"checkpoint but {tuple(target.shape)} in the model.",
                                "Use the checkpoint of this model's configuration.")
            target.copy_(t)
            del t
