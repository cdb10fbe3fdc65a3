"""The model build (training/build.py, model/build.py, model/materialize.py): built on the meta
device, materialised a unit at a time with random init seeded per module - the same model
whatever the rank count, LoRA's base the full model's - or read from a local safetensors
checkpoint a tensor at a time; under FSDP each unit is sharded before the next is materialised,
so no rank holds more than its shard plus one unsharded unit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tunepilot.errors import UserError  # noqa: E402
from tunepilot.spec import spec_from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support" / "build_memory.py"
MiB = 1 << 20
# What a rank's host RSS may grow by during a sharded build beyond its shard and two unsharded
# units (the unit being built and the glibc heap it leaves for the next): the Python objects of
# the model and FSDP, the C allocator's slack. Measured 36-49 MiB on this test's model.
RSS_SLACK = 64 * MiB
# 16 decoder layers of 12.7 MB (fp32) and an 8.4 MB root: 211 MB whole, 105 MB per rank of 2.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
          "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 8,
          "num_hidden_layers": 16, "vocab_size": 2048, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2}


def tiny(**changes):
    base = {"model": {"preset": "tiny"}, "method": {"kind": "full"}, "precision": "fp32",
            "sequence_length": 32, "micro_batch_size": 2, "data": {"source": "synthetic"},
            "target": {"tokens": 1e6}}
    return spec_from_dict({**base, **changes})


def params(model) -> dict[str, torch.Tensor]:
    from tunepilot.model.materialize import canonical_name

    return {canonical_name(n): p.detach() for n, p in model.named_parameters()}


def test_canonical_names_take_out_peft_and_fsdp_wrappers():
    from tunepilot.model.materialize import canonical_name, module_seed

    assert canonical_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert canonical_name("base_model.model.lm_head.modules_to_save.default.weight") == \
        "lm_head.weight"
    assert canonical_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert canonical_name("_fsdp_wrapped_module.model.norm") == "model.norm"
    assert module_seed(7, "base_model.model.model.norm") == module_seed(7, "model.norm")
    assert module_seed(7, "model.norm") != module_seed(8, "model.norm")


def test_a_build_is_seeded_per_module_and_lora_keeps_the_full_models_base():
    from tunepilot.model.build import build_model

    full = params(build_model(tiny(), "cpu"))
    again = params(build_model(tiny(), "cpu"))
    assert all(torch.equal(full[k], again[k]) for k in full)
    other = params(build_model(tiny(seed=1), "cpu"))
    assert not torch.equal(full["model.layers.0.mlp.up_proj.weight"],
                           other["model.layers.0.mlp.up_proj.weight"])
    lora = params(build_model(tiny(method={"kind": "lora", "dora": True,
                                           "modules_to_save": ["lm_head"]}), "cpu"))
    base = {k: v for k, v in lora.items() if "lora_" not in k}
    assert base and all(torch.equal(full[k], v) for k, v in base.items())
    b = [v for k, v in lora.items() if ".lora_B." in k]
    a = [v for k, v in lora.items() if ".lora_A." in k]
    assert b and all(not v.any() for v in b)  # B = 0: the adapted model starts as the base
    assert a and all(v.std() > 0 for v in a)
    mags = [v for k, v in lora.items() if "lora_magnitude_vector" in k]
    assert mags and all(torch.isfinite(v).all() and (v > 0).all() for v in mags)
    norms = [v for k, v in full.items() if k.endswith("layernorm.weight")]
    assert norms and all(torch.equal(v, torch.ones_like(v)) for v in norms)


def test_a_unit_at_a_time_builds_the_same_model_as_all_at_once():
    """What a sharded rank does (one FSDP unit, then the next, then the root) gives every module
    the values the whole build gives it: the unsharded model does not depend on the cut."""
    from tunepilot.model.build import build_meta_model, build_model, materializer
    from tunepilot.model.shard import decoder_layers

    spec = tiny(method={"kind": "lora"})
    whole = params(build_model(spec, "cpu"))
    model = build_meta_model(spec)
    fill = materializer(model, spec, "cpu")
    for layer in reversed(decoder_layers(model)):  # another order, too
        fill(layer)
    fill(model)
    assert not any(p.is_meta for p in model.parameters())
    assert fill.fallbacks == []
    cut = params(model)
    assert cut.keys() == whole.keys() and all(torch.equal(cut[k], whole[k]) for k in whole)


def test_a_full_dpo_reference_starts_as_the_policy():
    from tunepilot.training.build import build_run

    spec = tiny(objective={"kind": "dpo"}, data={"source": "tiny-preference"},
                sequence_length=64)
    run = build_run(spec, "cpu", total_steps=2, data=False)
    ref = params(run.state.reference)
    pol = params(run.model)
    assert ref.keys() == pol.keys() and all(torch.equal(ref[k], pol[k]) for k in ref)
    assert all(not p.requires_grad for p in run.state.reference.parameters())


def test_weights_load_from_a_local_safetensors_checkpoint(tmp_path):
    from tunepilot.model.build import build_model

    saved = build_model(tiny(seed=5), "cpu")
    saved.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    want = params(saved)
    got = params(build_model(tiny(model={"preset": "tiny", "weights": str(tmp_path / "ckpt")},
                                  method={"kind": "lora"}), "cpu"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import save_file

    from tunepilot.model.build import build_model

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(ckpt / "model.safetensors"))
    with pytest.raises(UserError) as err:
        build_model(tiny(model={"preset": "tiny", "weights": str(ckpt)}), "cpu")
    assert err.value.field == "model.weights" and "model.embed_tokens.weight" in str(err.value)


def test_qlora_without_bitsandbytes_and_cuda_is_refused_cleanly():
    from tunepilot.model.build import build_model

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine builds QLoRA (tests marked gpu)")
    with pytest.raises(UserError) as err:
        build_model(tiny(method={"kind": "qlora"}, precision="bf16-mixed"), "cpu")
    assert err.value.field == "method.kind"


@pytest.mark.gpu
def test_qlora_packs_its_codes_in_quant_storage_on_a_gpu():
    pytest.importorskip("bitsandbytes")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tunepilot.model.build import build_model

    spec = tiny(method={"kind": "qlora", "quant_storage": "bf16"}, precision="bf16-mixed")
    model = build_model(spec, "cuda")
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    assert packed and all(p.dtype == torch.bfloat16 and p.bnb_quantized for p in packed)
    assert all(getattr(p, "quant_state", None) is not None for p in packed)


def _launch(spec_path: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(SUPPORT), str(spec_path), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _spec_file(tmp_path: Path, **model) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    import yaml

    spec = {"name": "build-memory", "model": {"config": "config.json", **model},
            "method": {"kind": "full"}, "precision": "fp32", "sequence_length": 64,
            "micro_batch_size": 1, "parallel": {"strategy": "fsdp", "devices": 2},
            "data": {"source": "synthetic"}, "target": {"tokens": 1e6}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _check_bounds(r: dict) -> None:
    unit = max(r["unit_bytes"])
    assert r["differ"] == [], r["differ"]
    assert r["build_peak_bytes"] <= r["shard_bytes"] + unit, r  # its shard + one unit
    assert r["shard_bytes"] < 0.55 * r["whole_bytes"]
    bound = r["shard_bytes"] + 2 * unit + RSS_SLACK
    assert r["rss_growth_bytes"] <= bound, (r["rss_growth_bytes"], bound)
    assert bound < r["whole_bytes"]  # the bound excludes holding the model


@pytest.mark.slow
def test_no_rank_holds_more_than_its_shard_and_one_unit_while_the_model_builds(tmp_path):
    for r in _launch(_spec_file(tmp_path), tmp_path / "out"):
        _check_bounds(r)


@pytest.mark.slow
def test_a_sharded_load_reads_the_checkpoint_a_tensor_at_a_time(tmp_path):
    spec = _spec_file(tmp_path)
    proc = subprocess.run([sys.executable, str(SUPPORT), "--save", str(spec),
                           str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for r in _launch(_spec_file(tmp_path, weights="ckpt"), tmp_path / "out"):
        _check_bounds(r)  # "differ" compares every gathered tensor with the checkpoint's


@pytest.mark.slow
def test_fsdp1_holds_its_shard_plus_a_unit_and_its_flat_copy(tmp_path):
    """FSDP1 materialises a unit through param_init_fn, then flattens it into one flat
    parameter beside its tensors before it cuts the shard: two unsharded copies at most."""
    path = _spec_file(tmp_path)
    path.write_text(path.read_text().replace("devices: 2", "devices: 2\n  fsdp_version: 1"))
    for r in _launch(path, tmp_path / "out"):
        assert r["build_peak_bytes"] <= r["shard_bytes"] + 2 * max(r["unit_bytes"]), r


def test_a_model_with_no_sdpa_path_is_built_with_eager_attention():
    """gpt-oss has no SDPA path (its attention sinks): transformers refuses sdpa, so the build
    (the trace's and the pilot's) takes eager, as the model's own recipes do."""
    import json
    from pathlib import Path

    import torch
    from transformers import AutoConfig

    from tunepilot.model.build import _from_config

    raw = json.loads((Path(__file__).parent / "data" / "configs" / "gpt-oss-20b.json").read_text())
    hf = AutoConfig.for_model(**raw)
    spec = spec_from_dict({"model": {"preset": "tiny"}, "method": {"kind": "full"}})
    with torch.device("meta"):
        model = _from_config(spec, hf)
    assert model.config._attn_implementation == "eager"
