"""The slice of a model one rank holds under tensor or expert parallel, as an :class:`Arch` whose
matrices (``decoder``) are that rank's - so ``param_counts``, ``linear_modules`` and LoRA on the
slice count what the rank holds. (Replacing Arch's scalar fields alone changes no count: the
counts come from the matrices.)

  tensor (Megatron-style, Shoeybi et al. 2019)  column-parallel matrices (q, k, v, gate, up, the
      fused ones, MLA's up-projections, fc1) keep 1/t of their outputs, row-parallel ones (o,
      down, fc2) 1/t of their inputs, their bias whole (added once after the all-reduce); K/V
      heads fewer than t are replicated, one per rank; a router, MLA's down-projections and the
      norms are replicated; the vocabulary is split 1/t (vocabulary-parallel embedding and head).
  expert (GShard / Megatron-core)  each of e ranks holds num_experts / e of every MoE layer's
      routed experts; attention, dense and shared MLPs, the router and the embeddings are
      replicated. A rank computes about the same token-expert pairs as without it (each token's
      top-k go to the ranks holding those experts and come back: the all-to-all).
"""

from __future__ import annotations

import dataclasses

from tunepilot.errors import SpecError
from tunepilot.model.arch.core import Arch, LinearSpec

_COLUMN = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "q_b_proj",
           "kv_b_proj", "gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "dense_h_to_4h",
           "w1", "w3"}
_ROW = {"o_proj", "dense", "c_proj", "out_proj", "down_proj", "fc2", "dense_4h_to_h", "w2"}


def _divides(t: int, size: int, what: str) -> None:
    if size % t:
        raise SpecError("parallel.tensor", f"{t} tensor-parallel ranks cannot split the "
                        f"model's {what} ({size}) evenly.", f"Use a tensor size that divides "
                        f"{size}.")


def _tensor_spec(spec: LinearSpec, arch: Arch, t: int, kv_heads: int) -> LinearSpec:
    if spec.group == "router" or spec.group == "vision" or (
            spec.name not in _COLUMN and spec.name not in _ROW):
        return spec  # replicated: routers, MLA's latent down-projections, a vision tower
    hd = arch.head_dim
    if spec.name in ("k_proj", "v_proj"):
        return dataclasses.replace(spec, out_features=kv_heads * hd)
    if spec.name in ("qkv_proj", "query_key_value"):
        return dataclasses.replace(spec, out_features=(arch.num_heads // t + 2 * kv_heads) * hd)
    if spec.name in _COLUMN:
        return dataclasses.replace(spec, out_features=spec.out_features // t)
    return dataclasses.replace(spec, in_features=spec.in_features // t)


def tensor_slice(arch: Arch, t: int) -> Arch:
    """The slice of the model one of t tensor-parallel ranks holds (its weights, gradients and
    optimizer state are those of this narrower model)."""
    if t == 1:
        return arch
    _divides(t, arch.num_heads, "attention heads")
    for width, what in ((arch.intermediate_size, "MLP intermediate size"),
                        (arch.dense_intermediate_size, "dense MLP intermediate size"),
                        (arch.shared_intermediate_size, "shared experts' width")):
        if width:
            _divides(t, width, what)
    kv_heads = max(1, arch.num_kv_heads // t)  # fewer K/V heads than ranks: replicated
    return dataclasses.replace(
        arch, decoder=tuple(_tensor_spec(s, arch, t, kv_heads) for s in arch.decoder),
        num_heads=arch.num_heads // t, num_kv_heads=kv_heads,
        intermediate_size=arch.intermediate_size // t, vocab_size=-(-arch.vocab_size // t),
        dense_intermediate_size=arch.dense_intermediate_size // t,
        shared_intermediate_size=arch.shared_intermediate_size // t)


def expert_slice(arch: Arch, e: int) -> Arch:
    """The routed experts one of e expert-parallel ranks holds (num_experts / e per MoE layer);
    everything else replicated. ``num_experts`` stays the model's (the router scores all of
    them); the slice's routed matrices count num_experts / e."""
    if e == 1:
        return arch
    if not arch.is_moe:
        raise SpecError("parallel.expert", f"expert parallel needs routed experts; "
                        f"{arch.model_type} has none.", "Set parallel.expert: 1.")
    if arch.num_experts % e:
        raise SpecError("parallel.expert", f"{e} expert-parallel ranks cannot split the "
                        f"model's {arch.num_experts} routed experts evenly.",
                        f"Use an expert size that divides {arch.num_experts}.")
    local = arch.num_experts // e
    return dataclasses.replace(arch, decoder=tuple(
        dataclasses.replace(s, count_per_layer=local) if s.routed else s for s in arch.decoder))
