"""What the run trains: the objective (the spec's ``objective:`` block), and the arithmetic every
stage shares about it (lengths, rows per micro-batch, the generation batch, the useful unit).

    sft                     supervised next-token loss (the default)
    dpo ipo                 pairs (chosen, rejected) through the policy - concatenated into one
                            forward by default, as TRL does - and a reference forward (no grad)
    orpo simpo cpo          pairs, no reference model
    kto                     unpaired desirable/undesirable rows and a reference forward
    reward                  pairs scored by a sequence-classification head (no reference)
    grpo rloo               generation (num_generations completions per prompt), then the policy
                            update over the completions; a reference forward unless beta is 0
    ppo                     one completion per prompt, a reference and a reward-model forward,
                            the policy (+ value head) update (LLaMA-Factory's stage: ppo)

The reference of a LoRA run is the base with the adapters disabled (no extra weights); of a full
run a frozen copy on the device, unless its log-probabilities are precomputed before training.

Defaults are the trainers' own (TRL 1.16, read from trl/trainer/*_config.py and
trl/experimental/{orpo,cpo}/*_config.py): DPOConfig beta 0.1 and loss_type sigmoid; KTOConfig
beta 0.1; ORPOConfig/CPOConfig beta 0.1; GRPOConfig beta 0.0 ("the reference model is not
loaded"), num_generations 8, max_completion_length 512, loss_type dapo, vLLM colocated at
vllm_gpu_memory_utilization 0.3; RLOOConfig beta 0.05, num_generations 2, max_completion_length
512. PPO (LLaMA-Factory): max_new_tokens 1024 (GeneratingArguments), one completion per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ObjectiveKind = Literal["sft", "dpo", "ipo", "orpo", "simpo", "cpo", "kto", "reward", "grpo",
                        "rloo", "ppo"]
PAIRED = ("dpo", "ipo", "orpo", "simpo", "cpo", "reward")
NO_REFERENCE = ("sft", "orpo", "simpo", "cpo", "reward")
GENERATIVE = ("grpo", "rloo", "ppo")
Reference = Literal["auto", "adapters-off", "copy", "precomputed", "none"]
GenerationBackend = Literal["vllm-colocate", "vllm-server", "transformers"]
RewardModel = Literal["none", "adapter", "copy"]

DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "kto": 0.1, "orpo": 0.1, "simpo": 0.1, "cpo": 0.1,
                "grpo": 0.0, "rloo": 0.05, "ppo": 0.1}
DEFAULT_LOSS_TYPE = {"dpo": "sigmoid", "ipo": "ipo", "kto": "kto", "orpo": "orpo",
                     "simpo": "simpo", "cpo": "sigmoid", "reward": "bradley-terry",
                     "grpo": "dapo", "rloo": "rloo", "ppo": "ppo"}
DEFAULT_NUM_GENERATIONS = {"grpo": 8, "rloo": 2, "ppo": 1}
DEFAULT_COMPLETION_TOKENS = {"grpo": 512, "rloo": 512, "ppo": 1024}
PAIRED_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
"""the DPO-family losses tunepilot's own step computes (training/step.py -> training/preference.py)"""


# TRL 1.16's loss_type values per trainer (DPOConfig, GRPOConfig, KTOConfig, CPOConfig): a name
# outside them is refused (TRL refuses it too); tunepilot's own step computes PAIRED_LOSSES
TRL_LOSS_TYPES = {
    "dpo": PAIRED_LOSSES + ("robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
                            "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                            "sigmoid_norm"),
    "grpo": ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "kto": ("kto", "apo_zero_unpaired"),
    "cpo": ("sigmoid", "hinge", "ipo", "simpo", "alphapo"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class GenerationSpec(_Strict):
    """How GRPO/RLOO/PPO generate their completions."""

    backend: GenerationBackend = "transformers"
    """vllm-colocate: vLLM in the training process, on the same card (it reserves
    gpu_memory_utilization of the card's memory); vllm-server: vLLM on server_devices cards of
    their own (counted in the card count and the cost); transformers: model.generate with a KV
    cache on the training card"""
    gpu_memory_utilization: float = Field(default=0.3, gt=0, lt=1, allow_inf_nan=False)
    """vllm-colocate: the fraction of the card's memory vLLM reserves (weights, KV cache)"""
    sleep_mode: bool = False
    """vllm-colocate: vLLM releases its KV cache (and offloads its weights) while training runs"""
    server_devices: int = Field(default=1, gt=0, le=4096)
    """vllm-server: cards that run the vLLM server"""
    tensor_parallel: int = Field(default=1, gt=0, le=64)
    """vLLM's tensor_parallel_size: the cards one generation engine spans (its weights and KV
    cache split over them); the engines are the cards / tensor_parallel"""
    off_policy_steps: int = Field(default=0, ge=0, le=64)
    """0: on-policy, each step generates with the weights it trains; 1 or more: generation of
    the next batches runs on the server while the policy trains on this one (NeMo-RL's async
    GRPO, verl's one-step-off): the step takes the longer of the two, not their sum"""

    @model_validator(mode="after")
    def _sleep_needs_colocate(self) -> GenerationSpec:
        if self.sleep_mode and self.backend != "vllm-colocate":
            raise ValueError(f"generation.sleep_mode is vLLM's colocated sleep (it frees the "
                             f"card between generations) but backend is {self.backend!r}; "
                             "remove sleep_mode, or set backend: vllm-colocate")
        if self.off_policy_steps and self.backend != "vllm-server":
            raise ValueError(f"generation.off_policy_steps {self.off_policy_steps} overlaps "
                             "generation with training, which needs generation on cards of its "
                             f"own, but backend is {self.backend!r}; set backend: vllm-server "
                             "(with server_devices), or off_policy_steps: 0")
        if self.tensor_parallel > 1 and self.backend == "transformers":
            raise ValueError("generation.tensor_parallel splits a vLLM engine over cards; "
                             "transformers' generate runs on each training rank: remove it, or "
                             "set backend: vllm-colocate / vllm-server")
        if self.backend == "vllm-server" and self.server_devices % self.tensor_parallel:
            raise ValueError(f"generation.server_devices {self.server_devices} is not a "
                             f"multiple of tensor_parallel {self.tensor_parallel}: every engine "
                             "spans tensor_parallel cards; set server_devices to a multiple")
        return self


class ObjectiveSpec(_Strict):
    """The training objective and what it changes in memory and time."""

    kind: ObjectiveKind = "sft"
    beta: float | None = Field(default=None, ge=0, le=1e6, allow_inf_nan=False)
    """the KL / preference strength; null: the trainer's default (DEFAULT_BETA; GRPO's is 0:
    no reference model)"""
    loss_type: str | None = None
    """the loss variant as the trainer names it (sigmoid, ipo, hinge, dapo, ...); null: the
    trainer's default"""
    reference: Reference = "auto"
    """auto: adapters-off for LoRA/QLoRA, a frozen copy for a full run; none for the objectives
    that need none"""
    max_prompt_length: int | None = Field(default=None, gt=0, le=1 << 21)
    """tokens of the prompt; default: half of sequence_length for pairs, sequence_length -
    max_completion_length for generation"""
    max_completion_length: int | None = Field(default=None, gt=0, le=1 << 21)
    """tokens of each completion (chosen/rejected, or generated; TRL's GRPO default 512)"""
    mean_completion_length: int | None = Field(default=None, gt=0, le=1 << 21)
    """generation: the mean tokens a completion runs to before its end-of-sequence (your
    trainer's logged completion length, or the dataset profile's); null: half of
    max_completion_length. The time model draws completion lengths around it with a long tail
    that reaches the cap (cost/rollout.py) and the step waits for its longest"""
    concatenate_pairs: bool = True
    """pairs: chosen and rejected in one forward of 2 x micro_batch_size rows (TRL's default)"""
    num_generations: int | None = Field(default=None, gt=0, le=4096)
    """GRPO/RLOO: completions per prompt (default: the trainer's, 8 for GRPO, 2 for RLOO)"""
    num_iterations: int = Field(default=1, gt=0, le=1024)
    """GRPO: policy updates per generation batch"""
    steps_per_generation: int | None = Field(default=None, gt=0, le=1 << 16)
    """GRPO: micro-batches' worth of completions generated at once, as TRL counts it
    (default: gradient_accumulation_steps - one generation batch per optimizer step); a
    multiple of gradient_accumulation_steps"""
    reward_model: RewardModel = "none"
    """a reward model scored in the step: adapter (a LoRA reward adapter on the same base, no
    extra weights: LLaMA-Factory's reward_model_type lora) or copy (a second model on the card)"""
    generation: GenerationSpec = Field(default_factory=GenerationSpec)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> ObjectiveSpec:
        if self.kind == "sft":
            set_ = [k for k in ("beta", "loss_type", "max_prompt_length",
                                "max_completion_length") if getattr(self, k) is not None]
            if set_:
                raise ValueError(f"sets {', '.join(set_)} on objective kind 'sft', which has no "
                                 "preference or generation terms; remove them, or set kind "
                                 "(dpo, kto, grpo, ...)")
        if self.kind in NO_REFERENCE and self.reference not in ("auto", "none"):
            raise ValueError(f"objective {self.kind!r} uses no reference model, but reference "
                             f"is {self.reference!r}; remove it (or use dpo/kto/grpo)")
        if not self.generative:
            gen = [k for k in ("num_generations", "steps_per_generation",
                               "mean_completion_length") if getattr(self, k) is not None]
            gen += ["num_iterations"] if self.num_iterations != 1 else []
            gen += ["generation"] if self.generation != GenerationSpec() else []
            if gen:
                raise ValueError(f"sets {', '.join(gen)} on objective kind {self.kind!r}, which "
                                 "generates nothing; remove them, or set kind: grpo (or rloo)")
        if self.kind in ("grpo", "rloo") and self.generations < 2:
            raise ValueError(f"num_generations is {self.generations}: {self.kind} needs at "
                             "least 2 completions per prompt (its advantages are relative to "
                             "the group; TRL refuses it too); set num_generations: 2 or more")
        if self.kind == "ppo" and self.generations != 1:
            raise ValueError("num_generations applies to grpo/rloo; ppo generates one "
                             "completion per prompt: remove it")
        known = TRL_LOSS_TYPES.get(self.kind)
        if self.loss_type is not None and known and self.loss_type not in known:
            raise ValueError(f"loss_type {self.loss_type!r} is not one of TRL's {self.kind} "
                             f"losses ({', '.join(known[:8])}{', ...' if len(known) > 8 else ''})")
        return self

    @property
    def paired(self) -> bool:
        return self.kind in PAIRED

    @property
    def generative(self) -> bool:
        return self.kind in GENERATIVE

    @property
    def effective_beta(self) -> float:
        """beta as the run uses it: the spec's, else the trainer's default (0 for sft/reward)."""
        return self.beta if self.beta is not None else DEFAULT_BETA.get(self.kind, 0.0)

    @property
    def effective_loss_type(self) -> str:
        return self.loss_type or DEFAULT_LOSS_TYPE.get(self.kind, "cross-entropy")

    @property
    def generations(self) -> int:
        """Completions per prompt (1 for everything that does not generate)."""
        if self.num_generations is not None:
            return self.num_generations
        return DEFAULT_NUM_GENERATIONS.get(self.kind, 1)

    @property
    def needs_reference(self) -> bool:
        """dpo/ipo/kto/ppo always; grpo/rloo unless beta is 0 (TRL then loads none); never for
        sft/orpo/simpo/cpo/reward."""
        if self.kind in NO_REFERENCE or self.reference == "none":
            return False
        if self.kind in ("grpo", "rloo"):
            return self.effective_beta > 0
        return True

    def reference_kind(self, method_kind: str) -> str:
        """What the reference costs: none, adapters-off (LoRA: the base with the adapters
        disabled), copy (a frozen second model on the card) or precomputed (log-probs read
        with the data)."""
        if not self.needs_reference:
            return "none"
        if self.reference != "auto":
            return self.reference
        return "adapters-off" if method_kind in ("lora", "qlora") else "copy"

    @property
    def sequences_per_sample(self) -> int:
        """Sequences through the policy per sample of the micro-batch: 2 for pairs (chosen and
        rejected), 1 otherwise (a generative micro-batch counts completions)."""
        return 2 if self.paired else 1


# --- the arithmetic every stage shares (the spec is a RunSpec; duck-typed to avoid a cycle) ----


@dataclass(frozen=True)
class Lengths:
    """Tokens of one sample's parts: prompt, completion and the whole sequence."""

    prompt: int
    completion: int
    sequence: int


def lengths(spec: Any) -> Lengths:
    """The prompt, completion and sequence length the run trains at (the one rule).

    sft: the whole sequence is its own "completion". Pairs: sequence_length is each of chosen
    and rejected (prompt + completion, TRL's max_length); the prompt is max_prompt_length or
    half of it. Generation: the completion is max_completion_length (the trainer's default), the
    prompt max_prompt_length or what sequence_length leaves; the policy sees prompt + completion.
    """
    o, s = spec.objective, spec.sequence_length
    if o.generative:
        c = o.max_completion_length or DEFAULT_COMPLETION_TOKENS[o.kind]
        p = o.max_prompt_length or max(s - c, 1)
        return Lengths(p, c, p + c)
    if o.kind == "sft":
        return Lengths(0, s, s)
    p = o.max_prompt_length if o.max_prompt_length is not None else s // 2
    c = o.max_completion_length if o.max_completion_length is not None else s - p
    return Lengths(p, min(c, s - p), s)


def logits_rows_positions(spec: Any, rows: int) -> int:
    """Token positions whose logits the policy's loss computes for ``rows`` sequences: every
    position (SFT, pairs: TRL's concatenated forward), the completion only for generation (TRL
    keeps logits_to_keep = completion + 1)."""
    ln = lengths(spec)
    if spec.objective.generative:
        return rows * (ln.completion + 1)
    return rows * ln.sequence


def generation_batch(spec: Any) -> int:
    """Completions one device generates at once: micro_batch_size x steps_per_generation (TRL's
    per-device generation batch; steps_per_generation defaults to gradient_accumulation_steps)."""
    o = spec.objective
    return spec.micro_batch_size * (o.steps_per_generation or spec.gradient_accumulation_steps)


def global_generation_batch(spec: Any) -> int:
    return generation_batch(spec) * spec.parallel.world_size


def prompts_per_generation(spec: Any) -> int:
    """Prompts per device per generation (a prompt's completions may span ranks; on one
    device this is exact)."""
    return max(1, generation_batch(spec) // spec.objective.generations)


@dataclass(frozen=True)
class UsefulUnit:
    """What the objective trains on, and how many useful tokens one unit holds at full length.

    The useful token of every objective is a token the loss trains (labels != -100): SFT's
    supervised tokens; the completion tokens of chosen and rejected for pairs; the generated
    completion tokens for GRPO/RLOO/PPO. The unit is what a person counts: pairs, prompts (with
    their completions), completions."""

    name: str
    """tokens | pairs | completions | prompts"""
    tokens_per_unit: int
    how: str

    def units(self, useful_tokens: float) -> float:
        return useful_tokens / max(self.tokens_per_unit, 1)


def useful_unit(spec: Any) -> UsefulUnit:
    """The one rule of the useful output: quote, compare and the pilot name it from here."""
    o, ln = spec.objective, lengths(spec)
    if o.kind == "sft":
        return UsefulUnit("tokens", 1, "supervised tokens (labels != -100)")
    if o.kind == "reward":
        return UsefulUnit("pairs", 2 * ln.sequence,
                          f"pairs: chosen and rejected scored whole ({ln.sequence:,} tokens "
                          "each at full length)")
    if o.paired:
        return UsefulUnit("pairs", 2 * ln.completion,
                          f"pairs: the completion tokens of chosen and rejected (2 x "
                          f"{ln.completion:,} at full length)")
    if o.kind == "kto":
        return UsefulUnit("completions", ln.completion,
                          f"completions: their tokens ({ln.completion:,} at full length)")
    n = o.generations
    return UsefulUnit("prompts", n * ln.completion,
                      f"prompts with their {n} generated completion{'s' if n > 1 else ''} "
                      f"({n} x {ln.completion:,} tokens at full length)")


def generation_cards(spec: Any) -> int:
    """Cards a vLLM server takes beside the training cards (rented and billed with them)."""
    o = spec.objective
    return o.generation.server_devices if o.generative and \
        o.generation.backend == "vllm-server" else 0


def unit_notes(spec: Any, target_tokens: float | None) -> list[str]:
    """What a quote's useful token is, and the target in the objective's own unit."""
    unit = useful_unit(spec)
    server = generation_cards(spec)
    out = [f"generation on a vLLM server: {server} more card(s) of this kind rented beside the "
           "training cards, in the term's cost"] if server else []
    if unit.name == "tokens":
        return out
    many = (f" (the target of {target_tokens:,.0f} useful tokens is about "
            f"{unit.units(target_tokens):,.0f} {unit.name} at full length)"
            if target_tokens else "")
    return out + [f"objective {spec.objective.kind}: a useful token is a token the loss "
                  f"trains; the unit is {unit.how}{many}"]


def useful_fraction_at_full_length(spec: Any) -> float:
    """Useful tokens / token positions the policy processes, at full length with no padding:
    what synthetic data trains (the prompt of a pair or of a generation is not trained)."""
    ln = lengths(spec)
    if spec.objective.kind in ("sft", "reward"):
        return 1.0
    return ln.completion / ln.sequence


def check(spec: Any) -> None:
    """The objective against the rest of the spec; ValueError names the field and the fix."""
    o = spec.objective
    ln = lengths(spec)
    s = spec.sequence_length
    if o.generative:
        if o.max_completion_length is not None and o.max_prompt_length is None and \
                o.max_completion_length >= s:
            raise ValueError(f"objective.max_completion_length {o.max_completion_length} leaves "
                             f"no prompt in sequence_length {s} (prompt + completion); set "
                             f"sequence_length: {o.max_completion_length + 512} (a 512-token "
                             "prompt) or objective.max_prompt_length")
        if ln.sequence > s:
            raise ValueError(f"sequence_length {s} is shorter than objective.max_prompt_length "
                             f"+ max_completion_length ({ln.prompt} + {ln.completion}); set "
                             f"sequence_length: {ln.sequence}")
        if o.mean_completion_length is not None and o.mean_completion_length > ln.completion:
            raise ValueError(f"objective.mean_completion_length {o.mean_completion_length} is "
                             f"longer than max_completion_length {ln.completion}: a completion "
                             "stops at the cap; set it to your trainer's logged mean (at most "
                             "the cap)")
        if o.generation.backend == "vllm-colocate" and \
                spec.parallel.world_size % o.generation.tensor_parallel:
            raise ValueError(f"objective.generation.tensor_parallel "
                             f"{o.generation.tensor_parallel} does not divide the "
                             f"{spec.parallel.world_size} training card(s) the colocated engines "
                             "run on; set it to a divisor of parallel.devices x nodes")
        gen = global_generation_batch(spec)
        if o.generations > 1 and gen % o.generations:
            raise ValueError(_indivisible(spec, gen))
        if o.reference == "precomputed":
            raise ValueError("objective.reference precomputed: the completions are generated "
                             "during training, so their reference log-probs cannot be computed "
                             "beforehand; use reference: auto (or beta: 0 for no reference)")
    elif (o.paired or o.kind == "kto") and ln.prompt >= s:
        raise ValueError(f"objective.max_prompt_length {ln.prompt} leaves no completion in "
                         f"sequence_length {s} (each of chosen and rejected is prompt + "
                         "completion); raise sequence_length or lower max_prompt_length")
    if o.reference == "adapters-off" and not spec.method.is_lora:
        raise ValueError("objective.reference adapters-off disables LoRA adapters, but "
                         f"method.kind is {spec.method.kind!r} (no adapters); use reference: "
                         "copy (a frozen copy on the card) or precomputed")
    _check_task(spec)
    _check_data(spec)


def _check_data(spec: Any) -> None:
    """Rows of the format the objective reads: pairs for the DPO family, prompts for
    generation, no pairs or bare prompts for SFT."""
    o, d = spec.objective, spec.data
    if d.source == "synthetic":
        return
    fmt = d.data_format
    want = {"pairs": ("preference",), "kto": ("preference", "prompt-completion", "messages"),
            "generative": ("prompt", "prompt-completion", "messages"),
            "sft": ("text", "prompt-completion", "messages")}
    key = "pairs" if o.paired else "generative" if o.generative else \
        ("kto" if o.kind == "kto" else "sft")
    if fmt not in want[key]:
        raise ValueError(f"data.format {fmt!r} does not fit objective {o.kind!r}, which reads "
                         f"{' or '.join(want[key])} rows; set data.format (preference: "
                         "prompt/chosen/rejected; prompt: prompt-only rows for generation) or "
                         "objective.kind")


def _indivisible(spec: Any, gen: int) -> str:
    o, b = spec.objective, spec.micro_batch_size
    steps = o.steps_per_generation or spec.gradient_accumulation_steps
    what = "steps_per_generation" if o.steps_per_generation else "gradient_accumulation_steps"
    ok = [d for d in range(2, min(gen, 64) + 1) if gen % d == 0]
    return (f"objective.num_generations {o.generations} does not divide the global generation "
            f"batch of {gen} completions (micro_batch_size {b} x {what} {steps} x "
            f"{spec.parallel.world_size} rank(s)): every prompt's {o.generations} completions "
            "must be generated in one batch, and TRL refuses it too; set num_generations to a "
            f"divisor of {gen}" + (f" ({', '.join(map(str, ok[:6]))})" if ok else "")
            + f", or micro_batch_size / {what} so the batch is a multiple of "
            f"{o.generations}")


def _check_task(spec: Any) -> None:
    o, task = spec.objective, spec.model.task
    if o.kind == "reward" and task != "sequence-classification":
        raise ValueError("objective reward trains a scalar head on the last token (TRL's "
                         "RewardTrainer: a sequence-classification model, num_labels 1); set "
                         "model.task: sequence-classification and model.num_labels: 1")
    if task == "sequence-classification" and o.kind not in ("sft", "reward"):
        raise ValueError(f"objective {o.kind!r} trains a language model's token log-probs, "
                         "which a sequence-classification model has not; set model.task: "
                         "causal-lm (or objective.kind: reward for a reward model)")
