"""The trace holds what the GPU holds: the three specs that fell back to the analytic plan now
trace (CUDA autocast's rules in checkpointing's recompute; FSDP with a chunked loss), and the
GPU kernels' fused attention dropout keeps no s x s matrix."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tunepilot.plan.trace.step import trace_step  # noqa: E402
from tunepilot.spec import spec_from_dict  # noqa: E402

SMALL = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024}


def _trace(config: dict, **fields):
    spec = spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 128, **fields})
    return trace_step(spec, config, "cuda")


@pytest.mark.parametrize("config,fields", [
    # an fp16-mixed classifier with eager attention and a Python GELU (pow, tanh): those run in
    # fp32 under CUDA's autocast; the recompute ran them in fp16 and checkpoint refused the
    # mismatch (as fp16 BERT with eager attention did)
    ({"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 512,
      "n_positions": 1024},
     {"precision": "fp16-mixed", "kernels": {"attention": "eager"}, "method": {"kind": "full"},
      "model": {"preset": "tiny", "task": "sequence-classification"}}),
    # a QLoRA model whose activation (xIELU: expm1, exp) is on CUDA autocast's fp32 list
    ({"model_type": "apertus", "num_key_value_heads": 2, "hidden_act": "xielu", **SMALL},
     {"method": {"kind": "qlora", "lora_targets": "all-linear"}}),
])
def test_a_checkpointed_mixed_precision_step_recomputes_under_cudas_autocast_rules(config,
                                                                                   fields):
    raw = _trace(config, activation_checkpointing="full", **fields)
    assert raw.peak_bytes > 0
    assert any("CUDA's rules" in n for n in raw.notes)


def test_fsdp_with_a_chunked_loss_gathers_the_body_and_the_head_it_calls():
    tiny = {"model_type": "llama", "num_key_value_heads": 2, **SMALL}
    raw = _trace(tiny, precision="bf16-true", chunked_loss=True, torch_compile=True,
                 activation_checkpointing="full", method={"kind": "full"},
                 model={"preset": "tiny", "implementation": "torchtune"},
                 parallel={"strategy": "fsdp", "devices": 2})
    assert raw.fsdp_version == 2 and raw.world_size == 2


def test_fused_attention_dropout_keeps_no_attention_matrix():
    """Seed-OSS ships attention_dropout 0.1 (a llama-style config with it here): on the CPU SDPA
    takes its math path for dropout and keeps a (heads, s, s) matrix the GPU's flash kernel
    never holds."""
    cfg = {"model_type": "llama", "num_key_value_heads": 2, "head_dim": 32, **SMALL,
           "num_attention_heads": 16}
    fields = {"method": {"kind": "lora"}, "precision": "bf16-true", "sequence_length": 512,
              "kernels": {"attention": "flash-attention-2"}}
    with_dropout = _trace(dict(cfg, attention_dropout=0.1), **fields)
    without = _trace(dict(cfg, attention_dropout=0.0), **fields)
    assert with_dropout.peak_bytes == without.peak_bytes
    assert any("attention dropout 0.1" in n for n in with_dropout.notes)
    eager = _trace(dict(cfg, attention_dropout=0.1),
                   **dict(fields, kernels={"attention": "eager"}))
    s_by_s = 16 * 512 * 512  # one layer's attention matrix, elements
    assert eager.peak_bytes > without.peak_bytes + s_by_s  # eager really keeps it


def test_a_trace_far_from_the_formula_says_which_the_plan_uses_and_why():
    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import analytic_plan
    from tunepilot.plan.trace.core import trusted

    spec = spec_from_dict({"model": {"preset": "tiny"}})
    analytic = analytic_plan(spec, resolve_arch(spec))
    near = analytic.model_copy(deep=True)
    assert trusted(near, analytic) is None
    far = analytic.model_copy(deep=True)
    far.per_device.allocated_peak_bytes = int(analytic.per_device.allocated_peak_bytes * 1.25)
    far.differences = [{"component": "temporary", "why": "the real ops' buffers"}]
    verdict = trusted(far, analytic)
    assert verdict["uses"] == "trace" and verdict["difference_fraction"] == pytest.approx(0.25)
    assert "+25%" in verdict["text"] and "temporary" in verdict["text"]


def test_gpt_oss_with_a_flash_kernel_and_an_experts_loop_traces_as_the_gpu_runs_it():
    """gpt-oss has no SDPA path in transformers (attention sinks), so it is built eager; axolotl
    runs it with FlashAttention 3 (sinks supported) and its experts as a Python loop. The trace
    fell back (nonzero on fake tensors), and eager attention would keep each layer's
    (heads, s, s) scores that the kernel never holds: now it traces, as the flash kernel."""
    cfg = {"model_type": "gpt_oss", "num_key_value_heads": 2, "head_dim": 32, **SMALL,
           "num_attention_heads": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}
    fields = {"method": {"kind": "lora"}, "precision": "bf16-true", "sequence_length": 512,
              "moe": {"implementation": "eager"}}
    flash = _trace(cfg, kernels={"attention": "flash-attention-3"}, **fields)
    eager = _trace(cfg, kernels={"attention": "eager"}, **fields)
    assert any("balanced routing" in n for n in flash.notes)
    assert any("no SDPA path" in n for n in flash.notes)
    assert not any("no SDPA path" in n for n in eager.notes)
    s_by_s = 16 * 512 * 512  # one layer's attention scores, elements
    assert eager.peak_bytes > flash.peak_bytes + s_by_s


def test_a_fused_loss_finds_the_decoder_of_a_causal_lm_whose_base_model_is_itself():
    """Llama4ForCausalLM names base_model_prefix "language_model" but holds ``model``: its
    base_model is the CausalLM, and the fused-loss stand-in recursed into itself (the trace of
    a Llama-4-Scout QLoRA run with cut cross-entropy fell back on a RecursionError)."""
    from tunepilot.plan.trace.kernel_standins import _decoder

    cfg = {"model_type": "llama4_text", "num_key_value_heads": 2, "head_dim": 32, **SMALL,
           "num_local_experts": 4, "intermediate_size_mlp": 256}
    raw = _trace(cfg, method={"kind": "lora"}, precision="bf16-true",
                 kernels={"attention": "flash-attention-2", "cut_cross_entropy": True})
    assert raw.peak_bytes > 0
    from transformers import AutoConfig, AutoModelForCausalLM

    body = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama4_text", **body))
    assert model.base_model is model and _decoder(model) is model.model


@pytest.mark.parametrize("optimizer", ["adamw_8bit_torchao", "adamw_8bit"])
def test_a_quantized_optimizer_keeps_the_state_of_each_ranks_shard(optimizer):
    """torchao quantizes each rank's local shard, and bitsandbytes runs on FSDP1's flat
    shard: rank 0 of 4 holds a quarter of the codes and scales, not the whole model's (the
    stand-in sized them from the DTensor's global numel: gpt-oss-20b on 8 ranks was planned
    39.6 GiB of 8-bit state per rank where the whole model's is 39.6)."""
    wide = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
            "vocab_size": 512, "max_position_embeddings": 1024}  # every shard >= 4096 values
    fields = {"method": {"kind": "full"}, "optimizer": {"name": optimizer}}

    def state(**more) -> int:
        return max(p.optimizer_bytes for p in _trace(wide, **fields, **more).phases)

    one, four = state(), state(parallel={"strategy": "fsdp", "devices": 4})
    assert one / 4 <= four <= one / 4 * 1.05


def test_dropout_is_traced_as_the_gpus_fused_kernel_keeping_a_bool_mask():
    # CUDA's F.dropout runs native_dropout and keeps a bool mask for the backward; the CPU's
    # composite dropout keeps a noise tensor in the input's dtype (4 B per element for LoRA's
    # fp32 adapter inputs). Two layers of q, k, v, o, gate, up (128 wide) and down (256) on
    # 128 tokens: 262,144 dropout inputs
    from tunepilot.plan.trace.standins import cuda_dropout

    x = torch.randn(64, 32, requires_grad=True)
    with cuda_dropout():
        y = torch.nn.functional.dropout(x, 0.1, True)
        assert y.grad_fn._saved_result1.dtype == torch.bool
        same = [torch.nn.functional.dropout(x, p, t) for p, t in ((0.0, True), (0.1, False))]
    assert all(s is x for s in same)  # p = 0 and eval pass the input through, as on CUDA
    lora = {"kind": "lora", "lora_targets": "all-linear", "lora_rank": 4}
    config = {"model_type": "llama", "num_key_value_heads": 4, **SMALL}
    saved = {p: _trace(config, method=dict(lora, lora_dropout=p)).saved_bytes_at_peak
             for p in (0.0, 0.1)}
    n = 2 * 128 * (6 * 128 + 256)
    assert 0.8 * n <= saved[0.1] - saved[0.0] <= 1.5 * n


def test_megatrons_cross_entropy_stand_in_computes_cross_entropy_keeping_one_fp32_softmax():
    from tunepilot.plan.trace.kernel_standins import _megatron_ce_loss

    logits = torch.randn(2, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 6))
    labels[0, 2] = -100
    loss = _megatron_ce_loss(logits, labels, 50)
    ref = torch.nn.functional.cross_entropy(
        logits.float()[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    saved = loss.grad_fn.next_functions[0][0].saved_tensors  # the Function's own saves
    assert [t.dtype for t in saved] == [torch.float32, torch.int64]
    assert saved[0].shape == (12, 50)  # the softmax, not a log-softmax beside an upcast
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert g.dtype == torch.bfloat16
    assert torch.allclose(g.float(), g_ref.float(), atol=1e-2)
    # the trace of a megatron spec takes it: at the loss, transformers' log-softmax output and
    # its separate fp32 gradient are not held (a LoRA run on 128 tokens of a 32k vocabulary,
    # where the loss sets the peak)
    config = {"model_type": "llama", "num_key_value_heads": 4, **dict(SMALL, vocab_size=32768)}
    peaks = {impl: _trace(config, method={"kind": "lora"},
                          model={"preset": "tiny", "implementation": impl}).peak_bytes
             for impl in ("transformers", "megatron")}
    assert peaks["megatron"] < peaks["transformers"] - 128 * 32768 * 4


def test_an_fp32_grouped_gemm_of_mixed_precision_experts_traces_as_the_gpus_fallback_runs_it():
    # transformers' grouped_mm experts under bf16-mixed get fp32 inputs (fp32 weights, no
    # autocast rule for _grouped_mm): CUDA runs them through its fallback, the CPU kernel refused
    # them ("Expected inputs of BF16 type") and the trace fell back to the analytic plan
    moe = {"model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 1024}
    full = {"method": {"kind": "full"}, "moe": {"implementation": "grouped_mm"}}
    saved = {p: next(ph.saved_bytes for ph in _trace(moe, precision=p, **full).phases
                     if ph.name == "forward") for p in ("bf16-mixed", "bf16-true")}
    assert saved["bf16-mixed"] > saved["bf16-true"]  # the experts' fp32 inputs kept
