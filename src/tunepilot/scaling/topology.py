"""Parse what the vendor tools say about how the cards of one node are wired.

`nvidia-smi topo -m` prints a matrix whose cells name the path between two devices
(X, NV#, PIX, PXB, PHB, NODE, SYS) followed by "CPU Affinity", "NUMA Affinity" and, on newer
drivers, "GPU NUMA ID" columns. `rocm-smi --showtopo` prints sections (weight, hops, link type,
NUMA nodes) whose link cells are XGMI or PCIE. Both parsers are pure functions of the text, so
they are tested against captured outputs (tests/test_scaling_preflight.py) on a machine with
neither tool.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# What each path code means and how fast it is as a class (the legend nvidia-smi prints, plus
# AMD's link types). `fast` = a direct GPU-to-GPU fabric (NVLink, Infinity Fabric/XGMI);
# the others go over PCIe, and SYS also crosses the CPU sockets' interconnect (QPI/UPI/xGMI).
LINK_KINDS: dict[str, dict] = {
    "X": {"kind": "self", "fast": True, "means": "the device itself"},
    "NV": {"kind": "nvlink", "fast": True, "means": "a bonded set of # NVLinks"},
    "XGMI": {"kind": "xgmi", "fast": True, "means": "AMD Infinity Fabric (XGMI) link"},
    "PIX": {"kind": "pcie", "fast": False, "means": "PCIe through at most one PCIe bridge"},
    "PXB": {"kind": "pcie", "fast": False,
            "means": "PCIe through several PCIe bridges, not the host bridge"},
    "PHB": {"kind": "pcie", "fast": False,
            "means": "PCIe through a PCIe host bridge (typically the CPU)"},
    "NODE": {"kind": "pcie", "fast": False,
             "means": "PCIe plus the link between host bridges inside one NUMA node"},
    "SYS": {"kind": "pcie-cross-numa", "fast": False,
            "means": "PCIe plus the SMP interconnect between NUMA nodes (QPI/UPI)"},
    "SOC": {"kind": "pcie-cross-numa", "fast": False,
            "means": "older drivers' name for SYS (across CPU sockets)"},
    "PCIE": {"kind": "pcie", "fast": False, "means": "PCIe (rocm-smi link type)"},
}


def link_info(code: str) -> dict:
    """The LINK_KINDS entry for a cell such as 'NV18' or 'PHB' (unknown codes are not fast)."""
    c = code.strip().upper()
    key = "NV" if re.fullmatch(r"NV\d+", c) else c
    info = LINK_KINDS.get(key, {"kind": "unknown", "fast": False, "means": f"unknown ({code})"})
    out = dict(info)
    if key == "NV":
        out["nvlinks"] = int(c[2:])
    return out


def parse_cpulist(text: str | None) -> list[int]:
    """A Linux cpulist ('0-3,8,10-11') as a sorted list of CPU ids; '' or 'N/A' is []."""
    if not text:
        return []
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part or not re.fullmatch(r"\d+(-\d+)?", part):
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
            cpus.update(range(lo, hi + 1))
        else:
            cpus.add(int(part))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """The inverse of parse_cpulist: [0,1,2,3,8] -> '0-3,8'."""
    xs = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        runs.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass
class Topology:
    """The devices of one node and the path between each pair, as the vendor tool reports."""

    source: str
    """Which tool produced it: 'nvidia-smi topo -m', 'rocm-smi --showtopo' or 'none'."""
    devices: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)
    """'i-j' (i < j) -> the path code between device i and device j, e.g. {'0-1': 'NV18'}."""
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    """device index -> cpulist of the CPUs nearest it ('0-55,112-167')."""
    numa_node: dict[int, int | None] = field(default_factory=dict)
    """device index -> the NUMA node it is attached to (None when the tool says N/A)."""
    notes: list[str] = field(default_factory=list)

    def link(self, i: int, j: int) -> str | None:
        a, b = min(i, j), max(i, j)
        return self.links.get(f"{a}-{b}")

    def pairs(self, devices: list[int]) -> list[tuple[int, int, str]]:
        """(i, j, code) for each pair among `devices` the tool reported a path for."""
        out = []
        for n, i in enumerate(devices):
            for j in devices[n + 1:]:
                code = self.link(i, j)
                if code is not None:
                    out.append((i, j, code))
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_affinity"] = {str(k): v for k, v in self.cpu_affinity.items()}
        d["numa_node"] = {str(k): v for k, v in self.numa_node.items()}
        return d


def _cells(line: str) -> list[str]:
    """Split a matrix line: on tabs as nvidia-smi writes them, else on runs of 2+ spaces."""
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return [c.strip() for c in re.split(r"\s{2,}", line.strip())]


def _gpu_index(name: str) -> int | None:
    m = re.fullmatch(r"GPU\[?(\d+)\]?", name.strip())
    return int(m.group(1)) if m else None


def parse_nvidia_smi_topo(text: str) -> Topology:
    """Parse `nvidia-smi topo -m`: GPU rows only (NIC rows and the legend are skipped)."""
    topo = Topology(source="nvidia-smi topo -m")
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header: list[str] | None = None
    for ln in lines:
        if not ln.strip():
            continue
        if header is None:
            cells = [c for c in _cells(ln)]
            if cells and cells[0] == "":
                cells = cells[1:]  # the header line starts with a tab (the row-name column)
            if cells and _gpu_index(cells[0]) is not None:
                header = cells
            continue
        if ln.lstrip().startswith("Legend"):
            break
        cells = _cells(ln)
        if not cells or _gpu_index(cells[0]) is None:
            continue  # NIC rows, blank or legend lines
        row = _gpu_index(cells[0])
        assert row is not None
        values = cells[1:]
        if "\t" not in ln:  # space-separated copy: empty cells were merged away
            values = [v for v in values if v]
        for col, val in zip(header, values, strict=False):
            col_dev = _gpu_index(col)
            if col_dev is not None:
                if col_dev != row and val:
                    topo.links[f"{min(row, col_dev)}-{max(row, col_dev)}"] = val.upper()
            elif col.lower() == "cpu affinity":
                topo.cpu_affinity[row] = val
            elif col.lower() == "numa affinity":
                topo.numa_node[row] = int(val) if val.isdigit() else None
        topo.devices.append(f"GPU{row}")
    if header is None:
        topo.notes.append("no GPU header line found in the nvidia-smi output")
    return topo


def parse_rocm_smi_topo(text: str) -> Topology:
    """Parse `rocm-smi --showtopo`: the 'Link Type' matrix and the 'Numa Nodes' section."""
    topo = Topology(source="rocm-smi --showtopo")
    section = ""
    header: list[str] = []
    for raw in text.splitlines():
        ln = _ANSI.sub("", raw).strip()
        if not ln:
            continue
        if ln.startswith("="):
            section = ln.strip("= ").lower()
            header = []
            continue
        if "link type" in section:
            cells = ln.split()
            if not header:
                header = cells
                continue
            row = _gpu_index(cells[0])
            if row is None:
                continue
            if f"GPU{row}" not in topo.devices:
                topo.devices.append(f"GPU{row}")
            for col, val in zip(header, cells[1:], strict=False):
                col_dev = _gpu_index(col)
                if col_dev is not None and col_dev != row and not val.isdigit():
                    topo.links[f"{min(row, col_dev)}-{max(row, col_dev)}"] = val.upper()
        elif "numa" in section:
            m = re.match(r"GPU\[(\d+)\]\s*:\s*\(Topology\)\s*Numa Node:\s*(-?\d+)", ln)
            if m:
                node = int(m.group(2))
                topo.numa_node[int(m.group(1))] = node if node >= 0 else None
    if not topo.devices:
        topo.notes.append("no 'Link Type between two GPUs' matrix found in the rocm-smi output")
    return topo


def no_topology(why: str) -> Topology:
    return Topology(source="none", notes=[why])


# NVML's common-ancestor levels (nvml.h nvmlGpuTopologyLevel_t) -> nvidia-smi's path codes.
NVML_LEVEL_CODES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVML_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS (Hopper has 18 NVLinks per GPU)
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2  # nvml.h nvmlNvLinkDeviceType_t: GPU 0, IBMNPU 1, SWITCH 2
NVML_P2P_CAPS_INDEX_NVLINK = 3  # nvml.h nvmlGpuP2PCapsIndex_t
NVML_P2P_STATUS_OK = 0


def topology_from_nvml(nvml, handles: list) -> Topology:
    """The same Topology from the NVML library (pynvml) that `nvidia-smi topo -m` reads: the
    path between each pair of GPUs (NV# when NVLinks join them, else the PCIe level of their
    common ancestor), each GPU's CPU affinity and NUMA node. No subprocess; used where NVML
    answers (nvidia-smi may be absent in a container that has the library)."""
    topo = Topology(source="NVML (pynvml)")
    pci = [_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
    switch = [_switch_links(nvml, h) for h in handles]
    topo.devices = [f"GPU{i}" for i in range(len(handles))]
    for i, h in enumerate(handles):
        for j in range(i + 1, len(handles)):
            links = _nvlinks_between(nvml, h, pci[j]) or \
                _through_switch(nvml, h, handles[j], switch[i], switch[j])
            if links:
                topo.links[f"{i}-{j}"] = f"NV{links}"
            else:
                try:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(h, handles[j]))
                except Exception:
                    continue
                topo.links[f"{i}-{j}"] = NVML_LEVEL_CODES.get(level, f"L{level}")
        try:
            words = nvml.nvmlDeviceGetCpuAffinity(h, 64)
            cpus = [64 * w + b for w, word in enumerate(words) for b in range(64)
                    if int(word) >> b & 1]
            topo.cpu_affinity[i] = format_cpulist(cpus)
        except Exception:
            pass
        try:
            topo.numa_node[i] = int(nvml.nvmlDeviceGetNumaNodeId(h))
        except Exception:
            topo.numa_node[i] = None
    return topo


def _nvlinks_between(nvml, h, other_bus_id: str) -> int:
    n = 0
    for link in range(NVML_MAX_LINKS):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(h, link):
                continue
            remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
        except Exception:
            continue
        n += remote == other_bus_id
    return n


def _switch_links(nvml, h) -> int:
    """Active NVLinks of a GPU whose far end is an NVSwitch (HGX/DGX boards: every link of
    every GPU; the remote PCI id is then the switch's, never a peer GPU's)."""
    n = 0
    for link in range(NVML_MAX_LINKS):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(h, link):
                continue
            kind = int(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
        except Exception:
            continue
        n += kind == NVML_NVLINK_DEVICE_TYPE_SWITCH
    return n


def _through_switch(nvml, a, b, switch_a: int, switch_b: int) -> int:
    """NVLinks between two GPUs through NVSwitches: each GPU's switch links (the path runs at
    the narrower end's count, as `nvidia-smi topo -m` prints NV18 on an HGX H100). Where NVML
    cannot name a link's far end, its P2P status says whether the pair talks over NVLink."""
    if switch_a and switch_b:
        return min(switch_a, switch_b)
    try:
        if int(nvml.nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)) == \
                NVML_P2P_STATUS_OK:
            return max(switch_a, switch_b, _active_links(nvml, a), 1)
    except Exception:
        pass
    return 0


def _active_links(nvml, h) -> int:
    n = 0
    for link in range(NVML_MAX_LINKS):
        try:
            n += bool(nvml.nvmlDeviceGetNvLinkState(h, link))
        except Exception:
            continue
    return n


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
