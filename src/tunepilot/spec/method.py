"""How the model is trained (the spec's ``method:`` block): full fine-tuning, LoRA or QLoRA, and
the adapter variants that change memory or time.

    dora             DoRA (PEFT use_dora): a trainable magnitude vector per adapted linear and,
                     every forward, the norm of W + BA (weight-sized temporaries); the base
                     output and the adapter output are saved for the magnitude's gradient
    rslora           rank-stabilised LoRA (PEFT use_rslora): scaling alpha/sqrt(r) instead of
                     alpha/r - no change in memory or time (said in the plan)
    modules_to_save  modules trained in full beside the adapters (PEFT modules_to_save, axolotl
                     lora_modules_to_save, LLaMA-Factory additional_target): PEFT keeps a trainable
                     copy beside the frozen original, with full gradients and optimizer state
LoRA on MoE experts is a target like any other (lora_targets: w1/w2/w3, gate_up_proj,
down_proj): model/arch.py counts each expert's adapters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MethodKind = Literal["full", "lora", "qlora"]
DEFAULT_LORA_RANK = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class MethodSpec(_Strict):
    """Full fine-tuning, LoRA, or QLoRA (NF4 4-bit frozen base, bf16 compute)."""

    kind: MethodKind = "lora"
    lora_rank: int | None = Field(default=None, gt=0, le=65536)
    lora_alpha: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    lora_targets: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )
    base_dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """lora: dtype of the frozen base; default 16 bit (as loaded with torch_dtype=bfloat16), fp32
    only under precision fp32. qlora: the dtype of the parts left unquantized."""
    double_quant: bool = False
    """qlora: 8-bit quantization of the NF4 absmax constants (bitsandbytes double quant)."""
    quantize_lm_head: bool = False
    """qlora: quantize lm_head too (transformers keeps it in 16 bit; some frameworks do not)."""
    quantize_on_load: bool = True
    """qlora: quantize while loading (transformers); false = load the bf16 base, then quantize."""
    quant_storage: Literal["uint8", "bf16", "fp16", "fp32"] | None = None
    """qlora: the dtype bitsandbytes packs the 4-bit codes in (bnb_4bit_quant_storage). Default
    uint8 on one device; under FSDP the base dtype, as the FSDP-QLoRA recipes set it (FSDP1
    flattens a layer's parameters into one tensor of a single dtype)."""
    adapter_dtype: Literal["bf16", "fp32"] | None = None
    """LoRA/QLoRA adapter weights: null = PEFT's default (fp32 adapters, autocast_adapter_dtype);
    bf16 = adapters in bf16 (LitGPT's and torchtune's pure-bf16 runs)"""
    lora_qkv_parts: list[Literal["q", "k", "v"]] | None = None
    """model.implementation litgpt only: the parts of a fused query/key/value matrix (gpt_neox's
    query_key_value, qkv_proj, Wqkv, c_attn) its LoRA adapts - LitGPT's lora_query / lora_key /
    lora_value (its finetune defaults: [q, v]); the other parts' update stays zero. null: the
    whole matrix. On a model with split q_proj / k_proj / v_proj, lora_targets says it."""
    dora: bool = False
    """DoRA (PEFT use_dora): magnitude vector + per-forward weight norm of W + BA"""
    rslora: bool = False
    """rank-stabilised scaling alpha/sqrt(r) (PEFT use_rslora): no memory or time change"""
    modules_to_save: list[str] = Field(default_factory=list, max_length=16)
    """modules trained in full beside the adapters, e.g. [embed_tokens, lm_head]: PEFT trains a
    copy of each (full gradients and optimizer state), the original stays frozen"""

    @model_validator(mode="after")
    def _lora_fields(self) -> MethodSpec:
        if self.kind == "full":
            if self.lora_rank is not None or self.lora_alpha is not None:
                raise ValueError(
                    "sets lora_rank/lora_alpha on a full fine-tune (kind: full); remove them, "
                    "or set kind: lora"
                )
            if self.adapter_dtype is not None:
                raise ValueError(
                    "sets adapter_dtype on a full fine-tune; there are no adapters: the "
                    "precision field decides the weights' dtype"
                )
            if self.base_dtype is not None:
                raise ValueError(
                    "sets base_dtype on a full fine-tune; there is no frozen base: the "
                    "precision field decides the weights' dtype"
                )
            on = [k for k in ("dora", "rslora") if getattr(self, k)] + \
                (["modules_to_save"] if self.modules_to_save else []) + \
                (["lora_qkv_parts"] if self.lora_qkv_parts is not None else [])
            if on:
                raise ValueError(
                    f"sets {', '.join(on)} on a full fine-tune; these are LoRA variants (every "
                    "parameter already trains in full): remove them, or set kind: lora"
                )
        else:
            if self.lora_rank is None:
                object.__setattr__(self, "lora_rank", DEFAULT_LORA_RANK)
            if self.lora_alpha is None:
                object.__setattr__(self, "lora_alpha", float(2 * self.lora_rank))
            parts = self.lora_qkv_parts
            if parts is not None and (not parts or len(set(parts)) != len(parts)):
                raise ValueError(f"lora_qkv_parts {parts} is empty or lists a part twice: list "
                                 "each adapted part once, e.g. [q, v], or leave it null")
            if isinstance(self.lora_targets, list) and not self.lora_targets:
                raise ValueError("lora_targets is empty; list module names or use 'all-linear'")
            if len(set(self.modules_to_save)) != len(self.modules_to_save) or \
                    not all(n.strip() for n in self.modules_to_save):
                raise ValueError(f"modules_to_save {self.modules_to_save} lists a module twice "
                                 "or an empty name: list each module once, e.g. [embed_tokens, "
                                 "lm_head]")
        return self

    @property
    def is_lora(self) -> bool:
        return self.kind in ("lora", "qlora")


def quant_storage_for(method: MethodSpec, sharded: bool, base_dtype: str) -> str:
    """QLoRA: the dtype the 4-bit codes are packed in - method.quant_storage, else the base
    dtype under FSDP (sharded with the rest of the layer), else bitsandbytes' uint8."""
    if method.quant_storage is not None:
        return method.quant_storage
    return base_dtype if sharded else "uint8"


def check_quant_storage(method: MethodSpec, parallel, storage: str) -> None:
    """FSDP1 flattens a layer's parameters into one tensor of one dtype: uint8 codes beside
    16-bit norms cannot be flattened (the reason bnb_4bit_quant_storage exists)."""
    if (method.kind == "qlora" and parallel.strategy == "fsdp" and parallel.fsdp_version == 1
            and storage == "uint8"):
        raise ValueError(
            "method.quant_storage uint8 under FSDP1: FSDP1 flattens each layer's parameters into "
            "one tensor of one dtype, and the 4-bit codes would be uint8 beside 16-bit norms; "
            "set method.quant_storage: bf16 (bnb_4bit_quant_storage, as the FSDP-QLoRA recipes "
            "do) or parallel.fsdp_version: 2")
