"""The spec's kernels on a card that has them (model/kernels.py), decided on the CPU: a kernel
runs where the GPU supports it and its package is installed; otherwise the pilot says which
stand-in ran and what it leaves unmeasured; a run that fits only with its kernels is refused
naming what keeps them from running. (The kernels themselves run in tests marked gpu.)"""

from __future__ import annotations

import pytest

from tunepilot.device import DeviceInfo
from tunepilot.model.kernels import choose
from tunepilot.spec import spec_from_dict

LIGER = ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]


def gpu(cc: str = "9.0", name: str = "NVIDIA H100 80GB HBM3") -> DeviceInfo:
    return DeviceInfo(kind="cuda", name=name, torch_device="cuda:0", count=1,
                      memory_bytes=80 * 10**9, card_id="h100-sxm-80gb", torch_version="2.x",
                      compute_capability=cc)


def spec(**over):
    base = {"model": {"preset": "tiny"}, "method": {"kind": "full"},
            "precision": "bf16-mixed"}
    return spec_from_dict({**base, **over})


def everything(_module: str) -> bool:
    return True


def nothing(_module: str) -> bool:
    return False


def test_on_a_cpu_every_gpu_kernel_stands_in_and_says_so():
    s = spec(kernels={"liger": LIGER, "attention": "flash-attention-2"},
             precision="fp8-tensorwise")
    c = choose(s, None, everything)
    assert c.ran == [] and c.precision == "bf16-mixed"
    assert c.kernels["liger"] == [] and c.kernels["attention"] == "sdpa"
    assert all("need a GPU" in why for why in c.stand_ins.values())
    text = " ".join(c.notes())
    assert "did NOT measure" in text and "FP8 is NOT measured" in text


def test_on_an_h100_with_the_packages_the_spec_kernels_run():
    s = spec(kernels={"liger": LIGER, "attention": "flash-attention-2"},
             precision="fp8-rowwise")
    c = choose(s, gpu(), everything)
    assert c.stand_ins == {} and c.precision == "fp8-rowwise"
    assert c.kernels["liger"] == LIGER and c.kernels["attention"] == "flash-attention-2"
    assert any("torchao" in k for k in c.ran) and any(k.startswith("liger") for k in c.ran)
    assert "ran as the spec says" in c.notes()[0]


def test_a_missing_package_is_named_with_what_to_install():
    c = choose(spec(kernels={"liger": LIGER, "cut_cross_entropy": False}), gpu(), nothing)
    (label, why), = c.stand_ins.items()
    assert label.startswith("liger") and "pip install liger-kernel" in why
    assert c.missing_packages == {label: "liger-kernel"}


@pytest.mark.parametrize(("over", "device", "why"), [
    ({"kernels": {"attention": "flash-attention-2"}, "precision": "fp32"}, gpu(),
     "runs in 16-bit"),
    ({"kernels": {"attention": "flash-attention-2"}}, gpu("7.5", "Tesla T4"), "8.0+"),
    ({"kernels": {"attention": "flash-attention-3"}}, gpu("8.0", "NVIDIA A100"), "9.0+"),
    ({"precision": "fp8-tensorwise"}, gpu("8.0", "NVIDIA A100"), "8.9+"),
    ({"precision": "fp8-tensorwise", "method": {"kind": "lora"}}, gpu(), "LoRA"),
    ({"precision": "fp8-te"}, gpu(), "Transformer Engine"),
    ({"kernels": {"transformer_engine": True}}, gpu(), "Transformer Engine"),
    ({"kernels": {"unsloth": True}}, gpu(), "Unsloth"),
])
def test_a_kernel_the_card_or_the_spec_cannot_run_stands_in_with_why(over, device, why):
    c = choose(spec(**over), device, everything)
    assert c.ran == [] and len(c.stand_ins) == 1
    assert why in next(iter(c.stand_ins.values()))


def test_a_run_that_fits_only_with_its_kernels_is_refused_naming_the_package(monkeypatch):
    from tunepilot.model.arch import resolve_arch
    from tunepilot.pilot import prepare
    from tunepilot.plan.analytic.core import analytic_plan

    s = spec(kernels={"liger": LIGER}, sequence_length=4096, micro_batch_size=8)
    stock = s.with_changes(kernels={"liger": []})
    arch = resolve_arch(s)
    need = {k: analytic_plan(x, arch, "cuda").per_device.allocated_peak_bytes
            for k, x in (("liger", s), ("stock", stock))}
    assert need["liger"] < need["stock"]  # Liger's fused loss never holds the logits
    have = (need["liger"] + need["stock"]) // 2
    monkeypatch.setattr(prepare, "local_memory", lambda _info: (have, "cuda:0 (test)"))
    problem = prepare.plan_fit_problem(stock, analytic_plan(stock, arch, "cuda"), gpu())
    assert problem is not None
    msg = prepare._kernels_would_fit(s, arch, gpu(), 1, problem, has=nothing)
    assert msg.startswith(problem) and "With the spec's kernels the plan fits" in msg
    assert "pip install liger-kernel" in msg


@pytest.mark.gpu
def test_the_gpu_pilot_builds_liger_into_the_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tunepilot.model.build import build_model

    model = build_model(spec(kernels={"liger": ["rms_norm", "swiglu"]}), "cuda", kernels=True)
    stock = build_model(spec(kernels={"liger": ["rms_norm", "swiglu"]}), "cuda")
    assert "liger" in getattr(model.model.norm.forward, "__module__", "")
    assert "liger" not in getattr(stock.model.norm.forward, "__module__", "")
