"""What FP8 training (precision fp8-*, tunepilot/spec/fp8.py) changes in one device's memory, against
the same run in bf16-mixed. Pure arithmetic; the analytic plan applies it to its timeline and
the traced plan to the bf16 step it traced (the trace cannot run FP8 kernels on a CPU).

Kept as in bf16-mixed (no change): fp32 master weights, fp32 gradients, optimizer state, the
frozen base of a LoRA run (bf16), lm_head (torchao and Megatron leave the output layer in bf16).

What changes, per recipe (tunepilot/spec/fp8.py RECIPES, with their sources):
- the trained weights' 16-bit casts: autocast caches a bf16 copy of every fp32 weight it casts
  until the forward ends (2 B/param). torchao's Float8Linear casts the weight straight to FP8 per
  matmul and keeps no copy (it saves the parameter itself), so the decoder's linears lose that
  cache; Transformer Engine keeps FP8 workspaces instead - the FP8 weight and, on Hopper, its
  transpose (2 x 1 B/param): the same bytes as the bf16 copy.
- saved activations: torchao saves the bf16 inputs of each matmul (unchanged); Transformer Engine
  saves the FP8 cast of the input for the weight gradient (1 B per feature instead of 2) - for
  full fine-tuning without checkpointing, where the linears' inputs are what is saved.
- the working set: the FP8 copies of one linear's input, weight and output gradient (1 B per
  element; rowwise casts each twice, once per axis) while it computes.
- FSDP: tensorwise all-gathers the weights in FP8, so the unsharded layers' linear weights take
  1 B/param instead of 2.
- scales: one fp32 per tensor (tensorwise, TE; TE's amax history adds a few fp32 per tensor) or
  per row (rowwise, inside the working set above): kilobytes to a few MB, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tunepilot.model.arch import Arch, linear_modules


@dataclass
class Fp8Terms:
    """FP8's changes to the analytic timeline (bytes; negative = saved)."""

    saved_delta: int = 0
    casts_delta: int = 0
    transient: int = 0
    unsharded_delta: int = 0
    notes: list[str] = field(default_factory=list)


def _linear_inputs_per_token(arch: Arch) -> int:
    """Features of the matmul inputs one decoder layer saves per token in full fine-tuning: the
    attention input, the o_proj input, the MLP input (not for a parallel block) and the down
    projection's input (per routed expert) - the `full` term of activations.py."""
    h = arch.hidden_size
    hq = arch.num_heads * arch.head_dim
    parallel = arch.family == "phi" or arch.norms_per_layer == 1
    return h + hq + (0 if parallel else h) + arch.mlp_width_per_token


def fp8_terms(spec, arch: Arch, cb: int, tokens: int, shard: int, linear_weights: int,
              casts_fwd: int) -> Fp8Terms:
    """FP8's changes for the spec (None of them when the spec is not FP8)."""
    from tunepilot.spec.fp8 import recipe

    r = recipe(spec)
    t = Fp8Terms()
    if r is None:
        return t
    full = spec.method.kind == "full"
    decoder_casts = 2 * linear_weights // shard if casts_fwd else 0
    if decoder_casts and not r.weight_cache_bytes_per_param:
        t.casts_delta = -decoder_casts
        t.notes.append(f"{spec.precision}: no bf16 weight casts for the decoder's linears "
                       "(Float8Linear casts each weight to FP8 per matmul and keeps no copy); "
                       "lm_head stays bf16")
    elif decoder_casts:
        t.notes.append(f"{spec.precision}: FP8 weight workspaces (the weight and its transpose, "
                       "1 B/param each) in place of autocast's bf16 copies")
    if r.saves_fp8_inputs and full and spec.activation_checkpointing == "none":
        t.saved_delta = -(cb - 1) * tokens * arch.num_layers * _linear_inputs_per_token(arch)
        t.notes.append(f"{spec.precision}: the linears' inputs saved in FP8 for the weight "
                       "gradient (1 B per feature, not 2)")
    linears = [m for m in linear_modules(arch) if m.group != "head"]
    if linears:
        widest_in = max(m.in_features for m in linears)
        widest_out = max(m.out_features for m in linears)
        largest = max(m.in_features * m.out_features for m in linears)
        t.transient = r.recasts * (tokens * (widest_in + widest_out) + largest)
    if r.all_gather_fp8 and spec.parallel.strategy == "fsdp" and shard > 1:
        from tunepilot.model.shard import FSDP_UNSHARDED_LAYERS

        per_layer = linear_weights // max(arch.num_layers, 1)
        t.unsharded_delta = -(cb - 1) * FSDP_UNSHARDED_LAYERS * per_layer \
            if spec.parallel.reshard_after_forward else -(cb - 1) * linear_weights
        t.notes.append(f"{spec.precision}: FSDP all-gathers the linear weights in FP8 "
                       "(1 B/param in the unsharded layers)")
    t.notes.append(f"{spec.precision}: fp32 master weights, gradients and optimizer state as "
                   "bf16-mixed; the FP8 copies of one linear's operands while it computes "
                   f"({'each cast along both axes' if r.recasts > 1 else 'one cast each'}); "
                   "scales (a few fp32 per tensor or row) not counted")
    return t
