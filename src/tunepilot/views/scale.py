"""The scaling test as a person reads it: preflight, the batch arithmetic, one row per strategy,
each rank, and the recommendation. Prints (rich); the library functions never do."""

from __future__ import annotations

from rich.table import Table

from tunepilot.results.scale import NodeFacts, PreflightResult, ScalingResult, StrategyResult
from tunepilot.units import fmt_bytes, fmt_number, fmt_seconds
from tunepilot.views.common import console

MIB = 2**20


def _f(v, fmt: str = ",.0f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def gib(n) -> str:
    return fmt_bytes(n)


def render_scale(result: ScalingResult) -> None:
    """The scaling test: preflight, the batch arithmetic, one row per strategy, each rank."""
    pre = result.preflight
    node = pre.node
    col = pre.collective
    console.print(f"[bold]{result.label}[/bold]  scaling test on {node.kind.upper()}: "
                  f"{result.nproc} rank(s) per node x {result.nnodes} node(s) = "
                  f"{result.world_size} ranks, {result.warmup_steps} warm-up + "
                  f"{result.steps} measured steps each (every figure measured here)")
    _render_preflight(pre, node, col)
    console.print(f"global batch: {result.global_batch.arithmetic}")
    b = result.baseline
    console.print(f"baseline (1 rank, no wrapper): {fmt_number(b.useful_tokens_per_s)} useful "
                  f"tokens/s, step {fmt_seconds(b.step_time_s.median)} median, peak memory "
                  f"{gib(b.peak_memory_bytes_per_rank)}")
    if result.strategies:
        _render_strategies(result.strategies)
    for s, r in result.strategies.items():
        if r.status == "ok" and r.run:
            _render_ranks(s, r.run["per_rank"])
            nodes = r.run.get("host_peak_rss_bytes_per_node") or {}
            if nodes:
                console.print(f"{s}: host RAM per node (measured: the sum of its ranks' peak "
                              "RSS, an upper bound) " + ", ".join(
                                  f"{h} {gib(v)}" for h, v in nodes.items()))
    rec = result.recommendation
    console.print(f"[bold]recommendation: {rec.strategy or 'none'}[/bold] - {rec.reason}")
    for n in result.notes:
        console.print(f"note: {n}")
    if result.run_dir:
        console.print(f"written: {result.run_dir}/scale.json (per rank: "
                      f"{result.run_dir}/scale/<run>/rank<R>.json, logs in "
                      f"{result.run_dir}/logs/scale/)")


def _render_preflight(pre: PreflightResult, node: NodeFacts, col: dict) -> None:
    console.print("[bold]preflight[/bold]")
    dev = (", ".join(node.device_names) if node.device_names else
           f"CPU (usable cores {node.usable_cpus})")
    console.print(f"  devices: {dev}; collective: {col['library']} {col.get('version') or ''}"
                  f"; torch {node.torch_version}")
    if pre.threads_per_rank:
        console.print(f"  CPU threads per rank: {pre.threads_per_rank} (baseline too)")
    topo = pre.topology
    if topo.source == "none":
        console.print(f"  topology: {'; '.join(topo.notes)}")
    else:
        links = ", ".join(f"GPU{k.replace('-', '-GPU')} {v}" for k, v in topo.links.items())
        console.print(f"  topology ({topo.source}): {links or 'no pairs'}")
    t = Table(title="  ranks on this node", title_justify="left")
    for c in ("rank", "device", "NUMA node", "CPUs near the device", "may run on", "placement"):
        t.add_column(c)
    for r in pre.ranks:
        t.add_row(str(r.local_rank), r.device + (f" x{r.threads} threads" if r.threads else ""),
                  _f(r.numa_node, "d") if r.numa_node is not None else
                  ",".join(str(n) for n in r.may_run_on_numa_nodes) or "-",
                  r.near_cpus or "-", r.may_run_on_cpus, r.placement)
    console.print(t)
    bw = pre.bus_bandwidth
    if "rows" in bw:
        console.print(f"  bus bandwidth ({bw['backend']}, {bw['ranks']} ranks, median of "
                      f"{bw['iters']} calls, slowest rank): busbw = algbw x 2(n-1)/n for "
                      "all-reduce, x (n-1)/n for all-gather; GB/s = 10^9 bytes/s")
        t = Table()
        for c in ("op", "size", "time", "algbw GB/s", "busbw GB/s"):
            t.add_column(c, justify="left" if c == "op" else "right")
        for r in bw["rows"]:
            t.add_row(r["op"], fmt_bytes(r["size_bytes"]), fmt_seconds(r["time_s"]),
                      f"{r['algbw_gbps']:,.2f}", f"{r['busbw_gbps']:,.2f}")
        console.print(t)
    else:
        console.print(f"  bus bandwidth: {bw.get('unavailable')}")
    link = pre.link
    net = link.get("nccl_network") or bw.get("nccl_network")
    if net:
        console.print(f"  NCCL's network between nodes (its own report): {net['network']}"
                      + (f", provider {net['provider']}" if net.get("provider") else ""))
    if "fraction_of_fabric" in link:
        console.print(f"  fabric ({link['scope']}): {link['link']}; measured all-reduce busbw "
                      f"{link['measured_busbw_gbps']:,.1f} GB/s = "
                      f"{link['wire_gbps_per_card']:,.1f} GB/s per card on the wire, "
                      f"{link['fraction_of_fabric']:.0%} of its "
                      f"{link['fabric_gbps_per_card']:,.1f} GB/s per card "
                      f"({link['fraction_of_expected']:.0%} of what published runs reach; "
                      f"{link['rule']})")
    elif "fraction_of_link" in link:
        console.print(f"  link: {link['card']} {link['link']} "
                      f"{link['bandwidth_gbps_per_direction']:,.0f} GB/s per direction; measured "
                      f"all-reduce busbw is {link['fraction_of_link']:.0%} of it")
    else:
        console.print(f"  link: {link.get('unavailable', '-')}")
    for w in pre.warnings:
        console.print(f"  [yellow]warning[/yellow] [{w.code}] {w.message}")
    for n in pre.notes:
        console.print(f"  note: {n}")


def _render_strategies(strategies: dict[str, StrategyResult]) -> None:
    t = Table(title="Per strategy (same global batch, same data order as the baseline)",
              title_justify="left")
    cols = ("strategy", "ranks", "useful tok/s", "speed-up", "efficiency", "step median",
            "overhead/step", "peak mem/rank", "loss max diff", "data order", "ranks reported")
    for c in cols:
        t.add_column(c, justify="left" if c == "strategy" else "right")
    for s, r in strategies.items():
        if r.status != "ok":
            t.add_row(s, str(r.world_size), "-", "-", "-", "-", "-", "-", "-", "-", r.status)
            continue
        loss = f"{fmt_number(r.loss_max_abs_diff)} nats/token " + (
            "ok" if r.loss_agrees else "[red]DIFFERS[/red]")
        t.add_row(s, str(r.world_size), fmt_number(r.useful_tokens_per_s), f"{r.speedup:.2f}x",
                  f"{r.efficiency:.2f}", fmt_seconds(r.step_time_s_median),
                  f"{fmt_seconds(r.overhead_s_per_step)} ({r.overhead_fraction:.0%})",
                  gib(r.peak_memory_bytes_per_rank), loss,
                  "same" if r.data_order_same else "[red]differs[/red]",
                  f"{len(r.ranks_reported)}/{r.world_size}")
    console.print(t)
    console.print("efficiency = T_N / (N x T_1) on useful tokens/s; overhead/step = N-rank step - "
                  "baseline time for the same micro-batches (communication, waiting, sharding)")
    for s, r in strategies.items():
        if r.note:
            console.print(f"note ({s}): {r.note}")
        if r.status != "ok" and r.error:
            console.print(f"[red]{s} {r.status.replace('_', ' ')}[/red]: {r.error}")
            if r.log_tail:
                console.print(f"  last lines of its log ({r.log or 'the rank log'}):")
                console.print("\n".join("    " + ln for ln in r.log_tail.splitlines()),
                              markup=False, highlight=False)


def _render_ranks(strategy: str, per_rank: list[dict]) -> None:
    t = Table(title=f"{strategy}: each rank", title_justify="left")
    for c in ("rank", "host", "useful tok/s", "step median", "step min-max", "peak mem",
              "host RSS peak", "comm in flight/step", "comm exposed/step"):
        t.add_column(c, justify="left" if c in ("rank", "host") else "right")
    for p in per_rank:
        st = p["step_time_s"]
        t.add_row(str(p["rank"]), p["host"], fmt_number(p["useful_tokens_per_s"]),
                  fmt_seconds(st["median"]),
                  f"{fmt_seconds(st['min'])} - {fmt_seconds(st['max'])}",
                  gib(p["peak_memory_bytes"]), gib(p.get("host_peak_rss_bytes")),
                  _ms(p["comm_inflight_s_per_step"]), _ms(p["comm_exposed_s_per_step"]))
    console.print(t)


def _ms(v) -> str:
    return "n/a" if v is None else fmt_seconds(v)
