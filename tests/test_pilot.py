"""The pilot on this CPU with the tiny model: the result and manifest, the longest batch, the
out-of-memory path (a simulated device cap), --find-max-batch, the CLI, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunepilot.cli import main
from tunepilot.dataset import TINY_DIR
from tunepilot.errors import UserError
from tunepilot.pilot.runner import PilotOptions, run_pilot
from tunepilot.plan.api import make_plan
from tunepilot.plan.calibrate import load_calibration
from tunepilot.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.yaml"
COST_KEYS = [("throughput", "useful_tokens_per_s"), ("throughput", "padded_tokens_per_s"),
             ("timings", "model_load_s"), ("timings", "setup_s"),
             ("timings", "validation_pass_s"), ("timings", "checkpoint_write_s"),
             ("timings", "checkpoint_bytes")]

pytestmark = pytest.mark.slow


def cli(*args: str) -> int:
    """Run the console entry point in-process; its exit code."""
    old = sys.argv
    sys.argv = ["tunepilot", *args]
    try:
        main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old


def figures(node, path=""):
    """Every figure dict in a result, with where it is."""
    if isinstance(node, dict):
        if "unit" in node and "basis" in node and "value" in node:
            yield path, node
        for k, v in node.items():
            yield from figures(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from figures(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pilot") / "tiny"
    res = run_pilot(load_spec(TINY), out, PilotOptions(steps=3))
    return res, out


def test_tiny_pilot_fits_and_fills_every_field(tiny_run):
    res, out = tiny_run
    d = json.loads((out / "pilot.json").read_text())
    assert d == res.to_dict() and d["fits"] is True
    assert d["verdict"] == "fits at micro_batch=4, seq=128"
    for a, b in COST_KEYS:  # what the cost stage reads
        f = d[a][b]
        assert f["basis"] == "measured" and f["value"] > 0 and f["unit"], (a, b)
    assert d["device"] == {"kind": "cpu", "name": d["device"]["name"], "card_id": None,
                           "count": 1, "memory": d["device"]["memory"]}
    assert d["steps"]["measured"]["value"] == 3 and d["steps"]["stopped_because"] == "fixed"
    st = d["step_time"]
    assert st["p50_s"]["value"] <= st["p90_s"]["value"] <= st["p99_s"]["value"] <= \
        st["max_s"]["value"]
    assert d["throughput"]["useful_tokens_per_s"]["value"] < \
        d["throughput"]["padded_tokens_per_s"]["value"]  # the shift drops one target per row
    # every figure: measured with a value, or not measured with a reason, or a projected plan
    # number with its rule
    for where, f in figures(d):
        if f["basis"] == "measured":
            assert f["value"] is not None, where
        else:
            assert f["how"], where
    # GPU-only figures are marked not measured, not faked
    assert d["memory"]["allocator"]["peak_allocated_bytes"]["basis"] == "not measured"
    assert d["memory"]["device"]["peak_bytes"]["how"]
    assert "CPU" in d["mfu"]["how"] and d["mfu"]["basis"] == "not measured"
    assert d["memory"]["process"]["peak_rss_bytes"]["value"] > 0
    # the plan's exact counts match what the step really holds (tiny, fp32, AdamW)
    comps = d["plan_vs_measured"]["components"]
    assert comps["gradients"]["ratio"]["value"] == pytest.approx(1.0)
    assert comps["weights"]["ratio"]["value"] == pytest.approx(1.0, abs=0.01)
    assert comps["optimizer"]["ratio"]["value"] == pytest.approx(1.0, abs=0.01)
    assert 0.5 < comps["activations"]["ratio"]["value"] < 1.5
    assert d["calibration"]["ratios"]["activations"] == comps["activations"]["ratio"]["value"]
    assert (out / "logs" / "pilot.log").read_text().count("measured 3 steps") == 1
    assert not any((out / "checkpoints").iterdir())  # the timing probe is removed


def test_manifest_has_provenance(tiny_run):
    _, out = tiny_run
    spec = load_spec(TINY)
    m = json.loads((out / "manifest.json").read_text())
    assert m["spec_hash"] == spec.spec_hash() and m["spec"]["model"]["preset"] == "tiny"
    assert m["device"]["kind"] == "cpu" and "card_id" in m["device"]
    assert "pilot" in m["stages"]
    p = m["provenance"]
    assert p["software"]["torch"] and p["software"]["python"] and p["software"]["tunepilot"]
    assert p["model"]["config_sha256"] and len(p["model"]["config_sha256"]) == 64
    assert p["data"]["source"] == "synthetic"
    assert p["spec_hash"] == spec.spec_hash() and p["spec"] == m["spec"]
    assert isinstance(p["env"], dict)
    assert p["git"] is None or len(p["git"]["commit"]) == 40


def test_calibrated_plan_applies_the_measured_ratios(tiny_run):
    _, out = tiny_run
    spec = load_spec(TINY)
    cal = load_calibration(out)
    base = make_plan(spec, card_ids=["h100"])
    plan = make_plan(spec, "calibrated", run_dir=out, card_ids=["h100"])
    assert plan.fidelity == "analytic+calibrated"
    assert plan.per_device.activations_bytes == pytest.approx(
        base.per_device.activations_bytes * cal.ratios["activations"], abs=2)
    assert any("calibrated by the pilot" in a for a in plan.assumptions)


def test_longest_batch_and_truncation(tmp_path):
    words = ["alpha"] * 3, ["beta"] * 40, ["gamma"] * 7, ["delta"] * 25, ["eps"] * 2
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(w)}) + "\n" for w in words))
    spec = spec_from_dict({"name": "lb", "model": {"preset": "tiny"}, "method": {"kind": "full"},
                           "precision": "fp32", "sequence_length": 16, "micro_batch_size": 2,
                           "data": {"source": "jsonl", "path": str(data),
                                    "tokenizer": str(TINY_DIR / "tokenizer")},
                           "validation": {"num_batches": 1}})
    d = run_pilot(spec, tmp_path / "run", PilotOptions(steps=1)).to_dict()
    lb = d["data"]["longest_batch"]
    # the two longest samples (40 and 25 words, both past 16 tokens) -> truncated to 16 tokens
    assert lb["micro_batch_size"] == 2 and lb["sequence_length"] == 16
    assert lb["useful_tokens"]["value"] == 2 * 15  # 16 targets per row, minus the shift
    assert d["data"]["truncated_samples"]["value"] >= 2
    assert any("truncated" in n for n in d["notes"])


def test_out_of_memory_is_a_result_not_a_crash(tmp_path, capsys):
    out = tmp_path / "oom"
    code = cli("pilot", str(TINY), "--steps", "2", "--memory-limit", "8MB", "--out", str(out),
               "--json")
    assert code == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False
    assert d["verdict"] == "does not fit at micro_batch=4, seq=128"
    dnf = d["does_not_fit"]
    assert dnf["simulated"] is True and "warm-up step 1" in dnf["phase"]
    assert dnf["live_tensor_bytes_at_oom"] > 8_000_000
    assert d["memory"]["tracked"]["peak_bytes"]["value"] > 8_000_000  # the last numbers
    assert d["timings"]["model_load_s"]["basis"] == "measured"
    assert d["throughput"]["useful_tokens_per_s"]["value"] is None  # not measured, with a reason
    assert d["throughput"]["useful_tokens_per_s"]["basis"] == "not measured"
    assert d["throughput"]["useful_tokens_per_s"]["how"]
    assert json.loads((out / "pilot.json").read_text())["fits"] is False


def test_find_max_batch_under_a_memory_limit(tmp_path):
    res = run_pilot(load_spec(TINY), tmp_path / "fmb",
                    PilotOptions(steps=1, memory_limit_bytes=16 * 2**20, find_max_batch=True))
    assert res.fits
    s = res.to_dict()["find_max_batch"]
    best = s["max_micro_batch"]["value"]
    assert 4 <= best < 64
    tries = s["tries"]
    assert all(t["fits"] == (t["micro_batch_size"] <= best) for t in tries)
    assert {"micro_batch_size": best + 1, "fits": False} in [
        {k: t[k] for k in ("micro_batch_size", "fits")} for t in tries]  # the boundary was tried
    assert all(t["tracked_peak_bytes"] <= 16 * 2**20 for t in tries if t["fits"])


def test_cli_json_run_of_the_tiny_example(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "tunepilot.cli", "pilot", str(TINY), "--steps",
                        "2", "--out", str(out), "--json"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # stdout is the JSON and nothing else
    assert d["fits"] is True and d["stage"] == "pilot"
    assert d["spec_hash"] == load_spec(TINY).spec_hash()
    assert (out / "manifest.json").exists() and (out / "logs" / "pilot.log").exists()


# --- bad input: exit 2 with a message, before any model is built ------------------------------


def write_spec(tmp_path: Path, **over) -> Path:
    base = {"model": {"preset": "tiny"}, "method": {"kind": "full"}, "precision": "fp32",
            "sequence_length": 64, "micro_batch_size": 2}
    base.update(over)
    p = tmp_path / "spec.yaml"
    p.write_text(json.dumps(base))  # JSON is YAML
    return p


TOK = str(TINY_DIR / "tokenizer")


@pytest.mark.parametrize("case,over,needle", [
    ("missing dataset", {"data": {"source": "jsonl", "path": "nope.jsonl", "tokenizer": TOK}},
     "does not exist"),
    ("missing tokenizer", {"data": {"source": "jsonl", "path": "DATA", "tokenizer": "no-tok"}},
     "tokenizer"),
    ("empty dataset", {"data": {"source": "jsonl", "path": "EMPTY", "tokenizer": TOK}},
     "no samples"),
    ("fewer samples than a batch", {"micro_batch_size": 4,
                                    "data": {"source": "jsonl", "path": "DATA", "tokenizer": TOK}},
     "fewer than one micro-batch"),
    ("qlora on cpu", {"method": {"kind": "qlora"}, "precision": "bf16-mixed"}, "qlora needs"),
    ("8-bit adam on cpu", {"optimizer": {"name": "adamw_8bit"}}, "bitsandbytes"),
])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, case, over, needle):
    (tmp_path / "data.jsonl").write_text('{"text": "one short sample"}\n')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    if "data" in over:
        d = dict(over["data"])
        d["path"] = {"DATA": str(tmp_path / "data.jsonl"),
                     "EMPTY": str(tmp_path / "empty.jsonl")}.get(d["path"], d["path"])
        over = dict(over, data=d)
    spec = write_spec(tmp_path, **over)
    code = cli("pilot", str(spec), "--steps", "1", "--out", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 2, (case, err)
    assert needle in err and "Traceback" not in err


def test_bad_memory_limit_and_steps(tmp_path, capsys):
    assert cli("pilot", str(TINY), "--memory-limit", "lots", "--out", str(tmp_path)) == 2
    assert "--memory-limit" in capsys.readouterr().err
    with pytest.raises(UserError):
        run_pilot(load_spec(TINY), tmp_path / "x", PilotOptions(steps=0))


def test_run_dir_of_another_spec_is_refused(tiny_run, tmp_path):
    _, out = tiny_run
    other = load_spec(TINY).with_changes(micro_batch_size=2)
    with pytest.raises(UserError, match="belongs to another spec"):
        run_pilot(other, out, PilotOptions(steps=1))
