"""The objective's phases on the analytic plan's timeline (plan/analytic/core.py calls these).

    generation         GRPO/RLOO/PPO: the model states and, with transformers' generate, the KV
                       cache of the generation batch at prompt + completion (2 x layers x KV
                       heads x head_dim x compute bytes per token) and the decode step's
                       transient - or the prompt prefill's, whichever is larger. vLLM keeps its
                       weights and KV cache in its own reserve (colocated: gpu_memory_utilization
                       x the card's memory, outside PyTorch's allocator; computed per card in the
                       fit table by vllm_reserve_bytes) or on its own cards (server)
    reference-forward  a forward without gradient: the DPO family's after the policy's forward
                       (the policy's saved activations and kept log-probs alive), GRPO's before
                       the update (nothing saved alive); old-logprobs (num_iterations > 1) and
                       reward-model (PPO, reward_model) forwards are the same size
    a frozen copy      reference copy / reward_model copy: a second model in the compute dtype
                       among the weights of every phase
Pure arithmetic, no torch.
"""

from __future__ import annotations

from tunepilot.model.arch import Arch
from tunepilot.plan.analytic.activations import no_grad_layer_bytes
from tunepilot.results.plan import Phase
from tunepilot.spec import RunSpec
from tunepilot.spec.objective import generation_batch, lengths


def frozen_copies_bytes(spec: RunSpec, total_params: int) -> int:
    """Weights of the frozen models beside the policy: a reference copy and a reward-model copy,
    each in the compute dtype (as TRL and axolotl load them: bf16 unless the run is fp32)."""
    o = spec.objective
    n = int(o.reference_kind(spec.method.kind) == "copy") + int(o.reward_model == "copy")
    return n * total_params * spec.precision.frozen_copy.compute_bytes


def kv_cache_bytes(arch: Arch, spec: RunSpec, tokens_per_row: int, rows: int) -> int:
    """transformers' KV cache: keys and values of every layer, in the compute dtype."""
    cb = spec.precision.compute_bytes
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * cb * tokens_per_row * rows


def generation_phase(spec: RunSpec, arch: Arch, states: tuple[int, int, int], cb: int,
                     unsharded: int = 0) -> Phase:
    """The training process during generation: (weights, master weights, optimizer state) and,
    with transformers' generate, the KV cache and the larger of the prefill's and the last
    decode step's transient (one layer's K/V copy as the cache grows, the logits of the last
    position with their fp32 softmax)."""
    weights, master, optim = states
    if spec.objective.generation.backend != "transformers":
        return Phase.make("generation", weights, master, 0, optim, 0, unsharded)
    ln, g = lengths(spec), generation_batch(spec)
    full = kv_cache_bytes(arch, spec, ln.sequence, g)
    prompt = kv_cache_bytes(arch, spec, ln.prompt, g)
    decode = full // max(arch.num_layers, 1) + g * arch.vocab_size * (cb + 8)
    prefill = prompt + no_grad_layer_bytes(arch, cb, g * ln.prompt)
    temp = max(full + decode, prefill)
    return Phase.make("generation", weights, master, 0, optim, 0, temp + unsharded)


def no_grad_forward_bytes(spec: RunSpec, arch: Arch, cb: int, tokens: int,
                          logprob_reference: int) -> int:
    """A forward without gradient of one micro-batch: a layer's working set, or the log-probs'
    (logits + one row's fp32 upcast and log-softmax), whichever is larger."""
    return max(no_grad_layer_bytes(arch, cb, tokens), logprob_reference)


def objective_phases(spec: RunSpec, arch: Arch, phases: list[Phase], *, states: tuple,
                     saved_and_kept: int, no_grad: int, cb: int, unsharded: int,
                     buckets: int) -> list[Phase]:
    """The SFT-shaped timeline with the objective's phases: pairs get a reference-forward
    after the policy's forward; generation gets generation, reference-forward, old-logprobs
    and reward-model phases before the policy update (and no validation pass)."""
    o = spec.objective
    weights, master, acc_grads, optim = states
    if o.kind == "sft" or spec.model.task != "causal-lm":
        return phases
    if not o.generative:
        if o.reference_kind(spec.method.kind) in ("none", "precomputed"):
            return phases
        ref = Phase.make("reference-forward", weights, master, acc_grads, optim,
                         saved_and_kept, no_grad + unsharded, buckets)
        return phases[:1] + [ref] + phases[1:]
    before = [generation_phase(spec, arch, (weights, master, optim), cb, unsharded)]
    for name, needed in (("reference-forward", o.needs_reference),
                         ("old-logprobs", o.num_iterations > 1),
                         ("reward-model", o.reward_model != "none" or o.kind == "ppo")):
        if needed:
            before.append(Phase.make(name, weights, master, 0, optim, 0, no_grad + unsharded,
                                     buckets))
    return before + [p for p in phases if p.name != "validation"]


def vllm_reserve_bytes(spec: RunSpec, capacity_bytes: int) -> int:
    """vLLM colocated: the share of the card it takes (gpu_memory_utilization x the card's
    memory: its weights, KV cache and activations), outside PyTorch's allocator - COMPUTED
    (vLLM's allocator does not run on a CPU). 0 for every other backend."""
    g = spec.objective.generation
    if not spec.objective.generative or g.backend != "vllm-colocate":
        return 0
    return int(g.gpu_memory_utilization * capacity_bytes)


def vllm_weights_bytes(arch_total_params: int) -> int:
    """vLLM's own copy of the weights (bf16; TRL loads LoRA merged into it)."""
    return 2 * arch_total_params


def card_device_peak(plan, spec: RunSpec, capacity_bytes: int) -> tuple[int, str]:
    """(the device peak on a card of ``capacity_bytes``, the phase that sets it). A colocated
    vLLM holds its reserve all along - so every phase carries it - unless sleep_mode frees it
    while training runs: then only the generation phase does."""
    pd = plan.per_device
    reserve = vllm_reserve_bytes(spec, capacity_bytes)
    if not reserve:
        return pd.device_peak_bytes, plan.peak_phase
    g = spec.objective.generation
    what = f"vLLM's colocated reserve ({g.gpu_memory_utilization:g} x the card)"
    if not g.sleep_mode:
        return pd.device_peak_bytes + reserve, f"{plan.peak_phase} + {what}, which vLLM " \
                                               "holds through every phase, generation included"
    gen = plan.phase("generation")
    gen_device = device_bytes(gen.total_bytes, pd) + reserve
    if gen_device > pd.device_peak_bytes:
        return gen_device, f"generation + {what} (sleep_mode frees it while training runs)"
    return pd.device_peak_bytes, f"{plan.peak_phase} (vLLM asleep: its reserve is freed)"


def device_bytes(allocated: int, per_device) -> int:
    """A phase's allocated bytes at the device level: the allocator's reserve and the runtime
    (the plan's own ratio of reserved to allocated, and its runtime overhead)."""
    ratio = per_device.reserved_peak_bytes / max(per_device.allocated_peak_bytes, 1)
    return int(allocated * ratio) + per_device.runtime_overhead_bytes


def objective_notes(spec: RunSpec, arch: Arch) -> list[str]:
    """What the plan assumes of the objective (the plan's assumptions)."""
    o = spec.objective
    if o.kind == "sft":
        return []
    ln = lengths(spec)
    ref = o.reference_kind(spec.method.kind)
    ref_what = {"adapters-off": "the base with the LoRA adapters disabled (no extra weights)",
                "copy": "a frozen copy of the model in the compute dtype",
                "precomputed": "log-probs precomputed before training (no reference forward)",
                "none": "none"}[ref]
    out = [f"objective {o.kind}: reference {ref_what}"]
    if spec.model.task == "causal-lm":
        out.append("log-probs as TRL's selective_log_softmax takes them from the logits "
                   "(row by row; under autocast each row's log-softmax is kept in fp32)"
                   + ("; chunked_loss: per chunk, as TRL 1.x's fused LM head" if
                      spec.loss_is_chunked else "; TRL >= 1.0's fused LM head never holds "
                      "the logits: set chunked_loss: true to plan it"))
    if o.paired:
        out.append(f"pairs: chosen and rejected ({ln.sequence:,} tokens each, the "
                   f"{ln.prompt:,}-token prompt not trained) through the policy as "
                   f"{2 * spec.micro_batch_size} rows"
                   + (" in one forward (TRL's concatenated_forward)" if o.concatenate_pairs
                      else " in two forwards, both graphs alive until the loss"))
    if o.generative:
        g = o.generation
        if g.backend == "transformers":
            kv = kv_cache_bytes(arch, spec, ln.sequence, generation_batch(spec))
            out.append(f"generation: transformers' generate, KV cache of "
                       f"{generation_batch(spec):,} completions x {ln.sequence:,} tokens = "
                       f"{kv / 2**30:,.2f} GiB at its largest")
        elif g.backend == "vllm-colocate":
            out.append(f"generation: vLLM colocated, its reserve = {g.gpu_memory_utilization:g}"
                       " x each card's memory (fit table), COMPUTED - vLLM's allocator does "
                       "not run on a CPU" + ("; sleep mode frees it while training runs"
                                             if g.sleep_mode else ""))
        else:
            out.append(f"generation: a vLLM server on {g.server_devices} card(s) of its own "
                       "(not on this card; counted in the quote's cards)")
        out.append(f"the policy's logits only over the {ln.completion:,} completion tokens "
                   "(TRL's logits_to_keep)")
    return out


def generation_room_problem(spec: RunSpec, plan, row, headroom: float) -> str | None:
    """Why a colocated vLLM's share of the chosen card leaves no room (None when it does not
    matter or fits): too little for vLLM's own weights, or too much for the training step."""
    from tunepilot.units import fmt_bytes

    reserve = row.generation_reserve_bytes
    if not reserve:
        return None
    g = spec.objective.generation
    cap = row.capacity_bytes
    what = f"{g.gpu_memory_utilization:g}"
    weights = vllm_weights_bytes(plan.params.total - plan.params.trainable)
    if reserve < weights * VLLM_MIN_WEIGHTS_SHARE:
        need = weights * VLLM_MIN_WEIGHTS_SHARE / cap
        return (f"{what} of {row.card} gives vLLM {fmt_bytes(reserve)}, not enough for its "
                f"copy of the weights ({fmt_bytes(weights)} in bf16) and a KV cache: vLLM "
                f"would not start; raise it to at least {need:.2f}, or use backend: "
                "vllm-server")
    usable = int(cap * (1 - headroom))
    training = plan.per_device.device_peak_bytes
    if row.fits or training > usable:
        return None
    most = (usable - training) / cap
    fix = (f"lower it to at most {most:.2f} (vLLM needs {fmt_bytes(weights)} of it for its "
           "weights, the rest is its KV cache)" if most * cap > weights * VLLM_MIN_WEIGHTS_SHARE
           else "the card cannot hold both: use a larger card")
    return (f"{what} of {row.card} is {fmt_bytes(reserve)} reserved for vLLM, leaving "
            f"{fmt_bytes(usable - reserve)} (with {headroom:.0%} headroom) where the training "
            f"step needs {fmt_bytes(training)} (device peak); {fix}, turn on "
            "generation.sleep_mode, or generate on a vLLM server (backend: vllm-server)")


VLLM_MIN_WEIGHTS_SHARE = 1.1
"""vLLM refuses to start when its share leaves no KV-cache blocks after its weights; 10% above
the weights is the least this plan accepts (an assumption, said in the message)"""


def check_generation_room(spec: RunSpec, plan, headroom: float) -> None:
    """On the cards the user chose (plan --card, quote --card): a UserError naming
    gpu_memory_utilization when a colocated vLLM leaves no room."""
    from tunepilot.errors import UserError

    for row in plan.cards:
        problem = generation_room_problem(spec, plan, row, headroom)
        if problem:
            raise UserError("objective.generation.gpu_memory_utilization", problem + ".")
