"""The device memory allocator as the run configures it (the spec's ``allocator:`` block): what
PYTORCH_CUDA_ALLOC_CONF (or, on ROCm, PYTORCH_HIP_ALLOC_CONF - the CUDA name wins when both are
set) asks of PyTorch's caching allocator. The reserve model per card is plan/reserve/core.py."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class AllocatorSpec(BaseModel):
    """The caching allocator's settings the reserve depends on."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    expandable_segments: bool = False
    """expandable_segments:True - one virtual segment per stream that maps pages as it grows,
    so blocks cached for one size do not strand memory (CUDA since PyTorch 2.1; ROCm from 7.0,
    a silent no-op on ROCm 6.x). Recipes that set it: ms-swift's Megatron and DeepSpeed
    scripts, torchtune, torchtitan"""
