"""The host plan per node (plan/host.py) beside the device plan, the offers' host facts in the
catalog, and the quote/compare refusing an offer by host RAM with the binding resource named.

The catalogs written here are FIXTURES (an offer with too little host RAM, one with none); the
shipped offers' host figures carry their sources in resources/catalog.yaml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tunepilot.catalog import load_catalog
from tunepilot.catalog.skypilot import import_vms_csv
from tunepilot.cost.compare import compare
from tunepilot.cost.quote import quote
from tunepilot.errors import UserError
from tunepilot.model.arch import resolve_arch
from tunepilot.plan.analytic.core import state_bytes
from tunepilot.plan.api import make_plan
from tunepilot.plan.host import Layout, host_plan
from tunepilot.scaling.analysis import host_per_node
from tunepilot.scaling.messages import RankRecord
from tunepilot.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXE = Path(sys.executable).with_name("tunepilot")
GIB = 1 << 30
FSDP_70B = load_spec(EXAMPLES / "llama3.1-70b-fsdp8.yaml")
OFFLOAD_70B = load_spec(EXAMPLES / "llama3.1-70b-fsdp8-offload.yaml")
LORA_8B = load_spec(EXAMPLES / "llama3-8b-lora.yaml")
ARCH_70B = resolve_arch(FSDP_70B, None)


def small_host_catalog(tmp_path: Path) -> Path:
    """h100: an 8-card offer with 512 GiB of host RAM; h200: an offer that lists none."""
    path = tmp_path / "small-host.yaml"
    path.write_text(yaml.safe_dump({"cards": [
        {"id": "h100", "pricing": {"host": {
            "instance_type": "small-8x", "accelerators": 8, "ram_gib": 512, "vcpus": 96,
            "source": "test fixture", "as_of": "2026-12-04"}}},
        {"id": "h200", "pricing": {"host": None}}]}))
    return path


def test_70b_fsdp8_with_cpu_offload_needs_hundreds_of_gib_per_node():
    # the offload example is the 70B FSDP x 8 example with parallel.cpu_offload: true
    assert OFFLOAD_70B.with_changes(parallel={**OFFLOAD_70B.parallel.model_dump(),
                                              "cpu_offload": False}).spec_hash() == \
        FSDP_70B.spec_hash()
    plan = make_plan(OFFLOAD_70B, card_ids=["h100", "h200", "a100"])
    h = plan.host
    states = state_bytes(OFFLOAD_70B, ARCH_70B).model_states
    # bf16-true AdamW: 2 (weights) + 2 (grads) + 4 (two bf16 moments) B/param, all 8 shards
    assert states == 8 * state_bytes(OFFLOAD_70B, ARCH_70B).params
    offload = h.component("cpu offload")
    assert offload.bytes_per_node == 8 * (states // 8) and offload.pinned
    assert h.peak_phase == "training" and h.needs_host_ram
    assert h.peak_bytes_per_node == offload.bytes_per_node + 8 * 2 * GIB + 8 * 4096 * 24
    assert 300 * GIB < h.peak_bytes_per_node < 1000 * GIB  # "hundreds of GiB"
    # the shipped offers (p5 2048 GiB, p5en 2048 GiB, p4de 1152 GiB) hold it; host RAM binds
    for row in plan.cards:
        assert row.host.host_fits and row.host.binds == "host RAM", row.card
    # without offload the training phase is the process alone: the load sets the peak
    assert make_plan(FSDP_70B, card_ids=["h100"]).host.peak_phase == "model-load"


def test_loading_per_rank_reads_the_checkpoint_once_per_rank():
    total = state_bytes(FSDP_70B, ARCH_70B).params * 2  # 16-bit checkpoint
    by = {mode: host_plan(FSDP_70B.with_changes(host={"load": mode}), ARCH_70B)
          for mode in ("per-rank", "rank0", "mmap")}
    assert by["per-rank"].component("model load").bytes_per_node == 8 * total
    assert by["rank0"].component("model load").bytes_per_node == total
    assert by["mmap"].component("model load").bytes_per_rank == 0
    assert host_plan(FSDP_70B, ARCH_70B).load == "rank0"  # auto under FSDP
    assert host_plan(LORA_8B, resolve_arch(LORA_8B, None)).load == "per-rank"
    # the host section does not change what the pilot measures: not in the spec hash
    assert by["mmap"].load == "mmap"
    assert FSDP_70B.with_changes(host={"load": "mmap"}).spec_hash() == FSDP_70B.spec_hash()


def test_workers_async_staging_and_activation_offload_are_counted_per_node():
    spec = OFFLOAD_70B.with_changes(
        host={"async_checkpoint": True}, activation_offloading=True,
        data={"source": "synthetic", "num_workers": 4})
    h = host_plan(spec, ARCH_70B)
    workers = h.component("dataloader workers")
    assert workers.holders == 32 and workers.bytes_per_node == 32 * workers.bytes_per_rank
    staging = h.component("async checkpoint staging")
    assert staging.phases == ["checkpoint-save"] and staging.bytes_per_node > 100 * GIB
    act = h.component("activation offload")
    assert act.phases == ["training"] and act.bytes_per_node > 0
    save = next(p for p in h.phases if p.name == "checkpoint-save")
    train = next(p for p in h.phases if p.name == "training")
    assert save.bytes_per_node - train.bytes_per_node == \
        staging.bytes_per_node - act.bytes_per_node


def test_a_70b_offload_plan_is_refused_on_an_offer_with_too_little_host_ram(tmp_path):
    cat = load_catalog(small_host_catalog(tmp_path))
    with pytest.raises(UserError) as err:
        quote(OFFLOAD_70B, card_id="h100", count=8, term_s=None, catalog=cat)
    assert err.value.field == "card"
    assert "host RAM binds" in err.value.message and "541.7 GiB" in err.value.message
    assert "460.8 GiB usable" in err.value.message and "cpu offload" in err.value.message
    assert "cpu_offload" in err.value.hint
    c = compare(OFFLOAD_70B, catalog=cat)
    refused = {r.card: r.reason for r in c.refused}
    assert "host RAM binds" in refused["h100-sxm-80gb"]
    assert "lists no host RAM" in refused["h200-sxm-141gb"]
    assert {q.card_id for q in c.rows} == {"a100-sxm-80gb", "mi300x-192gb"}
    assert all(q.host.fits for q in c.rows)


def test_an_offer_with_no_host_ram_where_the_plan_needs_one_exits_2(tmp_path):
    spec = EXAMPLES / "llama3.1-70b-fsdp8-offload.yaml"
    proc = subprocess.run([str(EXE), "quote", str(spec), "--card", "h200", "--count", "8",
                           "--catalog", str(small_host_catalog(tmp_path)), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-500:]
    assert "h200-sxm-141gb.pricing.host.ram_gib" in proc.stderr
    assert "lists no host RAM" in proc.stderr and "Traceback" not in proc.stderr


def test_a_lora_8b_plan_on_an_instance_with_ample_ram_is_unaffected(tmp_path):
    plan = make_plan(LORA_8B, card_ids=["h100"])
    assert plan.host.peak_bytes_per_node < 20 * GIB and not plan.host.needs_host_ram
    assert plan.cards[0].host.binds == "device memory" and plan.cards[0].host.host_fits
    with_host = quote(LORA_8B, card_id="h100", count=1, term_s=None)
    cat = load_catalog(small_host_catalog(tmp_path))  # h200 without host facts
    without = quote(LORA_8B, card_id="h200", count=1, term_s=None, catalog=cat)
    shipped_h200 = quote(LORA_8B, card_id="h200", count=1, term_s=None)
    assert with_host.host.fits and without.host.host_fits is None
    # no host facts and no host-held state: the quote is the same as with them
    assert without.term == shipped_h200.term and without.job_s == shipped_h200.job_s
    assert with_host.host.utilisation["host RAM"] < 0.1


def test_the_offer_host_block_is_validated_and_replaced_whole(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cards": [{"id": "h100", "pricing": {"host": {
        "accelerators": 8, "ram_gib": 1024, "source": "mine", "as_of": "2026-12-04"}}}]}))
    h = load_catalog(path).get("h100").pricing.host
    assert h.ram_gib == 1024 and h.local_disk_gb is None  # not the shipped p5's 30,400 GB
    assert h.ram_bytes(4) == 512 * GIB
    for bad, field in ((float("nan"), "ram_gib"), (-1, "ram_gib")):
        path.write_text(yaml.safe_dump({"cards": [{"id": "h100", "pricing": {"host": {
            "accelerators": 8, "ram_gib": bad, "source": "x", "as_of": "2026-12-04"}}}]}))
        with pytest.raises(UserError) as err:
            load_catalog(path)
        assert err.value.field == f"catalog.cards[0].pricing.host.{field}"  # the user's entry
    # a price of another source is another offer: the shipped example's spot does not leak in
    path.write_text(yaml.safe_dump({"cards": [{"id": "h100", "pricing": {
        "on_demand_usd_per_hour": "3.00", "source": "my quote", "as_of": "2026-12-04"}}]}))
    p = load_catalog(path).get("h100").pricing
    assert p.spot_usd_per_hour is None and p.host is None


def test_catalog_import_reads_host_ram_and_vcpus(tmp_path):
    csv = tmp_path / "vms.csv"
    csv.write_text((ROOT / "tests/fixtures/skypilot/vms.csv").read_text()
                   .replace("p4de.24xlarge,A100-80GB,8.0,96.0,1152.0",
                            "p4de.24xlarge,A100-80GB,8.0,96.0,640.0"))
    r = import_vms_csv(csv, as_of="2026-12-01")
    cards = {c["id"]: c["pricing"] for c in r.cards}
    assert cards["h100-sxm-80gb"]["host"]["ram_gib"] == 2048.0
    assert cards["h100-sxm-80gb"]["host"]["vcpus"] == 192
    assert cards["h100-sxm-80gb"]["host"]["accelerators"] == 8
    # 640 GiB for 8 x 80 GB: the GPUs' own memory, not host RAM (RunPod v7's MemoryGiB trap)
    assert "host" not in cards["a100-sxm-80gb"]
    assert any("MemoryGiB 640" in w and "not host RAM" in w for w in r.warnings)


def test_each_node_sums_its_ranks_peak_rss():
    def rec(rank, host, rss):
        memory = {} if rss is None else {"host_peak_rss_bytes": {"value": rss}}
        return RankRecord(rank=rank, strategy="fsdp", host=host, memory=memory)

    nodes = host_per_node([rec(0, "a", 10), rec(1, "a", 20), rec(2, "b", 5), rec(3, "b", None)])
    assert nodes == {"a": 30, "b": 5}


def test_quote_on_cards_layout_is_nodes_of_eight():
    lay = Layout.on_cards(FSDP_70B, 16, "fsdp")
    assert (lay.world, lay.per_node, lay.nodes) == (16, 8, 2)
    one = host_plan(OFFLOAD_70B, ARCH_70B, layout=Layout.on_cards(OFFLOAD_70B, 8, "fsdp"))
    two = host_plan(OFFLOAD_70B, ARCH_70B, layout=lay)
    # two nodes hold half the offloaded state each
    assert two.component("cpu offload").bytes_per_node * 2 == pytest.approx(
        one.component("cpu offload").bytes_per_node, rel=1e-6)


def test_plan_json_carries_the_host_plan_and_each_offers_fit():
    proc = subprocess.run([str(EXE), "plan", str(EXAMPLES / "llama3-8b-lora.yaml"), "--card",
                           "mi300x", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["host"]["peak_phase"] == "model-load"
    row = data["cards"][0]["host"]
    assert row["instance"] == "Standard_ND96isr_MI300X_v5" and row["host_fits"] is True
