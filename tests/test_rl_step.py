"""The RL step model (cost/rollout.py, cost/rl_step.py, cost/rl_quote.py): completion lengths with a
tail to the cap and a step that waits for the longest, the KV cache's concurrency, colocated vs a
server, the log-prob passes the objective needs, overlap of off-policy generation, the phases as
the quote's terms, compare ranking both layouts, and the fitted constants resting on no held-out
publication."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.cost.compare import compare
from tunepilot.cost.quote import quote
from tunepilot.cost.rl_step import PHASES, _passes, rl_step
from tunepilot.cost.rollout import completion_shape, engines, generation
from tunepilot.cost.runs import held_out_publication
from tunepilot.cost.step_model import step_model
from tunepilot.model.arch import Arch, load_preset
from tunepilot.spec import spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
H100 = load_catalog().get("h100")
ARCH = Arch.from_config(load_preset("llama-3.1-8b"))


def _spec(**objective) -> object:
    o = {"kind": "grpo", "beta": 0.04, "num_generations": 8, "max_prompt_length": 256,
         "max_completion_length": 1024, "mean_completion_length": 300,
         "generation": {"backend": "vllm-colocate", "gpu_memory_utilization": 0.3}}
    o.update(objective)
    return spec_from_dict({"name": "grpo", "model": {"preset": "llama-3.1-8b"},
                           "method": {"kind": "lora", "lora_rank": 16},
                           "precision": "bf16-mixed", "sequence_length": 1280,
                           "micro_batch_size": 8, "gradient_accumulation_steps": 4,
                           "activation_checkpointing": "full",
                           "parallel": {"strategy": "ddp", "devices": 8},
                           "objective": o, "target": {"tokens": 1e7}})


def test_completion_lengths_keep_their_mean_and_a_tail_to_the_cap():
    shape = completion_shape(_spec())
    capped = shape.scale * (1 - math.exp(-shape.cap / shape.scale))
    assert capped == pytest.approx(300, rel=1e-6)  # E[min(X, cap)] is the spec's mean
    assert 0 < shape.at_cap < 0.1
    assert shape.longest(4) < shape.longest(64) <= shape.cap
    assert shape.longest(10_000) == shape.cap  # enough completions put one at the cap
    default = completion_shape(_spec(mean_completion_length=None))
    assert default.mean == 512 and "half the cap" in default.how


def test_the_step_waits_for_its_longest_completion():
    """The same mean with a longer cap: more decode steps for the tail, a longer generation."""
    short, long = _spec(max_completion_length=512), _spec()
    eng = engines(short, ARCH, H100, 8)
    g_short = generation(short, ARCH, eng, completion_shape(short), 0.4)
    g_long = generation(long, ARCH, engines(long, ARCH, H100, 8), completion_shape(long), 0.4)
    assert g_long.longest > g_short.longest and g_long.seconds > g_short.seconds
    assert "the longest of" in g_long.how


def test_a_smaller_kv_cache_holds_fewer_completions_and_queues_the_rest():
    roomy = _spec(generation={"backend": "vllm-colocate", "gpu_memory_utilization": 0.9})
    tight = _spec(generation={"backend": "vllm-colocate", "gpu_memory_utilization": 0.21},
                  num_generations=8)
    big = {"micro_batch_size": 64, "gradient_accumulation_steps": 4}
    roomy, tight = roomy.with_changes(**big), tight.with_changes(**big)
    e_roomy, e_tight = engines(roomy, ARCH, H100, 8), engines(tight, ARCH, H100, 8)
    assert e_tight.concurrent < e_tight.completions_each <= e_roomy.concurrent
    g = generation(tight, ARCH, e_tight, completion_shape(tight), 0.4)
    assert g.seconds > generation(roomy, ARCH, e_roomy, completion_shape(roomy), 0.4).seconds
    assert "KV cache full" in g.how


def test_colocated_and_server_layouts_sync_weights_differently_and_overlap_when_off_policy():
    colo = rl_step(_spec(), ARCH, H100, 8, "ddp")
    server = _spec(generation={"backend": "vllm-server", "server_devices": 2})
    on = rl_step(server, ARCH, H100, 8, "ddp")
    off = rl_step(_spec(generation={"backend": "vllm-server", "server_devices": 2,
                                    "off_policy_steps": 1}), ARCH, H100, 8, "ddp")
    assert "colocated engine" in colo.phases["weight sync"].how
    assert "broadcast to the server" in on.phases["weight sync"].how
    assert on.step.value == pytest.approx(sum(p.value for p in on.phases.values()))
    train = sum(off.phases[k].value for k in ("log-probs", "reward", "policy update"))
    assert off.step.value == pytest.approx(max(off.phases["generation"].value, train)
                                           + off.phases["weight sync"].value)
    assert off.step.value < on.step.value


def test_the_log_prob_passes_are_the_ones_the_objective_needs():
    one = _spec()  # one optimizer step per generation batch, beta 0.04: the reference only
    assert _passes(one, 1.0)[0] == ["reference"]
    assert _passes(_spec(beta=0.0), 1.0)[0] == []
    assert _passes(_spec(beta=0.0), 4.0)[0] == ["old policy"]  # a batch feeds 4 updates
    assert _passes(_spec(num_iterations=2), 1.0)[0] == ["old policy", "reference"]
    r = rl_step(_spec(beta=0.0), ARCH, H100, 8, "ddp")
    assert r.phases["log-probs"].value == 0 and "none" in r.phases["log-probs"].how


def test_the_quote_shows_the_phases_as_terms_and_which_dominates():
    q = quote(_spec(), card_id="h100", count=8, term_s=None)
    training = next(t for t in q.time_terms if t.name == "training")
    assert [p.name for p in training.parts] == list(PHASES)
    assert sum(p.total.value for p in training.parts) == pytest.approx(training.total.value)
    assert training.dominant in PHASES
    assert any(n.startswith(f"RL step: {training.dominant} dominates") for n in q.notes)
    assert q.generation_layout == "vllm-colocate"


def test_compare_ranks_colocated_and_server_layouts_together():
    c = compare(_spec())
    assert set(c.layouts) == {"vllm-colocate", "vllm-server 1"}
    seen = {q.generation_layout for q in c.rows}
    assert seen == {"vllm-colocate", "vllm-server 1"}
    costs = [q.cost_per_million_term_usd for q in c.rows if not q.tight]
    assert costs == sorted(costs)  # one ranking over both layouts


def test_the_spec_refuses_a_mean_past_the_cap_and_async_without_a_server():
    with pytest.raises(Exception, match="mean_completion_length"):
        _spec(mean_completion_length=2048)
    with pytest.raises(Exception, match="off_policy_steps"):
        _spec(generation={"backend": "vllm-colocate", "off_policy_steps": 1})
    with pytest.raises(Exception, match="tensor_parallel"):
        _spec(generation={"backend": "vllm-colocate", "tensor_parallel": 3})


def test_the_fitted_constants_rest_on_no_held_out_publication_and_are_their_fit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import rl_steps
    finally:
        sys.path.pop(0)
    by_id = {r["id"]: r for r in rl_steps.data()["runs"]}
    d, w = step_model().decode, step_model().weight_sync
    for ids in (d.engine_runs, w.colocated_runs):
        assert ids and all(not held_out_publication(by_id[i]["publication"]) for i in ids)
    f = rl_steps.fit()
    assert f["engine_runs"] == d.engine_runs and f["colocated_runs"] == w.colocated_runs
    assert d.engine_step_s == pytest.approx(f["engine_step_s"], rel=0.01)
    assert d.tp_allreduce_s == pytest.approx(f["tp_allreduce_s"], rel=0.01)
    assert w.colocated_gb_per_s == pytest.approx(f["colocated_gb_per_s"], rel=0.01)
    held = [r for r in rl_steps.data()["runs"] if held_out_publication(r["publication"])]
    assert len(held) >= 4 and len({r["stack"].split(" ")[0] for r in held}) >= 2


def test_the_training_passes_read_the_policys_layout_and_generation_its_engines():
    """A policy trained at tensor parallel 4 takes the model-parallel cells and a quarter-wide
    rank (cost/mfu.py shape_of): its log-prob and update passes change by that MFU ratio
    (Megatron's model-parallel cell and a 1,024-wide rank: slower); generation, on the vLLM
    engines' own layout, does not change."""
    from tunepilot.cost.mfu import mfu_for

    spec = spec_from_dict({**_spec().model_dump(mode="json", exclude_none=True),
                           "model": {"preset": "llama-3.1-8b", "implementation": "megatron"},
                           "method": {"kind": "full"}})
    dp = rl_step(spec, ARCH, H100, 8, "ddp")
    tp = rl_step(spec, ARCH, H100, 8, "ddp", {"tensor": 4})
    ratio = mfu_for(spec, H100, ARCH).value / mfu_for(spec, H100, ARCH,
                                                      layout={"tensor": 4}).value
    assert ratio > 1.1
    assert tp.phases["generation"].value == dp.phases["generation"].value
    assert tp.phases["policy update"].value == pytest.approx(
        dp.phases["policy update"].value * ratio, rel=1e-6)
    assert tp.phases["log-probs"].value > dp.phases["log-probs"].value


def test_eager_generate_takes_the_longer_of_the_hosts_dispatch_and_the_devices_work():
    """transformers' generate dispatches one forward's ops from Python per decode step: a small
    batch is host-bound (ops x eager_op_host_s a step), however fast the card reads weights."""
    from tunepilot.cost.launch import forward_kernels

    spec = _spec(generation={"backend": "transformers"}, mean_completion_length=1024)
    eng = engines(spec, ARCH, H100, 8)
    g = generation(spec, ARCH, eng, completion_shape(spec), 0.4)
    host = forward_kernels(ARCH, spec) * step_model().decode.eager_op_host_s
    weights_read = 2 * 8.0e9 / (H100.hbm_bandwidth_bytes_per_s * step_model().decode.hbm_fraction)
    assert host > weights_read  # an 8B's weights read faster than its ops are dispatched
    assert g.decode_s == pytest.approx(g.longest * host, rel=0.05)
    assert "eager ops" in g.how
