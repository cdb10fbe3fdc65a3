"""The trace of kernels and adapter variants: the GPU kernels' PyTorch stand-ins compute the same
loss and gradients as PyTorch's own ops (on real CPU tensors), and a traced plan moves by what
the analytic plan says each kernel or variant saves (its difference from the stock twin)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tunepilot.model.arch import resolve_arch, resolve_model_config  # noqa: E402
from tunepilot.plan.analytic.core import analytic_plan  # noqa: E402
from tunepilot.plan.api import make_plan  # noqa: E402
from tunepilot.plan.trace import kernel_standins as ks  # noqa: E402
from tunepilot.plan.trace.step import trace_step  # noqa: E402
from tunepilot.spec import spec_from_dict  # noqa: E402

TINY = {"model": {"preset": "tiny"}, "sequence_length": 128, "micro_batch_size": 4,
        "optimizer": {"name": "adamw", "lr": 1e-3}}
FULL = {"method": {"kind": "full"}, "precision": "bf16-true"}
LORA = {"method": {"kind": "lora", "lora_rank": 8}}
LIGER = ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]


def grads(fn, *inputs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    out.backward()
    return out.detach(), [x.grad for x in xs if x.requires_grad]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_norm_and_glu_stand_ins_compute_pytorchs_values_and_gradients():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 16), torch.rand(16) + 0.5, torch.randn(16)

    def rms_ref(x, w):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).square().sum()

    out, g = grads(lambda x, w: ks._RMSNorm.apply(x, w, 1e-6, 0.0).square().sum(), x, w)
    ref, gr = grads(rms_ref, x, w)
    close(out, ref), [close(a, c) for a, c in zip(g, gr, strict=True)]
    out, g = grads(lambda x, w, b: ks._LayerNorm.apply(x, w, b, 1e-5).square().sum(), x, w, b)
    ref, gr = grads(lambda x, w, b: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5)
                    .square().sum(), x, w, b)
    close(out, ref), [close(a, c) for a, c in zip(g, gr, strict=True)]
    a, u = torch.randn(4, 7, 24), torch.randn(4, 7, 24)
    for gelu in (False, True):
        act = torch.nn.functional.gelu if gelu else torch.nn.functional.silu
        kw = {"approximate": "tanh"} if gelu else {}
        out, g = grads(lambda a, u, ge=gelu: ks._GLU.apply(a, u, ge).square().sum(), a, u)
        ref, gr = grads(lambda a, u, f=act, kw=kw: (f(a, **kw) * u).square().sum(), a, u)
        close(out, ref), [close(p, q) for p, q in zip(g, gr, strict=True)]


def test_the_loss_stand_ins_compute_the_cross_entropy_and_its_gradients():
    torch.manual_seed(0)
    h, w = torch.randn(40, 16), torch.randn(64, 16)
    y = torch.randint(0, 64, (40,))
    y[::7] = -100  # ignored positions

    def ref(h, w):
        return torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100,
                                                 reduction="sum")

    want, gw = grads(ref, h, w)
    for fn in (lambda h, w: ks._FusedLinearCE.apply(h, w, y, 8),
               lambda h, w: ks._CutCE.apply(h, w, y, 4)):
        got, gg = grads(fn, h, w)
        close(got, want), [close(p, q) for p, q in zip(gg, gw, strict=True)]
    got, gg = grads(lambda x: ks._InPlaceCE.apply(x.clone(), y), h @ w.t())
    want2, gw2 = grads(lambda x: torch.nn.functional.cross_entropy(x, y, reduction="sum"),
                       h @ w.t())
    close(got, want2), close(gg[0], gw2[0])


def delta(base: dict, over: dict) -> tuple[int, int, list[str]]:
    """(traced, analytic) step-2 peak of `over` minus its stock twin `base`, and the notes."""
    out = []
    for fields in (base, over):
        spec = spec_from_dict(dict(TINY, **fields))
        raw = trace_step(spec, resolve_model_config(spec), "cuda", fake=True)
        a = analytic_plan(spec, resolve_arch(spec), "cuda").per_device.allocated_peak_bytes
        out.append((raw.peak_bytes, a, raw.notes))
    return out[1][0] - out[0][0], out[1][1] - out[0][1], out[1][2]


@pytest.mark.slow
@pytest.mark.parametrize("base,over,what", [
    (FULL, dict(FULL, kernels={"liger": LIGER}), "Liger's norms"),
    (FULL, dict(FULL, kernels={"cut_cross_entropy": True}), "cut cross entropy"),
    (FULL, dict(FULL, kernels={"liger": ["cross_entropy"]}), "liger cross entropy"),
    (LORA, dict(LORA, kernels={"unsloth": True}), "Unsloth's norms"),
    (FULL, dict(FULL, kernels={"attention": "eager"}), "attention"),
    (LORA, {"method": dict(LORA["method"], dora=True)}, ""),
    ({"method": dict(LORA["method"], lora_dropout=0.1)},
     {"method": dict(LORA["method"], lora_dropout=0.1, dora=True)}, ""),
    (LORA, {"method": dict(LORA["method"], modules_to_save=["lm_head"])}, ""),
])
def test_the_traced_difference_from_the_stock_twin_agrees_with_the_analytic_one(base, over,
                                                                                 what):
    traced, analytic, notes = delta(base, over)
    assert traced != 0 and (traced > 0) == (analytic > 0)
    assert abs(traced - analytic) <= 0.12 * abs(analytic), (traced, analytic)
    if what:  # the trace says what it stood in
        assert any(what in n for n in notes), notes


@pytest.mark.slow
def test_a_traced_plan_of_fused_kernels_is_traced_and_says_what_it_assumed():
    spec = spec_from_dict(dict(TINY, **LORA, kernels={"liger": LIGER,
                                                      "attention": "flash-attention-2"}))
    plan = make_plan(spec, "traced", card_ids=["h100"])
    assert plan.fidelity == "trace" and plan.trace["status"] == "traced"
    text = " ".join(plan.assumptions)
    assert "PyTorch stand-ins" in text and "traced as SDPA's flash kernel" in text
    assert "never held" in text  # the analytic arithmetic it rests on, said too


@pytest.mark.slow
def test_lora_on_fused_moe_experts_saves_the_merged_weights_as_the_analytic_plan_says(
        tmp_path):
    """transformers >= 5 fuses each layer's experts into raw parameters: PEFT wraps them with
    target_parameters (built for gate_up_proj / down_proj), merges W + BA per forward and the
    grouped matmul saves the merged weight and its routed input - traced and analytic agree."""
    import json

    cfg = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg))
    attn = {"model": {"config": str(path)}, "method": {"kind": "lora", "lora_rank": 8,
                                                       "lora_targets": ["q_proj", "v_proj"]}}
    experts = {"model": {"config": str(path)}, "method": {
        "kind": "lora", "lora_rank": 8,
        "lora_targets": ["q_proj", "v_proj", "gate_up_proj", "down_proj"]}}
    traced, analytic, notes = delta(attn, experts)
    assert traced == pytest.approx(analytic, rel=0.02)
    per_layer = 2 * (4 * 64 * 256 + 4 * 128 * 64)  # the merged gate_up and down, bf16
    assert analytic > 2 * per_layer


@pytest.mark.slow
def test_liger_materialises_the_logits_in_validation_cut_cross_entropy_does_not():
    """Liger's lce_forward fuses only while training; in eval mode it computes the logits and
    the model's own loss (their fp32 upcast and log-softmax). CCE fuses in eval too."""
    def validation_temporary(kernels):
        spec = spec_from_dict(dict(TINY, **FULL, kernels=kernels))
        raw = trace_step(spec, resolve_model_config(spec), "cuda", fake=True)
        traced = next(p for p in raw.phases if p.name == "validation")
        planned = next(p for p in analytic_plan(spec, resolve_arch(spec), "cuda").phases
                       if p.name == "validation")
        return spec, traced.temporary_bytes, planned.temporary_bytes

    spec, liger_t, liger_a = validation_temporary({"liger": LIGER})
    fp32_logits = 4 * resolve_arch(spec).vocab_size * spec.batch.positions_per_micro_batch
    assert liger_t >= 2 * fp32_logits and liger_a >= 2 * fp32_logits  # upcast + log-softmax
    _, cce_t, cce_a = validation_temporary({"cut_cross_entropy": True})
    assert cce_t < fp32_logits and cce_a < fp32_logits


def test_a_plan_whose_liger_validation_sets_the_peak_says_why_and_what_to_change():
    from tunepilot.plan.analytic.core import LIGER_VALIDATION_NOTE

    fields = {"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
              "sequence_length": 4096, "micro_batch_size": 8, "activation_checkpointing": "full",
              "kernels": {"liger": LIGER}}
    spec = spec_from_dict(fields)
    plan = analytic_plan(spec, resolve_arch(spec))
    assert plan.peak_phase == "validation" and LIGER_VALIDATION_NOTE in plan.assumptions
    spec = spec_from_dict(dict(fields, validation={"micro_batch_size": 1}))
    plan = analytic_plan(spec, resolve_arch(spec))
    assert plan.peak_phase != "validation" and LIGER_VALIDATION_NOTE not in plan.assumptions
