"""The restore proof's determinism on a GPU, decided on the CPU: deterministic algorithms are
forced where the device has them, PyTorch's SDPA "... defaults to a non-deterministic algorithm"
warnings are recognised as what they are, and a proof that cannot be bit-exact states the
tolerance it compared to and holds the losses to it."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")

from tunepilot.restore import compare as cmp  # noqa: E402
from tunepilot.restore.messages import DeterminismReport  # noqa: E402
from tunepilot.restore.worker import (  # noqa: E402
    deterministic,
    is_determinism_error,
    nondeterministic_ops,
    strict_default,
)
from tunepilot.results.restore import StepRecord  # noqa: E402

FLASH = ("Flash Attention defaults to a non-deterministic algorithm. To explicitly enable "
         "determinism call torch.use_deterministic_algorithms(True, warn_only=False).")
MEM_EFF = ("Memory Efficient attention defaults to a non-deterministic algorithm. To explicitly "
           "enable determinism call torch.use_deterministic_algorithms(True, warn_only=False).")
INDEX = ("index_add_cuda_ does not have a deterministic implementation, but you set "
         "'torch.use_deterministic_algorithms(True, warn_only=True)'.")


def test_the_sdpa_warnings_name_their_kernels_as_non_deterministic():
    assert nondeterministic_ops([FLASH, MEM_EFF, INDEX, "something else"]) == [
        "Flash Attention", "Memory Efficient attention", "index_add_cuda_"]


def test_the_proof_context_records_what_warned_and_says_it_did_not_hold():
    import torch

    with deterministic("cpu") as det:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        warnings.warn(FLASH, UserWarning, stacklevel=1)
    assert det["nondeterministic_ops"] == ["Flash Attention"] and det["held"] is False
    with deterministic("cpu", strict=True) as det:
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert det["held"] and det["strict"]
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back


def test_a_gpu_forces_deterministic_algorithms_and_a_cpu_warns_only():
    assert strict_default("cuda:0") and strict_default("cuda")
    assert not strict_default("cpu")
    assert is_determinism_error(RuntimeError("scatter_add_cuda_kernel does not have a "
                                             "deterministic implementation, but you set ..."))
    assert not is_determinism_error(RuntimeError("CUDA out of memory"))


def _steps(losses):
    return [StepRecord(step=i, loss=x, loss_bits=float(x).hex(), lr=1e-3,
                       lr_bits=(1e-3).hex(), fingerprints=["a"], useful_tokens=10)
            for i, x in enumerate(losses)]


def test_without_bit_exactness_the_proof_states_its_tolerance_and_holds_to_it():
    det = cmp.determinism(DeterminismReport(held=False, nondeterministic_ops=["Flash Attention"]))
    text = cmp.tolerance(True, det)
    assert f"rtol {cmp.GPU_LOSS_RTOL:g}" in text and "Flash Attention" in text
    ref = _steps([2.0, 1.9, 1.8])
    close = _steps([2.0, 1.9 * (1 + 1e-6), 1.8 * (1 - 1e-6)])
    far = _steps([2.0, 1.9, 1.8 * (1 + 1e-2)])
    checks, _, _ = cmp.compare_steps(ref, close, cmp.GPU_LOSS_RTOL, "GPU")
    assert all(c.passed for c in checks)
    checks, divergence, _ = cmp.compare_steps(ref, far, cmp.GPU_LOSS_RTOL, "GPU")
    assert not all(c.passed for c in checks) and divergence is not None
    checks, _, _ = cmp.compare_steps(ref, close, None)  # held: bit-exact, so 1e-6 fails
    assert not all(c.passed for c in checks)
    held = cmp.determinism(DeterminismReport(strict=True), DeterminismReport(strict=True))
    assert held.strict and cmp.tolerance(False, held).startswith("bit-exact")
