"""The autocast a spec's precision runs under: bf16 for bf16-mixed (and FP8, whose pilot and
trace run its bf16-mixed stand-in), fp16 for fp16-mixed, none otherwise - one rule for the
training step, the trace and generation."""

from __future__ import annotations

import contextlib

import torch

from tunepilot.spec import RunSpec


def autocast_context(spec: RunSpec, device_type: str):
    if spec.precision == "bf16-mixed" or spec.is_fp8:  # FP8 runs as its bf16-mixed stand-in
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if spec.precision == "fp16-mixed":
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()
