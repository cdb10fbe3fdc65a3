"""What the run trains: the objective (the spec's ``objective:`` block).

    sft                     supervised next-token loss (the default)
    dpo ipo                 pairs (chosen, rejected) through the policy - concatenated into one
                            forward by default, as TRL does - and a reference forward (no grad)
    orpo simpo cpo          pairs, no reference model
    kto                     unpaired desirable/undesirable rows and a reference forward
    reward                  pairs scored by a sequence-classification head (no reference)
    grpo rloo               generation (num_generations completions per prompt), then the policy
                            update over the completions; a reference forward unless beta is 0

The reference of a LoRA run is the base with the adapters disabled (no extra weights); of a full
run a frozen copy on the device, unless its log-probabilities are precomputed before training.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ObjectiveKind = Literal["sft", "dpo", "ipo", "orpo", "simpo", "cpo", "kto", "reward", "grpo",
                        "rloo"]
PAIRED = ("dpo", "ipo", "orpo", "simpo", "cpo", "reward")
NO_REFERENCE = ("sft", "orpo", "simpo", "cpo", "reward")
GENERATIVE = ("grpo", "rloo")
Reference = Literal["auto", "adapters-off", "copy", "precomputed", "none"]
GenerationBackend = Literal["vllm-colocate", "vllm-server", "transformers"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class GenerationSpec(_Strict):
    """How GRPO/RLOO generate their completions."""

    backend: GenerationBackend = "transformers"
    """vllm-colocate: vLLM in the training process, on the same card (it reserves
    gpu_memory_utilization of the card's memory); vllm-server: vLLM on server_devices cards of
    their own (counted in the card count and the cost); transformers: model.generate with a KV
    cache on the training card"""
    gpu_memory_utilization: float = Field(default=0.3, gt=0, lt=1, allow_inf_nan=False)
    """vllm-colocate: the fraction of the card's memory vLLM reserves (weights, KV cache)"""
    sleep_mode: bool = False
    """vllm-colocate: vLLM releases its KV cache (and offloads its weights) while training runs"""
    server_devices: int = Field(default=1, gt=0, le=4096)
    """vllm-server: cards that run the vLLM server"""


class ObjectiveSpec(_Strict):
    """The training objective and what it changes in memory and time."""

    kind: ObjectiveKind = "sft"
    beta: float | None = Field(default=None, ge=0, le=1e6, allow_inf_nan=False)
    """the KL / preference strength; GRPO with beta 0 loads no reference model"""
    loss_type: str | None = None
    """the DPO-family loss variant as the trainer names it (sigmoid, ipo, hinge, ...)"""
    reference: Reference = "auto"
    """auto: adapters-off for LoRA/QLoRA, a frozen copy for a full run; none for the objectives
    that need none"""
    max_prompt_length: int | None = Field(default=None, gt=0, le=1 << 21)
    """tokens of the prompt (pairs and GRPO); default: half of sequence_length for pairs"""
    max_completion_length: int | None = Field(default=None, gt=0, le=1 << 21)
    """tokens of each completion (chosen/rejected, or generated)"""
    concatenate_pairs: bool = True
    """pairs: chosen and rejected in one forward of 2 x micro_batch_size rows (TRL's default)"""
    num_generations: int = Field(default=8, gt=0, le=4096)
    """GRPO/RLOO: completions per prompt"""
    num_iterations: int = Field(default=1, gt=0, le=1024)
    """GRPO: policy updates per generation batch"""
    generation: GenerationSpec = Field(default_factory=GenerationSpec)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> ObjectiveSpec:
        if self.kind == "sft":
            set_ = [k for k in ("beta", "loss_type", "max_prompt_length",
                                "max_completion_length") if getattr(self, k) is not None]
            if set_:
                raise ValueError(f"sets {', '.join(set_)} on objective kind 'sft', which has no "
                                 "preference or generation terms; remove them, or set kind "
                                 "(dpo, kto, grpo, ...)")
        if self.kind in NO_REFERENCE and self.reference not in ("auto", "none"):
            raise ValueError(f"objective {self.kind!r} uses no reference model, but reference "
                             f"is {self.reference!r}; remove it (or use dpo/kto/grpo)")
        return self

    @property
    def paired(self) -> bool:
        return self.kind in PAIRED

    @property
    def generative(self) -> bool:
        return self.kind in GENERATIVE

    @property
    def needs_reference(self) -> bool:
        """dpo/ipo/kto always; grpo/rloo unless beta is 0; never for sft/orpo/simpo/cpo/reward."""
        if self.kind in NO_REFERENCE or self.reference == "none":
            return False
        if self.generative:
            return self.beta is None or self.beta > 0
        return True
