"""LitGPT's LoRA on a fused query/key/value projection, as it runs, on transformers' model.

LitGPT (lit_gpt/lora.py LoRAQKVLinear @8641822; litgpt/lora.py keeps the same zero_pad) holds
one fused qkv matrix per layer. When LoRA adapts only some of q, k and v (its finetune/lora.py
defaults: lora_query and lora_value, not lora_key), the adapters' output - one conv1d over the
enabled parts - is scattered into a zero tensor of the full qkv width before it is added:

    result = x.new_zeros((..., out_features)).index_copy(1, lora_ind, after_B)

index_copy's backward (tools/autograd/derivatives.yaml) reads its `source`, so autograd keeps
the enabled parts' adapter output - tokens x (q + v widths) in the compute dtype - per layer
until the backward. With all three adapted, zero_pad returns its input and keeps nothing.

transformers' split q_proj / k_proj / v_proj with PEFT LoRA on some of them is the same
computation; `keep_lora_output` routes each adapted projection's lora_B output through the same
index_copy (into a zero tensor of its own width, identity index), so the step keeps what
LitGPT's keeps: the same values, the same saved bytes. The analytic plan counts it with
`litgpt_kept_features`.

The fused matrix also keeps its whole output, LoRA or not (CausalSelfAttention.forward
@8641822): q and k are made anew by the rope's torch.cat, but v stays a view of the qkv output
(permute, split and, with as many K/V heads as query heads, a reshape that needs no copy), and
the attention saves v - so the q and k widths of that output stay alive with it until the
backward. `fused_qkv_storage` makes transformers' split v_proj output such a view of a q + k + v
wide tensor (the same values); with fewer K/V heads LitGPT's expand and reshape copy v and
nothing extra is kept.
"""

from __future__ import annotations

QKV_SPLIT = ("q_proj", "k_proj", "v_proj")
QKV_FUSED = ("query_key_value", "qkv_proj", "Wqkv", "c_attn")  # one matrix for q, k and v
INTERLEAVED = ("query_key_value",)  # gpt_neox: per head [q | k | v] (view(..., heads, 3 * hd))


def partial_qkv(adapted: set[str], present: set[str]) -> list[str]:
    """The split q/k/v projections whose LoRA output LitGPT's zero_pad keeps: the adapted ones,
    when some but not all of the model's q, k and v are adapted."""
    qkv = [n for n in QKV_SPLIT if n in present]
    hit = [n for n in qkv if n in adapted]
    return hit if 0 < len(hit) < len(qkv) else []


def part_widths(heads: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    return {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}


def fused_part_index(name: str, parts: list[str], heads: int, kv_heads: int,
                     head_dim: int) -> list[int]:
    """Output features of the fused qkv matrix `name` that belong to `parts`, in order."""
    if name in INTERLEAVED:  # gpt_neox: multi-head, each head's q, k, v side by side
        offset = {"q": 0, "k": head_dim, "v": 2 * head_dim}
        return [hh * 3 * head_dim + offset[p] + d for hh in range(heads)
                for p in ("q", "k", "v") if p in parts for d in range(head_dim)]
    w = part_widths(heads, kv_heads, head_dim)
    start = {"q": 0, "k": w["q"], "v": w["q"] + w["k"]}
    return [start[p] + i for p in ("q", "k", "v") if p in parts for i in range(w[p])]


def keep_lora_output(model, parts: list[str] | None = None) -> None:
    """LitGPT's zero_pad on transformers' model: route the adapted q/k/v projections' lora_B
    output through index_copy (only some of split q, k, v adapted), or - with `parts` - keep
    only those parts of a fused qkv matrix's adapter output, the rest zero."""
    import torch

    present: set[str] = set()
    adapted: dict[str, list] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in QKV_SPLIT and leaf not in QKV_FUSED:
            continue
        present.add(leaf)
        lora_b = getattr(module, "lora_B", None)
        if isinstance(lora_b, torch.nn.ModuleDict) and len(lora_b):
            adapted.setdefault(leaf, []).extend(lora_b.values())
    hooks = {leaf: _zero_pad(None) for leaf in partial_qkv(set(adapted), present)}
    fused = [n for n in QKV_FUSED if n in adapted]
    if parts is not None and len(set(parts)) < 3 and fused:
        from tunepilot.model.arch import Arch

        arch = Arch.from_config(model.config.to_dict())
        hooks.update({leaf: _zero_pad(fused_part_index(leaf, parts, arch.num_heads,
                                                       arch.num_kv_heads, arch.head_dim))
                      for leaf in fused})
    for leaf, hook in hooks.items():
        for linear in adapted[leaf]:
            linear.register_forward_hook(hook)


def _zero_pad(index: list[int] | None):
    """A forward hook scattering the adapter output into zeros of its width with index_copy, as
    LitGPT's zero_pad does: all of it (index None: equal values, the output kept), or the parts
    at `index` (the other parts' update zero; the index made per call on the output's device,
    as LitGPT's torch.tensor(self.lora_ind))."""
    def hook(module, args, out):
        import torch

        dim = out.dim() - 1
        if index is None:
            idx, source = torch.arange(out.shape[-1], device=out.device), out
        else:
            idx = torch.tensor(index, device=out.device)
            source = out.index_select(dim, idx)
        return out.new_zeros(out.shape).index_copy(dim, idx, source)
    return hook


def fused_qkv_storage(model) -> int:
    """On a split-q/k/v model with as many K/V heads as query heads: make each v_proj output a
    view into a tensor as wide as LitGPT's fused qkv output (zeros where q and k would be), so
    the attention's saved v keeps what LitGPT's keeps. Returns the projections hooked."""
    from tunepilot.model.arch import Arch

    arch = Arch.from_config(model.config.to_dict())
    if arch.num_kv_heads != arch.num_heads:
        return 0
    hooked = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "v_proj" and hasattr(module, "register_forward_hook"):
            module.register_forward_hook(_within_fused)
            hooked += 1
    return hooked


def _within_fused(module, args, out):
    """v as the last third of a q|k|v-wide tensor (MHA: each part as wide as v)."""
    import torch

    width = out.shape[-1]
    return torch.cat((out.new_zeros(*out.shape[:-1], 2 * width), out), dim=-1)[..., 2 * width:]
