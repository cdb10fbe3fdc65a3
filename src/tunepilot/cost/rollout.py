"""Generation in an RL step (GRPO / RLOO / PPO): the prefill and the decode of the step's
completions on the engines that generate them, waiting for the longest completion.

Completion lengths: the spec's mean (objective.mean_completion_length, else half the cap) drawn
from a capped exponential - L = min(X, cap), X exponential with the scale mu that gives the
mean - a long right tail that puts a share exp(-cap / mu) of the completions at the cap, as RL
logs show (verl's GRPO on GSM8K: mean response 160-200 tokens, the longest at the 1,024 cap in
nearly every step with 0.1% clipped). The step waits for its longest completion: of n
completions the expected longest, mu (ln n + 0.577), or the cap once n completions put one there.

Engines: vllm-colocate runs training cards / tensor_parallel engines on the training cards;
vllm-server server_devices / tensor_parallel on cards of their own; transformers' generate runs
on every training rank over its own completions (no continuous batching: the batch keeps every
row until the longest finishes). A vLLM engine holds at once the completions its KV cache allows
at gpu_memory_utilization: (utilization x the cards' memory - the weights) / KV bytes per token
(2 x layers x KV heads x head dim x 2 B); beyond it completions queue and run as others finish.

Decode step of an engine with b completions at context x, per card of it:
    max(weights + b x x x KV bytes per token) / (HBM x hbm_fraction),
        2 x active parameters x b / (peak x MFU)) + the engine's fixed work per step
    (vLLM: engine_step_s + 2 x layers x tp_allreduce_s when tensor parallel); transformers'
    eager generate: the longer of that and the host's dispatch of one forward's ops (their count,
    cost/launch.py, x eager_op_host_s), the device running them as they come
summed over the decode steps while the completions finish (b = n x P(L > t)). Prefill: 2 x active
parameters per prompt token at the cell's forward MFU (vLLM computes a prompt once for its
completions, prefix caching; transformers once per completion row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EULER_GAMMA = 0.5772156649
GRID = 96  # points of the decode integral


@dataclass(frozen=True)
class CompletionShape:
    """Completion lengths: min(X, cap), X exponential of scale ``scale``."""

    mean: float
    cap: int
    scale: float  # inf: every completion runs to the cap
    how: str

    def survival(self, t: float) -> float:
        """Share of completions still generating after t tokens."""
        if t >= self.cap:
            return 0.0
        return 1.0 if math.isinf(self.scale) else math.exp(-t / self.scale)

    @property
    def at_cap(self) -> float:
        return 1.0 if math.isinf(self.scale) else math.exp(-self.cap / self.scale)

    def longest(self, n: float) -> float:
        """The expected longest of ``n`` completions."""
        if n <= 0:
            return 0.0
        if n * self.at_cap >= 1 or math.isinf(self.scale):
            return float(self.cap)
        return min(float(self.cap), self.scale * (math.log(n) + EULER_GAMMA))


def completion_shape(spec) -> CompletionShape:
    """The spec's completion lengths (the default: half the cap, said)."""
    from tunepilot.spec.objective import lengths

    cap = lengths(spec).completion
    given = spec.objective.mean_completion_length
    mean = float(min(given, cap)) if given else cap / 2
    if mean >= cap * 0.999:
        return CompletionShape(cap, cap, math.inf, f"every completion runs to the {cap:,} cap")
    lo, hi = mean, 1e9 * cap  # mu (1 - exp(-cap / mu)) grows with mu from 0 to cap
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if mid * (1 - math.exp(-cap / mid)) < mean:
            lo = mid
        else:
            hi = mid
    scale = math.sqrt(lo * hi)
    said = (f"objective.mean_completion_length {given:,}" if given else
            f"no mean_completion_length: half the cap, {mean:,.0f} (the default shape)")
    return CompletionShape(mean, cap, scale, (
        f"completion lengths min(X, {cap:,}), X exponential of scale {scale:,.0f} tokens: mean "
        f"{mean:,.0f} ({said}), {math.exp(-cap / scale):.2%} reach the cap"))


@dataclass(frozen=True)
class Engines:
    """Where the step's completions are generated."""

    backend: str
    count: int  # engines
    cards_each: int  # tensor_parallel
    completions_each: float
    concurrent: float  # completions one engine holds at once (its KV cache)
    card: object  # the catalog card they run on
    how: str

    @property
    def cards(self) -> int:
        return self.count * self.cards_each


def weight_bytes(arch, spec) -> float:
    """The weights a generation engine holds, in the 16-bit dtype vLLM serves them in."""
    from tunepilot.model.arch import param_counts

    return 2.0 * param_counts(arch).total


def kv_bytes_per_token(arch) -> float:
    """K and V of one token over every layer, 16-bit: 2 x layers x KV heads x head dim x 2 B."""
    return 2.0 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2


def engines(spec, arch, card, count: int) -> Engines:
    """The engines of the spec's generation backend, ``count`` training cards of ``card``."""
    from tunepilot.spec.objective import generation_batch

    g = spec.objective.generation
    total = generation_batch(spec) * count
    if g.backend == "transformers":
        each = generation_batch(spec)
        return Engines("transformers", count, 1, each, each, card,
                       f"transformers' generate on each of {count} training rank(s), {each:,} "
                       "completions in one batch")
    tp = g.tensor_parallel
    n = max(1, (count if g.backend == "vllm-colocate" else g.server_devices) // tp)
    free = g.gpu_memory_utilization * card.capacity_bytes * tp - weight_bytes(arch, spec)
    per_seq = (spec.objective.max_prompt_length or 0) + completion_shape(spec).mean
    held = max(1.0, free / kv_bytes_per_token(arch) / max(per_seq, 1.0))
    where = ("on the training cards" if g.backend == "vllm-colocate"
             else f"on {g.server_devices} server card(s) of their own")
    return Engines(g.backend, n, tp, total / n, held, card, (
        f"{n} vLLM engine(s) of {tp} card(s) {where}, {total / n:,.0f} completions each; its KV "
        f"cache ({g.gpu_memory_utilization:g} x {card.capacity_bytes / 1e9:,.0f} GB x {tp} - "
        f"{weight_bytes(arch, spec) / 1e9:,.1f} GB of weights) holds {held:,.0f} at once"))


@dataclass(frozen=True)
class Generation:
    seconds: float
    prefill_s: float
    decode_s: float
    longest: float
    iterations: float  # decode steps an engine runs (the queue's, then the longest's)
    overhead_s: float  # the engine's fixed work per decode step
    how: str


def generation(spec, arch, eng: Engines, shape: CompletionShape, forward_mfu: float
               ) -> Generation:
    """Seconds of one generation batch on ``eng`` (every engine in parallel, the step waiting
    for the longest completion of all)."""
    from tunepilot.cost.launch import forward_kernels
    from tunepilot.cost.step_model import step_model
    from tunepilot.model.arch import param_counts

    d, card = step_model().decode, eng.card
    tp, prompt = eng.cards_each, float(spec.objective.max_prompt_length or 0)
    peak = card.peak_flops("bf16") * tp
    active = param_counts(arch).active_per_token
    kv = kv_bytes_per_token(arch)
    hbm = card.hbm_bandwidth_bytes_per_s * tp * d.hbm_fraction
    weights = weight_bytes(arch, spec)
    eager = eng.backend == "transformers"
    if eager:  # the host dispatches each op in turn; the device runs them as they come
        host = forward_kernels(arch, spec) * d.eager_op_host_s
        overhead = 0.0
        said = (f"at least the host's {forward_kernels(arch, spec):,} eager ops x "
                f"{d.eager_op_host_s * 1e6:.3g} us ({d.eager_kind}): {host * 1e3:.3g} ms a step")
    else:
        host = 0.0
        overhead = (d.engine_step_s or 0.0) + (2 * arch.num_layers * (d.tp_allreduce_s or 0.0)
                                               if tp > 1 else 0.0)
        said = f"+ the engine's {overhead * 1e3:.3g} ms per step ({d.engine_kind})"

    def step(b: float, context: float) -> float:
        mem = (weights + b * context * kv) / hbm
        flops = 2.0 * active * b / (peak * forward_mfu)
        return max(mem, flops, host) + overhead

    n, held = eng.completions_each, min(eng.concurrent, eng.completions_each)
    longest = shape.longest(n * eng.count)  # the step waits for the longest of all
    bulk_steps = 0.0
    if eng.backend == "transformers":  # no continuous batching: every row to the longest
        decode = _integral(lambda t: step(n, prompt + t), longest)
        bulk = 0.0
    else:
        bulk_steps = max(0.0, n - held) * shape.mean / held  # the queue, at a full cache
        bulk = bulk_steps * step(held, prompt + shape.mean)
        decode = bulk + _integral(lambda t: step(held * shape.survival(t), prompt + t), longest)
    unique = n if eng.backend == "transformers" else n / spec.objective.generations
    prefill = 2.0 * active * unique * prompt / (peak * forward_mfu)
    return Generation(prefill + decode, prefill, decode, longest, bulk_steps + longest,
                      overhead, (
        f"{eng.how}; {shape.how}; the longest of {n * eng.count:,.0f} runs {longest:,.0f} "
        f"decode steps, each the longer of reading {weights / tp / 1e9:,.2f} GB of weights + "
        f"the KV cache ({kv / 1e3:,.0f} kB/token) per card at {d.hbm_fraction:g} x "
        f"{card.hbm_bandwidth_tbps:g} TB/s and the matmuls at MFU {forward_mfu:.2f}, {said}: "
        f"{decode:,.1f} s" + (f" ({bulk:,.1f} s of it with the KV cache full and completions "
                               "queued)" if bulk else "")
        + f"; prefill {prefill:,.2f} s"))


def _integral(f, end: float) -> float:
    """Sum of f over the decode steps 0 .. end (midpoint rule on GRID pieces)."""
    if end <= 0:
        return 0.0
    width = end / GRID
    return sum(f((i + 0.5) * width) for i in range(GRID)) * width
