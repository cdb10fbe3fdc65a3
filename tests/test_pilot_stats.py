"""The pilot's arithmetic on known numbers: percentiles, CV, the t-interval stop rule, the
max-batch search, size parsing, the device -> catalog card mapping, and the tensor tracker."""

from __future__ import annotations

import math

import pytest
import torch

from tunepilot.device import MemorySampler, card_id_for_device_name
from tunepilot.errors import UserError
from tunepilot.pilot.provenance import git_state, relevant_env
from tunepilot.pilot.stats import (
    StopRule,
    ci95_half_width,
    percentile,
    stdev,
    summarize,
    t975,
)
from tunepilot.plan.search import largest_passing
from tunepilot.plan.trace.tracker import StorageTracker, tensor_bytes
from tunepilot.units import parse_bytes

# --- statistics ------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly_like_numpy():
    xs = list(range(1, 11))  # 1..10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 10
    assert percentile([3.0], 99) == 3.0
    assert percentile([10, 1, 5], 50) == 5  # order does not matter


def test_sample_stdev_and_cv():
    xs = [2, 4, 4, 4, 5, 5, 7, 9]  # mean 5, sum of squares 32, ddof=1 -> sqrt(32/7)
    s = summarize(xs)
    assert s.mean == 5
    assert s.std == pytest.approx(math.sqrt(32 / 7))
    assert s.cv == pytest.approx(math.sqrt(32 / 7) / 5)
    assert stdev([1.0]) == 0.0


def test_t_quantiles_table_and_expansion():
    assert t975(1) == 12.706
    assert t975(9) == 2.262
    assert t975(40) == pytest.approx(2.0211, abs=2e-4)  # tables: 2.021
    assert t975(120) == pytest.approx(1.9799, abs=2e-4)  # tables: 1.980
    with pytest.raises(ValueError):
        t975(0)


def test_ci_half_width_on_known_numbers():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]  # s = sqrt(2.5), n = 5, t(0.975, 4) = 2.776
    assert ci95_half_width(xs) == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert ci95_half_width([1.0]) == math.inf


def test_stop_rule_converges_on_steady_steps():
    rule = StopRule(max_steps=100)
    steady = [0.100, 0.101, 0.099, 0.100]
    assert rule.verdict(steady) is None  # fewer than MIN_STEPS
    steady.append(0.100)
    assert rule.verdict(steady) == "converged"  # half-width ~0.1% < 2%


def test_stop_rule_runs_to_max_steps_on_noisy_steps():
    rule = StopRule(max_steps=8)
    noisy = [0.1, 0.3, 0.1, 0.3, 0.1, 0.3, 0.1]
    assert rule.verdict(noisy) is None
    assert rule.verdict([*noisy, 0.3]) == "max_steps"


def test_stop_rule_boundary_is_two_percent():
    # [1+d, 1-d, 1+d, 1-d, 1]: mean 1, s = d, half-width = t(0.975, 4) * d / sqrt(5)
    def steps_with_rel(rel):
        d = rel * math.sqrt(5) / 2.776
        return [1 + d, 1 - d, 1 + d, 1 - d, 1.0]

    xs = steps_with_rel(0.019)
    assert ci95_half_width(xs) / 1.0 == pytest.approx(0.019, rel=1e-6)
    assert StopRule(max_steps=50).verdict(xs) == "converged"
    assert StopRule(max_steps=50).verdict(steps_with_rel(0.021)) is None


def test_fixed_steps_ignore_the_adaptive_rule():
    rule = StopRule(max_steps=100, fixed_steps=3)
    assert rule.verdict([1.0, 1.0]) is None
    assert rule.verdict([1.0, 1.0, 1.0]) == "fixed"
    assert rule.limit == 3


# --- the max-batch search --------------------------------------------------------------------


@pytest.mark.parametrize("largest", [1, 2, 3, 13, 64, 100])
def test_largest_passing_finds_the_boundary(largest):
    best, tries = largest_passing(lambda b: b <= largest, 1024)
    assert best == largest
    assert all(ok == (b <= largest) for b, ok in tries)
    assert len(tries) <= 2 * math.ceil(math.log2(largest + 1)) + 2


def test_largest_passing_from_known_points():
    best, tries = largest_passing(lambda b: b <= 13, 1024, known_ok=4)
    assert best == 13 and tries[0][0] == 8  # doubles from the known good size
    best, tries = largest_passing(lambda b: b <= 2, 1024, known_bad=4)
    assert best == 2 and all(b < 4 for b, _ in tries)
    assert largest_passing(lambda b: False, 1024)[0] == 0
    assert largest_passing(lambda b: True, 16)[0] == 16  # the cap


# --- sizes, cards, tracker, sampler, provenance ----------------------------------------------


def test_parse_bytes_units():
    assert parse_bytes("12884901888") == 12 * 2**30
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20
    for bad in ("twelve", "12 parsecs", "0", "-3GB"):
        with pytest.raises(UserError):
            parse_bytes(bad)


@pytest.mark.parametrize("name,memory,card", [
    ("NVIDIA H200", 150_000_000_000, "h200-sxm-141gb"),
    ("NVIDIA H100 80GB HBM3", 85_520_000_000, "h100-sxm-80gb"),
    ("NVIDIA A100-SXM4-80GB", 85_100_000_000, "a100-sxm-80gb"),
    ("AMD Instinct MI300X", 205_000_000_000, "mi300x-192gb"),
    ("NVIDIA H200", None, "h200-sxm-141gb"),
    ("NVIDIA A100-SXM4-40GB", 42_000_000_000, None),  # memory does not match the 80GB card
    ("NVIDIA H100 PCIe", 85_000_000_000, None),  # another form factor, another peak
    ("NVIDIA H100 NVL", 100_000_000_000, None),
    ("NVIDIA GeForce RTX 4090", 25_000_000_000, None),
])
def test_device_name_to_catalog_card(name, memory, card):
    assert card_id_for_device_name(name, memory) == card


def test_tracker_counts_storages_once_and_frees_them():
    tr = StorageTracker(1, device_type="cpu")
    with tr:
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        v = a.view(32, 32)  # a view: no new storage
        assert tr.live_bytes == 4096
        b = a * 2
        assert tr.live_bytes == 8192 and tr.peak_bytes == 8192
        del b
        assert tr.live_bytes == 4096
    del v, a
    assert tr.live_bytes == 0 and tr.peak_bytes == 8192


def test_tracker_limit_raises_the_allocators_error():
    tr = StorageTracker(1, limit_bytes=10_000, device_type="cpu")
    keep = torch.zeros(1000)  # made outside: adopted
    assert tr.adopt([keep]) == 4000
    with tr, pytest.raises(torch.OutOfMemoryError, match="simulated device memory limit"):
        torch.ones(2000)  # 8000 more bytes: 12000 > 10000
    assert tr.num_ooms == 1
    assert tr.live_bytes == 4000  # the failed allocation was freed
    assert tensor_bytes([keep, keep[:10]]) == 4000


def test_sampler_keeps_peak_over_baseline():
    readings = iter([100, 100, 250, 180, 120, 120, 120])
    s = MemorySampler("test", lambda: next(readings, 120), interval_s=3600)
    s.start()
    s.sample()
    s.sample()
    r = s.stop()
    assert r.baseline_bytes == 100 and r.peak_bytes == 250 and r.peak_minus_baseline_bytes == 150


def test_provenance_env_and_git(tmp_path):
    env = {"NCCL_DEBUG": "INFO", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HIP_VISIBLE_DEVICES": "0", "HOME": "/root",
           "AWS_SECRET_ACCESS_KEY": "x"}
    assert relevant_env(env) == {k: env[k] for k in ("CUBLAS_WORKSPACE_CONFIG", "HIP_VISIBLE_DEVICES",
                                                     "NCCL_DEBUG", "PYTORCH_CUDA_ALLOC_CONF")}
    assert git_state(tmp_path) is None


def test_a_wide_interval_or_a_loaded_machine_is_said_not_called_converged(monkeypatch):
    from tunepilot.pilot import load
    from tunepilot.pilot.assemble import _confidence

    assert _confidence(0.02, None).startswith("converged")
    wide = _confidence(0.43, None)
    assert "+-43%" in wide and "wider than +-10%" in wide and not wide.startswith("converged")

    monkeypatch.setattr(load.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(load.os, "cpu_count", lambda: 2)
    ticks = iter([[100, 0, 50, 800, 0, 0, 0, 0], [200, 0, 100, 1550, 0, 0, 0, 100]])
    monkeypatch.setattr(load, "_cpu_times", lambda: next(ticks))
    m = load.MachineLoadWatch().stop()
    assert m.loaded and m.load_average_1m == 3.0 and abs(m.cpu_steal_fraction - 0.1) < 1e-9
    said = _confidence(0.02, m)
    assert "load average 3.00 on 2 cores" in said and "stole 10%" in said
    assert not said.startswith("converged")
