"""Routed experts as one nn.Linear per expert and projection (``moe.experts_layout:
per_expert``): the module layout of axolotl's linearized Llama 4 checkpoints
(``llama4_linearized_experts: true``), built in place of transformers' fused experts so that
bitsandbytes quantizes them under QLoRA and PEFT targets them by name, as on the user's run.

The math is transformers' Llama4TextExperts: every expert takes its slice of the routed input
(the router's scores already applied) through up * act(gate), then down - one expert at a time.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearizedExperts(nn.Module):
    """A layer's routed experts, each expert's gate, up and down projections an nn.Linear."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act, device=None,
                 dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.num_experts, self.hidden_size = num_experts, hidden
        self.gate_projs = nn.ModuleList(nn.Linear(hidden, inter, **kw) for _ in range(num_experts))
        self.up_projs = nn.ModuleList(nn.Linear(hidden, inter, **kw) for _ in range(num_experts))
        self.down_projs = nn.ModuleList(nn.Linear(inter, hidden, **kw)
                                        for _ in range(num_experts))
        self.act_fn = act

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.view(self.num_experts, -1, self.hidden_size)
        out = torch.zeros_like(x)
        for i in range(self.num_experts):
            out[i] = self.down_projs[i](self.up_projs[i](x[i]) * self.act_fn(self.gate_projs[i](x[i])))
        return out.view(-1, self.hidden_size)


def linearize_experts(model: nn.Module) -> int:
    """Replace every fused Llama 4 experts module (3-D gate_up_proj (E, h, 2i) and down_proj
    (E, i, h)) with LinearizedExperts on the same device and dtype; the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            gate_up = getattr(child, "gate_up_proj", None)
            if type(child).__name__ != "Llama4TextExperts" or not isinstance(gate_up, torch.Tensor):
                continue
            e, h, two_i = gate_up.shape
            setattr(parent, name, LinearizedExperts(e, h, two_i // 2, child.act_fn,
                                                    gate_up.device, gate_up.dtype))
            replaced += 1
    return replaced
