"""The run spec: the fine-tuning run a person intends, as a typed, validated YAML document.

This is a user-facing contract (field names are kept stable). Every field has a default except
``model``; unknown keys are errors with a "did you mean". ``load_spec`` turns every problem into a
``SpecError`` naming the field and the fix, so the CLI never shows a traceback for bad input.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunepilot.errors import SpecError, did_you_mean
from tunepilot.spec.allocator import AllocatorSpec
from tunepilot.spec.batch import Batch
from tunepilot.spec.kernels import KernelSpec
from tunepilot.spec.method import MethodSpec, check_quant_storage, quant_storage_for
from tunepilot.spec.moe import MoeSpec
from tunepilot.spec.objective import ObjectiveSpec
from tunepilot.spec.parallel import ParallelSpec, check_sequence_split
from tunepilot.spec.precision import Precision
from tunepilot.spec.yaml_input import read_yaml_mapping

OptimizerName = Literal["adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit",
                        "adamw_8bit_torchao", "adamw_4bit", "sgd", "adafactor"]
"""adamw (torch); adamw_8bit, paged_adamw, paged_adamw_8bit (bitsandbytes); adamw_8bit_torchao,
adamw_4bit (torchao AdamW8bit / AdamW4bit); sgd; adafactor - resources/optimizers.yaml"""
StateDtype = Literal["fp32", "bf16"]
Checkpointing = Literal["none", "full", "selective", "selective-op"]
Implementation = Literal["transformers", "litgpt", "torchtune", "torchtitan", "megatron"]
Task = Literal["causal-lm", "sequence-classification"]

# chunked_loss: lm_head + cross-entropy per this many tokens, recomputed in backward (the plan
# and tunepilot's own training step use the same chunk).
CHUNKED_LOSS_TOKENS = 1024
LITGPT_LM_HEAD_CHUNK = 128  # LitGPT's loss: lit-gpt finetune/*.py model(..., lm_head_chunk_size=128)


class _Strict(BaseModel):
    """Unknown keys are errors and types are strict: '64' is not a number, true is not 1."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ModelSpec(_Strict):
    """Which model: a shipped preset or a local Hugging Face config (exactly one)."""

    preset: str | None = None
    config: str | None = None
    revision: str | None = None
    weights: str = "random"
    implementation: Implementation = "transformers"
    """the training code that runs the model: its kernels and loss decide what is saved and how
    fast it runs (transformers + PEFT, LitGPT, torchtune, torchtitan, Megatron-core/NeMo)"""
    task: Task = "causal-lm"
    """causal-lm (next-token loss over the vocabulary) or sequence-classification (a small
    classification head on the last token; encoders such as BERT included)"""
    num_labels: int = Field(default=2, gt=0, le=100_000)
    """sequence-classification: the number of classes"""
    rope_scaling: float | None = Field(default=None, gt=1, le=1024, allow_inf_nan=False)
    """linear RoPE scaling factor (position interpolation): the context x this (model/context.py)"""
    transformers_version: str | None = Field(default=None, max_length=40)
    """the transformers release the run trains with, where it is older than the installed one:
    it decides the causal LM's loss path (spec.run hf_loss_path). The model's other code is
    planned from the installed transformers."""

    @field_validator("transformers_version")
    @classmethod
    def _release(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?[0-9A-Za-z.+-]*", v):
            raise ValueError(f"{v!r} is not a release number: write the transformers release "
                             "the run trains with, such as '4.40.2' (pip show transformers), "
                             "or leave it out for the installed one")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.preset is None) == (self.config is None):
            both = self.preset is not None
            raise ValueError(("sets both 'preset' and 'config'; " if both else "needs 'preset' or "
                              "'config'; ") + "give exactly one: a shipped preset name (see "
                             "`tunepilot presets`) or the path of a local Hugging Face "
                             "config.json or model directory")
        return self


class OptimizerSpec(_Strict):
    """The optimizer and the dtype of its state."""

    name: OptimizerName = "adamw"
    lr: float = Field(default=2.0e-4, gt=0, le=10, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, le=10, allow_inf_nan=False)
    state_dtype: StateDtype | None = None
    impl: Literal["foreach", "fused", "for-loop"] | None = None
    """PyTorch's implementation; default as PyTorch picks (foreach on CUDA, for-loop on CPU)."""


class SchedulerSpec(_Strict):
    """Learning-rate schedule (part of the training state a checkpoint must restore)."""

    kind: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(default=10, ge=0, le=10**9)


DataSource = Literal["synthetic", "tiny-text", "tiny-chat", "tiny-preference", "tiny-prompts",
                     "jsonl", "parquet", "arrow", "hf-disk"]
DataFormat = Literal["text", "prompt-completion", "messages", "preference", "prompt"]
TINY_FORMATS = {"tiny-chat": "messages", "tiny-preference": "preference", "tiny-prompts": "prompt"}
FILE_SOURCES = ("jsonl", "parquet", "arrow", "hf-disk")
NAMED_CHAT_TEMPLATES = ("chatml", "llama-3")


class DataSpec(_Strict):
    """Training data: synthetic tokens, the shipped tiny sets, or a local dataset file (JSONL,
    Parquet, Arrow, a ``datasets.save_to_disk`` directory) read with a local tokenizer.

    format: text (every token trained), prompt-completion or messages (chat turns rendered with
    a chat template; under ``train_on: completions`` only the completion / assistant turns are
    trained, the rest get label -100), preference (prompt + chosen + rejected, each a string or
    a list of messages: the DPO family) or prompt (prompt-only rows: generation). packing:
    several samples per row of sequence_length tokens, position ids restarting per sample so
    attention stays within each sample."""

    source: DataSource = "synthetic"
    path: str | None = None
    format: DataFormat | None = None
    """default: messages for tiny-chat, preference for tiny-preference, prompt for tiny-prompts,
    else text"""
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    tokenizer: str | None = None
    chat_template: str | None = None
    """the tokenizer's own when it has one, else 'chatml' (said in the output); or 'chatml',
    'llama-3', 'tokenizer' (the tokenizer's, required), or the path of a Jinja template"""
    train_on: Literal["completions", "all"] | None = None
    """default: completions for prompt-completion and messages, all for text"""
    packing: bool = False
    max_samples: int | None = Field(default=None, gt=0, le=10**9)
    skip_bad_rows: bool = False
    """skip (and count) rows that cannot be used instead of stopping at the first"""
    split: str = "train"
    """hf-disk: the split of a saved DatasetDict"""
    shuffle: bool = True
    num_workers: int = Field(default=0, ge=0, le=256)

    @model_validator(mode="after")
    def _files_and_format(self) -> DataSpec:
        if self.source in FILE_SOURCES and (self.path is None or self.tokenizer is None):
            raise ValueError(
                f"source {self.source!r} needs 'path' (the local dataset) and 'tokenizer' (a "
                "local Hugging Face tokenizer directory)"
            )
        fmt = self.data_format
        if fmt == "text" and self.train_on == "completions":
            raise ValueError(
                "train_on 'completions' needs a prompt-completion or messages format: plain "
                "text has no completion to train on; set format, or train_on: all"
            )
        if self.source in TINY_FORMATS and self.format not in (None, TINY_FORMATS[self.source]):
            raise ValueError(f"source {self.source!r} holds {TINY_FORMATS[self.source]} rows; "
                             f"remove format {self.format!r}")
        if self.source in ("synthetic", "tiny-text") and self.format not in (None, "text"):
            raise ValueError(f"source {self.source!r} is plain text; format {self.format!r} "
                             "needs a dataset file (jsonl, parquet, arrow, hf-disk)")
        if self.chat_template is not None and fmt == "text":
            raise ValueError("chat_template applies to prompt-completion and messages data; "
                             "remove it, or set format")
        return self

    @property
    def data_format(self) -> str:
        if self.format is not None:
            return self.format
        return TINY_FORMATS.get(self.source, "text")

    @property
    def supervise(self) -> str:
        """What is trained: completions (prompt and user/system turns get label -100) or all."""
        if self.train_on is not None:
            return self.train_on
        return "all" if self.data_format == "text" else "completions"


class ValidationSpec(_Strict):
    enabled: bool = True  # False: never validates (val_set_size 0): none planned or billed
    every_steps: int = Field(default=500, gt=0, le=10**12)
    num_batches: int = Field(default=20, gt=0, le=10**6)
    micro_batch_size: int | None = Field(default=None, gt=0, le=2**20)
    """Sequences per validation batch (HF's per_device_eval_batch_size); None: the training
    micro-batch. The plan's validation phase and the pilot's validation pass use it."""


class CheckpointSpec(_Strict):
    every_steps: int = Field(default=1000, gt=0, le=10**12)
    state_dict: Literal["sharded", "full", "none"] = "sharded"  # FSDP1's save (plan: README)
    dir: str = Field(default="checkpoints", min_length=1, max_length=4096)

    @field_validator("dir")
    @classmethod
    def _a_path(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("holds a NUL character, which no file system allows in a path")
        return v


HostLoad = Literal["auto", "per-rank", "rank0", "mmap"]


class HostSpec(_Strict):
    """How the run uses each node's host memory and disk: what the host plan (plan/host.py)
    adds up. Not part of the spec hash: none of it changes the training step."""

    load: HostLoad = "auto"
    """how the weights reach the devices: per-rank (every process reads the whole checkpoint
    into host RAM: from_pretrained under DDP, or FSDP without rank-0 loading), rank0 (rank 0
    reads it, the others build on the meta device and receive a broadcast: accelerate's
    fsdp_cpu_ram_efficient_loading), mmap (safetensors memory-mapped and copied to the device:
    page cache shared by the node's ranks). auto: rank0 under FSDP, per-rank otherwise"""
    async_checkpoint: bool = False
    """checkpoints staged into host RAM and written in the background (DCP async_save): a
    staging copy of each rank's shard while the save runs"""
    checkpoints_kept: int = Field(default=2, ge=1, le=10_000)
    """checkpoints kept on the node's disk (HF save_total_limit); one more exists while a save
    runs"""
    prefetch_factor: int = Field(default=2, ge=1, le=1024)
    """batches each dataloader worker prepares ahead (PyTorch's default 2)"""
    data_in_memory: bool = False
    """the tokenized dataset held as Python lists in every rank (and copied into each dataloader
    worker as it is read), instead of memory-mapped Arrow shared by the node"""

    @property
    def is_default(self) -> bool:
        return self == HostSpec()


class TargetSpec(_Strict):
    """How much training the term must deliver: useful tokens, epochs over a dataset (its
    supervised tokens come from `tunepilot data`'s profile, or dataset_tokens), or a number of
    optimizer steps (a trainer's max_steps)."""

    tokens: float | None = Field(default=None, ge=1, le=1e18, allow_inf_nan=False)
    epochs: float | None = Field(default=None, ge=1e-6, le=1e6, allow_inf_nan=False)
    dataset_tokens: float | None = Field(default=None, ge=1, le=1e18, allow_inf_nan=False)
    steps: int | None = Field(default=None, gt=0, le=10**12)
    """optimizer steps (HF's max_steps): the useful tokens are steps x tokens per step x the
    useful fraction"""

    @model_validator(mode="after")
    def _one_target(self) -> TargetSpec:
        given = [k for k in ("tokens", "epochs", "steps") if getattr(self, k) is not None]
        if not given:
            object.__setattr__(self, "tokens", 1.0e9)
        if len(given) > 1:
            raise ValueError(f"sets {' and '.join(repr(k) for k in given)}; give one")
        return self

    @property
    def useful_tokens(self) -> float | None:
        """The target in useful tokens, when the spec alone says it (None: epochs of a dataset
        whose profile says how many supervised tokens an epoch holds, or a number of steps)."""
        if self.tokens is not None:
            return self.tokens
        if self.epochs is not None and self.dataset_tokens is not None:
            return self.epochs * self.dataset_tokens
        return None


class RunSpec(_Strict):
    """One fine-tuning run, as the person intends to run it."""

    name: str | None = None
    model: ModelSpec
    method: MethodSpec = Field(default_factory=MethodSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    precision: Precision = Precision("bf16-mixed")
    """fp32 | bf16-mixed (fp32 weights, bf16 autocast) | bf16-true (all bf16) | fp16-mixed |
    FP8 training on bf16-mixed (fp32 master weights and optimizer state, the decoder's linear
    layers' matmuls in FP8; see spec/fp8.py): fp8-tensorwise (torchao Float8Linear, one dynamic scale
    per tensor, float8 all-gather under FSDP), fp8-rowwise (torchao, one scale per row) or
    fp8-te (NVIDIA Transformer Engine, delayed or current per-tensor scaling). FP8 needs FP8
    tensor cores: H100, H200, MI300X - not A100"""
    sequence_length: int = Field(default=2048, gt=0, le=1 << 21)
    """tokens per sample (at most 2,097,152)"""
    micro_batch_size: int = Field(default=1, gt=0, le=1 << 16)
    gradient_accumulation_steps: int = Field(default=1, gt=0, le=1 << 16)
    activation_checkpointing: Checkpointing = "none"
    """none | full (each layer's input) | selective (op-level SAC: matmul and attention
    outputs kept, the elementwise ops recomputed) | selective-op (torchtitan's per-op SAC: every
    other matmul output kept, attention outputs kept). Megatron's selective recompute (the core
    attention only) is none here under a flash kernel, which keeps no s x s scores anyway."""
    chunked_loss: bool = False
    torch_compile: bool = False
    """the model compiled with torch.compile (Inductor fuses pointwise ops: fewer saved
    intermediates, its own workspace)"""
    optimizer_in_backward: bool = False
    """each parameter is stepped in its gradient hook and its gradient freed at once
    (torchtune's optimizer_in_bwd): no full set of gradients is ever alive; needs
    gradient_accumulation_steps 1 and no GradScaler"""
    loop_keeps_output: Literal["none", "through-backward", "to-next-forward"] = "none"
    """how long the training loop keeps each micro-batch's model output (its logits):
    none - only the loss (HF Trainer, tunepilot's own step); through-backward - through its
    backward and the optimizer step, dropped before the next forward (`output = model(...)`,
    `output.loss.backward()`, `output = None`: AnswerDotAI fsdp_qlora train.py);
    to-next-forward - until the next micro-batch's forward returns and rebinds it (fms-fsdp
    before its PR #152, open-instruct before #777)"""
    activation_offloading: bool = False
    """saved activations go to host memory in the forward and come back in the backward
    (torchtune's enable_activation_offloading): the device holds the layers in flight"""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    """what is trained: sft (default), the DPO family, kto, reward, grpo/rloo (spec/objective.py)"""
    kernels: KernelSpec = Field(default_factory=KernelSpec)
    """the attention implementation and the fused kernels in use (spec/kernels.py)"""
    moe: MoeSpec = Field(default_factory=MoeSpec)
    """an MoE model's experts implementation and routing capacity (spec/moe.py)"""
    data: DataSpec = Field(default_factory=DataSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    target: TargetSpec = Field(default_factory=TargetSpec)
    allocator: AllocatorSpec = Field(default_factory=AllocatorSpec)
    """the caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF): its reserve per card"""
    host: HostSpec = Field(default_factory=HostSpec)
    """host memory and disk of each node: loading, async checkpoints, workers (the host plan)"""
    seed: int = Field(default=1234, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _cross_field(self) -> RunSpec:
        kernels = self.kernels.problem_with(self.model.implementation,
                                            self.activation_checkpointing, self.chunked_loss,
                                            self.model.task)
        if kernels:
            raise ValueError(kernels)
        if self.method.lora_qkv_parts is not None and self.model.implementation != "litgpt":
            raise ValueError(
                f"method.lora_qkv_parts {self.method.lora_qkv_parts} with model.implementation "
                f"{self.model.implementation}: adapting part of a fused query/key/value matrix "
                "is LitGPT's LoRA (lora_query / lora_key / lora_value); PEFT adapts the whole "
                "module. Set model.implementation: litgpt, or remove method.lora_qkv_parts")
        par = self.parallel
        if (self.model.implementation == "megatron" and par.strategy == "deepspeed"
                and par.deepspeed.stage > 1):
            raise ValueError(
                f"model.implementation megatron with parallel.deepspeed.stage "
                f"{par.deepspeed.stage}: Megatron-LM's optimizer is planned in ZeRO's terms, "
                "stage 1 for its distributed optimizer (--use-distributed-optimizer: fp32 "
                "main parameters and optimizer state sharded, gradients whole) and stage 0 "
                "without it; it does not shard gradients or parameters. Set "
                "parallel.deepspeed.stage: 1 (or 0)")
        p = self.precision
        if p.is_fp8 and self.method.kind == "qlora":
            raise ValueError(
                f"precision {self.precision} runs the linear layers' matmuls in FP8, but QLoRA's "
                "frozen base is NF4, dequantised to bf16 for every matmul; use method.kind lora "
                "with FP8, or precision bf16-mixed with QLoRA")
        if self.method.kind == "qlora" and not p.computes_in_bf16:
            raise ValueError(
                f"method.kind qlora computes in bf16 but precision is {self.precision!r}; "
                "set precision: bf16-true or bf16-mixed"
            )
        if (self.target.epochs is not None and self.target.dataset_tokens is None
                and self.data.source == "synthetic"):
            raise ValueError(
                "target.epochs needs a dataset (data.source) or target.dataset_tokens (useful "
                "tokens in one epoch): synthetic data has no epochs"
            )
        from tunepilot.spec.objective import check as check_objective

        check_objective(self)
        if self.optimizer_in_backward and self.gradient_accumulation_steps > 1:
            raise ValueError(
                "optimizer_in_backward steps each parameter as soon as its gradient exists, so "
                f"gradients cannot accumulate over {self.gradient_accumulation_steps} "
                "micro-batches; set gradient_accumulation_steps: 1 (and a larger "
                "micro_batch_size) or optimizer_in_backward: false")
        if self.optimizer_in_backward and p.needs_grad_scaler:
            raise ValueError(
                "optimizer_in_backward cannot unscale gradients it has already applied "
                "(fp16-mixed needs a GradScaler over all of them); use bf16-mixed or "
                "optimizer_in_backward: false")
        o = self.optimizer
        if o.name in ("adamw", "sgd") and o.state_dtype is not None and \
                o.state_dtype != self.trainable_dtype:
            what = (f"{self.trainable_dtype} LoRA adapters (method.adapter_dtype "
                    f"{self.method.adapter_dtype or 'null: PEFT keeps them in fp32'})"
                    if self.method.is_lora else f"{self.trainable_dtype} parameters under "
                    f"precision {self.precision}")
            fix = ("set method.adapter_dtype: bf16 for bf16 optimizer state"
                   if self.method.is_lora and o.state_dtype == "bf16" else
                   "remove optimizer.state_dtype or change precision")
            raise ValueError(f"optimizer.state_dtype {o.state_dtype} on {what}: PyTorch keeps "
                             f"optimizer state in the parameter dtype; {fix}")
        check_quant_storage(self.method, self.parallel, self.quant_storage_dtype)
        check_sequence_split(self.parallel, self.sequence_length)
        return self

    @property
    def quant_storage_dtype(self) -> str:
        """QLoRA: the dtype the 4-bit codes are packed in (method.quant_storage_for)."""
        return quant_storage_for(self.method, self.parallel.shards_parameters, self.frozen_base_dtype)

    @property
    def loss_is_chunked(self) -> bool:
        """chunked_loss, recomputed per chunk (LitGPT runs its own loss: litgpt_loss)."""
        return self.chunked_loss and not self.litgpt_loss

    @property
    def loss_calls_head_apart(self) -> bool:
        """The loss calls the decoder body and lm_head itself, never the model's forward (a
        chunked loss, LitGPT's): under FSDP each must be its own unit (model/shard.py)."""
        return (self.loss_is_chunked or self.litgpt_loss) and self.model.task == "causal-lm"

    @property
    def hf_loss_path(self) -> str:
        """How a transformers causal LM's own forward computes the SFT loss, by
        model.transformers_version (the installed release's when unset):

          current      the loss function upcasts the logits to fp32 and shifts the labels
                       (taken as 4.49 on: PR #35646, merged 2025-01-13, after 4.48.0 of
                       2025-01-10); the output keeps the 16-bit logits
          shift-copy   the loss function's fp32 upcast and a contiguous copy of the shifted
                       logits (4.46 to 4.48: loss_utils ForCausalLMLoss)
          fp32-output  the forward upcasts the logits to fp32 and keeps them in its output, and
                       the loss copies the shifted logits (before 4.46: PR #33902 removed
                       the upcast)
        "none" where the model's forward computes no such loss (another implementation,
        a chunked or fused-kernel loss, another objective or task)."""
        if (self.model.implementation != "transformers" or self.model.task != "causal-lm"
                or self.loss_is_chunked or self.kernels.fused_loss
                or self.objective.kind != "sft"):
            return "none"
        v = self.model.transformers_version
        if v is None:
            return "current"
        major, minor = (int(x) for x in v.split(".")[:2])
        if (major, minor) < (4, 46):
            return "fp32-output"
        return "shift-copy" if (major, minor) < (4, 49) else "current"

    @property
    def output_kept(self) -> str:
        """loop_keeps_output where the model's forward returns logits to keep (hf_loss_path is
        not "none"), else "none": what the step and the plan keep."""
        return self.loop_keeps_output if self.hf_loss_path != "none" else "none"

    @property
    def litgpt_loss(self) -> bool:
        """LitGPT's chunked_cross_entropy: every 128-position chunk kept (training.litgpt_loss)."""
        return self.model.implementation == "litgpt" and self.model.task == "causal-lm"

    @property
    def trainable_dtype(self) -> StateDtype:
        """The dtype of the trained parameters: LoRA adapters fp32 unless adapter_dtype: bf16
        (PEFT's autocast_adapter_dtype); a full run's parameters bf16 under bf16-true, else
        fp32 (mixed precision keeps fp32 parameters)."""
        if self.method.is_lora:
            return "bf16" if self.method.adapter_dtype == "bf16" else "fp32"
        return self.precision.parameter_dtype

    # --- derived figures -------------------------------------------------------------------
    @property
    def optimizer_state_dtype(self) -> StateDtype:
        """The trained parameters' dtype (PyTorch keeps state in it): fp32 under fp32 and
        *-mixed, bf16 under bf16-true - for LoRA the adapters' dtype (fp32 unless
        method.adapter_dtype: bf16)."""
        if self.optimizer.state_dtype is not None:
            return self.optimizer.state_dtype
        return self.trainable_dtype

    @property
    def frozen_base_dtype(self) -> str:
        """The storage dtype of a LoRA run's frozen base (see method.base_dtype)."""
        if self.method.base_dtype is not None:
            return self.method.base_dtype
        return self.precision.frozen_base_dtype

    @property
    def batch(self) -> Batch:
        """The batch in numbers: global batch, token positions per micro-batch and per step,
        steps per epoch (spec/batch.py, the one rule every stage calls)."""
        return Batch(self)

    @property
    def validation_micro_batch_size(self) -> int:
        return self.validation.micro_batch_size or self.micro_batch_size

    @property
    def label(self) -> str:
        return self.name or (self.model.preset or Path(self.model.config or "model").name)

    def spec_hash(self) -> str:
        """SHA-256 of the spec's canonical JSON (all resolved fields, without the label and
        the host section, which does not change the training step; the moe block,
        loop_keeps_output, model.transformers_version and checkpoint.state_dict only where set,
        so specs written before them keep their hash)."""
        data = self.model_dump(mode="json", exclude={"name", "host"} | (
            {"moe"} if self.moe.is_default else set()))
        if self.loop_keeps_output == "none":
            del data["loop_keeps_output"]
        if self.model.transformers_version is None:
            del data["model"]["transformers_version"]
        if self.checkpoint.state_dict == "sharded":
            del data["checkpoint"]["state_dict"]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def with_changes(self, **changes: Any) -> RunSpec:
        """A copy with top-level fields replaced, validated again."""
        data = self.model_dump(mode="python")
        data.update(changes)
        return RunSpec.model_validate(data)


# --- loading -----------------------------------------------------------------------------------


def load_spec(path: str | Path) -> RunSpec:
    """Read and validate a run spec; every problem becomes a SpecError naming the field."""
    p = Path(path)
    return spec_from_dict(read_yaml_mapping(p), source=p.name)


def spec_from_dict(data: Any, source: str = "spec") -> RunSpec:
    if data is None:
        raise SpecError(None, f"{source} is empty.", "A spec needs at least 'model: {preset: ...}'.")
    if not isinstance(data, dict):
        raise SpecError(None, f"{source} must be a YAML mapping of fields, got {type(data).__name__}.",
                        "Start from one of the files in examples/.")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, data) from None


def _spec_error(exc: ValidationError, data: dict) -> SpecError:
    """Turn pydantic's first error into one paragraph naming the field and the fix."""
    err = exc.errors(include_url=False)[0]
    loc = [str(x) for x in err["loc"]]
    field = ".".join(loc) if loc else None
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        parent_loc, key = loc[:-1], loc[-1]
        model = _model_at(parent_loc)
        choices = list(model.model_fields) if model else []
        return SpecError(field, f"unknown key {key!r}.", did_you_mean(key, choices))
    if kind == "missing":
        return SpecError(field, "is required but missing.", _hint_for(loc))
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",") if c.strip()]
        hint = did_you_mean(str(value), choices) if choices else ""
        return SpecError(field, f"{_short(value)} is not one of {expected}.", hint)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        ctx = err.get("ctx", {})
        bound = next(iter(ctx.values()), "")
        words = {"greater_than": "greater than", "greater_than_equal": "at least",
                 "less_than": "less than", "less_than_equal": "at most"}[kind]
        return SpecError(field, f"is {_short(value)} but must be {words} {bound}.",
                         "Sizes and counts are positive whole numbers.")
    if kind == "value_error":
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        return SpecError(field, msg + ".")
    msg = err.get("msg", "is not valid")
    return SpecError(field, f"{msg} (got {_short(value)}).", _hint_for(loc))


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message: never unbounded (a huge list or string is cut)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunSpec
    for key in loc:
        info = model.model_fields.get(key)
        ann = getattr(info, "annotation", None) if info else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def _hint_for(loc: list[str]) -> str:
    if loc and loc[0] == "model":
        return "Example: model: {preset: llama-3-8b}. See `tunepilot presets` for the names."
    return "See examples/ for a complete spec."
