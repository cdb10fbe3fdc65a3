"""Kernels and adapter variants in the plan, the trace, the pilot and the time model: Liger, Cut
Cross-Entropy, Unsloth, attention implementations, Transformer Engine, DoRA, rsLoRA and
modules_to_save. The analytic figures are checked against the kernels' own arithmetic; the
traced differences against the analytic ones; the stand-ins' gradients against PyTorch's."""

from __future__ import annotations

import pytest

from tunepilot.errors import SpecError
from tunepilot.model.arch import resolve_arch
from tunepilot.plan.analytic import variants
from tunepilot.plan.analytic.core import analytic_plan
from tunepilot.spec import spec_from_dict

GIB = 2**30
LIGER = ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]
# the case: Llama-3.1-8B full fine-tune, 8192 tokens, FSDP over 8 ranks
L8 = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "full"}, "precision": "bf16-true",
      "sequence_length": 8192, "activation_checkpointing": "full",
      "parallel": {"strategy": "fsdp", "devices": 8}}


def plan(base: dict, **over):
    d = dict(base)
    d.update(over)
    spec = spec_from_dict(d)
    arch = resolve_arch(spec)
    return spec, arch, analytic_plan(spec, arch, "cuda")


def phase(p, name: str):
    return next(ph for ph in p.phases if ph.name == name)


# ------------------------------------------------------------------------------ the analytic plan


def test_liger_plan_is_below_its_twin_by_the_logits_it_never_holds():
    # the training step (a validation pass materialises Liger's logits: test_kernel_trace.py)
    no_eval = dict(L8, validation={"enabled": False})
    spec, arch, stock = plan(no_eval)
    _, _, liger = plan(no_eval, kernels={"liger": LIGER})
    tokens, V, h = 8192, arch.vocab_size, arch.hidden_size
    # the stock loss holds the fp32 log-softmax (4V per token) and, in its backward, two fp32
    # (tokens, V) gradients; Liger's fused loss holds grad_input and lm_head's gradient instead
    fp32_logits = 4 * V * tokens
    assert phase(stock, "loss-backward").activations_bytes - \
        phase(liger, "loss-backward").activations_bytes >= fp32_logits - \
        (2 * h * tokens + 2 * V * h) - 8 * h * tokens * arch.num_layers  # + its norms' saving
    gain = stock.per_device.allocated_peak_bytes - liger.per_device.allocated_peak_bytes
    assert gain > 4 * GIB, gain / GIB  # several GiB: 22.12 -> 12.35 GiB allocated
    assert stock.peak_phase == "loss-backward" and liger.peak_phase != "loss-backward"
    assert any("never held" in n for n in liger.assumptions)


def test_liger_fused_loss_keeps_the_lm_head_gradient_from_the_forward_on():
    """Liger computes lm_head's grad_weight in the forward: a (V, h) tensor alive through the
    backward when lm_head trains (full fine-tune), none under LoRA's frozen head."""
    base = dict(L8, parallel={"strategy": "single"}, activation_checkpointing="none",
                sequence_length=1024)
    spec, arch, _ = plan(base, kernels={"liger": ["fused_linear_cross_entropy"]})
    kept, bwd, fwd = variants.loss_bytes(arch, spec, 2, 2, 1024)
    assert kept == 2 * arch.hidden_size * 1024 + 2 * arch.vocab_size * arch.hidden_size
    assert bwd == 0  # the gradients were made in the forward
    assert fwd == 2 * arch.vocab_size * 32 + 4 * 1024  # a 32-token chunk: next_pow2(1024 / 32)
    lora, _, _ = plan(dict(base, method={"kind": "lora"}),
                      kernels={"liger": ["fused_linear_cross_entropy"]})
    assert variants.head_grad_bytes(arch, lora) == 0


def test_cut_cross_entropy_keeps_its_input_and_the_log_sum_exp_only():
    base = dict(L8, parallel={"strategy": "single"}, method={"kind": "lora"},
                precision="bf16-mixed")
    spec, arch, cce = plan(base, kernels={"cut_cross_entropy": True})
    kept, bwd, fwd = variants.loss_bytes(arch, spec, 2, 2, 8192)
    assert kept == 2 * arch.hidden_size * 8192 + 12 * 8192 and fwd == 0
    assert bwd == 2 * arch.hidden_size * 8192  # de; no dc: LoRA's lm_head is frozen
    _, _, stock = plan(base)
    assert stock.per_device.allocated_peak_bytes - cce.per_device.allocated_peak_bytes > 8 * GIB


def test_eager_attention_is_above_sdpa_by_the_s_by_s_term():
    base = {"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "lora"},
            "sequence_length": 2048, "micro_batch_size": 2}
    _, arch, sdpa = plan(base)
    _, _, eager = plan(base, kernels={"attention": "eager"})
    s, b = 2048, 2
    # per layer: the fp32 softmax output and its bf16 copy (6 B per score) + q and K/V repeated
    # to every head (3 x hq) instead of q, k, v and the output (2 x hq + 2 x hkv)
    hq, hkv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_token = arch.num_heads * s * 6 + 2 * (3 * hq) - (2 * (2 * hq + 2 * hkv) + 4 *
                                                         arch.num_heads)
    expected = per_token * b * s * arch.num_layers
    diff = phase(eager, "forward-end").activations_bytes - \
        phase(sdpa, "forward-end").activations_bytes
    assert diff == expected
    assert expected > arch.num_layers * b * arch.num_heads * s * s * 6 * 0.99  # the s x s term
    # checkpointed: one layer's s x s term in the recompute, not every layer's
    _, _, ck_sdpa = plan(base, activation_checkpointing="full")
    _, _, ck_eager = plan(base, activation_checkpointing="full", kernels={"attention": "eager"})
    assert phase(ck_eager, "backward-end").activations_bytes - \
        phase(ck_sdpa, "backward-end").activations_bytes == per_token * b * s
    assert any("s, s) softmax output" in n for n in eager.assumptions)


@pytest.mark.parametrize("impl", ["flash-attention-2", "flash-attention-3", "flex"])
def test_fused_attention_kernels_save_what_sdpa_saves(impl):
    base = {"model": {"preset": "llama-3.2-1b"}, "sequence_length": 4096}
    assert plan(base, kernels={"attention": impl})[2].per_device == plan(base)[2].per_device


def test_dora_plan_is_above_lora_by_its_magnitudes_and_saved_outputs():
    base = {"model": {"preset": "llama-3.2-3b"}, "method": {"kind": "lora", "lora_rank": 32},
            "precision": "bf16-true", "sequence_length": 768, "micro_batch_size": 4}
    spec, arch, dora = plan(dict(base, method=dict(base["method"], dora=True)))
    _, _, lora = plan(base)
    q_out, v_out = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    assert dora.params.trainable - lora.params.trainable == (q_out + v_out) * arch.num_layers
    # saved per token per layer: the base output (bf16) and the adapter output (fp32 adapters
    # without autocast) of q_proj and v_proj, for the magnitude's gradient
    tokens = 4 * 768
    per_token = (q_out + v_out) * (2 + 4)
    diff = phase(dora, "forward-end").activations_bytes - \
        phase(lora, "forward-end").activations_bytes
    assert diff == per_token * tokens * arch.num_layers
    assert dora.per_device.allocated_peak_bytes > lora.per_device.allocated_peak_bytes
    # each forward's weight norm: the in x in identity and weight-sized fp32 temporaries
    h = arch.hidden_size
    assert variants.dora_transient(arch, spec) >= 4 * h * h + 4 * 3 * h * q_out
    assert any("DoRA on 2 matrices" in n for n in dora.assumptions)


def test_rslora_changes_no_byte_and_says_so():
    base = {"model": {"preset": "llama-3.2-3b"}, "method": {"kind": "lora", "lora_rank": 64}}
    _, _, rs = plan(base, method={"kind": "lora", "lora_rank": 64, "rslora": True})
    _, _, lora = plan(base)
    assert rs.per_device == lora.per_device and rs.params == lora.params
    assert any("rsLoRA" in n and "no memory or time change" in n for n in rs.assumptions)


def test_modules_to_save_trains_full_copies_with_gradients_and_optimizer_state():
    base = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "lora"},
            "precision": "bf16-mixed"}
    mts = {"kind": "lora", "modules_to_save": ["embed_tokens", "lm_head"]}
    _, arch, copies = plan(base, method=mts)
    _, _, lora = plan(base)
    n = 2 * arch.vocab_size * arch.hidden_size
    assert copies.params.trainable - lora.params.trainable == n
    assert copies.params.frozen == lora.params.frozen  # the originals stay, frozen
    step = phase(copies, "optimizer-step")
    base_step = phase(lora, "optimizer-step")
    # bf16 copies: weights 2 B, gradients 2 B, AdamW's two states 2 x 2 B per parameter
    assert step.master_weights_bytes - base_step.master_weights_bytes == 2 * n
    assert step.gradients_bytes - base_step.gradients_bytes == 2 * n
    assert step.optimizer_bytes - base_step.optimizer_bytes == 4 * n
    with pytest.raises(SpecError, match="modules_to_save"):
        plan(base, method={"kind": "lora", "modules_to_save": ["layers.0.mlp"]})


def test_unsloth_gradient_checkpointing_keeps_two_layers_inputs_on_the_device():
    base = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "qlora", "lora_rank": 32,
                                                              "lora_targets": "all-linear"},
            "sequence_length": 32768, "activation_checkpointing": "full"}
    _, arch, gc = plan(base, kernels={"unsloth": True})
    _, _, off = plan(base, kernels={"unsloth": True, "unsloth_gradient_checkpointing": True})
    layer_inputs = 2 * arch.hidden_size * 32768
    assert phase(gc, "forward-end").activations_bytes - \
        phase(off, "forward-end").activations_bytes == layer_inputs * (arch.num_layers - 2)


@pytest.mark.parametrize("fields,match", [
    ({"kernels": {"unsloth_gradient_checkpointing": True}}, "activation_checkpointing: full"),
    ({"kernels": {"liger": ["rms_norm"]}, "model": {"preset": "tiny",
                                                    "implementation": "litgpt"}},
     "patch transformers' models"),
    ({"kernels": {"cut_cross_entropy": True}, "chunked_loss": True}, "drop chunked_loss"),
    ({"method": {"kind": "full", "dora": True}}, "LoRA variants"),
    ({"method": {"kind": "lora", "modules_to_save": ["lm_head", "lm_head"]}}, "twice"),
])
def test_impossible_kernel_and_variant_settings_are_refused_with_the_fix(fields, match):
    d = {"model": {"preset": "tiny"}}
    d.update(fields)
    with pytest.raises(SpecError, match=match):
        spec_from_dict(d)


# ------------------------------------------------------------------------------ the CPU pilot


def test_the_pilot_leaves_gpu_kernels_out_and_says_they_were_not_measured():
    from tunepilot.pilot.prepare import without_gpu_kernels

    spec = spec_from_dict({"model": {"preset": "tiny"}, "activation_checkpointing": "full",
                           "method": {"kind": "lora", "dora": True},
                           "kernels": {"liger": LIGER, "attention": "flash-attention-2",
                                       "unsloth_gradient_checkpointing": True}})
    pilot, notes = without_gpu_kernels(spec)
    assert pilot.kernels.liger == [] and pilot.kernels.attention == "sdpa"
    assert not pilot.kernels.unsloth_gradient_checkpointing
    assert pilot.method.dora  # DoRA runs for real: PEFT builds it
    assert len(notes) == 1 and "did NOT measure" in notes[0] and "liger" in notes[0]
    eager = spec.with_changes(kernels={"attention": "eager"})
    assert without_gpu_kernels(eager) == (eager, [])  # eager runs for real on the CPU


@pytest.mark.slow
def test_dora_and_modules_to_save_run_for_real_in_the_cpu_pilot(tmp_path):
    pytest.importorskip("peft")
    from tunepilot.pilot.runner import PilotOptions, run_pilot

    spec = spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 64,
                           "micro_batch_size": 2, "precision": "fp32",
                           "method": {"kind": "lora", "lora_rank": 4, "dora": True,
                                      "modules_to_save": ["lm_head"]},
                           "kernels": {"liger": ["fused_linear_cross_entropy"]}})
    res = run_pilot(spec, tmp_path / "pilot", PilotOptions(steps=2))
    assert res.fits is True
    arch = resolve_arch(spec)
    planned = analytic_plan(spec, arch, "cpu").params.trainable
    assert res.params["trainable"].value == planned  # magnitudes + the lm_head copy, built
    assert any("did NOT measure" in n and "fused_linear_cross_entropy" in n for n in res.notes)


# ------------------------------------------------------------------------------ the time model


def test_each_kernels_speed_factor_is_in_the_projection_with_its_kind_and_source():
    from tunepilot.catalog import load_catalog
    from tunepilot.cost.mfu import kernel_factors, mfu_for, pilot_lever_factors

    card = load_catalog().select(["h100"])[0]
    base = {"model": {"preset": "llama-3.1-8b"}, "method": {"kind": "lora", "dora": True}}
    spec, arch, _ = plan(base, kernels={"liger": LIGER})
    stock, _, _ = plan(base, method={"kind": "lora"})
    factors = {kf.name.split()[0]: kf for kf in kernel_factors(spec)}
    assert factors["liger"].factor == pytest.approx(1.14) and factors["liger"].kind == "published"
    assert factors["dora"].factor == pytest.approx(0.79) and "peft" in factors["dora"].source
    mfu = mfu_for(spec, card, arch)
    assert mfu.value == pytest.approx(mfu_for(stock, card, arch).value * 1.14 * 0.79)
    assert "liger" in mfu.how and "published" in mfu.how and "dora 0.79" in mfu.how
    # a quote from a pilot's throughput: the pilot left Liger out (x its factor), ran DoRA
    levers = {lv.lever.split()[0] for lv in pilot_lever_factors(spec)}
    assert "liger" in levers and "dora" not in levers
    partial, _, _ = plan(base, kernels={"liger": ["fused_linear_cross_entropy"]})
    (kf,) = [k for k in kernel_factors(partial) if k.name.startswith("liger")]
    assert kf.kind == "assumed" and 1.0 < kf.factor < 1.14  # a share of the default set's


# ------------------------------------------------------------------------------ the callbacks


def test_the_callbacks_derived_spec_records_the_kernels_and_variants_the_live_model_ran(
        tmp_path):
    """What the user's run really ran: eager attention (config._attn_implementation), a norm
    whose forward Liger's instance patching bound (a function of liger_kernel's module), PEFT's
    DoRA and modules_to_save - read from the live model by the HF/Lightning callbacks."""
    import types

    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunepilot.integrations.derive import derive_spec

    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")

    def liger_rms_forward(self, x):  # stands for liger_kernel.transformers.rms_norm's forward
        return x

    liger_rms_forward.__module__ = "liger_kernel.transformers.rms_norm"
    liger_rms_forward.__qualname__ = "LigerRMSNorm.forward"
    for mod in model.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            mod.forward = types.MethodType(liger_rms_forward, mod)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            use_dora=True, modules_to_save=["lm_head"]))
    spec, _, notes = derive_spec(peft, tmp_path, micro_batch_size=2, accumulation=1,
                                 sequence_length=64)
    assert spec.kernels.attention == "eager" and spec.kernels.liger == ["rms_norm"]
    assert spec.method.dora and spec.method.modules_to_save == ["lm_head"]
    assert any("kernels active in this run" in n and "liger rms_norm" in n for n in notes)


def test_lora_on_mixtrals_fused_experts_saves_a_merged_copy_of_them_per_layer():
    base = {"model": {"preset": "mixtral-8x7b"}, "precision": "bf16-mixed",
            "sequence_length": 1024}
    _, arch, attn = plan(base, method={"kind": "lora", "lora_targets": ["q_proj", "v_proj"]})
    _, _, experts = plan(base, method={"kind": "lora", "lora_targets": [
        "q_proj", "v_proj", "gate_up_proj", "down_proj"]})
    merged = 2 * 3 * arch.hidden_size * arch.intermediate_size * arch.num_experts  # bf16
    diff = phase(experts, "forward-end").activations_bytes - \
        phase(attn, "forward-end").activations_bytes
    assert diff > merged * arch.num_layers  # ~84 GiB: every layer's merged experts
    assert any("fused MoE experts" in n for n in experts.assumptions)
