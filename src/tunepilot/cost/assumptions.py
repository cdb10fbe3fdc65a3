"""The cost model's assumptions (resources/cost_model.yaml): what a quote falls back on when no
stage measured a term. Every figure taken from here is marked projected and names its key."""

from __future__ import annotations

from functools import cache

from tunepilot.resources import COST_MODEL_YAML, read_yaml


@cache
def cost_model() -> dict:
    """The assumptions of ``resources/cost_model.yaml`` (each with source and as_of)."""
    return read_yaml(COST_MODEL_YAML)


def assumed(key: str) -> float:
    return float(cost_model()[key]["value"])


def _next_key(table: dict, n: int) -> float:
    """The value at the smallest key >= n (``beyond`` past the largest)."""
    keys = sorted(int(k) for k in table if k != "beyond")
    for k in keys:
        if n <= k:
            return float(table[k])
    return float(table["beyond"])


def gpus_per_node() -> int:
    return int(cost_model()["scaling_efficiency_by_nodes"]["gpus_per_node"])


def efficiency_assumed(strategy: str, count: int, nodes: int | None = None,
                       tokens_per_replica_step: float | None = None,
                       peak_tflops: float | None = None) -> float:
    """Scaling efficiency of ``count`` cards under ``strategy`` when nothing measured it: the
    within-node table (scaling_efficiency_assumed) at min(count, gpus_per_node), times, past one
    node, the node-count table (scaling_efficiency_by_nodes) of the column the tokens one model
    replica processes per optimizer step select (``None``: the amortised column), counted in
    H100-equivalent tokens for a card of ``peak_tflops`` dense BF16."""
    return efficiency_parts(strategy, count, nodes, tokens_per_replica_step, peak_tflops)[0]


def efficiency_parts(strategy: str, count: int, nodes: int | None = None,
                     tokens_per_replica_step: float | None = None,
                     peak_tflops: float | None = None) -> tuple[float, str]:
    """(efficiency, how it was read) - see efficiency_assumed."""
    if count <= 1 or strategy == "single":
        return 1.0, "one card"
    cm = cost_model()
    per_node = gpus_per_node()
    within = _next_key(cm["scaling_efficiency_assumed"]["fsdp" if strategy == "fsdp" else "ddp"],
                       min(count, per_node))
    nodes = nodes if nodes is not None else -(-count // per_node)
    if nodes <= 1:
        return within, f"{strategy} within one node at {count} cards {within:g} (assumed)"
    by = cm["scaling_efficiency_by_nodes"]
    tokens = tokens_per_replica_step
    if tokens is not None and peak_tflops:
        tokens = tokens * by["reference_peak_tflops"] / peak_tflops
    column = ("amortised" if tokens is None or tokens >= by["amortised_from_tokens"]
              else "latency_bound")
    across = _next_key(by[column], nodes)
    return within * across, (
        f"{strategy} within a node {within:g} (assumed) x {nodes} nodes {across:g} (published, "
        f"{column.replace('_', '-')}: " + (f"{tokens:,.0f}" if tokens else "unknown")
        + " H100-equivalent tokens per replica per step; cost_model.yaml "
        "scaling_efficiency_by_nodes)")
