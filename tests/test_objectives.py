"""What the run trains (spec/objective.py): the DPO family's and GRPO's plan (phases, the reference,
generation, vLLM's reserve per card), the importers' objective keys, bad input, the useful unit
and the time model. The tiny pilots and the trace of these steps are in test_objective_steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.cli import main
from tunepilot.errors import SpecError, UserError
from tunepilot.integrations.importers import ImportOptions, import_config
from tunepilot.model.arch import resolve_arch
from tunepilot.model.flops import decode_seconds_per_position, flops_per_token
from tunepilot.plan.api import make_plan
from tunepilot.spec import spec_from_dict
from tunepilot.spec.objective import lengths, useful_unit

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
H100, H200 = "h100-sxm-80gb", "h200-sxm-141gb"
SYNTH = ImportOptions(synthetic_data=True)


def cli(*args: str) -> int:
    old = sys.argv
    sys.argv = ["tunepilot", *args]
    try:
        main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old


def imported(name: str, **kw):
    return import_config(CONFIGS / name, options=ImportOptions(synthetic_data=True, **kw)).spec


def test_dpo_plan_doubles_the_activations_and_adds_the_reference_forward():
    """axolotl's rl: dpo twin of an SFT config (Llama-3.1-8B LoRA, 2 x 2048, checkpointed):
    the activations are twice the SFT twin's (chosen and rejected through the policy), and the
    peak is the reference forward while the policy's activations are alive."""
    sft, dpo = imported("axolotl-sft-8b.yml"), imported("axolotl-dpo-8b.yml")
    assert dpo.objective.kind == "dpo" and dpo.objective.beta == 0.1
    a, b = make_plan(sft, card_ids=[H100]), make_plan(dpo, card_ids=[H100])
    ratio = b.per_device.activations_bytes / a.per_device.activations_bytes
    assert 1.9 < ratio < 2.1
    assert b.peak_phase == "reference-forward"
    ref, fwd = b.phase("reference-forward"), b.phase("forward-end")
    assert ref.activations_bytes == fwd.activations_bytes  # the policy's still alive
    assert ref.total_bytes > fwd.total_bytes
    assert ref.weights_bytes == a.phase("forward-end").weights_bytes  # LoRA: adapters off
    # above the SFT twin's peak by the second sequence's activations, the reference forward's
    # transient in place of the SFT loss backward's
    extra = b.per_device.allocated_peak_bytes - a.per_device.allocated_peak_bytes
    second = b.per_device.activations_bytes - a.per_device.activations_bytes
    sft_peak = a.phase(a.peak_phase)
    assert extra == second + ref.temporary_bytes - sft_peak.temporary_bytes
    assert extra >= second > 0


def test_a_full_run_keeps_a_frozen_reference_copy_unless_precomputed():
    base = {"model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
            "precision": "bf16-true", "sequence_length": 512}
    sft = make_plan(spec_from_dict(base))
    dpo = make_plan(spec_from_dict(dict(base, objective={"kind": "dpo"})))
    pre = make_plan(spec_from_dict(dict(base, objective={"kind": "dpo",
                                                         "reference": "precomputed"})))
    copy = dpo.per_device.weights_bytes - sft.per_device.weights_bytes
    assert copy == 2 * dpo.params.total  # bf16 weights of a second model
    assert pre.per_device.weights_bytes == sft.per_device.weights_bytes
    assert pre.phase("reference-forward") is None
    orpo = make_plan(spec_from_dict(dict(base, objective={"kind": "orpo"})))
    assert orpo.phase("reference-forward") is None  # ORPO needs no reference


def test_grpo_card_peak_includes_the_colocated_vllm_reserve_of_that_card():
    """TRL's GRPO config (Qwen2.5-7B LoRA, 8 completions of 1536 tokens after 512-token prompts,
    vLLM colocated at 0.3): the per-card device peak adds 0.3 x that card's memory and names
    generation; the plan's own phases start with generation."""
    spec = imported("trl-grpo.yaml")
    o = spec.objective
    assert (o.kind, o.generations, o.generation.backend) == ("grpo", 8, "vllm-colocate")
    assert lengths(spec).sequence == spec.sequence_length == 2048
    plan = make_plan(spec, card_ids=[H100, H200])
    assert plan.phases[0].name == "generation"
    assert plan.phase("reference-forward") is None  # beta 0: TRL loads no reference
    cat = load_catalog()
    for card in (H100, H200):
        row = plan.card(card)
        reserve = int(0.3 * cat.get(card).capacity_bytes)
        assert row.generation_reserve_bytes == reserve
        assert row.device_peak_bytes == plan.per_device.device_peak_bytes + reserve
        assert "generation" in row.peak_phase and "vLLM" in row.peak_phase
    assert plan.card(H200).device_peak_bytes > plan.card(H100).device_peak_bytes


def test_sleep_mode_holds_the_reserve_during_generation_only():
    spec = imported("trl-grpo.yaml")
    o = spec.objective.model_dump()
    o["generation"]["sleep_mode"] = True
    awake, asleep = make_plan(spec, card_ids=[H100]), make_plan(
        spec.with_changes(objective=o), card_ids=[H100])
    assert asleep.card(H100).device_peak_bytes < awake.card(H100).device_peak_bytes
    assert asleep.card(H100).generation_reserve_bytes == awake.card(H100).generation_reserve_bytes


def test_transformers_generation_holds_the_kv_cache_in_the_training_process():
    spec = imported("trl-grpo.yaml")
    o = dict(spec.objective.model_dump(), beta=0.04, generation={"backend": "transformers"})
    plan = make_plan(spec.with_changes(objective=o))
    gen = plan.phase("generation")
    arch = resolve_arch(spec)
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2 * 2048 * 32  # 32 at once
    assert gen.temporary_bytes >= kv
    assert plan.phase("reference-forward") is not None  # beta > 0: adapters-off forward


def test_trl_defaults_beta_zero_for_grpo_and_its_completion_length():
    s = spec_from_dict({"model": {"preset": "tiny"}, "micro_batch_size": 8,
                        "objective": {"kind": "grpo"}})
    o = s.objective
    assert o.effective_beta == 0.0 and not o.needs_reference  # TRL 1.16 GRPOConfig.beta
    assert o.generations == 8 and lengths(s).completion == 512 and o.effective_loss_type == "dapo"
    r = spec_from_dict({"model": {"preset": "tiny"}, "micro_batch_size": 2,
                        "objective": {"kind": "rloo"}})
    assert r.objective.generations == 2 and r.objective.needs_reference  # RLOO beta 0.05


@pytest.mark.parametrize("objective, words", [
    ({"kind": "grpo", "num_generations": 3}, ["objective.num_generations", "divisor"]),
    ({"kind": "grpo", "num_generations": 1}, ["at least 2"]),
    ({"kind": "dpo", "reference": "adapters-off"}, ["adapters-off", "copy"]),
    ({"kind": "grpo", "num_generations": 4, "reference": "precomputed"}, ["precomputed"]),
    ({"kind": "reward"}, ["sequence-classification"]),
    ({"kind": "dpo", "num_generations": 4}, ["generates nothing"]),
])
def test_an_objective_the_run_cannot_have_is_refused_naming_the_field(objective, words):
    with pytest.raises(SpecError) as e:
        spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"},
                        "micro_batch_size": 4, "objective": objective})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_objective_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: tiny}\nmicro_batch_size: 4\n"
                   "objective: {kind: grpo, num_generations: 3}\n")
    assert cli("plan", str(bad)) == 2
    err = capsys.readouterr().err
    assert "num_generations" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("util, words", [(0.9, ["lower it", "sleep_mode"]),
                                         (0.1, ["raise it", "weights"])])
def test_a_vllm_fraction_that_leaves_no_room_on_the_chosen_card_exits_2(tmp_path, capsys,
                                                                         util, words):
    cfg = (CONFIGS / "trl-grpo.yaml").read_text().replace(
        "vllm_gpu_memory_utilization: 0.3", f"vllm_gpu_memory_utilization: {util}")
    path = tmp_path / "grpo.yaml"
    path.write_text(cfg)
    assert cli("plan", str(path), "--card", H100) == 2
    err = capsys.readouterr().err
    assert "gpu_memory_utilization" in err and all(w in err for w in words), err
    assert cli("plan", str(path)) == 0  # no card chosen: the fit table says which fit


def test_importers_map_every_objective_key_that_changes_memory_or_time():
    keys = {"axolotl-dpo-8b.yml": {"rl": "objective.kind", "rl_beta": "objective.beta"},
            "axolotl-grpo.yml": {"rl": "objective.kind", "trl": "objective",
                                 "vllm": "objective.generation.server_devices"},
            "trl-grpo.yaml": {"num_generations": "objective.num_generations",
                              "max_completion_length": "objective.max_completion_length",
                              "use_vllm": "objective.generation.backend",
                              "vllm_mode": "objective.generation.backend",
                              "vllm_gpu_memory_utilization":
                                  "objective.generation.gpu_memory_utilization",
                              "beta": "objective.beta", "loss_type": "objective.loss_type"},
            "llamafactory-llama3-lora-dpo.yaml": {"stage": "objective.kind",
                                                  "pref_beta": "objective.beta",
                                                  "pref_loss": "objective.kind"},
            "llamafactory-llama3-lora-ppo.yaml": {"stage": "objective.kind",
                                                  "max_new_tokens":
                                                      "objective.max_completion_length",
                                                  "reward_model": "objective.reward_model"}}
    for name, want in keys.items():
        r = import_config(CONFIGS / name, options=SYNTH)
        for key, field in want.items():
            assert r.mapped.get(key) == field, (name, key, r.mapped)
            assert key not in r.ignored
        assert r.spec.objective.kind != "sft"
    grpo = import_config(CONFIGS / "axolotl-grpo.yml", options=SYNTH).spec.objective
    assert grpo.generation.backend == "vllm-server" and grpo.generation.server_devices == 2
    assert "temperature" in import_config(CONFIGS / "trl-grpo.yaml", options=SYNTH).no_effect


def test_a_trl_config_names_its_trainer_with_objective(tmp_path):
    path = tmp_path / "kto.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nbeta: 0.1\nmax_length: 512\n"
                    "per_device_train_batch_size: 4\nuse_peft: true\n")
    guessed = import_config(path, options=SYNTH)
    told = import_config(path, options=ImportOptions(synthetic_data=True, objective="kto"))
    assert guessed.spec.objective.kind == "dpo" and told.spec.objective.kind == "kto"


def test_a_typo_in_an_objective_key_is_refused(tmp_path):
    cfg = (CONFIGS / "axolotl-dpo-8b.yml").read_text().replace("rl_beta:", "rl_bta:")
    path = tmp_path / "dpo.yml"
    path.write_text(cfg)
    with pytest.raises(UserError, match="rl_beta"):
        import_config(path, options=SYNTH)


def test_llamafactory_ranking_data_becomes_pairs():
    tok = str(ROOT / "src" / "tunepilot" / "resources" / "tiny" / "chat-tokenizer")
    r = import_config(CONFIGS / "llamafactory-llama3-lora-dpo.yaml",
                      options=ImportOptions(tokenizer=tok))
    d = r.spec.data
    assert d.data_format == "preference" and d.messages_field == "conversations"


def test_the_useful_unit_is_what_the_objective_trains_on():
    sft = spec_from_dict({"model": {"preset": "tiny"}})
    dpo = spec_from_dict({"model": {"preset": "tiny"}, "sequence_length": 1024,
                          "objective": {"kind": "dpo", "max_prompt_length": 256}})
    grpo = imported("trl-grpo.yaml")
    assert useful_unit(sft).name == "tokens"
    assert useful_unit(dpo).name == "pairs" and useful_unit(dpo).tokens_per_unit == 2 * 768
    assert useful_unit(grpo).name == "prompts" and useful_unit(grpo).tokens_per_unit == 8 * 1536


def test_flops_count_the_reference_forward_and_the_decode_is_bandwidth_bound():
    sft, dpo = imported("axolotl-sft-8b.yml"), imported("axolotl-dpo-8b.yml")
    arch = resolve_arch(sft)
    a, b = flops_per_token(arch, sft), flops_per_token(arch, dpo)
    assert b.train - a.train == pytest.approx(b.extra_passes)
    # one forward per position, the reference's: the base without its LoRA adapters
    assert b.extra_passes == pytest.approx(a.forward, rel=0.01) and b.extra_passes < a.forward
    grpo = imported("trl-grpo.yaml")
    g = resolve_arch(grpo)
    cat = load_catalog()
    h100 = decode_seconds_per_position(g, grpo, cat.get(H100).hbm_bandwidth_bytes_per_s)
    h200 = decode_seconds_per_position(g, grpo, cat.get(H200).hbm_bandwidth_bytes_per_s)
    assert h100 > h200 > 0  # more bandwidth, faster decode
    assert decode_seconds_per_position(arch, dpo, 3e12) == 0


def test_the_quote_names_the_unit_and_times_the_rl_step(capsys):
    assert cli("quote", str(CONFIGS / "trl-grpo.yaml"), "--card", H100, "--json") == 0
    import json

    q = json.loads(capsys.readouterr().out)
    assert any("prompts with their 8 generated completions" in n for n in q["notes"])
    assert "the RL step's" in q["throughput"]["per_card"]["how"]
    training = next(t for t in q["time_terms"] if t["name"] == "training")
    assert "decode steps" in training["parts"][0]["each"]["how"]  # generation, its decode
    # no mean completion length in the config: half the 1,536-token cap, of 2,048 positions
    assert q["throughput"]["useful_fraction"]["value"] == pytest.approx(768 / 2048)


def test_the_fit_search_keeps_num_generations_dividing_the_batch():
    plan = make_plan(imported("trl-grpo.yaml"), card_ids=[H200])
    row = plan.card(H200)
    assert row.fits and row.max_micro_batch % 2 == 0  # 8 | micro x 4 accumulation
    assert row.max_sequence_length > 2048


def test_a_vllm_servers_cards_are_billed_on_demand_and_on_spot():
    """A GRPO run with generation on a 2-card vLLM server rents 2 more cards: the on-demand job,
    the term and the spot term bill count + 2 (the spot term billed the training cards only)."""
    import math

    from tunepilot.cost.quote import quote

    spec = import_config(CONFIGS / "axolotl-grpo.yml", options=SYNTH).spec
    q = quote(spec, card_id="h100", count=2, term_s=None)
    card = load_catalog().get("h100")
    job_s = sum(t.total.value for t in q.time_terms)  # on demand: the quote's own terms
    spot_s = q.spot.work_s.value  # on spot: the same job with the spot term's own checkpoints

    def billed(s: float) -> int:
        step = card.pricing.billing_increment_s
        return math.ceil(math.ceil(s) / step) * step

    assert q.term.count == 4 and q.spot.cards == 4
    for rate, s, cents in ((card.pricing.spot_usd_per_hour, spot_s, q.spot.naive_cost_cents),
                           (card.pricing.on_demand_usd_per_hour, job_s,
                            q.spot.on_demand_cost_cents)):
        assert cents == round(4 * billed(s) * rate * 100 / 3600)
