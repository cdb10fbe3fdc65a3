"""Balanced routing: the trace of an MoE layer whose experts run as a Python loop.

transformers' eager experts (gpt-oss's, and every ``experts_implementation: eager``) find the
experts a batch hits and each expert's tokens with ``nonzero`` / ``torch.where`` and test an
index with ``if expert_idx == num_experts``: data-dependent shapes and a data-dependent branch,
which fake tensors refuse (DynamicOutputShapeException), so the trace fell back. Inside each
experts module's forward this mode answers them as a balanced router does, the assumption the
analytic plan makes (plan/analytic/moe.py):

    hit experts      every expert is hit (a training batch routes T x k >> E pairs), so the
                     mask's nonzero over E (or E + 1 with a masking slot) entries has E rows
    expert's tokens  the nonzero of one expert's (k, T) mask has ceil(k T / E) rows
    scalar tests     an index compared with num_experts is not the masking slot (False), and an
                     index read as a number is 0 (a view of one expert's weights: the same bytes)

Every other op passes on unchanged (to the tracker and the fake mode below), so the loop's
gathers, matmuls, saved tensors and index_add_ are the real code's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = torch.ops.aten


class BalancedRouting(TorchDispatchMode):
    """Answers the data-dependent ops of a loop over ``num_experts`` experts as a balanced
    router would (see the module's docstring)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ATEN.nonzero.default:
            x = args[0]
            e = self.num_experts
            rows = e if x.numel() in (e, e + 1) else -(-x.numel() // e)
            return torch.empty((rows, x.dim()), dtype=torch.long, device=x.device)
        if func in (_ATEN._local_scalar_dense.default, _ATEN.is_nonzero.default):
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)


def experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Each module holding a layer's experts as 3-D parameters, with its expert count."""
    found = []
    for module in model.modules():
        e = getattr(module, "num_experts", None) or getattr(module, "num_local_experts", None)
        if isinstance(e, int) and e > 1 and any(
                p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((module, e))
    return found


def balanced_routing(model: torch.nn.Module, notes: list[str]) -> int:
    """Run every experts module's forward (and its recompute under checkpointing) inside
    BalancedRouting; the number wrapped."""
    wrapped = 0
    for module, e in experts_modules(model):
        forward = module.forward

        def routed(*args, _forward=forward, _e=e, **kwargs):
            with BalancedRouting(_e):
                return _forward(*args, **kwargs)

        module.forward = routed
        wrapped += 1
    if wrapped:
        notes.append(f"MoE: {wrapped} experts modules traced with balanced routing (every "
                     "expert hit, ceil(tokens x top-k / experts) tokens each), as the analytic "
                     "plan assumes")
    return wrapped
