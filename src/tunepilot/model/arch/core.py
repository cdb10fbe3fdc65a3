"""The normalised facts of one model: :class:`Arch`, and :class:`LinearSpec` for each of its weight
matrices (with the number of decoder layers that hold it). Built from a config by the layout
rules in model/arch/layouts.py (dense), moe.py (experts) and vision.py (a vision tower)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MoeLayout = Literal["fused", "per_expert"]


@dataclass(frozen=True)
class LinearSpec:
    """One weight matrix of a decoder layer (or the LM head, or a vision tower's layer), as PEFT
    would target it."""

    name: str  # PEFT target name, e.g. "q_proj"
    path: str  # path inside one decoder layer, e.g. "self_attn.q_proj"; PEFT matches its suffix
    in_features: int
    out_features: int
    has_bias: bool
    count_per_layer: int = 1  # num_experts for MoE experts stored as one (experts, out, in) tensor
    group: str = "attention"  # attention | mlp | router | head | vision
    # "module": an nn.Linear / Conv1D that PEFT's target_modules and all-linear wrap;
    # "parameter": a raw nn.Parameter (fused MoE experts, router) reached via target_parameters
    peft_kind: str = "module"
    layers: int = 1
    """how many layers hold this matrix (decoder layers; the vision tower's for group vision;
    1 for the head)"""
    routed: bool = False
    """a routed expert: each token passes through experts_per_token of count_per_layer"""
    transposed: bool = False
    """stored (experts, in, out) rather than (experts, out, in) (gpt-oss, Llama-4 experts)"""
    layer_kind: str = "all"
    """which decoder layers hold it: all, the dense ones, or the MoE ones (an MoE model)"""

    @property
    def numel(self) -> int:
        """Parameters in this entry for one layer: weight (+ bias) times count_per_layer."""
        return (
            self.in_features * self.out_features + self.has_bias * self.out_features
        ) * self.count_per_layer

    @property
    def total_numel(self) -> int:
        """Parameters in this entry over every layer that holds it."""
        return self.numel * self.layers

    @property
    def runs_per_token(self) -> bool:
        """False for a vision tower's matrices: text tokens never pass through them."""
        return self.group != "vision"


@dataclass(frozen=True)
class VisionTower:
    """A multimodal model's image encoder and projector (Gemma 3's SigLIP): counted in the
    model's parameters and weights, never run by a text-only fine-tune."""

    params: int
    linears: tuple[LinearSpec, ...]
    vectors: tuple[int, ...]  # sizes of its other parameters (norms, biases, embeddings)
    shapes: tuple[tuple[int, ...], ...]  # its non-linear parameters' shapes (conv, positions)


@dataclass(frozen=True)
class Arch:
    """The normalised facts the memory and LoRA arithmetic need, read from one config."""

    model_type: str
    family: str  # attention/MLP layout: llama | phi3 | gpt_neox | phi | gpt2 | mla
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # per query/key head (MLA: qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int  # per expert for MoE
    vocab_size: int
    tied_embeddings: bool
    num_experts: int  # routed experts per MoE layer; 1 for dense models
    experts_per_token: int  # 1 for dense models
    mlp_kind: str  # "gated" (SwiGLU / GeGLU: 3 matrices) or "plain" (GELU MLP: 2 matrices)
    norm_kind: str  # "rms" (weight only) or "layer" (weight + bias)
    norms_per_layer: int  # hidden-sized norms: 2; 4 for gemma2/3 (pre+post); 1 parallel blocks
    attention_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool  # attention output projection carries a bias
    mlp_bias: bool
    lm_head_bias: bool
    num_position_embeddings: int  # learned absolute positions (gpt2); 0 for rotary models
    max_position_embeddings: int | None
    known_layout: bool  # always True: a layout the rules cannot count is refused
    hf_id: str | None
    config_hash: str
    hidden_act: str = "silu"  # the config's activation (hidden_act / activation_function)
    # positions the config is made for: max_position_embeddings, or its rope_scaling's
    # original_max_position_embeddings x factor where larger (model/context.py); None: unnamed
    context_length: int | None = None
    decoder: tuple[LinearSpec, ...] = ()
    """every weight matrix of the decoder layers, each with the number of layers holding it"""
    layer_vectors: tuple[int, ...] = ()
    """sizes of one decoder layer's other parameters but the q/k norms and sinks: norm weights
    (and biases), MLA's latent norms, learned activation scalars"""
    qk_norm: str = "none"
    """q/k norms: none | head (one over head_dim each: Qwen3, Gemma 3, Apertus) | full (over all
    q and all k features: OLMo 2/3, OLMoE) | per_head (a LayerNorm per head: StableLM) |
    head_affine (a LayerNorm with bias over head_dim each: Phi)"""
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)
    model_vectors: tuple[int, ...] = ()
    """sizes of the model's parameters outside the layers and the head: the final norm"""
    num_moe_layers: int = 0  # layers whose MLP is routed experts (the rest are dense)
    num_shared_experts: int = 0  # experts every token passes through, beside the routed ones
    shared_intermediate_size: int = 0  # their total width (0 without)
    dense_intermediate_size: int = 0  # a dense layer's MLP width in an MoE model
    router: str = ""
    """how the MoE router picks (transformers 5.25): softmax (fp32 softmax, then top-k: Mixtral,
    Qwen-MoE, OLMoE, DeepSeek-V2) | softmax_grouped (DeepSeek-V2's group_limited_greedy) |
    sigmoid_grouped (DeepSeek-V3: sigmoid, top groups, top-k) | topk_softmax (gpt-oss: top-k of
    the logits, softmax over them) | topk_sigmoid (Llama 4)"""
    router_norm: bool = False  # the top-k weights renormalised to sum to 1
    router_groups: int = 1  # expert groups the grouped routers pick among (n_group)
    sliding_window: int | None = None  # local attention span of the sliding layers (tokens)
    num_sliding_layers: int = 0  # layers that attend within sliding_window (or a chunk)
    vision: VisionTower | None = None
    mtp_params: int = 0
    """multi-token-prediction modules the checkpoint ships but transformers does not build
    (DeepSeek-V3 num_nextn_predict_layers): reported, not in the model's parameters"""

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_vectors(self) -> tuple[int, ...]:
        """Sizes of one layer's q/k norm and sink parameters (they follow the head counts, so a
        tensor-parallel slice holds its heads' share)."""
        hd, q, kv = self.head_dim, self.num_heads, self.num_kv_heads
        sizes = {"none": [], "head": [hd, hd], "full": [q * hd, kv * hd],
                 "per_head": [hd] * (q + kv), "head_affine": [hd] * 4}[self.qk_norm]
        return tuple(sizes + ([q] if self.attention_sinks else []))

    @property
    def vectors_per_layer(self) -> tuple[int, ...]:
        """Every parameter of one decoder layer that is not a matrix, by size."""
        return self.layer_vectors + self.attention_vectors

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def mlp_width_per_token(self) -> int:
        """The MLP intermediate width one token passes through, averaged over the layers: the
        top-k routed experts plus the shared ones in an MoE layer, the dense width elsewhere
        (what the activation arithmetic multiplies by, in place of intermediate_size)."""
        if not self.is_moe:
            return self.intermediate_size
        moe = self.experts_per_token * self.intermediate_size + self.shared_intermediate_size
        dense_layers = self.num_layers - self.num_moe_layers
        total = self.num_moe_layers * moe + dense_layers * self.dense_intermediate_size
        return round(total / self.num_layers)

    @property
    def largest_mlp_width(self) -> int:
        """The widest MLP intermediate one token meets in a single layer (one layer's working
        set: top-k routed + shared in an MoE layer, or a dense layer's when that is wider)."""
        if not self.is_moe:
            return self.intermediate_size
        moe = self.experts_per_token * self.intermediate_size + self.shared_intermediate_size
        if self.num_moe_layers == self.num_layers:
            return moe
        return max(moe, self.dense_intermediate_size)

    def layer_share(self, lin: LinearSpec) -> float:
        """The fraction of the decoder layers that hold ``lin`` (1.0 for most; the MoE or the
        dense layers' share of an MoE model): a per-layer term times num_layers stays exact."""
        return lin.layers / self.num_layers

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Arch:
        """Build from a HF config dict (a preset or a user's config.json); a layout the rules
        cannot count is refused with a SpecError naming the key."""
        from tunepilot.model.arch.layouts import read_arch

        return read_arch(cfg)
