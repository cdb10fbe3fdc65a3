"""Stand-ins for what a CPU trace cannot run, each with the memory behaviour of the real thing.

    fake tensors   every parameter and buffer of a meta-built model as a FakeTensor (shapes,
                   dtypes, aliasing; no data): the trace allocates nothing real
    NF4            bitsandbytes is CUDA-only: frozen linears traced as 16-bit weights whose
                   storage is counted as bitsandbytes lays out NF4 (packed codes + absmax), each
                   matmul dequantising a weight-sized temporary in forward and again in backward
    8/4-bit, paged bitsandbytes and torchao optimizers: a stand-in holding the same state
    GradScaler     fp16 loss scaling without the data-dependent inf check
    CUDA autocast  CUDA's float32 op list applied under CPU autocast - in the forward and in
                   activation checkpointing's recompute (which runs inside the backward)
    packing check  transformers' data-dependent test for packed rows, answered as the batch is
    fused dropout  attention dropout inside the fused GPU kernels (flash-attention 2/3, SDPA's
                   flash and memory-efficient kernels): no mask kept, as the kernels regenerate
                   it from the RNG state in the backward
    dropout        F.dropout (LoRA's dropout, hidden dropout) as CUDA and ROCm run it: the
                   fused native_dropout kernel, a bool mask kept (1 B per element) where the
                   CPU's composite path keeps a noise tensor in the input's dtype (4 B in fp32)
Used by the traced plan (plan/trace/step.py) and its tests; importing this imports torch.
"""

from __future__ import annotations

import torch

# bitsandbytes.functional.quantize_4bit: NF4 codes packed two per byte, one absmax per 64 weights
# (fp32; with double quant 8-bit + one fp32 per 256 absmax + a 256-entry fp32 code), a 16-entry
# fp32 NF4 code per tensor.
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256



def nf4_parts(numel: int, double_quant: bool) -> list[int]:
    """The device allocations bitsandbytes makes for one NF4 weight of `numel` elements."""
    blocks = -(-numel // NF4_BLOCK)
    parts = [-(-numel // 2), 16 * 4]  # packed codes (uint8), the NF4 code table (fp32)
    if double_quant:
        parts += [blocks, 4 * -(-blocks // NF4_DQ_BLOCK), 4, 256 * 4]  # uint8 absmax, absmax2,
    else:  # offset, nested code
        parts += [4 * blocks]
    return parts


class _NF4Matmul(torch.autograd.Function):
    """bitsandbytes MatMul4Bit's memory behaviour on a stand-in 16-bit weight: the weight is
    dequantised into a weight-sized 16-bit temporary for the forward matmul and again for the
    input gradient; only the input is kept for backward (the frozen weight gets no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w = torch.empty_like(weight)  # dequantize_4bit(weight) -> (out, in) in compute dtype
        out = torch.nn.functional.linear(x, w, bias)
        del w
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty_like(ctx.weight)
        return grad @ w, None, None


def _nf4_forward(self, x):
    return _NF4Matmul.apply(x.to(self.weight.dtype), self.weight, self.bias)


class QuantizedAdamStandIn(torch.optim.Optimizer):
    """bitsandbytes' AdamW8bit / PagedAdamW8bit / PagedAdamW and torchao's AdamW8bit /
    AdamW4bit, for the trace (bitsandbytes is CUDA-only; torchao compiles its step): the same
    state tensors as resources/optimizers.yaml lays them out (model/optimizers.py) - codes of
    bits/8 bytes per element (4-bit: two per byte), one fp32 scale per block, the small tensors
    in fp32 (bitsandbytes) or the parameter's dtype (torchao) - updated in place by one fused
    kernel, so the step adds no temporaries. Paged states live in CUDA managed memory, outside
    the caching allocator; they are counted here as device memory (when resident)."""

    def __init__(self, params, name: str, lr: float = 1e-4):
        from tunepilot.model.optimizers import optimizer_info

        super().__init__(params, {"lr": lr})
        info = optimizer_info(name)
        self.layout = info["state"]
        self.torchao = info["library"] == "torchao"

    def _state(self, p: torch.Tensor) -> dict:
        """A parameter's state; of an FSDP-sharded (DTensor) parameter, its local shard's, as
        torchao quantizes each rank's shard (``p.to_local()``) and bitsandbytes runs on the flat
        shard FSDP1 hands it. The codes and scales of the whole parameter on every rank
        counted the world size's times the state (a gpt-oss-20b run on 8 ranks: 39.6 GiB, not
        4.9)."""
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor):
            return self._state(p.to_local())
        st = self.layout
        n = p.numel()
        bits, block = st.get("bits"), st.get("block") or 1
        quantized = bits and n >= st["min_elements"] and (not self.torchao or n % block == 0)
        if not quantized:
            dtype = p.dtype if self.torchao else torch.float32
            return {f"state{i + 1}": torch.zeros_like(p, dtype=dtype) for i in range(2)}
        out = {}
        for i in range(2):
            out[f"state{i + 1}"] = torch.zeros(-(-n * bits // 8), dtype=torch.uint8,
                                               device=p.device)
            out[f"absmax{i + 1}"] = torch.zeros(-(-n // block), dtype=torch.float32,
                                                device=p.device)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st.update(self._state(p))
                st["step"] += 1
        return None


class ScalerStandIn:
    """GradScaler for fake tensors: scale, unscale (the foreach kernel, as the real one) and step
    without GradScaler's found-inf check, which reads a value fake tensors do not have."""

    def __init__(self, device: torch.device, scale: float = 65536.0):
        self._scale = torch.full((), scale, device=device)
        self._device = device

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, torch.zeros(1, device=self._device), 1.0 / self._scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


def quantized_linears(model: torch.nn.Module, spec) -> list[torch.nn.Linear]:
    """The frozen nn.Linear layers bitsandbytes quantizes: every one but the adapters and (unless
    method.quantize_lm_head) lm_head, as tunepilot.model.build._build_qlora does."""
    out = []
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or ".lora_" in name:
            continue
        leaf = name.split(".")[-1]
        base = name.split(".")[-2] if leaf == "base_layer" else leaf
        if base != "lm_head" or spec.method.quantize_lm_head:
            out.append(mod)
    return out


def emulate_nf4(model: torch.nn.Module, spec) -> dict[int, list[int]]:
    """Turn the frozen nn.Linear layers bitsandbytes would quantize (every one but lm_head, unless
    method.quantize_lm_head; as tunepilot.model.build._build_qlora does) into NF4 stand-ins;
    id(weight) -> the allocations each stands for."""
    parts: dict[int, list[int]] = {}
    for mod in quantized_linears(model, spec):
        mod.forward = _nf4_forward.__get__(mod)
        parts[id(mod.weight)] = nf4_parts(mod.weight.numel(), spec.method.double_quant)
    return parts


def to_fake(model: torch.nn.Module, fake_mode) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape, stride and
    dtype (tied weights stay tied)."""
    memo: dict[int, torch.Tensor] = {}
    with fake_mode:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in memo:
                    t = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
                    memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    if id(b) not in memo:
                        memo[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype,
                                                          device="cpu")
                    mod._buffers[name] = memo[id(b)]


def unpacked_sequences():
    """transformers checks position_ids for packed sequences (a data-dependent test) and, on
    fake tensors, assumes they may be packed and builds a 4-D mask. tunepilot's batches are one
    sequence per row (positions 0..s-1), which the real check finds: say so to transformers."""
    import contextlib
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda _ids: None)


# CUDA autocast's float32 list (PyTorch docs, "CUDA Ops that can autocast to float32"), the ops
# of it a decoder can call; CPU autocast leaves them in 16 bit, so on fake CPU tensors they are
# cast here. (The 16-bit lists - matmuls, linear, SDPA - agree between CPU and CUDA.)
_F = torch.nn.functional
_T = torch.Tensor
CUDA_AUTOCAST_FP32 = frozenset(f for f in (
    torch.pow, _T.pow, _T.__pow__, _T.__rpow__, torch.rsqrt, _T.rsqrt, torch.exp, _T.exp,
    torch.expm1, torch.log, _T.log, torch.log1p, torch.log2, torch.log10, torch.reciprocal,
    _T.reciprocal, torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv,
    _T.__rtruediv__, _T.__rdiv__, torch.softmax, _T.softmax, _F.softmax, torch.log_softmax,
    _T.log_softmax, _F.log_softmax, _F.softmin, _F.softplus, torch.layer_norm, _F.layer_norm,
    torch.group_norm, _F.group_norm, torch.sum, _T.sum, torch.prod, _T.prod, torch.cumsum,
    _T.cumsum, torch.cumprod, _T.cumprod, torch.norm, _T.norm, _F.normalize, torch.dist,
    torch.cdist, _F.cosine_similarity, _F.cross_entropy, _F.nll_loss, _F.mse_loss, _F.l1_loss,
    _F.smooth_l1_loss, _F.kl_div, _F.binary_cross_entropy_with_logits, torch.renorm,
) if f is not None)


class CudaAutocastRules(torch.overrides.TorchFunctionMode):
    """Under CPU autocast, run CUDA autocast's float32 ops in float32 as CUDA autocast does:
    16-bit floating inputs cast to fp32 (copies autograd may save), the op run in fp32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_AUTOCAST_FP32 and torch.is_autocast_enabled("cpu"):
            def up(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (
                    torch.bfloat16, torch.float16) else x

            args = tuple(up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class CudaAutocastInRecompute:
    """CudaAutocastRules also in activation checkpointing's recompute. The recompute runs inside
    ``loss.backward()``, and a TorchFunctionMode is off while it handles an op (backward
    included), so the recomputed layer would run CPU autocast's rules where the forward ran
    CUDA's - and checkpoint refuses the mismatch ("Recomputed values ... have different
    metadata": a fp32 tensor saved in the forward, bf16 in the recompute). Every non-reentrant
    checkpoint (transformers' layers, the chunked loss) gets the rules in its recompute context,
    besides its own (selective checkpointing's policy)."""

    def __enter__(self):
        import contextlib
        from unittest import mock

        import torch.utils.checkpoint as cp

        orig = cp._checkpoint_without_reentrant_generator

        def generator(fn, preserve_rng_state=True, context_fn=cp.noop_context_fn, *args,
                      **kwargs):
            def with_rules():
                forward_ctx, recompute_ctx = context_fn()
                stack = contextlib.ExitStack()

                class _Both:
                    def __enter__(self):
                        stack.enter_context(recompute_ctx)
                        stack.enter_context(CudaAutocastRules())

                    def __exit__(self, *exc):
                        return stack.__exit__(*exc)

                return forward_ctx, _Both()

            return orig(fn, preserve_rng_state, with_rules, *args, **kwargs)

        self._patch = mock.patch.object(cp, "_checkpoint_without_reentrant_generator", generator)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


def fused_attention_dropout():
    """SDPA called without its dropout: the CPU kernels have no fused dropout, so SDPA with
    dropout_p > 0 takes the math path and keeps a (batch, heads, s, s) attention matrix and
    dropout mask for the backward (an 80-head model at 4096 tokens: ~10 GiB per layer) that the
    GPU's flash and memory-efficient kernels never hold - they apply dropout in the kernel and
    regenerate the mask from the saved RNG state. The forward's memory is the same without it.
    Used when the spec's attention is not eager (eager really keeps its dropout mask)."""
    from unittest import mock

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def without_dropout(*args, **kwargs):
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        return sdpa(*args, **kwargs)

    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                             without_dropout)


def cuda_dropout():
    """F.dropout as a GPU build runs it: ATen's dropout takes the fused native_dropout kernel
    for a training dropout with 0 < p < 1 on a CUDA (or ROCm) tensor (Dropout.cpp,
    is_fused_kernel_acceptable), which returns the output and a bool mask, the mask being what
    autograd keeps. On the CPU the same call multiplies by a noise tensor in the input's dtype
    and keeps that: a LoRA dropout on fp32 adapter inputs traced at 4 B per element where the
    GPU holds 1. In-place dropout is not fused on either, and stays as it is."""
    from unittest import mock

    dropout = torch.nn.functional.dropout

    def fused(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    return mock.patch.object(torch.nn.functional, "dropout", fused)
