"""The reserve by card: the same spec on a CUDA card and on an MI300X (ROCm's workspace and
context from resources/runtime.yaml), and expandable segments (allocator.expandable_segments)
where the stack has them."""

from __future__ import annotations

from tunepilot.model.arch import resolve_arch
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.resources import runtime_constants
from tunepilot.spec import spec_from_dict

BASE = {"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
        "sequence_length": 1024, "data": {"source": "tiny-text"}}


def _plan(stack: str, **fields):
    spec = spec_from_dict({**BASE, **fields})
    return analytic_plan(spec, resolve_arch(spec), stack)


def test_rocm_takes_its_own_workspace_and_context():
    cuda, rocm = _plan("cuda").per_device, _plan("rocm").per_device
    st = runtime_constants()["stacks"]
    extra = st["rocm"]["library_workspace_bytes"] - st["cuda"]["library_workspace_bytes"]
    assert rocm.allocated_peak_bytes - cuda.allocated_peak_bytes == extra
    assert rocm.runtime_overhead_bytes == st["rocm"]["context_bytes"]
    assert rocm.device_peak_bytes > cuda.device_peak_bytes


def test_expandable_segments_strand_no_blocks_and_say_so():
    cached = _plan("cuda")
    grown = _plan("cuda", allocator={"expandable_segments": True})
    assert cached.per_device.allocated_peak_bytes == grown.per_device.allocated_peak_bytes
    # varied batch lengths strand blocks in the caching allocator, not in expandable segments
    assert cached.per_device.reserved_peak_bytes > grown.per_device.reserved_peak_bytes
    assert grown.per_device.reserved_peak_bytes == grown.per_device.allocated_peak_bytes
    assert any(n.startswith("reserved: expandable segments") for n in grown.assumptions)
