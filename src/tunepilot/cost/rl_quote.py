"""An RL objective's quote: the throughput and the training term from its step, phase by phase
(cost/rl_step.py), when no pilot measured this run on this card (a measurement wins)."""

from __future__ import annotations

from tunepilot.catalog import Card
from tunepilot.cost.context import QuoteContext
from tunepilot.cost.measurements import measured_value
from tunepilot.cost.rl_step import RLStep, rl_step
from tunepilot.results.figure import Figure
from tunepilot.results.quote import TimeTerm


def rl_of(ctx: QuoteContext, card: Card, count: int, strategy: str) -> RLStep | None:
    """The RL step of the spec on ``count`` x ``card`` at the global-batch rule, or None: not a
    generative objective, or a pilot measured its throughput on this card."""
    spec = ctx.spec
    if not spec.objective.generative:
        return None
    pilot = ctx.run.pilot if ctx.run else None
    if pilot and ctx.run.card_id == card.id and \
            measured_value(pilot.throughput.useful_tokens_per_s):
        return None
    return rl_step(spec_on(spec, count), ctx.arch, card, count, strategy)


def spec_on(spec, count: int):
    """The spec at ``count`` training ranks, its global batch (and generation batch) held."""
    if count == spec.parallel.world_size:
        return spec
    b = spec.batch.on(count, exact=False)
    o = spec.objective.model_dump(mode="python")
    if o.get("steps_per_generation"):
        total = spec.micro_batch_size * o["steps_per_generation"] * spec.parallel.world_size
        o["steps_per_generation"] = max(1, round(total / (b.micro_batch_size * count)))
    per_node = min(count, 8)
    parallel = dict(spec.parallel.model_dump(mode="python"), devices=per_node,
                    nodes=max(1, -(-count // per_node)),
                    strategy="single" if count == 1 else spec.parallel.strategy
                    if spec.parallel.strategy != "single" else "ddp")
    return spec.with_changes(micro_batch_size=b.micro_batch_size,
                             gradient_accumulation_steps=b.accumulation, objective=o,
                             parallel=parallel)


def rl_throughput(rl: RLStep, count: int) -> tuple[Figure, Figure, Figure]:
    """(per card, efficiency, total) useful tokens/s of the RL step on ``count`` cards."""
    total = rl.useful_tokens / rl.step.value
    how = (f"{rl.useful_tokens:,.0f} completion tokens per generation batch / the RL step's "
           f"{rl.step.value:,.1f} s ({rl.layout}; cost/rl_step.py)")
    return (Figure.projected(total / count, "tokens/s", how + f" / {count} training card(s)"),
            rl.training_efficiency, Figure.projected(total, "tokens/s", how))


def rl_phases(term: TimeTerm, rl: RLStep, optimizer_steps: int) -> TimeTerm:
    """The training term with the RL step's phases as its parts, over the job's generation
    batches (optimizer steps / the steps one batch feeds)."""
    batches = max(1, round(optimizer_steps / rl.optimizer_steps))
    scale = term.total.value / max(rl.step.value * batches, 1e-12)  # the parts add to the term
    parts = []
    for name, each in rl.phases.items():
        total = each.value * batches * scale
        parts.append(TimeTerm(name=name, times=batches, each=each, total=Figure.projected(
            total, "s", f"{batches:,} generation batch(es) x {each.value:,.2f} s"
            + (" (overlapped with the training side)" if name == "generation" and total and
               "overlap" in rl.step.how else ""))))
    return term.model_copy(update={"parts": parts, "dominant": rl.dominant})


def rl_note(term: TimeTerm) -> str:
    share = {p.name: p.total.value for p in term.parts}
    whole = max(sum(share.values()), 1e-12)
    top = term.dominant or max(share, key=share.get)
    return (f"RL step: {top} dominates the training time ({share[top] / whole:.0%}): " +
            ", ".join(f"{p.name} {p.total.value / whole:.0%}" for p in term.parts
                      if p.total.value))


def generation_layout(spec) -> str | None:
    """vllm-colocate, vllm-server N (its cards), transformers; None when nothing generates."""
    o = spec.objective
    if not o.generative:
        return None
    g = o.generation
    if g.backend == "vllm-server":
        return f"vllm-server {g.server_devices}" + (
            f", {g.off_policy_steps} step off-policy" if g.off_policy_steps else "")
    return g.backend


def layout_variants(spec) -> list:
    """The spec and its other vLLM layout (colocated <-> a server of one engine's cards), for
    compare to rank together; a spec that does not generate with vLLM has no other."""
    o = spec.objective
    if not o.generative or o.generation.backend == "transformers":
        return [spec]
    g = o.generation.model_dump(mode="python")
    if g["backend"] == "vllm-colocate":
        other = dict(g, backend="vllm-server", server_devices=g["tensor_parallel"],
                     sleep_mode=False, off_policy_steps=0)
    else:
        other = dict(g, backend="vllm-colocate", server_devices=1, off_policy_steps=0)
    obj = dict(o.model_dump(mode="python"), generation=other)
    return [spec, spec.with_changes(objective=obj)]


def colocated_count_refused(spec, count: int) -> str | None:
    """Why colocated engines cannot run on ``count`` training cards (None: they can)."""
    g = spec.objective.generation if spec.objective.generative else None
    if g is None or g.backend != "vllm-colocate" or count % g.tensor_parallel == 0:
        return None
    return (f"colocated vLLM engines of tensor_parallel {g.tensor_parallel} do not divide "
            f"{count} training card(s)")
