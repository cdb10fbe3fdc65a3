"""A multimodal model's vision tower, as AutoModelForCausalLM builds it for Gemma 3 (4B and up):
Gemma3ForConditionalGeneration = a SigLIP vision encoder (transformers' SiglipVisionModel, no
pooling head) + the multi-modal projector + the text decoder. Its weights are loaded and held
whatever the data; a text-only fine-tune never runs them, and PEFT's all-linear (or a q_proj
target) wraps its linears too."""

from __future__ import annotations

from tunepilot.model.arch.core import LinearSpec, VisionTower
from tunepilot.model.arch.reader import ConfigView

# SiglipVisionConfig's defaults (transformers 5.25) for keys a vision_config may leave out
_SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
           "num_channels": 3, "image_size": 224, "patch_size": 16}


def vision_tower(top: ConfigView, text) -> VisionTower:
    """SigLIP: patch embedding (a conv with bias) and one learned position per patch; per
    layer two LayerNorms, q/k/v/out projections and fc1/fc2, all with biases; a post
    LayerNorm. Projector: an RMSNorm over the vision width and one (vision, text) matrix.
    ``text``: the text decoder's Dims."""
    vc = top.nested("vision_config", _SIGLIP)
    if vc.flag("vision_use_head", True):
        vc.refuse("vision_use_head", "is true (or absent): Gemma 3 builds its tower without "
                  "SigLIP's pooling head, and tunepilot counts no other")
    hv, iv, layers = vc.count("hidden_size"), vc.count("intermediate_size"), \
        vc.count("num_hidden_layers")
    patch, channels = vc.count("patch_size"), vc.count("num_channels")
    positions = (vc.count("image_size") // patch) ** 2

    def lin(name, path, fan_in, fan_out):
        return LinearSpec(name, f"vision_tower.encoder.layers.N.{path}", fan_in, fan_out, True,
                          group="vision", layers=layers)

    linears = tuple([lin(n, f"self_attn.{n}", hv, hv)
                     for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
                    + [lin("fc1", "mlp.fc1", hv, iv), lin("fc2", "mlp.fc2", iv, hv)])
    # per layer: layer_norm1, layer_norm2 (weight + bias); then the post_layernorm, the patch
    # conv's bias and the projector's RMSNorm
    vectors = tuple([hv] * (4 * layers) + [hv, hv, hv, hv])
    shapes = ((hv, channels, patch, patch), (positions, hv), (hv, text.hidden))
    params = sum(s.total_numel for s in linears) + sum(vectors) + sum(
        _numel(s) for s in shapes)
    return VisionTower(params, linears, vectors, shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
