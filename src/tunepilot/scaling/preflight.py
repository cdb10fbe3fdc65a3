"""Preflight of the scaling test: everything that can be known before a training step runs.

1. Ranks vs devices. On a GPU node, --nproc (ranks per node) must not exceed the visible
   devices: refused before anything is launched. On the CPU a "device" is an equal share of
   the cores this process may use (os.sched_getaffinity): N ranks are allowed while
   N <= usable cores, each rank (and the 1-rank baseline, so it is one such device) getting
   cores // N threads. More ranks than cores would measure contention between ranks, not
   scaling, and is refused.
2. Topology: `nvidia-smi topo -m` or `rocm-smi --showtopo` (tunepilot.scaling.topology), P2P
   access between each pair (torch.cuda.can_device_access_peer), and per rank the NUMA node and
   CPUs next to its device (sysfs of its PCI address, else the tool's affinity columns) against
   the CPUs the rank may run on (inherited from this process).
3. The collective library: NCCL (torch.cuda.nccl.version()), RCCL on ROCm, gloo on the CPU.
4. A bus-bandwidth micro-benchmark (tunepilot.scaling.bench) in a real torchrun launch, compared
   with the catalog's link bandwidth when the card is known.
Each finding that will hurt the run becomes a warning with its reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tunepilot.errors import UserError
from tunepilot.results.scale import PreflightResult
from tunepilot.scaling.topology import (
    Topology,
    format_cpulist,
    link_info,
    no_topology,
    parse_cpulist,
    parse_nvidia_smi_topo,
    parse_rocm_smi_topo,
)

BUSBW_LOW_FRACTION = 0.5
"""Warn when the largest message's all-reduce busbw is under this share of the link's
per-direction bandwidth. A chosen threshold, not a datasheet figure: at 64 MiB messages a
collective is bandwidth-bound, and one that gets under half of its link is taking a slower path
(PCIe, P2P off, a NCCL setting) - calibrate it against your own nccl-tests runs."""
SMI_TIMEOUT_S = 20
COLLECTIVES = {"cuda": "nccl", "rocm": "rccl", "cpu": "gloo"}  # library per device kind
BACKENDS = {"cuda": "nccl", "rocm": "nccl", "cpu": "gloo"}  # torch backend name (RCCL = "nccl")


@dataclass
class NodeProbe:
    """What this node offers the ranks of the scaling test."""

    kind: str
    """What the ranks run on: 'cuda', 'rocm' or 'cpu'."""
    device_count: int
    """Accelerators visible to this process (CUDA_VISIBLE_DEVICES applies); 0 on the CPU."""
    device_names: list[str] = field(default_factory=list)
    card_id: str | None = None
    usable_cpus: list[int] = field(default_factory=list)
    numa_cpus: dict[int, list[int]] = field(default_factory=dict)
    """NUMA node -> its CPUs (/sys/devices/system/node)."""
    device_pci: list[str | None] = field(default_factory=list)
    device_numa: list[int | None] = field(default_factory=list)
    device_local_cpus: list[list[int]] = field(default_factory=list)
    topo_index: list[int | None] = field(default_factory=list)
    """torch device i -> its index in nvidia-smi's topology (matched by PCI address: CUDA
    numbers devices fastest-first and CUDA_VISIBLE_DEVICES renumbers them)."""
    p2p: dict[str, bool] = field(default_factory=dict)
    """'i-j' -> torch.cuda.can_device_access_peer(i, j) (both directions must hold)."""
    collective: dict = field(default_factory=dict)
    torch_version: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["numa_cpus"] = {str(k): format_cpulist(v) for k, v in self.numa_cpus.items()}
        d["usable_cpus"] = format_cpulist(self.usable_cpus)
        d["device_local_cpus"] = [format_cpulist(c) for c in self.device_local_cpus]
        d["backend"] = self.backend
        return d


@dataclass
class Preflight:
    """The preflight's findings, in the order they were made."""

    nproc: int
    nnodes: int
    node: NodeProbe
    threads_per_rank: int | None
    topology: Topology
    ranks: list[dict]
    bus_bandwidth: dict
    link: dict
    warnings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return self.result().model_dump(mode="json")

    def result(self) -> PreflightResult:
        """The typed findings scale.json keeps."""
        return PreflightResult.model_validate({
            "nproc": self.nproc, "nnodes": self.nnodes, "node": self.node.to_dict(),
            "threads_per_rank": self.threads_per_rank, "topology": self.topology.to_dict(),
            "ranks": self.ranks, "collective": self.node.collective,
            "bus_bandwidth": self.bus_bandwidth, "link": self.link,
            "warnings": self.warnings, "notes": self.notes})


# --- probing -----------------------------------------------------------------------------------


def probe_node(device: str = "auto", catalog=None) -> NodeProbe:
    """Probe this node. device: 'auto' (a GPU if torch sees one), 'cuda' or 'cpu'."""
    import torch

    usable = sorted(os.sched_getaffinity(0))
    numa = numa_nodes()
    use_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_gpu:
        return NodeProbe(kind="cpu", device_count=0, usable_cpus=usable, numa_cpus=numa,
                         collective=collective_library("cpu", torch),
                         torch_version=torch.__version__)
    if not torch.cuda.is_available():
        raise UserError("--device", "cuda was asked for but torch sees no CUDA/ROCm device.",
                        "Check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu.")
    from tunepilot.device import probe_device

    info = probe_device(catalog)  # reused: kind, names, catalog card, NCCL/RCCL version
    n = torch.cuda.device_count()
    node = NodeProbe(kind=info.kind, device_count=n, card_id=info.card_id, usable_cpus=usable,
                     numa_cpus=numa, collective=collective_library(info.kind, torch,
                                                                   info.nccl_version),
                     torch_version=torch.__version__, notes=list(info.notes))
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        node.device_names.append(props.name)
        pci = _pci_address(props)
        node.device_pci.append(pci)
        node.device_numa.append(_sysfs_int(f"/sys/bus/pci/devices/{pci}/numa_node") if pci
                                else None)
        node.device_local_cpus.append(parse_cpulist(
            _sysfs_text(f"/sys/bus/pci/devices/{pci}/local_cpulist")) if pci else [])
    by_pci = _smi_index_by_pci() if info.kind == "cuda" else {}
    node.topo_index = [by_pci.get(p) if p else None for p in node.device_pci]
    if not by_pci:
        node.topo_index = list(range(n))
        if info.kind == "cuda":
            node.notes.append("topology rows are taken in torch's device order (nvidia-smi's "
                              "PCI addresses could not be read)")
    for i in range(n):
        for j in range(i + 1, n):
            with contextlib.suppress(Exception):
                node.p2p[f"{i}-{j}"] = bool(torch.cuda.can_device_access_peer(i, j)
                                            and torch.cuda.can_device_access_peer(j, i))
    return node


def _smi_index_by_pci() -> dict[str, int]:
    """PCI address ('0000:18:00.0') -> nvidia-smi's GPU index ({} without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    from tunepilot.proc.spawn import run_tool

    try:
        out = run_tool(["nvidia-smi", "--query-gpu=index,pci.bus_id",
                        "--format=csv,noheader"], capture_output=True, text=True,
                       timeout_s=SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.stdout.splitlines():
        idx, _, bus = line.partition(",")
        if idx.strip().isdigit() and bus.strip():
            found[bus.strip().lower()[-12:]] = int(idx)  # '00000000:18:00.0' -> '0000:18:00.0'
    return found


def collective_library(kind: str, torch, nccl_version: str | None = None) -> dict:
    """The collective library the ranks will use and its version (NCCL/RCCL: the pilot's probe
    reads torch.cuda.nccl.version(); gloo: bundled with torch)."""
    if kind == "cpu":
        return {"library": "gloo", "backend": "gloo",
                "version": f"bundled with torch {torch.__version__} (gloo has no version API)"}
    return {"library": COLLECTIVES[kind], "backend": "nccl", "version": nccl_version,
            "source": "torch.cuda.nccl.version()"}


def numa_nodes(root: str = "/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node -> CPUs, from sysfs ({} where the kernel exposes no NUMA information)."""
    out: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for p in sorted(Path(root).glob("node[0-9]*")):
            out[int(p.name[4:])] = parse_cpulist(_sysfs_text(str(p / "cpulist")))
    return out


def _pci_address(props) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    dom = getattr(props, "pci_domain_id", 0) or 0
    dev = getattr(props, "pci_device_id", 0) or 0
    return f"{dom:04x}:{bus:02x}:{dev:02x}.0"


def _sysfs_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _sysfs_int(path: str) -> int | None:
    t = _sysfs_text(path)
    with contextlib.suppress(TypeError, ValueError):
        v = int(t)  # type: ignore[arg-type]
        return v if v >= 0 else None  # -1: the platform does not say
    return None


def read_topology(kind: str) -> Topology:
    """Run the vendor tool for `kind` and parse it; a Topology with a note when it is missing."""
    tool = {"cuda": ["nvidia-smi", "topo", "-m"], "rocm": ["rocm-smi", "--showtopo"]}.get(kind)
    if tool is None:
        return no_topology("CPU ranks talk through shared memory / loopback (gloo): no "
                           "accelerator topology")
    if kind == "cuda":  # NVML answers without a subprocess, also where nvidia-smi is absent
        from tunepilot.device import nvml_handles
        from tunepilot.scaling.topology import topology_from_nvml

        handles = nvml_handles()
        if handles is not None and handles[1]:
            with contextlib.suppress(Exception):
                return topology_from_nvml(*handles)
    if shutil.which(tool[0]) is None:
        return no_topology(f"{tool[0]} is not on PATH: topology unknown")
    from tunepilot.proc.spawn import run_tool

    try:
        out = run_tool(tool, capture_output=True, text=True, timeout_s=SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return no_topology(f"{' '.join(tool)} failed: {exc}")
    if out.returncode != 0:
        return no_topology(f"{' '.join(tool)} exited {out.returncode}: "
                           f"{(out.stderr or out.stdout).strip()[:200]}")
    parse = parse_nvidia_smi_topo if kind == "cuda" else parse_rocm_smi_topo
    return parse(out.stdout)


# --- checks ------------------------------------------------------------------------------------


def check_ranks(node: NodeProbe, nproc: int) -> int | None:
    """Refuse more ranks per node than devices (before launching); the CPU threads per rank."""
    if nproc < 1:
        raise UserError("--nproc", f"is {nproc}; it must be at least 1.")
    if node.kind == "cpu":
        cores = len(node.usable_cpus) or (os.cpu_count() or 1)
        if nproc > cores:
            raise UserError("--nproc", f"asks for {nproc} CPU ranks but this process may use "
                            f"{cores} core(s) (os.sched_getaffinity). On the CPU each rank needs "
                            "a core of its own, or the test measures ranks fighting for cores, "
                            "not scaling.", f"Use --nproc {cores} or fewer.")
        return max(1, cores // nproc)
    if nproc > node.device_count:
        names = ", ".join(node.device_names) or "none"
        raise UserError("--nproc", f"asks for {nproc} ranks on this node but only "
                        f"{node.device_count} {node.kind.upper()} device(s) are visible "
                        f"({names}). Nothing was launched.",
                        f"Use --nproc {node.device_count} or fewer (--nproc counts ranks per "
                        "node; add nodes with --nnodes), check CUDA_VISIBLE_DEVICES / "
                        "HIP_VISIBLE_DEVICES, or run the ranks on the CPU with --device cpu.")
    return None


def rank_placement(node: NodeProbe, topo: Topology, nproc: int, threads: int | None
                   ) -> list[dict]:
    """Per local rank: its device, the NUMA node and CPUs next to it, and where it may run.

    torchrun's ranks inherit this process's CPU affinity (unless bound with --numa-binding or
    numactl), so the CPUs a rank may run on are os.sched_getaffinity of this process.
    """
    may_run = set(node.usable_cpus)
    cpu_node = {c: n for n, cpus in node.numa_cpus.items() for c in cpus}
    may_nodes = sorted({cpu_node[c] for c in may_run if c in cpu_node})
    rows = []
    for r in range(nproc):
        if node.kind == "cpu":
            rows.append({"local_rank": r, "device": "cpu", "threads": threads,
                         "may_run_on_cpus": format_cpulist(may_run),
                         "may_run_on_numa_nodes": may_nodes, "placement": "shared cores",
                         "note": "the OS scheduler places each rank's threads on these cores"})
            continue
        t = _topo_index(node, r)
        near = node.device_local_cpus[r] if r < len(node.device_local_cpus) else []
        if not near:
            near = parse_cpulist(topo.cpu_affinity.get(t))
        numa = node.device_numa[r] if r < len(node.device_numa) else None
        if numa is None:
            numa = topo.numa_node.get(t)
        near_set = set(near)
        if not near_set or not may_run:
            placement = "unknown"
        elif may_run <= near_set:
            placement = "bound near its device"
        elif not (may_run & near_set):
            placement = "wrong NUMA node"
        else:
            placement = "unbound" if near_set < may_run else "partly near"
        rows.append({"local_rank": r, "device": f"cuda:{r}",
                     "name": node.device_names[r] if r < len(node.device_names) else None,
                     "pci": node.device_pci[r] if r < len(node.device_pci) else None,
                     "topology_gpu": t,
                     "numa_node": numa, "near_cpus": format_cpulist(near),
                     "may_run_on_cpus": format_cpulist(may_run),
                     "may_run_on_numa_nodes": may_nodes, "placement": placement})
    return rows


def _topo_index(node: NodeProbe, r: int) -> int:
    t = node.topo_index[r] if r < len(node.topo_index) else None
    return r if t is None else t


def topology_warnings(node: NodeProbe, topo: Topology, ranks: list[dict], nproc: int
                      ) -> list[dict]:
    """Warnings, each with its reason, about links and placement that will slow the run."""
    out: list[dict] = []
    if node.kind == "cpu" or nproc < 2:
        return out
    pairs = topo.pairs([_topo_index(node, r) for r in range(nproc)])
    slow = [(i, j, c) for i, j, c in pairs if not link_info(c)["fast"]]
    if pairs and len(slow) == len(pairs):
        codes = sorted({c for _, _, c in slow})
        out.append(_warn("pcie-only", f"no NVLink/Infinity Fabric between the {nproc} cards "
                         f"this run uses: every pair is {', '.join(codes)} ("
                         + "; ".join(f"{c}: {link_info(c)['means']}" for c in codes)
                         + "). Gradient all-reduce and FSDP all-gather/reduce-scatter run at "
                         "PCIe speed; expect DDP's efficiency to drop with the model's size and "
                         "FSDP to pay most."))
    elif slow:
        out.append(_warn("mixed-links", "some pairs of cards have no direct fabric link: "
                         + ", ".join(f"GPU{i}-GPU{j} {c}" for i, j, c in slow)
                         + "; a ring or tree collective runs at the speed of its slowest link."))
    cross = [(i, j, c) for i, j, c in pairs if link_info(c)["kind"] == "pcie-cross-numa"]
    if cross:
        out.append(_warn("cross-numa-link", "traffic between "
                         + ", ".join(f"GPU{i}-GPU{j}" for i, j, _ in cross)
                         + " crosses the CPU sockets' interconnect (SYS): the slowest PCIe path."))
    no_p2p = [k for k, ok in node.p2p.items() if not ok and max(map(int, k.split("-"))) < nproc]
    if no_p2p:
        out.append(_warn("no-p2p", "peer-to-peer access is off between "
                         + ", ".join(f"cuda:{k.replace('-', ' and cuda:')}" for k in no_p2p)
                         + " (torch.cuda.can_device_access_peer): transfers are staged through "
                         "host memory."))
    for r in ranks:
        if r.get("placement") == "wrong NUMA node":
            out.append(_warn("wrong-numa-node", f"rank {r['local_rank']} may only run on CPUs "
                             f"{r['may_run_on_cpus']}, none of them next to its card (NUMA node "
                             f"{r['numa_node']}, CPUs {r['near_cpus']}): its data loading and "
                             "kernel launches cross the socket interconnect."))
    unbound = [r for r in ranks if r.get("placement") == "unbound"]
    if unbound and len(node.numa_cpus) > 1:
        out.append(_warn("ranks-unbound", "ranks are not bound to the NUMA node of their card ("
                         + ", ".join(f"rank {r['local_rank']}: node {r['numa_node']}"
                                     for r in unbound)
                         + "); the OS may run a rank on the far socket. Bind them (numactl, or "
                         "torchrun --numa-binding=node where your torch has it)."))
    return out


def _warn(code: str, message: str) -> dict:
    return {"code": code, "message": message}


# --- bus bandwidth -----------------------------------------------------------------------------


def link_bandwidth(card_id: str | None, catalog) -> dict:
    """The catalog's scale-up link for the card, per direction.

    NVIDIA and AMD quote a GPU's link bandwidth as the total of both directions (H100 SXM:
    18 NVLinks x 50 GB/s = 900 GB/s; MI300X: 7 x 128 GB/s); a collective's busbw is one
    direction's, so the figure compared is bandwidth_gbps / 2.
    """
    if card_id is None:
        return {"card": None, "unavailable": "no catalog card for this device: busbw is not "
                "compared with a link"}
    card = catalog.get(card_id)
    bw = card.scale_up.bandwidth_gbps
    if bw is None:
        return {"card": card.id, "link": card.scale_up.link,
                "unavailable": "the catalog gives no bandwidth for this card's link"}
    return {"card": card.id, "link": card.scale_up.link, "bandwidth_gbps_both_directions": bw,
            "bandwidth_gbps_per_direction": bw / 2,
            "source": "catalog scale_up.bandwidth_gbps (" + card.sources[0].source + ")"}


def compare_busbw(bench: dict, link: dict) -> tuple[dict, list[dict]]:
    """The largest message's all-reduce busbw against the link; a warning when far under it."""
    rows = [r for r in bench.get("rows", []) if r["op"] == "all_reduce"]
    if not rows or "bandwidth_gbps_per_direction" not in link:
        return link, []
    top = max(rows, key=lambda r: r["size_bytes"])
    frac = top["busbw_gbps"] / link["bandwidth_gbps_per_direction"]
    link = dict(link, measured_busbw_gbps=top["busbw_gbps"], at_size_bytes=top["size_bytes"],
                fraction_of_link=frac)
    warns = []
    if frac < BUSBW_LOW_FRACTION:
        warns.append(_warn("busbw-low", f"all-reduce busbw {top['busbw_gbps']:.1f} GB/s at "
                           f"{top['size_bytes'] / 2**20:.0f} MiB is {frac:.0%} of the "
                           f"{link['link']} link's {link['bandwidth_gbps_per_direction']:.0f} "
                           "GB/s per direction: the traffic takes a slower path (PCIe, "
                           "P2P off, a NCCL setting such as NCCL_P2P_DISABLE) or the ranks are "
                           "sharing links."))
    return link, warns


def measure_bus_bandwidth(nproc: int, node: NodeProbe, *, log_dir: Path, out_file: Path,
                          timeout_s: float, rdzv=None, threads: int | None = None,
                          sizes_bytes: list[int] | None = None, iters: int = 5) -> dict:
    """Run tunepilot.scaling.bench under torchrun on nproc ranks per node."""
    from tunepilot.scaling.bench import DEFAULT_SIZES_BYTES
    from tunepilot.scaling.fabric import NCCL_DEBUG_ENV, nccl_network
    from tunepilot.scaling.launch import launch
    from tunepilot.store import read_json

    sizes = list(sizes_bytes or DEFAULT_SIZES_BYTES)
    args = ["--out", str(out_file), "--sizes-bytes", ",".join(str(s) for s in sizes),
            "--iters", str(iters)]
    env = {"TUNEPILOT_SCALE_DEVICE": "cpu" if node.kind == "cpu" else "cuda"}
    across = rdzv is not None and rdzv.nnodes > 1 and node.kind != "cpu"
    if across:  # NCCL names the network it chose between nodes (NET/IB, Socket, Libfabric)
        env.update(NCCL_DEBUG_ENV)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    res = launch("preflight bus-bandwidth benchmark", "tunepilot.scaling.bench", args,
                 nproc=nproc, log_dir=log_dir, timeout_s=timeout_s, rdzv=rdzv, env=env)
    net = nccl_network([p for r in res.rank_logs for p in (r.stdout, r.stderr)]) \
        if across else None
    if not out_file.exists():
        return {"unavailable": "the benchmark wrote no result on this node (it is written by "
                "local rank 0 of each node)", "launch": res.to_dict(), "nccl_network": net}
    return dict(read_json(out_file), wall_s=res.wall_s, nccl_network=net)


def preflight(nproc: int, *, device: str = "auto", nnodes: int = 1, node: NodeProbe | None = None,
              catalog=None, bench: bool = True, log_dir: Path | None = None,
              out_dir: Path | None = None, timeout_s: float = 300, rdzv=None,
              sizes_bytes: list[int] | None = None) -> Preflight:
    """All preflight checks; raises UserError (nothing launched) when N exceeds the devices."""
    from tunepilot.catalog import load_catalog

    catalog = catalog or load_catalog()
    node = node or probe_node(device, catalog)
    threads = check_ranks(node, nproc)
    topo = read_topology(node.kind)
    ranks = rank_placement(node, topo, nproc, threads)
    warnings = topology_warnings(node, topo, ranks, nproc)
    notes: list[str] = []
    if node.kind == "cpu":
        notes.append(f"CPU run: a 'device' is {threads} thread(s) of the {len(node.usable_cpus)}"
                     f" usable cores; the 1-rank baseline gets the same {threads}, so "
                     "efficiency compares N such devices with one")
    link = link_bandwidth(node.card_id, catalog)
    world = nproc * nnodes
    if not bench or world < 2:
        bw = {"unavailable": "one rank: there is no collective to measure" if world < 2 else
              "skipped (bench=False)"}
    else:
        assert log_dir is not None and out_dir is not None
        bw = measure_bus_bandwidth(nproc, node, log_dir=log_dir, out_file=out_dir / "bench.json",
                                   timeout_s=timeout_s, rdzv=rdzv, threads=threads,
                                   sizes_bytes=sizes_bytes)
        if nnodes > 1:  # the yardstick is the network between the nodes, not NVLink
            from tunepilot.scaling.fabric import compare_cross_node, offer_fabric

            fabric, cards = offer_fabric(node.card_id, catalog)
            link, more = compare_cross_node(bw, fabric, cards, nnodes, world,
                                            bw.get("nccl_network"))
        else:
            link, more = compare_busbw(bw, link)
        warnings += more
    return Preflight(nproc=nproc, nnodes=nnodes, node=node, threads_per_rank=threads,
                     topology=topo, ranks=ranks, bus_bandwidth=bw, link=link,
                     warnings=warnings, notes=notes)
