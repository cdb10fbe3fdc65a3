"""The step of an RL objective (GRPO / RLOO / PPO), phase by phase, for the quote: one
generation batch (micro_batch_size x steps_per_generation completions per training rank) is

    generation    prefill + decode on the engines (cost/rollout.py), waiting for the longest
    weight sync   the policy's new weights to the engines: colocated, each card's engine share
                  at the achieved refit rate; a server, the whole model broadcast over the
                  fabric; transformers' generate uses the training weights (none); vLLM's sleep
                  mode adds the engine's weights leaving and re-entering the card (host link)
    log-probs     forward passes without gradient over every sequence at its real length: the
                  old policy's (when one batch feeds several optimizer steps or iterations) and
                  the reference's (beta > 0)
    reward        a reward model's forward (reward_model adapter/copy, PPO); a reward function
                  runs on the host and is not counted
    policy update the training pass over the sequences (x num_iterations), at the cell's MFU and
                  the scaling efficiency of the training cards; PPO's value model trains too
A sequence's real length is its prompt + its completion: packed (data.packing), the mean; padded
(the default), each micro-batch to its longest completion. On-policy the phases run in turn;
with generation.off_policy_steps >= 1 (a server) generation overlaps the log-probs, reward and
update of the previous batch: the step takes the longer of the two, plus the weight sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.cost.rollout import completion_shape, engines, generation, weight_bytes
from tunepilot.results.figure import Figure

PHASES = ("generation", "weight sync", "log-probs", "reward", "policy update")


@dataclass(frozen=True)
class RLStep:
    """One generation batch's time, phase by phase (seconds, projected)."""

    phases: dict[str, Figure]
    step: Figure
    optimizer_steps: float  # optimizer steps the batch feeds
    completions: float  # completions in the batch, over every rank
    useful_tokens: float  # their completion tokens (the loss trains them)
    dominant: str
    layout: str
    training_efficiency: Figure
    training_positions_per_s: Figure  # one card's training-pass rate (validation passes use it)

    @property
    def per_optimizer_step_s(self) -> float:
        return self.step.value / self.optimizer_steps

    def dominant_note(self) -> str:
        share = self.phases[self.dominant].value / max(self.step.value, 1e-12)
        return (f"the RL step is {self.step.value:,.1f} s per generation batch ({self.layout}); "
                f"{self.dominant} dominates ({share:.0%}): " + ", ".join(
                    f"{k} {v.value:,.1f} s" for k, v in self.phases.items() if v.value))


def _positions(spec, shape, micro: int) -> tuple[float, str]:
    """Token positions per sequence the training-side passes process."""
    prompt = float(spec.objective.max_prompt_length or 0)
    if spec.data.packing:
        return prompt + shape.mean, f"packed: prompt {prompt:,.0f} + mean completion {shape.mean:,.0f}"
    longest = shape.longest(micro)
    return prompt + longest, (f"padded to each micro-batch's longest: prompt {prompt:,.0f} + the "
                              f"longest of {micro} completions {longest:,.0f}")


def _passes(spec, steps_per_batch: float) -> tuple[list[str], list[str]]:
    """(the no-gradient log-prob passes, the reward forwards) the objective runs."""
    o = spec.objective
    logprobs = []
    if steps_per_batch > 1 or o.num_iterations > 1:
        logprobs.append("old policy")
    if o.needs_reference and o.reference_kind(spec.method.kind) != "precomputed":
        logprobs.append("reference")
    reward = ["reward model"] if o.reward_model != "none" or o.kind == "ppo" else []
    if o.kind == "ppo":
        reward.append("value model")
    return logprobs, reward


def rl_step(spec, arch, card, count: int, strategy: str, layout: dict | None = None
            ) -> RLStep:
    """The RL step of ``spec`` on ``count`` training cards of ``card`` (+ a server's cards).
    ``layout``: the training side's tensor / pipeline / context parallel degrees (a published
    run's; a spec's own parallel fields otherwise): its rank's width and the model-parallel
    cells set the training passes' MFU; generation runs on the engines' own layout."""
    from tunepilot.cost.assumptions import efficiency_parts
    from tunepilot.cost.mfu import mfu_for
    from tunepilot.cost.step_model import step_model
    from tunepilot.cost.throughput_model import throughput_model
    from tunepilot.model.flops import flops_per_token
    from tunepilot.spec.objective import generation_batch

    o, sm = spec.objective, step_model()
    shape = completion_shape(spec)
    completions = float(generation_batch(spec) * count)
    per_seq, pos_how = _positions(spec, shape, spec.micro_batch_size)
    steps_per_batch = (o.steps_per_generation or spec.gradient_accumulation_steps) \
        * o.num_iterations / spec.gradient_accumulation_steps
    mfu = mfu_for(spec, card, arch, layout=layout).value
    ac = throughput_model().checkpointing.get(spec.activation_checkpointing)
    fwd_mfu = min(mfu / (ac.factor if ac else 1.0), throughput_model().mfu_ceiling)
    gen_mfu = min(mfu_for(spec, card, arch).value / (ac.factor if ac else 1.0),
                  throughput_model().mfu_ceiling)
    peak = card.peak_flops(spec.precision.peak_key)
    f = flops_per_token(arch, spec, per_seq)
    train_flops, fwd_flops = f.train - f.extra_passes, f.forward
    positions = completions * per_seq
    per_replica = spec.micro_batch_size * spec.gradient_accumulation_steps * per_seq
    eff, eff_how = efficiency_parts(strategy, count, None, per_replica,
                                    card.peak_flops("bf16") / 1e12)
    rate = count * eff * peak  # FLOP/s of the training cards at their scaling efficiency

    eng = engines(spec, arch, card, count)
    gen = generation(spec, arch, eng, shape, gen_mfu)
    phases: dict[str, Figure] = {"generation": Figure.projected(gen.seconds, "s", gen.how)}
    phases["weight sync"] = _sync(spec, arch, eng, sm)
    logprobs, reward = _passes(spec, steps_per_batch)
    fwd_floor = _forward_floor(arch, spec, completions / count)
    lp_s = len(logprobs) * max(positions * fwd_flops / (rate * fwd_mfu), fwd_floor)
    phases["log-probs"] = Figure.projected(lp_s, "s", (
        f"{' + '.join(logprobs)} forward(s) over {completions:,.0f} sequences x {per_seq:,.0f} "
        f"positions ({pos_how}) x {fwd_flops:,.0f} FLOP/position at forward MFU {fwd_mfu:.2f}"
        f" on {count} card(s) x efficiency {eff:.2f}") if logprobs else "none: one optimizer "
        "step per batch and no reference (beta 0)")
    critic = 1.0 if o.kind == "ppo" else 0.0
    rw_s = len(reward) * max(positions * fwd_flops / (rate * fwd_mfu), fwd_floor)
    phases["reward"] = Figure.projected(rw_s, "s", (
        f"{' + '.join(reward)} forward(s) of the policy's size over the sequences"
        if reward else "a reward function on the host: not counted"))
    upd = (1 + critic) * max(positions * o.num_iterations * train_flops / (rate * mfu),
                             steps_per_batch * _update_floor(arch, spec))
    phases["policy update"] = Figure.projected(upd, "s", (
        f"{completions:,.0f} sequences x {per_seq:,.0f} positions x {o.num_iterations} "
        f"iteration(s) x {train_flops:,.0f} training FLOP/position" +
        (" (+ the value model's update)" if critic else "") +
        f" at MFU {mfu:.3g} on {count} x {card.id} x efficiency {eff:.3g} ({eff_how})"))
    train_side = lp_s + rw_s + upd
    if o.generation.off_policy_steps:
        total = max(gen.seconds, train_side) + phases["weight sync"].value
        layout = (f"generation {o.generation.off_policy_steps} step(s) off-policy on "
                  f"{eng.cards} server card(s), overlapping the training side")
        how = (f"max(generation {gen.seconds:,.1f} s, log-probs + reward + update "
               f"{train_side:,.1f} s) + weight sync: generation overlaps training")
    else:
        total = sum(p.value for p in phases.values())
        layout = {"vllm-colocate": f"vLLM colocated on the {count} training card(s)",
                  "vllm-server": f"a vLLM server on {eng.cards} card(s) of its own",
                  "transformers": "transformers' generate on the training ranks"}[eng.backend]
        how = "the phases in turn (on-policy): " + " + ".join(PHASES)
    dominant = max(phases, key=lambda k: phases[k].value)
    return RLStep(phases, Figure.projected(total, "s", how), steps_per_batch, completions,
                  completions * shape.mean, dominant, layout,
                  Figure.projected(eff, "fraction", f"the training side on {count} cards: "
                                   f"{eff_how}"),
                  Figure.projected(mfu * peak / train_flops, "tokens/s", f"MFU {mfu:.3g} x "
                                   f"{peak / 1e12:g} TFLOP/s / {train_flops:,.0f} FLOP/position"))


def _forward_floor(arch, spec, sequences_per_rank: float) -> float:
    """The launch floor of one no-gradient pass over a rank's sequences (cost/launch.py)."""
    from tunepilot.cost.launch import forward_kernels
    from tunepilot.cost.step_model import step_model

    micro = max(1.0, sequences_per_rank / spec.micro_batch_size)
    return micro * forward_kernels(arch, spec) * step_model().launch.per_launch_s


def _update_floor(arch, spec) -> float:
    """The launch floor of one optimizer step (cost/launch.py)."""
    import math

    from tunepilot.cost.launch import step_floor
    from tunepilot.model.flops import trainable_shapes

    shapes = trainable_shapes(arch, spec)
    return step_floor(arch, spec, spec.gradient_accumulation_steps, len(shapes),
                      sum(math.prod(x) for x in shapes)).seconds


def _sync(spec, arch, eng, sm) -> Figure:
    """The weight sync of one step (and vLLM's sleep/wake when colocated with sleep_mode)."""
    from tunepilot.cost.host_link import host_link_bytes_per_s

    ws, w = sm.weight_sync, weight_bytes(arch, spec)
    if eng.backend == "transformers":
        return Figure.projected(0.0, "s", "transformers' generate uses the training weights")
    if eng.backend == "vllm-server":
        s = w / (ws.server_gb_per_s * 1e9)
        return Figure.projected(s, "s", f"{w / 1e9:,.1f} GB broadcast to the server at "
                                f"{ws.server_gb_per_s:g} GB/s ({ws.server_kind}: NCCL refit)")
    per_card = w / eng.cards_each
    s = per_card / (ws.colocated_gb_per_s * 1e9)
    how = (f"{per_card / 1e9:,.1f} GB per card handed to its colocated engine at "
           f"{ws.colocated_gb_per_s:g} GB/s ({ws.colocated_kind}, resources/step_model.yaml)")
    if spec.objective.generation.sleep_mode:
        link = host_link_bytes_per_s(eng.card)
        s += 2 * per_card / link
        how += (f" + sleep/wake: the engine's {per_card / 1e9:,.1f} GB per card out and back "
                f"over the host link at {link / 1e9:,.0f} GB/s")
    return Figure.projected(s, "s", how)
