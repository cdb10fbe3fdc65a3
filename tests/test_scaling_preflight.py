"""Scaling preflight and arithmetic, without launching anything: topology parsers on captured
vendor-tool outputs, bus-bandwidth arithmetic, rank/device checks, the batch plan, the torchrun
command line, and the comparison/recommendation on made-up records."""

from __future__ import annotations

import pytest

from tunepilot.catalog import load_catalog
from tunepilot.errors import UserError
from tunepilot.scaling import analysis, bench, preflight, runner
from tunepilot.scaling.launch import Rendezvous, torchrun_command
from tunepilot.scaling.topology import (
    format_cpulist,
    link_info,
    parse_cpulist,
    parse_nvidia_smi_topo,
    parse_rocm_smi_topo,
)
from tunepilot.spec import spec_from_dict
from tunepilot.spec.precision import Precision

# --- captured outputs ------------------------------------------------------------------------

_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _hgx_h100() -> str:
    """8 x H100 SXM on NVSwitch, two NICs, a driver with the GPU NUMA ID column; the header
    underlined with ANSI escapes as nvidia-smi prints it to a terminal."""
    names = [f"GPU{i}" for i in range(8)]
    head = "\x1b[4m\t" + "\t".join(names + ["NIC0", "NIC1", "CPU Affinity", "NUMA Affinity",
                                            "GPU NUMA ID"]) + "\x1b[0m"
    rows = [head]
    for i in range(8):
        cells = [" X " if j == i else "NV18" for j in range(8)]
        nics = ["PXB", "SYS"] if i < 4 else ["SYS", "PXB"]
        aff, numa = ("0-55,112-167", "0") if i < 4 else ("56-111,168-223", "1")
        rows.append("\t".join([f"GPU{i}", *cells, *nics, aff, numa, "", "N/A"]))
    rows.append("NIC0\t" + "\t".join(["PXB"] * 4 + ["SYS"] * 4) + "\t X \tSYS")
    rows.append("NIC1\t" + "\t".join(["SYS"] * 4 + ["PXB"] * 4) + "\tSYS\t X ")
    return "\n".join(rows) + "\n" + _LEGEND + "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n"


PCIE_WORKSTATION = (  # 2 cards on PCIe through the host bridge, older driver (no GPU NUMA ID)
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tPHB\t0-31\t0\n"
    "GPU1\tPHB\t X \t0-31\t0\n" + _LEGEND)

TWO_SOCKETS_SPACES = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     SYS     SYS     0-23            0
GPU1    NV4      X      SYS     SYS     0-23            0
GPU2    SYS     SYS      X      NV4     24-47           1
GPU3    SYS     SYS     NV4      X      24-47           1
""" + _LEGEND  # as pasted into a ticket: tabs turned into spaces

SINGLE_H200 = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n" + _LEGEND

ROCM_MI300X = """============================ ROCm System Management Interface ============================
================================ Weight between two GPUs =================================
       GPU0         GPU1         GPU2         GPU3
GPU0   0            15           15           15
GPU1   15           0            15           15
GPU2   15           15           0            15
GPU3   15           15           15           0
================================= Hops between two GPUs ==================================
       GPU0         GPU1         GPU2         GPU3
GPU0   0            1            1            1
GPU1   1            0            1            1
GPU2   1            1            0            1
GPU3   1            1            1            0
=============================== Link Type between two GPUs ===============================
       GPU0         GPU1         GPU2         GPU3
GPU0   0            XGMI         XGMI         XGMI
GPU1   XGMI         0            XGMI         XGMI
GPU2   XGMI         XGMI         0            XGMI
GPU3   XGMI         XGMI         XGMI         0
======================================= Numa Nodes =======================================
GPU[0]		: (Topology) Numa Node: 0
GPU[0]		: (Topology) Numa Affinity: 0
GPU[1]		: (Topology) Numa Node: 0
GPU[1]		: (Topology) Numa Affinity: 0
GPU[2]		: (Topology) Numa Node: 1
GPU[2]		: (Topology) Numa Affinity: 1
GPU[3]		: (Topology) Numa Node: 1
GPU[3]		: (Topology) Numa Affinity: 1
================================== End of ROCm SMI Log ===================================
"""

ROCM_PCIE = """=============================== Link Type between two GPUs ===============================
       GPU0         GPU1
GPU0   0            PCIE
GPU1   PCIE         0
======================================= Numa Nodes =======================================
GPU[0]		: (Topology) Numa Node: 0
GPU[1]		: (Topology) Numa Node: -1
"""


def _gpu_node(n: int, kind: str = "cuda", **kw) -> preflight.NodeProbe:
    base = dict(kind=kind, device_count=n, device_names=["NVIDIA H100 80GB HBM3"] * n,
                usable_cpus=list(range(8)), numa_cpus={0: list(range(8))},
                device_pci=[None] * n, device_numa=[None] * n, device_local_cpus=[[]] * n,
                topo_index=list(range(n)), collective={"library": "nccl"})
    base.update(kw)
    return preflight.NodeProbe(**base)


# --- topology parsers --------------------------------------------------------------------------


def test_nvidia_smi_hgx_matrix_links_affinity_numa_and_nics_skipped():
    t = parse_nvidia_smi_topo(_hgx_h100())
    assert t.devices == [f"GPU{i}" for i in range(8)]
    assert len(t.links) == 28 and set(t.links.values()) == {"NV18"}
    assert t.link(3, 5) == "NV18" and t.link(5, 3) == "NV18"
    assert t.cpu_affinity[0] == "0-55,112-167" and t.cpu_affinity[7] == "56-111,168-223"
    assert t.numa_node == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    assert link_info("NV18") == {"kind": "nvlink", "fast": True,
                                 "means": "a bonded set of # NVLinks", "nvlinks": 18}


def test_nvidia_smi_pcie_workstation_warns_pcie_only():
    t = parse_nvidia_smi_topo(PCIE_WORKSTATION)
    assert t.links == {"0-1": "PHB"} and t.numa_node == {0: 0, 1: 0}
    node = _gpu_node(2)
    ranks = preflight.rank_placement(node, t, 2, None)
    codes = [w["code"] for w in preflight.topology_warnings(node, t, ranks, 2)]
    assert codes == ["pcie-only"]
    msg = preflight.topology_warnings(node, t, ranks, 2)[0]["message"]
    assert "PHB" in msg and "host bridge" in msg


def test_nvidia_smi_space_separated_two_sockets():
    t = parse_nvidia_smi_topo(TWO_SOCKETS_SPACES)
    assert t.link(0, 1) == "NV4" and t.link(2, 3) == "NV4" and t.link(1, 2) == "SYS"
    assert t.cpu_affinity[2] == "24-47" and t.numa_node[3] == 1
    node = _gpu_node(4)
    # GPUs 0 and 1 only: NVLink, nothing to warn about
    assert preflight.topology_warnings(node, t, [], 2) == []
    codes = {w["code"] for w in preflight.topology_warnings(node, t, [], 4)}
    assert codes == {"mixed-links", "cross-numa-link"}


def test_nvidia_smi_single_gpu_and_garbage():
    t = parse_nvidia_smi_topo(SINGLE_H200)
    assert t.devices == ["GPU0"] and t.links == {} and t.cpu_affinity == {0: "0-15"}
    empty = parse_nvidia_smi_topo("NVIDIA-SMI has failed because it couldn't communicate")
    assert empty.devices == [] and empty.notes


def test_rocm_smi_xgmi_and_pcie():
    t = parse_rocm_smi_topo(ROCM_MI300X)
    assert len(t.links) == 6 and set(t.links.values()) == {"XGMI"}
    assert t.numa_node == {0: 0, 1: 0, 2: 1, 3: 1}
    node = _gpu_node(4, kind="rocm")
    assert preflight.topology_warnings(node, t, [], 4) == []
    p = parse_rocm_smi_topo(ROCM_PCIE)
    assert p.links == {"0-1": "PCIE"} and p.numa_node == {0: 0, 1: None}
    assert [w["code"] for w in preflight.topology_warnings(_gpu_node(2, kind="rocm"), p, [], 2)
            ] == ["pcie-only"]


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("N/A") == [] and parse_cpulist("") == []
    assert format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_rank_on_the_wrong_numa_node_and_no_p2p_warn():
    t = parse_nvidia_smi_topo(PCIE_WORKSTATION)
    node = _gpu_node(2, usable_cpus=[4, 5, 6, 7], numa_cpus={0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
                     device_local_cpus=[[0, 1, 2, 3], [4, 5, 6, 7]], device_numa=[0, 1],
                     p2p={"0-1": False})
    ranks = preflight.rank_placement(node, t, 2, None)
    assert [r["placement"] for r in ranks] == ["wrong NUMA node", "bound near its device"]
    codes = [w["code"] for w in preflight.topology_warnings(node, t, ranks, 2)]
    assert "wrong-numa-node" in codes and "no-p2p" in codes
    wrong = next(w for w in preflight.topology_warnings(node, t, ranks, 2)
                 if w["code"] == "wrong-numa-node")
    assert "rank 0" in wrong["message"] and "NUMA node 0" in wrong["message"]


# --- bus bandwidth -----------------------------------------------------------------------------


def test_busbw_factors_are_nccl_tests_conventions():
    assert bench.bus_factor("all_reduce", 2) == 1.0
    assert bench.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bench.bus_factor("all_gather", 8) == pytest.approx(0.875)
    assert bench.bus_factor("all_gather", 1) == 0.0
    r = bench.row("all_reduce", 25 * 2**20, 0.010, 4)  # 25 MiB in 10 ms over 4 ranks
    assert r["algbw_gbps"] == pytest.approx(2.62144)
    assert r["busbw_gbps"] == pytest.approx(2.62144 * 1.5)
    with pytest.raises(ValueError):
        bench.bus_factor("broadcast", 2)


def test_busbw_compared_with_the_catalog_link():
    cat = load_catalog()
    link = preflight.link_bandwidth("h100", cat)
    assert link["bandwidth_gbps_per_direction"] == 450  # 900 GB/s over both directions
    rows = {"rows": [bench.row("all_reduce", 64 * 2**20, 64 * 2**20 / 100e9, 2)]}  # 100 GB/s
    out, warns = preflight.compare_busbw(rows, link)
    assert out["fraction_of_link"] == pytest.approx(100 / 450)
    assert [w["code"] for w in warns] == ["busbw-low"]
    fast = {"rows": [bench.row("all_reduce", 64 * 2**20, 64 * 2**20 / 380e9, 2)]}
    assert preflight.compare_busbw(fast, link)[1] == []
    assert "unavailable" in preflight.link_bandwidth(None, cat)


# --- ranks vs devices --------------------------------------------------------------------------


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(UserError) as e:
        preflight.check_ranks(_gpu_node(1), 2)
    text = str(e.value)
    assert "--nproc" in text and "2 ranks" in text and "1 CUDA device" in text
    assert "Nothing was launched" in text
    assert preflight.check_ranks(_gpu_node(2), 2) is None


def test_cpu_ranks_get_an_equal_share_of_the_cores():
    node = preflight.NodeProbe(kind="cpu", device_count=0, usable_cpus=[0, 1, 2, 3])
    assert preflight.check_ranks(node, 2) == 2 and preflight.check_ranks(node, 3) == 1
    with pytest.raises(UserError, match="core"):
        preflight.check_ranks(node, 5)


TINY = {"name": "tiny", "model": {"preset": "tiny"}, "method": {"kind": "full"},
        "precision": "fp32", "sequence_length": 32, "micro_batch_size": 4,
        "gradient_accumulation_steps": 1, "data": {"source": "synthetic"}}


def test_scale_refuses_before_launching_when_gpus_are_too_few(tmp_path, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched although the preflight should have refused")

    monkeypatch.setattr(runner, "launch", no_launch)
    monkeypatch.setattr(preflight, "measure_bus_bandwidth", no_launch)
    monkeypatch.setattr(preflight, "read_topology", no_launch)
    with pytest.raises(UserError, match="only 1 CUDA device"):
        runner.scale(spec_from_dict(TINY), 2, out=tmp_path / "run", node=_gpu_node(1))
    assert not (tmp_path / "run").exists()  # nothing written, nothing launched


# --- batch plan, data order, launch command ----------------------------------------------------


def test_global_batch_held_equal_and_indivisible_refused():
    spec = spec_from_dict(TINY)
    p = runner.plan_batches(spec, 2)  # 4 samples: micro 2 x 1 x 2 ranks = 2 x 2 x 1 rank
    assert (p.global_batch_samples, p.micro_batch_size, p.accumulation,
            p.baseline_accumulation) == (4, 2, 1, 2)
    assert p.note and "micro-batch per rank is 2" in p.note
    big = spec.with_changes(micro_batch_size=2, gradient_accumulation_steps=4)
    q = runner.plan_batches(big, 2)
    assert (q.micro_batch_size, q.accumulation, q.baseline_accumulation, q.note) == (2, 2, 4, None)
    with pytest.raises(UserError, match="cannot be split evenly over 3 ranks"):
        runner.plan_batches(spec, 3)


def test_interleave_rebuilds_the_single_device_order():
    assert analysis.interleave([["a", "c", "e"], ["b", "d", "f"]]) == list("abcdef")
    assert analysis.interleave([["a"]]) == ["a"]


def test_torchrun_command_passes_rendezvous_through(tmp_path):
    one = torchrun_command("m", ["--x"], nproc=2, rdzv=Rendezvous(), log_dir=tmp_path,
                           options=frozenset())
    assert one[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    assert "--standalone" in one and one[-3:] == ["-m", "m", "--x"]
    assert "--shutdown-timeout" not in one
    multi = Rendezvous(nnodes=2, node_rank=1, endpoint="node001:29400", id="job7")
    cmd = torchrun_command("m", [], nproc=8, rdzv=multi.for_launch("ddp"), log_dir=tmp_path,
                           options=frozenset({"--shutdown-timeout"}))
    text = " ".join(cmd)
    assert "--standalone" not in cmd
    for part in ("--nnodes 2", "--node-rank 1", "--rdzv-endpoint node001:29400",
                 "--rdzv-backend c10d", "--rdzv-id job7-ddp", "--redirects 3", "--tee 3",
                 "--max-restarts 0", "--shutdown-timeout"):
        assert part in text


# --- comparison and recommendation -------------------------------------------------------------


def _record(rank: int, world: int, strategy: str, wall: float, samples, losses, mem=100):
    from tunepilot.scaling.messages import RankRecord, RankStep

    steps = [RankStep(step=i, measured=i > 0, wall_s=wall, useful_tokens=100 // world,
                      padded_tokens=100 // world, loss_local=losses[i], loss_global=losses[i],
                      data_wait_s=0.0, samples=samples[i]) for i in range(len(losses))]
    return RankRecord(rank=rank, host="h", pid=1, device="cpu", threads=1, params_local=10,
                      strategy=strategy, backend="gloo", micro_batch_size=2,
                      accumulation=2 // world, comm_measure="-",
                      memory={"peak_bytes": {"value": mem}}, steps=steps)


def test_compare_and_recommend_on_made_up_records():
    spec = spec_from_dict(TINY)
    batches = runner.plan_batches(spec, 2)
    base = analysis.summarize([_record(0, 1, "single", 1.0, [list("abcd"), list("efgh")],
                                     [5.0, 4.0])])
    ddp = analysis.summarize([_record(0, 2, "ddp", 0.6, [list("ac"), list("eg")], [5.0, 4.0]),
                            _record(1, 2, "ddp", 0.6, [list("bd"), list("fh")], [5.0, 4.0])])
    r = analysis.compare(ddp, base, batches, Precision("fp32"), 2)
    assert r.efficiency == pytest.approx((100 / 0.6) / (2 * 100 / 1.0))
    assert r.data_order_same and r.loss_agrees and r.all_ranks_reported
    assert r.figures["efficiency"].unit == "ratio" and r.figures["efficiency"].is_measured
    assert r.overhead_s_per_step == pytest.approx(0.6 - 0.5)
    swapped = analysis.summarize([_record(0, 2, "ddp", 0.6, [list("bd"), list("eg")], [5.0, 4.2]),
                                _record(1, 2, "ddp", 0.6, [list("ac"), list("fh")], [5.0, 4.2])])
    bad = analysis.compare(swapped, base, batches, Precision("fp32"), 2)
    assert not bad.data_order_same and bad.data_order_first_mismatch_step == 0
    assert not bad.loss_agrees
    fsdp = r.model_copy(update={"useful_tokens_per_s": r.useful_tokens_per_s * 0.98,
                                "peak_memory_bytes_per_rank": 50,
                                "efficiency": r.efficiency * 0.98})
    rec = analysis.recommend({"ddp": r, "fsdp": fsdp}, base, 2)
    assert rec.strategy == "fsdp" and "less memory" in rec.reason
    slow = r.model_copy(update={"useful_tokens_per_s": 50.0, "efficiency": 0.25})
    assert analysis.recommend({"ddp": slow}, base, 2).strategy == "single"
    assert analysis.recommend({"ddp": bad}, base, 2).strategy is None


def test_cli_refuses_an_indivisible_batch_with_exit_2_and_json():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tunepilot.cli", "scale",
                          str(root / "examples" / "tiny.yaml"), "--nproc", "3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    err = json.loads(out.stdout)
    assert err["field"] == "--nproc" and "cannot be split evenly over 3 ranks" in err["message"]


def test_probe_node_gpu_path_with_a_simulated_two_gpu_node(monkeypatch):
    """The GPU branch of the probe on a CPU machine: torch.cuda and the pilot's probe faked."""
    from types import SimpleNamespace

    import torch

    from tunepilot import device as pilot_device

    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", pci_bus_id=b, pci_domain_id=0,
                             pci_device_id=0) for b in (0x18, 0x2A)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: False)
    info = SimpleNamespace(kind="cuda", card_id="h100-sxm-80gb", nccl_version="2.27.3",
                           notes=[])
    monkeypatch.setattr(pilot_device, "probe_device", lambda catalog=None: info)
    monkeypatch.setattr(preflight, "_smi_index_by_pci",
                        lambda: {"0000:18:00.0": 1, "0000:2a:00.0": 0})
    node = preflight.probe_node("cuda")
    assert node.kind == "cuda" and node.device_count == 2 and node.backend == "nccl"
    assert node.device_pci == ["0000:18:00.0", "0000:2a:00.0"]
    assert node.topo_index == [1, 0]  # matched by PCI address, not by position
    assert node.p2p == {"0-1": False}
    assert node.collective == {"library": "nccl", "backend": "nccl", "version": "2.27.3",
                               "source": "torch.cuda.nccl.version()"}
    with pytest.raises(UserError, match="only 2 CUDA device"):
        preflight.check_ranks(node, 4)
    t = parse_nvidia_smi_topo(PCIE_WORKSTATION)
    ranks = preflight.rank_placement(node, t, 2, None)
    assert [r["topology_gpu"] for r in ranks] == [1, 0]
    assert "no-p2p" in {w["code"] for w in preflight.topology_warnings(node, t, ranks, 2)}


def test_topology_from_the_nvml_library_matches_what_nvidia_smi_would_say():
    """NVML (pynvml) answers the topology question without a subprocess: NVLinks between a pair
    give NV#, else the PCIe level of the common ancestor; CPU affinity and NUMA per GPU. A fake
    NVML stands in for the library's calls (their return shapes as pynvml documents them)."""
    from types import SimpleNamespace

    from tunepilot.scaling.topology import topology_from_nvml

    bus = ["00000000:07:00.0", "00000000:0A:00.0", "00000000:41:00.0"]
    nv = {(0, 0): 1, (0, 1): 1}  # GPU0's links 0 and 1 go to GPU1

    class FakeNvml:
        def nvmlDeviceGetPciInfo(self, h):
            return SimpleNamespace(busId=bus[h].encode())

        def nvmlDeviceGetNvLinkState(self, h, link):
            return 1 if (h, link) in nv else 0

        def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
            return SimpleNamespace(busId=bus[nv[(h, link)]])

        def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
            return 50 if 2 in (a, b) else 30  # GPU2 sits across the sockets

        def nvmlDeviceGetCpuAffinity(self, h, words):
            return [0xFF if h < 2 else 0xFF00]

        def nvmlDeviceGetNumaNodeId(self, h):
            return 0 if h < 2 else 1

    topo = topology_from_nvml(FakeNvml(), [0, 1, 2])
    assert topo.source == "NVML (pynvml)" and topo.devices == ["GPU0", "GPU1", "GPU2"]
    assert topo.links == {"0-1": "NV2", "0-2": "SYS", "1-2": "SYS"}
    assert topo.cpu_affinity == {0: "0-7", 1: "0-7", 2: "8-15"}
    assert topo.numa_node == {0: 0, 1: 0, 2: 1}
