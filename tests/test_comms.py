"""The step's communication terms (cost/comms.py): collectives over the offer's fabric against the
published runs' fabric, tensor/context parallel inside the node, CPU offload's optimizer step over
the host link."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tunepilot.catalog import load_catalog
from tunepilot.cost.comms import collective_s, link_of, model_parallel_s, offload_s
from tunepilot.cost.quote import quote
from tunepilot.model.arch import Arch, load_preset
from tunepilot.spec import load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CAT = load_catalog()
FULL_8B = load_spec(EXAMPLES / "llama3-8b-full.yaml")


def test_a_collective_runs_over_nvlink_inside_a_node_and_the_fabric_across():
    a100, h100 = CAT.get("a100"), CAT.get("h100")
    one_node = collective_s(16e9, 8, 1, link_of(h100))
    assert one_node == pytest.approx(16e9 * 7 / 8 / (h100.scale_up.busbw_gbps * 1e9))
    slow = collective_s(16e9, 32, 4, link_of(a100))  # p4de: EFA 400 Gb/s per node
    fast = collective_s(16e9, 32, 4, link_of(h100))  # p5: 3,200 Gb/s per node
    assert slow > 5 * fast
    assert collective_s(16e9, 64, 8, link_of(a100)) > slow  # more nodes, more leaves each


def test_a_slow_fabric_costs_efficiency_past_one_node_and_a_listed_fast_one_does_not(tmp_path):
    q_a100 = quote(FULL_8B, card_id="a100", count=32, term_s=None)
    q_h100 = quote(FULL_8B, card_id="h100", count=32, term_s=None)
    assert "efa 400 Gb/s per node" in q_a100.throughput.efficiency.how
    assert q_a100.throughput.efficiency.value < q_h100.throughput.efficiency.value - 0.1
    # the same A100 offer on 8 x 400 Gb/s InfiniBand: the published runs' fabric, no penalty
    fabric = {"kind": "infiniband", "gbps_per_node": 3200, "achieved_fraction": 0.73,
              "latency_us": 69, "source": "test offer", "as_of": "2026-12"}
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"cards": [{"id": "a100", "pricing": {"fabric": fabric}}]}))
    q_ib = quote(FULL_8B, card_id="a100", count=32, term_s=None, catalog=load_catalog(path))
    assert q_ib.throughput.efficiency.value == pytest.approx(q_h100.throughput.efficiency.value,
                                                             abs=0.01)
    assert q_ib.throughput.efficiency.value > q_a100.throughput.efficiency.value


def test_an_offer_without_a_fabric_is_taken_as_the_published_runs_and_says_so():
    card = CAT.get("h100").model_copy(update={"pricing": CAT.get("h100").pricing.model_copy(
        update={"fabric": None})})
    assert "lists no fabric" in link_of(card).how


def test_cpu_offload_adds_the_host_optimizer_step_and_the_pcie_traffic():
    spec = load_spec(EXAMPLES / "llama3.1-70b-fsdp8-offload.yaml")
    seconds, how = offload_s(spec, 70_000_000_000, 8, CAT.get("h100"))
    slower, _ = offload_s(spec, 70_000_000_000, 8, CAT.get("a100"))  # PCIe 4
    assert seconds > 10 and slower > seconds and "pcie5" in how
    q = quote(spec, card_id="h100", count=8, term_s=None)
    eff = q.throughput.efficiency
    assert "CPU offload" in eff.how and eff.value < 0.92  # under the within-node table's 0.92


def test_tensor_parallel_is_exposed_and_context_parallel_hides_behind_attention():
    arch = Arch.from_config(load_preset("llama-3.1-70b"))
    h100 = CAT.get("h100")

    def spec(tensor: int, context: int):
        return SimpleNamespace(parallel=SimpleNamespace(tensor=tensor, context=context),
                               gradient_accumulation_steps=4)

    tp, how = model_parallel_s(spec(4, 1), arch, h100, 1, 8192, 10.0)
    assert tp > 0 and "tensor 4" in how
    hidden, _ = model_parallel_s(spec(1, 2), arch, h100, 1, 8192, 100.0)
    exposed, _ = model_parallel_s(spec(1, 2), arch, h100, 1, 8192, 0.01)
    assert hidden == 0 < exposed
    assert model_parallel_s(spec(1, 1), arch, h100, 1, 8192, 1.0) == (0.0, "")
