"""The kernels the run uses (the spec's ``kernels:`` block): what each saves in memory and what
it costs or gains in time is modelled by the plan and the time model, not ignored.

    attention           eager (saves the (batch, heads, s, s) attention probabilities; some
                        models still require it), sdpa (PyTorch's fused kernels), flash-attention-2,
                        flash-attention-3, flex
    liger               Liger Kernel's Triton kernels: rms_norm, swiglu (also GeGLU), rope,
                        fused_linear_cross_entropy (never holds the (tokens, vocab) logits),
                        layer_norm
    cut_cross_entropy   Apple's Cut Cross-Entropy: the loss without materialising the logits
    unsloth             Unsloth's fused kernels (and with unsloth_gradient_checkpointing its
                        checkpointing that offloads the saved layer inputs to host memory)
    transformer_engine  NVIDIA Transformer Engine's fused layers

Triton and CUDA kernels do not run on a CPU: the trace stands in PyTorch code that saves what the
kernel saves (and says so); the CPU pilot runs the stock path and says the kernel was not
measured.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Attention = Literal["eager", "sdpa", "flash-attention-2", "flash-attention-3", "flex"]
LigerKernel = Literal["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy", "layer_norm",
                      "geglu", "cross_entropy"]
LIGER_ALL = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class KernelSpec(_Strict):
    """Which kernels replace the stock PyTorch/transformers path."""

    attention: Attention = "sdpa"
    liger: list[LigerKernel] = Field(default_factory=list)
    """the Liger kernels in use (TRL's use_liger_kernel turns on rms_norm, swiglu, rope and
    fused_linear_cross_entropy)"""
    cut_cross_entropy: bool = False
    unsloth: bool = False
    unsloth_gradient_checkpointing: bool = False
    """Unsloth's 'unsloth' checkpointing: the saved layer inputs go to host memory"""
    transformer_engine: bool = False

    @model_validator(mode="after")
    def _one_loss_kernel(self) -> KernelSpec:
        if self.cut_cross_entropy and ("fused_linear_cross_entropy" in self.liger
                                       or "cross_entropy" in self.liger):
            raise ValueError("sets both cut_cross_entropy and Liger's cross-entropy kernel; the "
                             "loss runs one of them: drop one")
        if len(set(self.liger)) != len(self.liger):
            raise ValueError(f"liger lists a kernel twice: {self.liger}")
        return self

    @property
    def fused_loss(self) -> str | None:
        """The kernel that computes the loss without holding the logits, if any."""
        if self.cut_cross_entropy:
            return "cut_cross_entropy"
        if "fused_linear_cross_entropy" in self.liger:
            return "liger_fused_linear_cross_entropy"
        if self.unsloth:
            return "unsloth"
        return None

    def problem_with(self, implementation: str, checkpointing: str, chunked_loss: bool,
                     task: str) -> str | None:
        """Why these kernels cannot run with the rest of the spec (None: they can)."""
        patched = [k for k, on in (("liger", bool(self.liger)), ("cut_cross_entropy",
                                   self.cut_cross_entropy), ("unsloth", self.unsloth)) if on]
        if patched and implementation != "transformers":
            return (f"kernels {', '.join(patched)} patch transformers' models, but "
                    f"model.implementation is {implementation!r} (its own code); remove them or "
                    "set model.implementation: transformers")
        if self.unsloth_gradient_checkpointing and checkpointing != "full":
            return ("kernels.unsloth_gradient_checkpointing offloads the checkpointed layer "
                    f"inputs, but activation_checkpointing is {checkpointing!r}; set "
                    "activation_checkpointing: full (Unsloth's use_gradient_checkpointing: "
                    "'unsloth' is full checkpointing)")
        if self.fused_loss and chunked_loss:
            return (f"sets chunked_loss and the fused loss kernel {self.fused_loss}; the loss "
                    "runs one of them: drop chunked_loss")
        if self.fused_loss and task != "causal-lm":
            return (f"the loss kernel {self.fused_loss} computes a next-token loss over the "
                    f"vocabulary; a {task} model has none: remove it")
        return None

    @property
    def any(self) -> bool:
        return bool(self.liger or self.cut_cross_entropy or self.unsloth
                    or self.transformer_engine or self.attention != "sdpa")
