"""The network between nodes, for a multi-node scaling test's preflight: the fabric the offer has
(the catalog's pricing.fabric: InfiniBand, EFA, RoCE or TCP, its line rate per node and the
share of it published runs reach), the
network NCCL says it used (its own INFO line, "Using network IB | Socket | AWS Libfabric"), and
the measured cross-node all-reduce bandwidth against the fabric's line rate.

A collective over several nodes is hierarchical: NCCL reduces inside each node over NVLink and
only (nodes - 1) / (ranks - 1) of busbw crosses a card's network adapter share, so the wire
rate per card is busbw x (nodes - 1) / (ranks - 1) (github:stas00/ml-engineering
network/README.md @29c6b7087c66ce78a0333109e7bfa88b9871a26b: "per-accelerator rate = busbw *
(k-1)/(n-1)"; its 2 x p5.48xlarge row, 487 GB/s busbw over 16 H100s, is 32 GB/s per card of
the 50 GB/s its EFA share carries). That wire rate is what is compared with the fabric's line
rate per card and with the share of it the catalog says runs on this fabric reach; comparing
busbw with NVLink, as a single node does, blames PCIe for the network.
"""

from __future__ import annotations

import re
from pathlib import Path

LOW_FRACTION = 0.5
"""Warn when the cross-node wire rate per card is under this share of what the catalog says
the fabric reaches per card (its line rate x achieved_fraction, from published runs). A chosen
threshold, not a datasheet figure: half of a published rate is a path problem (a missing
plugin, sockets instead of RDMA, an interface left out), not run-to-run noise."""

NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
"""what the bench launch sets across nodes so that NCCL names the network it chose"""

_USING = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\w+)")
# NCCL's network plugin names -> the fabric kinds it drives (IB verbs also carry RoCE)
NETWORK_KINDS = {"IB": ("infiniband", "roce"), "Socket": ("tcp",),
                 "AWS Libfabric": ("efa",), "Libfabric": ("efa",)}
KIND_NAMES = {"infiniband": "InfiniBand", "efa": "EFA", "roce": "RoCE", "tcp": "TCP"}


def offer_fabric(card_id: str | None, catalog) -> tuple[object | None, int]:
    """(the catalog's Fabric of the card's offer or None, the offer instance's cards)."""
    if card_id is None:
        return None, 8
    pricing = catalog.get(card_id).pricing
    cards = (pricing.host.accelerators if pricing.host is not None else
             pricing.instance_accelerators or 8)
    return pricing.fabric, cards


def describe(fabric) -> str:
    return (f"{KIND_NAMES.get(fabric.kind, fabric.kind)} ({fabric.gbps_per_node:,.0f} Gbit/s "
            "per node)")


def nccl_network(log_paths: list[Path | None]) -> dict | None:
    """What NCCL reported choosing in the ranks' logs: {"network": "IB", "provider": "efa"}, or
    None when no log says (NCCL_DEBUG was off, or gloo ran)."""
    for p in log_paths:
        if p is None or not p.exists():
            continue
        text = p.read_text(errors="replace")
        m = _USING.search(text)
        if m:
            out = {"network": m.group(1).strip()}
            prov = _OFI_PROVIDER.search(text)
            if prov:
                out["provider"] = prov.group(1)
            return out
    return None


def compare_cross_node(bench: dict, fabric, accelerators: int, nnodes: int, world: int,
                       nccl: dict | None) -> tuple[dict, list[dict]]:
    """(link, warnings): the largest all-reduce's wire rate per card against the fabric."""
    rows = [r for r in bench.get("rows", []) if r["op"] == "all_reduce"]
    link: dict = {"scope": f"across {nnodes} nodes", "nccl_network": nccl}
    warns: list[dict] = []
    if fabric is not None:
        link.update(fabric=fabric.kind, link=describe(fabric),
                    source=f"catalog pricing.fabric ({fabric.source})")
    if nccl is not None and fabric is not None and \
            fabric.kind not in NETWORK_KINDS.get(nccl["network"], (fabric.kind,)):
        warns.append(_warn("fabric-unused", (
            f"NCCL used its '{nccl['network']}' network between nodes, but this offer's fabric "
            f"is {describe(fabric)}: the collectives do not run over it. "
            + _FIX.get(fabric.kind, ""))))
    if not rows or fabric is None or world < 2 or nnodes < 2:
        why = ("the catalog lists no fabric for this offer" if fabric is None
               else "no all-reduce was measured")
        seen = f"; NCCL reported its network as '{nccl['network']}'" if nccl else \
            "; NCCL did not name its network (NCCL_DEBUG off, or not NCCL)"
        link["unavailable"] = f"cross-node busbw not compared: {why}{seen}"
        return link, warns
    line = fabric.gbps_per_node / 8 / max(accelerators, 1)  # GB/s per card, one direction
    expected = line * fabric.achieved_fraction
    top = max(rows, key=lambda r: r["size_bytes"])
    wire = top["busbw_gbps"] * (nnodes - 1) / (world - 1)
    link.update(measured_busbw_gbps=top["busbw_gbps"], at_size_bytes=top["size_bytes"],
                wire_gbps_per_card=wire, fabric_gbps_per_card=line,
                expected_gbps_per_card=expected, fraction_of_fabric=wire / line,
                fraction_of_expected=wire / expected,
                rule="wire rate per card = busbw x (nodes - 1) / (ranks - 1), against the "
                     "fabric's line rate per card and the share of it published runs reach "
                     "(catalog achieved_fraction); GB/s = 10^9 bytes/s")
    if wire < LOW_FRACTION * expected:
        used = f" NCCL reported its network as '{nccl['network']}'." if nccl else ""
        warns.append(_warn("fabric-low", (
            f"across {nnodes} nodes the all-reduce moves {wire:.1f} GB/s per card over the "
            f"network ({top['busbw_gbps']:.1f} GB/s busbw at "
            f"{top['size_bytes'] / 2**20:.0f} MiB): {wire / line:.0%} of the line rate of "
            f"{describe(fabric)}, {line:.1f} GB/s per card, where published runs reach "
            f"{fabric.achieved_fraction:.0%}.{used} " + _FIX.get(fabric.kind, ""))))
    return link, warns


_FIX = {
    "efa": "On AWS: the aws-ofi-nccl plugin and FI_PROVIDER=efa (the image's EFA installer), "
           "every EFA interface attached; small messages never reach line rate.",
    "infiniband": "Check that NCCL sees the HCAs (NCCL_IB_HCA, ibstat), GPUDirect RDMA is on "
                  "and NCCL_IB_DISABLE is unset.",
    "roce": "Check NCCL_IB_GID_INDEX and that the RoCE NICs carry the traffic "
            "(NCCL_SOCKET_IFNAME for bootstrap only).",
    "tcp": "A TCP fabric (GPUDirect-TCPX/TCPXO) needs its NCCL plugin to reach its rate.",
}


def _warn(code: str, message: str) -> dict:
    return {"code": code, "message": message}
