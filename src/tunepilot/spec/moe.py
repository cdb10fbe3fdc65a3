"""How a mixture-of-experts model's routed experts run (the spec's ``moe:`` block; no effect on a
dense model, and the plan says so).

    implementation   transformers >= 5's experts_implementation (integrations/moe.py):
                     grouped_mm   the tokens sorted by expert, one grouped GEMM per projection
                                  (transformers' default where torch has the kernel)
                     eager        a Python loop over the experts a batch hits, one GEMM each
                     batched_mm   every token-expert pair gathers its expert's weights and runs a
                                  batched GEMM: for small batches (generation), a copy of the
                                  weights per routed token in training
    capacity_factor  None: dropless - every token reaches its top-k experts (transformers,
                     Megatron-core's default). A factor f: each expert takes at most
                     f x tokens x top_k / experts tokens and the dispatch buffers are padded to
                     that (Megatron-core moe_expert_capacity_factor with
                     moe_pad_expert_input_to_capacity; DeepSpeed-MoE's capacity_factor)
    load_factor      dropless under expert parallel: the busiest rank's token-expert pairs over
                     the mean (1.0: balanced routing, the plan's stated assumption; the router's
                     auxiliary loss keeps it near 1, a measured routing sets it)
    experts_layout   how the checkpoint stores the routed experts:
                     fused        two 3-D parameters per layer (transformers >= 5): bitsandbytes
                                  leaves them in 16 bit under QLoRA, PEFT reaches them through
                                  target_parameters
                     per_expert   one nn.Linear per expert and projection: axolotl's linearized
                                  Llama 4 checkpoints (``llama4_linearized_experts: true``;
                                  experts.gate_projs.N / up_projs.N / down_projs.N), which
                                  QLoRA quantizes to NF4 and LoRA targets by module name
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ExpertsImplementation = Literal["grouped_mm", "eager", "batched_mm"]
ExpertsLayout = Literal["fused", "per_expert"]


class MoeSpec(BaseModel):
    """The routed experts' implementation and routing capacity."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    implementation: ExpertsImplementation = "grouped_mm"
    capacity_factor: float | None = Field(default=None, gt=0, le=64)
    """None: dropless; else tokens per expert at most factor x tokens x top_k / experts"""
    load_factor: float = Field(default=1.0, ge=1, le=64)
    """the busiest expert-parallel rank's token-expert pairs over the mean (dropless)"""
    experts_layout: ExpertsLayout = "fused"
    """fused 3-D parameters (transformers >= 5), or one nn.Linear per expert (linearized)"""

    def pairs_per_token(self, top_k: int, expert_parallel: int = 1) -> float:
        """Token-expert pairs one rank computes per token it routes: top_k, padded to the
        capacity where there is one, or the busiest rank's share under expert parallel."""
        if self.capacity_factor is not None:
            return top_k * self.capacity_factor
        return top_k * (self.load_factor if expert_parallel > 1 else 1.0)

    @property
    def is_default(self) -> bool:
        return self == MoeSpec()
