"""What a layout's own parts save, against the CPU: the q/k norms of Qwen3-style attention
(the analytic plan's qk_norm_saved_per_token), as the bytes of the tensors autograd saves in the
attention block beyond those of the same block without them (Llama)."""

from __future__ import annotations

import pytest

from tunepilot.model.arch import Arch
from tunepilot.plan.analytic.activations import precision_bytes, qk_norm_saved_per_token
from tunepilot.spec import spec_from_dict

T = 256
CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=100, pad_token_id=0, bos_token_id=1,
           eos_token_id=2)
RUNS = [("bf16-true", "full"), ("bf16-true", "lora"), ("fp32", "full"), ("bf16-mixed", "full")]


def attention_saved_bytes(model_type: str, spec) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(model_type, **CFG)
    dtype = torch.bfloat16 if spec.precision == "bf16-true" or spec.method.is_lora else \
        torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype,
                                                          attn_implementation="sdpa")
    if spec.method.is_lora:
        for p in model.parameters():
            p.requires_grad_(False)
        model.get_input_embeddings().weight.requires_grad_(True)
    block = model.model.layers[0].self_attn
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.precision.mixed):
        model(torch.randint(3, 100, (1, T)))
    return sum(seen.values())


@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_qk_norms_save_what_the_plan_says(run):
    spec = spec_from_dict({"model": {"preset": "tiny"}, "precision": run[0],
                           "method": {"kind": run[1]}})
    arch = Arch.from_config(dict(CFG, model_type="qwen3"))
    cb, _, _ = precision_bytes(spec)
    measured = attention_saved_bytes("qwen3", spec) - attention_saved_bytes("llama", spec)
    assert qk_norm_saved_per_token(arch, spec, cb) * T == measured
