"""The analytic plan against hand-computed cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.model.arch import Arch, load_preset, param_counts
from tunepilot.plan.analytic.core import CHUNKED_LOSS_TOKENS, analytic_plan, workspace_bytes
from tunepilot.plan.api import make_plan
from tunepilot.spec import spec_from_dict

GIB = 2**30


def spec(**over):
    base = {"model": {"preset": "llama-2-7b"}, "method": {"kind": "full"},
            "precision": "bf16-mixed", "sequence_length": 1024, "micro_batch_size": 1}
    base.update(over)
    return spec_from_dict(base)


def arch(name="llama-2-7b"):
    return Arch.from_config(load_preset(name))


def test_7b_full_adamw_bf16_mixed_is_16_bytes_per_param_of_model_states():
    s = spec()
    p = analytic_plan(s, arch())
    n = param_counts(arch()).total
    assert p.params.trainable == n == 6_738_415_616
    b = p.bytes_per_param
    assert b["master_weights_per_trainable_param"] == 4  # fp32 params = the master copy
    assert b["gradients_per_trainable_param"] == 4
    assert b["optimizer_per_trainable_param"] == 8  # exp_avg + exp_avg_sq in fp32
    assert b["model_states_per_param"] == pytest.approx(16)
    d = p.per_device
    assert d.master_weights_bytes + d.gradients_bytes + d.optimizer_bytes == 16 * n


def test_bf16_true_full_keeps_states_in_bf16():
    p = analytic_plan(spec(precision="bf16-true"), arch())
    assert p.bytes_per_param["model_states_per_param"] == pytest.approx(8)  # 2 + 2 + 2*2
    assert p.per_device.master_weights_bytes == 0


def test_lora_trainable_count_is_r_times_in_plus_out_per_target():
    s = spec(method={"kind": "lora", "lora_rank": 8, "lora_targets": ["q_proj", "v_proj"]})
    p = analytic_plan(s, arch())
    # llama-2-7b: q and v are 4096 x 4096, 32 layers: 8 * (4096 + 4096) * 2 * 32
    assert p.params.trainable == 8 * (4096 + 4096) * 2 * 32 == 4_194_304
    assert p.params.frozen == 6_738_415_616
    # frozen base in bf16, adapters fp32 with fp32 grads and AdamW: 16 B per trainable param
    assert p.per_device.weights_bytes == 2 * 6_738_415_616
    assert p.per_device.gradients_bytes + p.per_device.master_weights_bytes + \
        p.per_device.optimizer_bytes == 16 * 4_194_304


def test_qlora_base_is_nf4_plus_absmax():
    s = spec(method={"kind": "qlora", "lora_rank": 8}, precision="bf16-true")
    p = analytic_plan(s, arch())
    a = arch()
    linear = 32 * 4096 * (4 * 4096 + 3 * 11008)  # q,k,v,o + gate,up,down per layer
    rest = param_counts(a).total - linear  # embeddings, norms, lm_head in bf16
    assert p.per_device.weights_bytes == int(linear * (0.5 + 4 / 64)) + 2 * rest + \
        4 * 4_194_304  # + fp32 adapters (PEFT), counted with weights under bf16-true


def test_activations_per_token_match_the_derivation_for_bf16_true():
    # 22h + 4*hkv + 8i + 4*heads bytes per token per layer (see analytic.py docstring)
    s = spec(precision="bf16-true")
    p = analytic_plan(s, arch())
    h, i, heads = 4096, 11008, 32
    per_layer = 22 * h + 4 * h + 8 * i + 4 * heads
    logits_kept = 4 * 32000 * 1024  # the fp32 log_softmax output; the bf16 logits are freed
    loss = next(ph for ph in p.phases if ph.name == "loss-backward")
    assert loss.activations_bytes == 32 * per_layer * 1024 + logits_kept


def test_activations_scale_linearly_with_tokens_and_checkpointing_cuts_them():
    a = arch()
    one = analytic_plan(spec(), a).per_device.activations_bytes
    two = analytic_plan(spec(micro_batch_size=2), a).per_device.activations_bytes
    full = analytic_plan(spec(activation_checkpointing="full"), a).per_device.activations_bytes
    sel = analytic_plan(spec(activation_checkpointing="selective"), a
                        ).per_device.activations_bytes
    casts = 2 * (6_738_415_616 - 2 * 32000 * 4096 - 65 * 4096 + 32000 * 4096)
    assert two - casts == pytest.approx(2 * (one - casts), rel=1e-9)
    assert full < sel < one


def test_chunked_loss_bounds_the_logits_term():
    a = arch("llama-3-8b")
    s = spec(model={"preset": "llama-3-8b"}, sequence_length=8192,
             method={"kind": "lora"}, precision="bf16-true")
    plain = next(ph for ph in analytic_plan(s, a).phases if ph.name == "loss-backward")
    chunked = next(ph for ph in analytic_plan(s.with_changes(chunked_loss=True), a).phases
                   if ph.name == "loss-backward")
    V = 128256
    assert plain.temporary_bytes == 8 * V * 8192
    assert chunked.temporary_bytes == 8 * V * CHUNKED_LOSS_TOKENS


def test_peak_is_the_largest_phase_not_a_sum_of_maxima():
    p = analytic_plan(spec(activation_checkpointing="full"), arch())
    d = p.per_device
    assert d.allocated_peak_bytes == max(ph.total_bytes for ph in p.phases) + \
        workspace_bytes(p.stack)
    components = sum(getattr(d, k) for k in ("weights_bytes", "master_weights_bytes", "gradients_bytes",
                                    "optimizer_bytes", "activations_bytes", "temporary_bytes"))
    assert d.allocated_peak_bytes < components
    assert d.allocated_peak_bytes <= d.reserved_peak_bytes < d.device_peak_bytes


def test_foreach_adamw_temporary_sets_the_peak_and_fused_does_not():
    a = arch()
    foreach = analytic_plan(spec(activation_checkpointing="full",
                                 optimizer={"name": "adamw", "impl": "foreach"}), a)
    fused = analytic_plan(spec(activation_checkpointing="full",
                               optimizer={"name": "adamw", "impl": "fused"}), a)
    assert foreach.peak_phase == "optimizer-step"
    assert foreach.per_device.allocated_peak_bytes - fused.per_device.allocated_peak_bytes \
        >= 4 * 6_738_415_616 - 4 * 2**30


def test_fsdp_shards_model_states_by_world_size():
    s1 = spec(activation_checkpointing="full")
    s8 = s1.with_changes(parallel={"strategy": "fsdp", "devices": 8})
    a = arch()
    p1, p8 = analytic_plan(s1, a), analytic_plan(s8, a)
    for k in ("master_weights_bytes", "gradients_bytes", "optimizer_bytes"):
        assert getattr(p8.per_device, k) == getattr(p1.per_device, k) // 8
    assert p8.per_device.runtime_overhead_bytes > p1.per_device.runtime_overhead_bytes


def test_ddp_adds_gradient_buckets_and_does_not_shard():
    s = spec(method={"kind": "lora"}, precision="bf16-true")
    ddp = s.with_changes(parallel={"strategy": "ddp", "devices": 4})
    a = arch()
    p, q = analytic_plan(s, a), analytic_plan(ddp, a)
    assert q.per_device.weights_bytes == p.per_device.weights_bytes
    assert q.per_device.collective_buffers_bytes == p.per_device.gradients_bytes


def test_gradient_accumulation_keeps_gradients_alive_through_later_forwards():
    a = arch()
    one = analytic_plan(spec(), a).phases[0]
    acc = analytic_plan(spec(gradient_accumulation_steps=4), a).phases[0]
    assert one.gradients_bytes == 0 and acc.gradients_bytes == 4 * 6_738_415_616


def test_fit_table_covers_the_four_cards_and_inverse_queries_are_consistent():
    s = spec_from_dict({"model": {"preset": "llama-3-8b"}, "method": {"kind": "lora"},
                        "precision": "bf16-mixed", "sequence_length": 2048,
                        "micro_batch_size": 1, "activation_checkpointing": "full"})
    plan = make_plan(s)
    assert [r.card for r in plan.cards] == ["a100-sxm-80gb", "h100-sxm-80gb",
                                               "h200-sxm-141gb", "mi300x-192gb"]
    for row in plan.cards:
        assert row.fits
        assert row.devices_needed.model_dump() == {"ddp": 1, "fsdp": 1, "ddp_tight": None,
                                                   "fsdp_tight": None}
        assert row.max_micro_batch >= 1 and row.max_sequence_length >= 2048
        bigger = s.with_changes(micro_batch_size=row.max_micro_batch + 1)
        over = make_plan(bigger, card_ids=[row.card]).cards[0]
        assert not over.fits


def test_70b_full_needs_fsdp_across_cards():
    s = spec_from_dict({"model": {"preset": "llama-3.1-70b"}, "method": {"kind": "full"},
                        "precision": "bf16-mixed", "sequence_length": 4096,
                        "activation_checkpointing": "full"})
    plan = make_plan(s, card_ids=["h100"])
    row = plan.cards[0]
    assert not row.fits and row.devices_needed.ddp is None
    # 16 B/param of model states for 70.6e9 params = 1.13 TB: at least 16 cards of 85 GB
    assert row.devices_needed.fsdp >= 16


def test_plan_does_not_import_torch_and_json_has_the_contract_keys(tmp_path):
    code = ("import sys, json; from tunepilot.cli import main; sys.argv=['tunepilot','plan',"
            "'examples/llama3-8b-lora.yaml','--json']; main()")
    out = subprocess.run([sys.executable, "-c", code + "\n"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["fidelity"] == "analytic"
    assert set(d["params"]) == {"total", "trainable", "frozen"}
    for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "master_weights_bytes",
              "activations_bytes", "temporary_bytes", "allocated_peak_bytes",
              "reserved_peak_bytes", "runtime_overhead_bytes", "device_peak_bytes"):
        assert isinstance(d["per_device"][k], int)
    row = d["cards"][0]
    for k in ("card", "capacity_bytes", "fits", "headroom_fraction", "devices_needed",
              "max_micro_batch", "max_sequence_length"):
        assert k in row
    probe = subprocess.run([sys.executable, "-c", "import sys; from tunepilot.plan.api import "
                            "make_plan; from tunepilot.spec import load_spec; "
                            "make_plan(load_spec('examples/llama3-8b-lora.yaml')); "
                            "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


def test_user_catalog_card_is_fitted(tmp_path):
    cat = tmp_path / "cat.yaml"
    base = load_catalog().get("h100").model_dump(mode="json")
    base.update(id="h100-nvl-94gb", aliases=["h100nvl"], name="H100 NVL", memory_gb=94,
                memory_bytes=94 * 10**9)
    import yaml

    cat.write_text(yaml.safe_dump({"cards": [base]}))
    plan = make_plan(spec(method={"kind": "lora"}), catalog=load_catalog(cat),
                     card_ids=["h100nvl"])
    assert plan.cards[0].capacity_bytes == 94 * 10**9


@pytest.mark.parametrize("name,words,not_words", [
    ("paged_adamw_8bit", "8-bit state", "state fp32"),
    ("adamw_8bit", "8-bit state", "state fp32"),
    ("adafactor", "factored", "state fp32"),
    ("adamw", "state fp32", "8-bit"),
])
def test_the_plan_header_names_the_optimizer_state_it_counts(tmp_path, name, words, not_words):
    import yaml

    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                                 "precision": "bf16-mixed", "sequence_length": 64,
                                 "micro_batch_size": 1, "optimizer": {"name": name}}))
    exe = Path(sys.executable).with_name("tunepilot")
    out = subprocess.run([str(exe), "plan", str(p), "--card", "h100"], capture_output=True,
                         text=True, timeout=120, env={**os.environ,
                                                      "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if line.startswith("params:"))
    assert words in header and not_words not in header, header


def test_a_checkpointed_step_peaks_where_the_last_layer_is_recomputed_with_every_input_kept():
    # under full checkpointing the backward starts by recomputing the last layer while every
    # layer's input is still kept: for an MoE layer at 16k tokens with a fused loss that working
    # set (the routed experts' saves) outweighs the loss, and sets the peak
    cfg = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 16,
           "num_experts_per_tok": 4, "vocab_size": 512, "max_position_embeddings": 8192}
    fields = {"model": {"preset": "tiny"}, "sequence_length": 4096, "micro_batch_size": 4,
              "method": {"kind": "lora", "lora_targets": ["q_proj", "v_proj"]},
              "precision": "bf16-true",
              "kernels": {"attention": "flash-attention-2", "cut_cross_entropy": True}}
    arch = Arch.from_config(cfg)
    p = analytic_plan(spec_from_dict(dict(fields, activation_checkpointing="full")), arch)
    first, end = (next(ph for ph in p.phases if ph.name == n)
                  for n in ("first-recompute", "backward-end"))
    inputs = 4 * 4 * 4096 * 256 * 2  # layers x tokens x hidden x bf16
    assert first.activations_bytes == end.activations_bytes + inputs
    assert p.peak_phase == "first-recompute"
    plain = analytic_plan(spec_from_dict(dict(fields, activation_checkpointing="none")), arch)
    assert "first-recompute" not in [ph.name for ph in plain.phases]


def test_the_loss_backward_holds_the_lm_heads_new_gradient_in_a_full_fine_tune():
    # lm_head's backward makes its weight gradient while the logits' gradient is alive: in .grad
    # (fp32 under mixed precision), or in flight to ZeRO's partition (16-bit); LoRA's head is
    # frozen, and FSDP's unsharded root holds it in its own working set
    from types import SimpleNamespace

    from tunepilot.model.arch import resolve_arch
    from tunepilot.plan.analytic.core import lm_head_gradient

    full = spec_from_dict({"model": {"preset": "llama-3.2-1b"}, "sequence_length": 512,
                           "method": {"kind": "full"}, "precision": "bf16-mixed"})
    arch = resolve_arch(full)
    head = arch.vocab_size * arch.hidden_size
    s = SimpleNamespace(lm_head_weights=head)
    assert lm_head_gradient(full, s, 2) == 4 * head
    zero = full.with_changes(parallel={"strategy": "deepspeed", "devices": 4,
                                       "deepspeed": {"stage": 3}})
    assert lm_head_gradient(zero, s, 2) == 2 * head
    assert lm_head_gradient(full.with_changes(parallel={"strategy": "fsdp", "devices": 4}),
                            s, 2) == 0
    assert lm_head_gradient(full.with_changes(method={"kind": "lora"}), s, 2) == 0
    p = analytic_plan(full, arch)
    loss = next(ph for ph in p.phases if ph.name == "loss-backward")
    assert loss.temporary_bytes >= 4 * head
