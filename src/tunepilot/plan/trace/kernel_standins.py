"""PyTorch stand-ins for GPU kernels, for the trace: Triton and CUDA kernels do not run on a CPU
(nor on fake tensors), so the trace runs autograd Functions that save exactly what each kernel
saves and allocate what it allocates (plan/analytic/variants.py derives the same for the analytic plan):

    norms        Liger LigerRMSNormFunction / LigerLayerNormFunction and Unsloth's
                 fast_rms_layernorm: the input in its dtype, the weight, fp32 rstd (and mean)
    gated MLP    Liger LigerSiLUMulFunction / LigerGELUMulFunction: (gate, up) saved; the
                 backward writes their gradients into the saved tensors (in place, as Liger)
    loss         Liger LigerFusedLinearCrossEntropyFunction: the gradients made in the forward,
                 chunk by chunk, grad_input and grad_weight kept; Cut Cross-Entropy
                 LinearCrossEntropyFunction: e, the fp32 lse and the valid-token index kept,
                 recomputed blockwise in backward (also Unsloth's loss)
The elementwise math runs in fp32 over row blocks so the stand-in's own scratch stays near the
kernel's (which keeps it in registers). Importing this imports torch.
"""

from __future__ import annotations

import types

import torch

from tunepilot.plan.analytic import variants

ROW_BLOCKS = 32  # the fp32 scratch of the elementwise math: 1/32 of the rows at a time
IGNORE = -100


def _blocks(n: int, size: int | None = None):
    size = size or max(1, -(-n // ROW_BLOCKS))
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _no_autocast(t: torch.Tensor):
    return torch.autocast(t.device.type, enabled=False)


# --------------------------------------------------------------------------- norms


class _RMSNorm(torch.autograd.Function):
    """Saves x (its own dtype), w and one fp32 rstd per row, as Liger's and Unsloth's kernels."""

    @staticmethod
    def forward(ctx, x, w, eps: float, offset: float):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        with _no_autocast(x):
            for b in _blocks(x2.shape[0]):
                xf = x2[b].float()
                rstd[b] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                y[b] = (xf * rstd[b] * (offset + w.float())).to(y.dtype)
        ctx.save_for_backward(x2, w, rstd)
        ctx.offset, ctx.shape = offset, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w, rstd = ctx.saved_tensors
        g2 = g.reshape(x2.shape)
        dx = torch.empty_like(x2)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) \
            if ctx.needs_input_grad[1] else None
        with _no_autocast(x2):
            wf = ctx.offset + w.float()
            for b in _blocks(x2.shape[0]):
                xhat = x2[b].float() * rstd[b]
                dxhat = g2[b].float() * wf
                dx[b] = (rstd[b] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
                         ).to(dx.dtype)
                if dw is not None:
                    dw += (g2[b].float() * xhat).sum(0)
        return dx.view(ctx.shape), (dw.to(w.dtype) if dw is not None else None), None, None


class _LayerNorm(torch.autograd.Function):
    """Saves x, w, b and fp32 mean and rstd per row, as Liger's LayerNorm kernel."""

    @staticmethod
    def forward(ctx, x, w, bias, eps: float):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty_like(x2)
        mean = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        with _no_autocast(x):
            for b in _blocks(x2.shape[0]):
                xf = x2[b].float()
                mean[b] = xf.mean(-1, keepdim=True)
                rstd[b] = torch.rsqrt((xf - mean[b]).pow(2).mean(-1, keepdim=True) + eps)
                out = (xf - mean[b]) * rstd[b] * w.float()
                y[b] = (out + bias.float() if bias is not None else out).to(y.dtype)
        ctx.save_for_backward(x2, w, bias, mean, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w, bias, mean, rstd = ctx.saved_tensors
        g2 = g.reshape(x2.shape)
        dx = torch.empty_like(x2)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        db = torch.zeros_like(dw) if bias is not None else None
        with _no_autocast(x2):
            for b in _blocks(x2.shape[0]):
                xhat = (x2[b].float() - mean[b]) * rstd[b]
                gf = g2[b].float()
                dxhat = gf * w.float()
                dx[b] = (rstd[b] * (dxhat - dxhat.mean(-1, keepdim=True)
                                    - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(dx.dtype)
                dw += (gf * xhat).sum(0)
                if db is not None:
                    db += gf.sum(0)
        return (dx.view(ctx.shape), dw.to(w.dtype) if ctx.needs_input_grad[1] else None,
                db.to(bias.dtype) if db is not None and ctx.needs_input_grad[2] else None, None)


def _rms_forward(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    offset = 1.0 if type(self).__name__.startswith("Gemma") else 0.0  # Gemma: x * (1 + w)
    return _RMSNorm.apply(x, self.weight, eps, offset)


def _ln_forward(self, x):
    return _LayerNorm.apply(x, self.weight, self.bias, self.eps)


# --------------------------------------------------------------------------- gated MLP


def _act(a: torch.Tensor, gelu: bool) -> torch.Tensor:
    return torch.nn.functional.gelu(a, approximate="tanh") if gelu else torch.nn.functional.silu(a)


class _GLU(torch.autograd.Function):
    """act(a) * b saving only (a, b); the backward writes da and db into them in place."""

    @staticmethod
    def forward(ctx, a, b, gelu: bool):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        out = torch.empty_like(a2)
        with _no_autocast(a):
            for r in _blocks(a2.shape[0]):
                out[r] = (_act(a2[r].float(), gelu) * b2[r].float()).to(out.dtype)
        ctx.save_for_backward(a2, b2)
        ctx.gelu, ctx.shape = gelu, a.shape
        return out.view(a.shape)

    @staticmethod
    def backward(ctx, g):
        a2, b2 = (t.detach() for t in ctx.saved_tensors)  # written in place below
        g2 = g.reshape(a2.shape)
        with _no_autocast(a2), torch.enable_grad():
            for r in _blocks(a2.shape[0]):
                af = a2[r].float().requires_grad_()
                act = _act(af, ctx.gelu)
                (dact,) = torch.autograd.grad(act, af, g2[r].float() * b2[r].float())
                db = g2[r].float() * act.detach()
                a2[r] = dact.to(a2.dtype)
                b2[r] = db.to(b2.dtype)
        return a2.view(ctx.shape), b2.view(ctx.shape), None


def _glu_forward(self, x):
    gelu = "gelu" in type(getattr(self, "act_fn", None)).__name__.lower()
    return self.down_proj(_GLU.apply(self.gate_proj(x), self.up_proj(x), gelu))


def _fused_glu_forward(self, x):  # Phi-3: one gate_up_proj
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(_GLU.apply(gate, up, False))


# --------------------------------------------------------------------------- xIELU


def _xielu(x, ap, an, beta: float, eps: float):
    """xIELU (arXiv 2411.13010) as transformers' XIELUActivation computes it."""
    return torch.where(x > 0, ap * x * x + beta * x,
                       (torch.expm1(torch.clamp(x, max=eps)) - x) * an + beta * x)


class _XIELU(torch.autograd.Function):
    """The xIELU CUDA kernel (nickjbrowning/XIELU, which transformers' XIELUActivation calls when
    it is installed and axolotl recommends "for reduced VRAM"): its input saved, nothing else -
    transformers' Python fallback keeps several intermediate-sized tensors (fp32 under CUDA
    autocast: expm1 is on its fp32 list) per layer. The math runs over row blocks."""

    @staticmethod
    def forward(ctx, x, alpha_p, alpha_n, beta: float, eps: float):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty_like(x2)
        with _no_autocast(x):
            ap = torch.nn.functional.softplus(alpha_p.float())
            an = beta + torch.nn.functional.softplus(alpha_n.float())
            for b in _blocks(x2.shape[0]):
                y[b] = _xielu(x2[b].float(), ap, an, beta, eps).to(y.dtype)
        ctx.save_for_backward(x2, alpha_p, alpha_n)
        ctx.beta, ctx.eps, ctx.shape = beta, eps, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, alpha_p, alpha_n = ctx.saved_tensors
        g2 = g.reshape(x2.shape)
        dx = torch.empty_like(x2)
        dp = torch.zeros_like(alpha_p, dtype=torch.float32)
        dn = torch.zeros_like(alpha_n, dtype=torch.float32)
        with _no_autocast(x2), torch.enable_grad():
            p = alpha_p.detach().float().requires_grad_()
            n = alpha_n.detach().float().requires_grad_()
            for b in _blocks(x2.shape[0]):
                xf = x2[b].detach().float().requires_grad_()
                y = _xielu(xf, torch.nn.functional.softplus(p),
                           ctx.beta + torch.nn.functional.softplus(n), ctx.beta, ctx.eps)
                gx, gp, gn = torch.autograd.grad(y, (xf, p, n), g2[b].float())
                dx[b] = gx.to(dx.dtype)
                dp += gp
                dn += gn
        return (dx.view(ctx.shape), dp.to(alpha_p.dtype) if ctx.needs_input_grad[1] else None,
                dn.to(alpha_n.dtype) if ctx.needs_input_grad[2] else None, None, None)


def _xielu_forward(self, x):
    return _XIELU.apply(x, self.alpha_p, self.alpha_n, float(self._beta_scalar),
                        float(self._eps_scalar))


def xielu_kernels(model: torch.nn.Module, notes: list[str]) -> int:
    """transformers' XIELUActivation modules as the xIELU CUDA kernel (the plan's assumption,
    plan/analytic/activations.py: the activation's input saved only)."""
    swapped = 0
    for mod in model.modules():
        if type(mod).__name__ == "XIELUActivation":
            mod.forward = types.MethodType(_xielu_forward, mod)
            swapped += 1
    if swapped:
        notes.append(f"xIELU: {swapped} activations traced as the xIELU CUDA kernel "
                     "(nickjbrowning/XIELU: its input saved); transformers' Python fallback, "
                     "used when the kernel is not installed, keeps several intermediate-sized "
                     "tensors per layer more")
    return swapped


# --------------------------------------------------------------------------- loss


def _ce_grad(logits: torch.Tensor, y: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, d loss / d logits) in fp32 for rows of logits and their targets."""
    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    valid = y != IGNORE
    yc = y.clamp(min=0)
    loss = (lse - lf.gather(-1, yc[:, None]).squeeze(-1)) * valid
    grad = torch.softmax(lf, -1)
    grad.scatter_add_(-1, yc[:, None], -torch.ones_like(lse)[:, None])
    return loss, grad * (valid[:, None] * scale)


class _FusedLinearCE(torch.autograd.Function):
    """Liger's fused linear cross-entropy: per chunk of tokens the logits (in the matmul's
    dtype) are overwritten by their gradient; grad_input and grad_weight are filled in the
    forward and kept for the backward, which only scales them in place."""

    @staticmethod
    def forward(ctx, h, w, y, chunk: int):
        needs = ctx.needs_input_grad[0]  # (grad mode is off inside forward)
        gi = torch.zeros_like(h) if needs else None
        gw = torch.zeros_like(w) if needs and ctx.needs_input_grad[1] else None
        loss = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        for c in _blocks(h.shape[0], chunk):
            logits = h[c] @ w.t()  # (chunk, V), autocast's dtype as Liger's matmul
            with _no_autocast(h):
                for r in _blocks(logits.shape[0], max(1, chunk // 16)):
                    rows = slice(c.start + r.start, c.start + r.stop)
                    lr, gr = _ce_grad(logits[r], y[rows], 1.0)
                    loss[rows] = lr
                    logits[r] = gr.to(logits.dtype)
            if gi is not None:
                gi[c] = logits @ w
            if gw is not None:
                with _no_autocast(h):
                    gw.addmm_(logits.t().to(gw.dtype), h[c].to(gw.dtype))
            del logits
        ctx.save_for_backward(gi, gw)
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        gi, gw = ctx.saved_tensors
        gi.mul_(g.to(gi.dtype))
        if gw is not None:
            gw.mul_(g.to(gw.dtype))
        return gi, gw, None, None


class _CutCE(torch.autograd.Function):
    """Cut Cross-Entropy: saves e, the classifier, a fp32 lse per token and the valid-token
    index; the backward recomputes the logits blockwise and allocates de and dc."""

    @staticmethod
    def forward(ctx, e, c, y, block: int):
        lse = torch.empty(e.shape[0], dtype=torch.float32, device=e.device)
        loss = torch.zeros_like(lse)
        for r in _blocks(e.shape[0], block):
            logits = e[r] @ c.t()
            with _no_autocast(e):
                lf = logits.float()
                lse[r] = torch.logsumexp(lf, -1)
                valid = y[r] != IGNORE
                loss[r] = (lse[r] - lf.gather(-1, y[r].clamp(min=0)[:, None]).squeeze(-1)) * valid
            del logits
        # CCE's int64 index of the valid tokens (nonzero: every token, the worst case - the
        # count is data a fake tensor does not have)
        valids = torch.arange(y.shape[0], device=y.device)
        ctx.save_for_backward(e, c, lse, y, valids)
        ctx.block = block
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        e, c, lse, y, _ = ctx.saved_tensors
        de = torch.zeros_like(e)
        dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
        for r in _blocks(e.shape[0], ctx.block):
            logits = e[r] @ c.t()
            with _no_autocast(e):
                _, grad = _ce_grad(logits, y[r], g.float())
                de[r] = (grad.to(c.dtype) @ c).to(de.dtype)
                if dc is not None:
                    dc.addmm_(grad.t().to(dc.dtype), e[r].to(dc.dtype))
            del logits, grad
        return de, dc, None, None


class _InPlaceCE(torch.autograd.Function):
    """Liger's cross_entropy on transformers' fp32 logits: the gradient is written into the
    logits in the forward and kept (no log-softmax output, no separate gradient)."""

    @staticmethod
    def forward(ctx, x, y):
        loss = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        needs = ctx.needs_input_grad[0]
        for r in _blocks(x.shape[0]):
            lr, gr = _ce_grad(x[r], y[r], 1.0)
            loss[r] = lr
            if needs:
                x[r] = gr.to(x.dtype)
        ctx.save_for_backward(x.detach())
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x.mul_(g.to(x.dtype)), None


def _next_tokens(labels, num_items_in_batch=None, ignore_index=IGNORE):
    """transformers' ForCausalLMLoss's targets: the labels shifted by one, flat, and the count
    the summed loss is divided by (the batch's own targets unless the trainer gives one)."""
    y = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    n = num_items_in_batch if num_items_in_batch is not None else (y != IGNORE).sum().clamp(min=1)
    return y, n


def _liger_ce_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE,
                   **_kwargs):
    """transformers' ForCausalLMLoss with Liger's cross_entropy patched in."""
    y, n = _next_tokens(labels, num_items_in_batch, ignore_index)
    return _InPlaceCE.apply(logits.float().view(-1, vocab_size), y) / n


class _MegatronCE(torch.autograd.Function):
    """Megatron-core's vocab-parallel cross entropy (fused or not, one tensor-parallel rank):
    the logits copied to fp32 (calculate_logits_max), shifted, exponentiated and normalised in
    place into the softmax it keeps for the backward, whose gradient is written into that
    softmax in place and cast to the logits' dtype - no log-softmax output, no separate fp32
    gradient (megatron/core/tensor_parallel/cross_entropy.py)."""

    @staticmethod
    def forward(ctx, logits, y):
        x = logits.float()
        x -= x.max(-1, keepdim=True).values
        valid = y != IGNORE
        picked = x.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
        torch.exp(x, out=x)
        total = x.sum(-1)
        x.div_(total[:, None])
        ctx.save_for_backward(x, y)
        return ((total.log() - picked) * valid).sum()

    @staticmethod
    def backward(ctx, g):
        softmax, y = ctx.saved_tensors
        valid = (y != IGNORE).to(softmax.dtype)
        softmax.scatter_add_(-1, y.clamp(min=0)[:, None], -valid[:, None])
        softmax.mul_(valid[:, None] * g.float())
        return softmax, None


def _megatron_ce_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE,
                      **_kwargs):
    """transformers' ForCausalLMLoss as Megatron computes it (_MegatronCE)."""
    y, n = _next_tokens(labels, num_items_in_batch, ignore_index)
    return _MegatronCE.apply(logits.view(-1, vocab_size), y) / n


def megatron_loss(model: torch.nn.Module, spec, notes: list[str]) -> bool:
    """model.implementation megatron without a loss kernel: its cross entropy in place of
    transformers' (which keeps an fp32 log-softmax and makes a separate fp32 gradient)."""
    if spec.model.implementation != "megatron" or variants.loss_kernel(spec) or \
            spec.model.task != "causal-lm" or spec.objective.kind != "sft":
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.loss_function = _megatron_ce_loss
    notes.append("model.implementation megatron: its vocab-parallel cross entropy traced as it "
                 "runs (an fp32 softmax kept, the gradient written into it in place)")
    return True


def _decoder(causal_lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack under a CausalLM head: ``model`` by transformers' convention, else its
    base model (Llama4ForCausalLM names a base_model_prefix it does not hold, so base_model is
    the CausalLM itself, and calling it would recurse into this forward)."""
    inner = getattr(causal_lm, "model", None)
    if isinstance(inner, torch.nn.Module) and inner is not causal_lm:
        return inner
    base = causal_lm.base_model
    return base if base is not causal_lm else causal_lm.get_decoder()


def _fused_loss_forward(self, input_ids=None, attention_mask=None, labels=None,
                        num_items_in_batch=None, position_ids=None, **_kwargs):
    """The patched CausalLM forward (as Liger's lce_forward and CCE's patch): the decoder, then
    the loss from the hidden states and lm_head's weight, without logits. Liger's fuses only
    while training: in eval mode it materialises the logits and calls the model's own loss
    (plan/analytic/variants.validation_spec), so a validation pass runs the unpatched forward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if self._tunepilot_loss == "liger_fused_linear_cross_entropy" and not self.training:
        return self._tunepilot_plain_forward(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels,
            num_items_in_batch=num_items_in_batch, position_ids=position_ids)

    hidden = _decoder(self)(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids).last_hidden_state  # (b, s, h)
    head = self.get_output_embeddings()
    y, n = _next_tokens(labels, num_items_in_batch)
    h = hidden.reshape(-1, hidden.shape[-1])
    kind = self._tunepilot_loss
    if kind == "liger_fused_linear_cross_entropy":
        chunk = variants.liger_chunk_tokens(h.shape[0], head.weight.shape[0], h.shape[1])
        loss = _FusedLinearCE.apply(h, head.weight, y, chunk)
    else:
        block = max(1, variants.liger_chunk_tokens(h.shape[0], head.weight.shape[0],
                                                   h.shape[1]) // 4)
        loss = _CutCE.apply(h, head.weight, y, block)
    return CausalLMOutputWithPast(loss=loss / n)


# --------------------------------------------------------------------------- applying them


def apply_kernel_standins(model: torch.nn.Module, spec, arch, notes: list[str]) -> int:
    """Swap the modules (and the loss) the spec's GPU kernels replace for their stand-ins;
    the number of modules swapped (a note says what)."""
    norm, mlp = variants.fused_norm(arch, spec), variants.fused_mlp(arch, spec)
    loss = variants.loss_kernel(spec)
    swapped = 0
    for mod in model.modules():
        name = type(mod).__name__
        if norm and name.endswith("RMSNorm") and hasattr(mod, "weight"):
            mod.forward = types.MethodType(_rms_forward, mod)
            swapped += 1
        elif norm and isinstance(mod, torch.nn.LayerNorm):
            mod.forward = types.MethodType(_ln_forward, mod)
            swapped += 1
        elif mlp and all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj")):
            mod.forward = types.MethodType(_glu_forward, mod)
            swapped += 1
        elif mlp and all(hasattr(mod, a) for a in ("gate_up_proj", "down_proj")) and \
                isinstance(mod.gate_up_proj, torch.nn.Module):
            mod.forward = types.MethodType(_fused_glu_forward, mod)
            swapped += 1
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if loss in ("liger_fused_linear_cross_entropy", "cut_cross_entropy", "unsloth"):
        base._tunepilot_loss, base._tunepilot_plain_forward = loss, base.forward
        base.forward = types.MethodType(_fused_loss_forward, base)
        swapped += 1
    elif loss == "liger_cross_entropy":
        base.loss_function = _liger_ce_loss
        swapped += 1
    if swapped:
        what = [f"{norm}'s norms" if norm else "", f"{mlp}'s gated MLP" if mlp else "",
                f"the {loss.replace('_', ' ')} loss" if loss else ""]
        notes.append(f"kernels: {', '.join(w for w in what if w)} are GPU (Triton/CUDA) kernels; "
                     f"traced as PyTorch stand-ins saving what they save ({swapped} modules)")
    return swapped


FLASH_STAND_IN = "tunepilot_flash_stand_in"


def _flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    **kwargs):
    """SDPA's flash kernel, causal and unmasked: it saves what the GPU's flash kernel saves (q,
    k, v, the output, an fp32 logsumexp). Attention sinks (``s_aux``) and a sliding window change
    which scores count, not what is kept; the sinks' own gradient is one value per head."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def flash_with_sinks(model: torch.nn.Module, spec, notes: list[str]) -> bool:
    """A model built with eager attention because transformers has no SDPA path for it
    (gpt-oss: attention sinks) while the spec runs a flash kernel that has one (FlashAttention
    3 with sinks, axolotl's and the gpt-oss recipes' vllm-flash-attn3): eager would keep every
    layer's (heads x s x s) scores, which the kernel never holds. The trace runs it as the
    flash kernel instead."""
    if spec.kernels.attention not in ("flash-attention-2", "flash-attention-3", "flex") or \
            getattr(model.config, "_attn_implementation", None) != "eager":
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(FLASH_STAND_IN, _flash_stand_in)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == "eager":
            cfg._attn_implementation = FLASH_STAND_IN
    notes.append(f"attention {spec.kernels.attention}: this model has no SDPA path in "
                 "transformers (built eager); traced as the flash kernel, causal, sinks and "
                 "sliding window aside (they change which scores count, not what is kept)")
    return True
