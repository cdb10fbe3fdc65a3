"""The optimizers a spec names, as resources/optimizers.yaml describes them: where each lives,
the bytes of its state per parameter tensor (quantized blocks for the 8- and 4-bit ones) and its
speed against PyTorch's fused AdamW (the time model's factor). Pure data, no torch.
"""

from __future__ import annotations

from functools import cache

from tunepilot.resources import RESOURCES, read_yaml

OPTIMIZERS_YAML = RESOURCES / "optimizers.yaml"


@cache
def _table() -> dict:
    return read_yaml(OPTIMIZERS_YAML)


def optimizer_info(name: str) -> dict:
    """The optimizer's entry: library, class, state layout, paged."""
    return _table()["optimizers"][name]


def is_quantized(name: str) -> bool:
    """Its moments are kept in 8 or 4 bits (blockwise, with an fp32 scale per block)."""
    return bool(optimizer_info(name)["state"].get("bits"))


def is_paged(name: str) -> bool:
    """Its state lives in CUDA managed memory (bitsandbytes' paged optimizers): resident on the
    device while it fits, paged to the host under memory pressure."""
    return bool(optimizer_info(name).get("paged"))


def quantized_state_bytes(name: str, shapes: list[tuple[int, ...]], param_bytes: int) -> int:
    """Bytes of a quantized optimizer's state for parameters of these shapes: per state tensor,
    bits/8 per element plus one fp32 scale per block where the tensor is quantized (at least
    min_elements; torchao also needs the block size to divide it), else the small tensors'
    dtype (bitsandbytes: fp32; torchao: the parameter's, ``param_bytes``)."""
    st = optimizer_info(name)["state"]
    bits, block, least = st["bits"], st["block"], st["min_elements"]
    divides = optimizer_info(name)["library"] == "torchao"
    small = 4 if st.get("small") == "fp32" else param_bytes
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        quantized = n >= least and (not divides or n % block == 0)
        per_state = -(-n * bits // 8) + 4 * -(-n // block) if quantized else small * n
        total += st["tensors"] * per_state
    return total


def speed_factor(name: str) -> float:
    """A step's throughput with this optimizer over the same step with fused AdamW (1.0 where
    no published comparison says otherwise); see optimizers.yaml for the benchmarks."""
    entry = _table()["speed_vs_fused_adamw"].get(name)
    return float(entry["factor"]) if entry else 1.0
