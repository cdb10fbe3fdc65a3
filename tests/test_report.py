"""The report as a person reads it: a callback run's report, the charts' geometry (labels inside
the picture and off the bars), a small model's memory, and term lengths in words."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tunepilot.report import charts

ROOT = Path(__file__).resolve().parents[1]
CHAR_PX = 6.2  # the width of one character at the charts' 11 px sans-serif (generous)


def _text_box(s: dict) -> tuple[float, float, float, float]:
    w = len(s["text"]) * CHAR_PX
    x0 = {"start": s["x"], "end": s["x"] - w, "middle": s["x"] - w / 2}[s["anchor"]]
    return x0, s["y"] - 9, x0 + w, s["y"] + 2


def _overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("values", [
    [100.0] * 30 + [101.0, 140.0],  # p50 on the tallest bar, p99 at the right edge
    [50 + (i % 7) for i in range(40)] + [400.0],
])
def test_histogram_marker_labels_stay_inside_and_off_the_bars(values):
    s = sorted(values)
    marks = {"p50": s[len(s) // 2], "p90": s[int(len(s) * 0.9)], "p99": s[-1]}
    c = charts.histogram("step time", values, marks, "ms", "wall time (ms)")
    bars = [(r["x"], r["y"], r["x"] + r["w"], r["y"] + r["h"]) for r in c.shapes
            if r["kind"] == "rect" and r["h"] > 0]
    labels = [t for t in c.shapes if t["kind"] == "text" and
              re.match(r"p(50|90|99) ", t["text"])]
    assert len(labels) == 3
    boxes = [_text_box(t) for t in labels]
    for t, box in zip(labels, boxes, strict=True):
        assert box[0] >= 0 and box[2] <= c.width, (t["text"], box, c.width)  # not clipped
        assert not any(_overlaps(box, b) for b in bars), t["text"]  # not drawn over a bar
    for i, a in enumerate(boxes):  # and not over each other
        assert not any(_overlaps(a, b) for b in boxes[i + 1:])


def test_a_small_models_memory_shows_its_training_state_not_only_the_runtime():
    from tunepilot.plan.api import make_plan
    from tunepilot.report.html import _memory
    from tunepilot.spec import load_spec

    plan = make_plan(load_spec(ROOT / "examples" / "tiny.yaml"), card_ids=["h100-sxm-80gb"])
    mem = _memory(plan, None)
    widths: dict[str, float] = {}
    for ch in mem["charts"]:
        for r in ch.shapes:
            if r["kind"] == "rect":
                comp = r["tip"].split(":")[0]
                widths[comp] = max(widths.get(comp, 0), r["w"])
    state = {k: v for k, v in widths.items() if k != "allocator + runtime"}
    assert state and max(state.values()) >= 100, widths  # visible, not 1-px slivers


def test_the_memory_chart_draws_the_fit_tables_device_peak_for_every_card():
    """One figure, one source: the demo's chart drew 804 MiB on all four cards where the table
    said 867.6 MiB (1.06 GiB on MI300X) - it dropped the cuBLAS workspace (in allocated, in no
    component) and drew one card's runtime for all."""
    from tunepilot.plan.api import make_plan
    from tunepilot.report.html import _memory
    from tunepilot.resources import DEMO_SPEC_YAML
    from tunepilot.spec import load_spec

    plan = make_plan(load_spec(DEMO_SPEC_YAML))
    assert len({c.device_peak_bytes for c in plan.cards}) > 1  # ROCm's runtime differs
    mem = _memory(plan, None)
    chart = mem["charts"][0]
    texts = [t["text"] for t in chart.shapes if t["kind"] == "text"]
    widths = [r for r in chart.shapes if r["kind"] == "rect"]
    assert widths and any("workspaces (cuBLAS)" in r["tip"] for r in widths)
    for card, row in zip(plan.cards, mem["fit_rows"], strict=True):
        assert row[2] in texts  # the table's device peak, word for word, at the bar's end
        bar = next(b for b in _bars_of(plan) if b["label"].startswith(card.card))
        assert sum(bar["values"].values()) == card.device_peak_bytes


def _bars_of(plan):
    """The bars _memory hands the chart (captured from charts.stacked_bars)."""
    from unittest import mock

    from tunepilot.report import charts, html

    with mock.patch.object(charts, "stacked_bars", wraps=charts.stacked_bars) as spy:
        html._memory(plan, None)
    return spy.call_args_list[0].args[1]


@pytest.mark.parametrize("seconds,words", [(780, "13 minutes"), (5400, "1.5 hours"),
                                           (3 * 86400, "3 days"), (45, "45 seconds")])
def test_term_lengths_read_as_words_not_fractions_of_an_hour(seconds, words):
    from tunepilot.units import fmt_hours

    assert fmt_hours(seconds) == words


@pytest.fixture(scope="module")
def callback_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cb") / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "own-loop" / "hf_train.py"),
                           "--out", str(out), "--steps", "4", "--save-steps", "100"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_report_of_a_callback_run_is_not_a_failed_run_and_shows_its_memory(callback_run):
    from tunepilot.report.html import build_report
    from tunepilot.units import fmt_bytes

    html, _ = build_report(callback_run)
    page = html.read_text()
    decision = re.search(r'<div class="decision ([a-z]+)" id="decision">(.*?)</div>', page, re.S)
    assert decision is not None
    assert decision.group(1) != "notready", decision.group(0)  # not red
    assert "has not finished" not in decision.group(2)
    assert "TunepilotCallback" in decision.group(2) and "tunepilot quote" in decision.group(2)
    memory = page.split('<section id="memory">')[1].split("</section>")[0]
    peak = json.loads((callback_run / "pilot.json").read_text())["memory"]["process"][
        "peak_rss_bytes"]["value"]
    assert "No plan in this run directory" not in memory
    assert "peak RSS" in memory and "measured" in memory
    assert fmt_bytes(peak) in memory
