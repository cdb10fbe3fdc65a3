"""The autocast a spec's precision runs under (spec.precision.autocast_dtype: bf16 for
bf16-mixed and FP8, whose pilot and trace run its bf16-mixed stand-in; fp16 for fp16-mixed; none
otherwise) as torch sees it - for the training step, the trace and generation."""

from __future__ import annotations

import contextlib

import torch

from tunepilot.model.build import torch_dtype
from tunepilot.spec import RunSpec


def autocast_dtype(spec: RunSpec) -> torch.dtype | None:
    """The torch dtype of the spec's autocast (None: the step runs without autocast)."""
    name = spec.precision.autocast_dtype
    return None if name is None else torch_dtype(name)


def autocast_context(spec: RunSpec, device_type: str):
    dtype = autocast_dtype(spec)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
