"""The scaling test for real: torchrun, 2 CPU ranks with gloo, the tiny model. Asserts the
mechanics (equal global batch, same data order, loss agreement, all ranks reported, the
teardown of a crashed or hung group), never a speed-up: this machine's efficiency is what it is.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tunepilot.proc.child import HOOK_ENV
from tunepilot.scaling import bench
from tunepilot.scaling.launch import LaunchError, launch
from tunepilot.scaling.runner import scale
from tunepilot.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
WORKER = "tunepilot.scaling.worker"

pytestmark = pytest.mark.slow


def _leftovers(marker: str) -> list[str]:
    """Processes still alive that this test started: children of pytest, or any process whose
    command line holds the test's unique directory (ranks are re-parented when torchrun dies)."""
    time.sleep(0.3)
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            # multiprocessing's resource tracker belongs to the pytest process (an earlier test
            # used multiprocessing), not to the scale run
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmd:
                left.append(f"child {p.pid}: {cmd}")
        except psutil.Error:
            pass
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(f"{p.info['pid']}: {cmd}")
    return left


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "run"
    spec = load_spec(TINY)
    messages: list[str] = []
    result = scale(spec, 2, ("ddp", "fsdp"), out=out, steps=2, warmup_steps=1,
                   base_dir=TINY.parent, device="cpu", timeout_s=240,
                   bench_sizes_bytes=[2**20, 4 * 2**20], progress=messages.append)
    return spec, out, result, messages


def _ranks(out: Path, run: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "scale" / run).glob("rank*.json"))]


def test_scale_json_has_what_the_cost_stage_reads(scaled):
    spec, out, result, messages = scaled
    data = json.loads((out / "scale.json").read_text())
    assert data["stage"] == "scale" and data["spec_hash"] == spec.spec_hash()
    for s in ("ddp", "fsdp"):
        row = data["strategies"][s]
        assert row["nproc"] == 2 and row["status"] == "ok"
        assert isinstance(row["efficiency"], float) and row["efficiency"] > 0
        assert isinstance(row["useful_tokens_per_s"], float) and row["useful_tokens_per_s"] > 0
        assert row["figures"]["useful_tokens_per_s"]["unit"] == "tokens/s"
    assert data["recommendation"]["strategy"] in ("ddp", "fsdp", "single")
    assert data["recommendation"]["reason"]
    assert any(m.startswith("ddp:") for m in messages)  # progress reached the caller


def test_global_batch_equal_and_every_rank_reported(scaled):
    _, out, result, _ = scaled
    base = _ranks(out, "baseline")
    assert len(base) == 1
    g = base[0]["micro_batch_size"] * base[0]["accumulation"] * base[0]["world_size"]
    assert g == result.global_batch.global_batch_samples == 4
    for s in ("ddp", "fsdp"):
        ranks = _ranks(out, s)
        assert [r["rank"] for r in ranks] == [0, 1]
        gathered = json.loads((out / "scale" / s / "all_ranks.json").read_text())
        assert [r["rank"] for r in gathered["ranks"]] == [0, 1]
        for r in ranks:
            assert r["micro_batch_size"] * r["accumulation"] * r["world_size"] == g
            assert r["strategy"] == s and r["backend"] == "gloo"
        assert result.strategies[s].all_ranks_reported


def test_same_data_order_as_the_baseline(scaled):
    _, out, result, _ = scaled
    base = _ranks(out, "baseline")[0]["steps"]
    for s in ("ddp", "fsdp"):
        ranks = _ranks(out, s)
        for i, step in enumerate(base):
            union = sorted(fp for r in ranks for fp in r["steps"][i]["samples"])
            assert union == sorted(step["samples"])  # the same samples in each global batch
        assert result.strategies[s].data_order_same  # and in the single-device order
        # the ranks read disjoint shards
        assert not set(ranks[0]["steps"][0]["samples"]) & set(ranks[1]["steps"][0]["samples"])


def test_loss_agrees_between_1_and_2_ranks(scaled):
    _, _, result, _ = scaled
    for s in ("ddp", "fsdp"):
        r = result.strategies[s]
        assert r.loss_agrees and r.loss_max_abs_diff < 1e-4  # fp32 on CPU
        assert len(r.loss_per_step["n_ranks"]) == 3


def test_preflight_measured_bus_bandwidth_in_a_real_launch(scaled):
    _, _, result, _ = scaled
    pre = result.preflight
    assert pre.collective["library"] == "gloo" and pre.threads_per_rank >= 1
    rows = pre.bus_bandwidth["rows"]
    assert {(r["op"], r["size_bytes"]) for r in rows} == {
        (op, s) for op in ("all_reduce", "all_gather") for s in (2**20, 4 * 2**20)}
    for r in rows:
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bench.bus_factor(r["op"], 2))
    ddp_ranks = result.strategies["ddp"].run["per_rank"]
    assert all(p["comm_inflight_s_per_step"] is not None for p in ddp_ranks)


def test_nothing_left_running_after_the_scale_test(scaled):
    _, out, _, _ = scaled
    assert _leftovers(str(out)) == []


def _worker_args(tmp: Path) -> list[str]:
    spec = load_spec(TINY)
    job = {"spec": spec.model_dump(mode="json"), "strategy": "ddp", "micro_batch": 2,
           "accumulation": 1, "global_batch": 4, "steps": 1, "warmup_steps": 0,
           "device": "cpu", "threads": 1, "out": str(tmp / "out"), "base_dir": None}
    f = tmp / "job.json"
    f.write_text(json.dumps(job))
    return [str(f)]


def test_a_crashing_rank_tears_the_group_down_and_is_named(tmp_path):
    with pytest.raises(LaunchError) as e:
        launch("scale ddp", WORKER, _worker_args(tmp_path), nproc=2, log_dir=tmp_path / "logs",
               timeout_s=120, env={HOOK_ENV: "support.faults:crash_rank_1", "OMP_NUM_THREADS": "1"})
    err = e.value
    assert err.rank == 1 and not err.timed_out
    assert "rank 1" in str(err) and "fails on purpose" in str(err)  # the rank's log tail
    assert err.log_path is not None and err.log_path.exists()
    assert _leftovers(str(tmp_path)) == []


def test_a_hanging_rank_is_torn_down_at_the_timeout(tmp_path):
    """(How soon after the timeout the group is down is benchmarks/timing_targets.py's.)"""
    timeout_s = 15
    with pytest.raises(LaunchError) as e:
        launch("scale ddp", WORKER, _worker_args(tmp_path), nproc=2, log_dir=tmp_path / "logs",
               timeout_s=timeout_s, env={HOOK_ENV: "support.faults:hang_rank_1", "OMP_NUM_THREADS": "1"})
    err = e.value
    assert err.timed_out and err.rank == 1
    assert "timed out after 15 s" in str(err) and "hanging on purpose" in str(err)
    assert _leftovers(str(tmp_path)) == []


def test_scale_result_reads_back_equal(scaled):
    from tunepilot.results.scale import ScalingResult
    from tunepilot.store import RunDir

    _, out, result, _ = scaled
    back = RunDir(out).read(ScalingResult)
    assert back == ScalingResult.from_dict(result.to_dict())
    assert back.to_dict() == json.loads((out / "scale.json").read_text())


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_tunepilot_scale_leaves_no_rank_running(tmp_path, sig):
    """SIGTERM is forwarded to torchrun's group; even SIGKILL of tunepilot (which cannot be
    caught) ends torchrun and the ranks through the parent-death signal."""
    import signal
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("tunepilot")
    out = tmp_path / f"scale-{sig}"
    proc = subprocess.Popen([str(exe), "scale", str(TINY), "--nproc", "2", "--steps", "200",
                             "--strategy", "ddp", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    ranks: list = []
    while time.monotonic() < deadline and len(ranks) < 2:  # wait until both ranks run
        ranks = [p for p in psutil.process_iter(["cmdline"])
                 if "tunepilot.scaling.worker" in " ".join(p.info["cmdline"] or [])
                 and str(out) in " ".join(p.info["cmdline"] or [])]
        time.sleep(0.2)
    assert len(ranks) >= 2, "the ranks never started"
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=60)
    end = time.monotonic() + 30
    while time.monotonic() < end and _leftovers(str(out)):
        time.sleep(0.5)
    assert _leftovers(str(out)) == []


def test_each_rank_and_each_node_record_their_host_rss(scaled):
    _, _, result, _ = scaled
    for s in ("ddp", "fsdp"):
        run = result.strategies[s].run
        rss = [p["host_peak_rss_bytes"] for p in run["per_rank"]]
        assert all(isinstance(v, int) and v > 50 * 2**20 for v in rss), rss  # torch alone > 50 MiB
        nodes = run["host_peak_rss_bytes_per_node"]
        assert len(nodes) == 1 and sum(nodes.values()) == sum(rss)  # one host: the sum of ranks
