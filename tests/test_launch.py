"""The catalog from a SkyPilot price table, and `tunepilot launch` through SkyPilot and Slurm:
the task loads with SkyPilot's own parser (a separate venv: skypilot's pins clash with the
hub client's), the sbatch script has the right directives, bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "tests" / "fixtures" / "skypilot" / "vms.csv"
EXE = Path(sys.executable).with_name("tunepilot")
SKY_PY = ROOT / ".venv-sky" / "bin" / "python"
SPEC = ROOT / "examples" / "llama3-8b-lora.yaml"


def _cli(*args, timeout=120):
    return subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_skypilot_table_becomes_a_catalog_that_quotes_use(tmp_path):
    out = tmp_path / "aws.yaml"
    proc = _cli("catalog", "import", CSV, "--out", out, "--as-of", "2026-12-01", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    cards = {c["id"]: c["pricing"] for c in r["cards"]}
    # H100: cheapest region us-east-1 98.32 / 8; no spot there -> eu-west-2's 41.20 / 8
    assert cards["h100-sxm-80gb"]["on_demand_usd_per_hour"] == "12.29"
    assert cards["h100-sxm-80gb"]["region"] == "us-east-1"
    assert cards["h100-sxm-80gb"]["instance_type"] == "p5.48xlarge"
    assert cards["h100-sxm-80gb"]["spot_usd_per_hour"] == "5.15"
    assert cards["a100-sxm-80gb"]["on_demand_usd_per_hour"] == "5.12125"
    # SkyPilot's "A100" is the 40 GB card: unknown, not mapped onto the 80 GB one; L4 unknown
    assert {u["accelerator"] for u in r["unknown"]} == {"A100", "L4"}
    assert any("H200" in w and "143,771 MiB" in w for w in r["warnings"])
    assert any("TotalGpuMemoryInMiB" in w and "per GPU" in w for w in r["warnings"])
    q = _cli("quote", SPEC, "--card", "h100", "--hours", "24", "--catalog", out, "--json")
    assert q.returncode == 0, q.stderr
    quote = json.loads(q.stdout)
    assert quote["term"]["total_cents"] == 24 * 1229
    assert quote["spot"]["spot_usd_per_hour"] == "5.15"  # the spot term priced beside it
    assert quote["spot"]["expected_cost_cents"] > quote["spot"]["naive_cost_cents"]
    assert cards["h100-sxm-80gb"]["host"]["ram_gib"] == 2048.0  # MemoryGiB of p5.48xlarge
    assert quote["host"]["host_ram_bytes_per_node"] == 256 * 2**30  # 1 card's share
    west = _cli("catalog", "import", CSV, "--out", tmp_path / "w.yaml", "--region", "eu-west-2",
                "--json")
    assert json.loads(west.stdout)["cards"][0]["pricing"]["on_demand_usd_per_hour"] == "13.8"


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.replace("AcceleratorCount", "Count"), "no column AcceleratorCount"),
    (lambda t: t.replace("98.32", "ninety"), "is not a number"),
    (lambda t: t.replace(",8.0,192.0,2048.0", ",0,192.0,2048.0", 1), "not a whole count"),
])
def test_bad_tables_exit_2_naming_the_problem(tmp_path, edit, words):
    bad = tmp_path / "vms.csv"
    bad.write_text(edit(CSV.read_text()))
    proc = _cli("catalog", "import", bad, "--out", tmp_path / "c.yaml")
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.yaml").exists()


_ROW = CSV.read_text().splitlines()[1]  # an H100 row: ...,H100,8.0,...,98.32,,us-east-1,...


@pytest.mark.parametrize("edit,field,words", [
    (lambda t: t.replace(",H100,8.0,", ",H100,nan,", 1), "AcceleratorCount", "whole count"),
    (lambda t: t.replace(",H100,8.0,", ",H100,inf,", 1), "AcceleratorCount", "whole count"),
    (lambda t: t.replace(",H100,8.0,", ",H100," + "9" * 40 + ",", 1), "AcceleratorCount",
     "whole count"),
    (lambda t: t + "p5.48xlarge,H100\n", "row 10", "has 2 of the header's 10 columns"),
    (lambda t: t + _ROW + ",extra,fields\n", "row 10", "more columns than the header"),
    (lambda t: t.replace(",110.40,41.20,", ",110.40,1e308,", 1), "SpotPrice",
     "not a plausible price"),
    (lambda t: t.replace(",110.40,41.20,", ",110.40,0,", 1), "SpotPrice", "a price > 0"),
    (lambda t: t.replace(",98.32,", ",0.0,", 1), "Price", "a price > 0"),
])
def test_hostile_table_values_exit_2_naming_row_and_column(tmp_path, edit, field, words):
    bad = tmp_path / "vms.csv"
    bad.write_text(edit(CSV.read_text()))
    proc = _cli("catalog", "import", bad, "--out", tmp_path / "c.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and field in proc.stderr and words in proc.stderr
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.slow
def test_a_100000_row_table_imports_with_a_summary(tmp_path):
    """Every H200 row lists its own wrong memory and every unknown accelerator is new: the
    warnings and unknowns are summarised, not one line per row. (Its speed, <= 15 s, is
    benchmarks/timing_targets.py's: a unit test asserts no wall time.)"""
    rows = CSV.read_text().splitlines()
    h200 = next(r for r in rows if ",H200," in r)
    lines = [rows[0]]
    for i in range(100_000):
        if i % 2:
            lines.append(h200.replace("'SizeInMiB': 81920", f"'SizeInMiB': {1000 + i}"))
        else:
            lines.append(rows[6].replace(",L4,", f",X{i},").replace("g6.xlarge", f"g{i}.x"))
    big = tmp_path / "big.csv"
    big.write_text("\n".join(lines) + "\n")
    proc = _cli("catalog", "import", big, "--out", tmp_path / "c.yaml", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.splitlines()) < 80  # a summary, not 100,000 lines
    assert "50,000 rows" in proc.stdout and "H200" in proc.stdout


@pytest.mark.slow
def test_a_partial_override_only_needs_the_keys_it_changes(tmp_path):
    cat = tmp_path / "c.yaml"
    cat.write_text(yaml.safe_dump({"schema_version": 1, "cards": [
        {"id": "h100", "pricing": {"on_demand_usd_per_hour": "3.00"}}]}))
    q = _cli("quote", SPEC, "--card", "h100", "--hours", "10", "--catalog", cat, "--json")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout)["term"]["total_cents"] == 3000


def test_launch_via_skypilot_writes_a_task_skypilot_loads(tmp_path):
    out = tmp_path / "pilot.sky.yaml"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "16", "--via", "skypilot", "--out",
                out, "--hours", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["nodes"] == 2 and plan["gpus_per_node"] == 8
    task = yaml.safe_load(out.read_text())
    assert task["resources"]["accelerators"] == "H100:8" and task["num_nodes"] == 2
    assert "tunepilot run llama3-8b-lora.yaml --card h100-sxm-80gb --count 16" in task["run"]
    assert "--node-rank $SKYPILOT_NODE_RANK" in task["run"]
    assert plan["commands_after"][0].startswith(f"rsync -Pavz {plan['cluster']}:~/sky_workdir/")
    if not SKY_PY.exists():
        pytest.skip("no .venv-sky (make test creates it): SkyPilot's own parser not run")
    check = subprocess.run([str(SKY_PY), "-c", "import sys, sky; t = sky.Task.from_yaml("
                            "sys.argv[1]); print(t.num_nodes, t.resources)", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.startswith("2 ") and "H100" in check.stdout


def test_launch_via_slurm_writes_the_directives(tmp_path):
    out = tmp_path / "pilot.sbatch"
    proc = _cli("launch", SPEC, "--card", "h200", "--count", "2", "--via", "slurm", "--out", out,
                "--hours", "24", "--time-limit", "1.5")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --gres=gpu:2", "#SBATCH --time=01:30:00"):
        assert line in text
    assert "tunepilot run" in text and "--card h200-sxm-141gb --count 2" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("args,field", [
    (["--via", "kubernetes"], "--via"),
    (["--via", "slurm", "--count", "12", "--gpus-per-node", "8"], "--count"),
    (["--via", "slurm", "--card", "h20"], "card"),
])
def test_launch_bad_input_exits_2(tmp_path, args, field):
    base = ["launch", SPEC, "--out", tmp_path / "x"]
    if "--card" not in args:
        base += ["--card", "h100"]
    proc = _cli(*base, *args)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr


FAKE_SRUN = r'''#!/bin/bash
# a 2-node allocation: srun runs its command once per node with that node's SLURM_NODEID
nodes=2; args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) nodes="${1#--nodes=}";;
    -w) shift;;
    --*) ;;
    *) break;;
  esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
'''


def _fake_bin(tmp_path: Path) -> Path:
    import os

    b = tmp_path / "bin"
    b.mkdir()
    scripts = {
        "srun": FAKE_SRUN,
        "scontrol": "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n",
        "tunepilot": f"#!/bin/bash\necho \"node=$SLURM_NODEID $*\" >> {tmp_path}/calls\n",
        "python": f"#!/bin/bash\necho \"python $*\" >> {tmp_path}/calls\n",
    }
    for name, body in scripts.items():
        (b / name).write_text(body)
        os.chmod(b / name, 0o755)
    return b


@pytest.mark.slow
def test_slurm_gives_every_node_its_own_rank_and_out_and_kills_on_a_bad_exit(tmp_path):
    """Run the written sbatch script on a fake 2-node allocation: the batch shell runs on node 0
    (SLURM_NODEID=0 there), srun runs one task per node."""
    import os

    out = tmp_path / "pilot.sbatch"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "16", "--via", "slurm", "--out",
                out, "--hours", "2")
    assert proc.returncode == 0, proc.stderr
    fake = _fake_bin(tmp_path)
    venv = tmp_path / "venv" / "bin"  # the venv the script activates (on the shared filesystem)
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(fake / "python")
    (venv / "activate").write_text(f'export PATH="{fake}:$PATH"\n')
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NODEID": "0", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "7", "TUNEPILOT_VENV": str(tmp_path / "venv"),
           "TMPDIR": str(tmp_path / "scratch")}
    run = subprocess.run(["bash", str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    scale = sorted(c for c in calls if " scale " in c)
    assert len(scale) == 2
    ranks = [c.split("--node-rank ")[1].split()[0] for c in scale]
    outs = [c.split("--out ")[1].split()[0] for c in scale]
    assert sorted(ranks) == ["0", "1"], scale  # each node its own rank
    assert len(set(outs)) == 2, scale  # each node its own directory
    for c in scale:
        node = c.split()[0].removeprefix("node=")
        out_dir = c.split("--out ")[1].split()[0]
        assert f"--node-rank {node} " in c
        assert out_dir.endswith(f"-node{node}") if node != "0" else not out_dir.endswith(
            "-node0")  # node 0 writes RUN_DIR itself: its scale.json is the run's
    assert out.read_text().count("srun --kill-on-bad-exit=1") == 2  # one failing node ends all


@pytest.mark.slow
@pytest.mark.parametrize("via", ["slurm", "skypilot"])
def test_launch_installs_this_tunepilot_not_the_package_index(tmp_path, via):
    out = tmp_path / "f"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "1", "--via", via, "--out", out,
                "--json")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert 'install "tunepilot[' not in text  # never the index when a source tree is here
    if via == "skypilot":
        task = yaml.safe_load(text)
        assert 'pip install "$HOME/.tunepilot/src[torch,gpu]"' in task["setup"]
        assert task["file_mounts"]["~/.tunepilot/src/src"] == str(ROOT / "src")
        assert task["file_mounts"]["~/.tunepilot/src/pyproject.toml"] == str(
            ROOT / "pyproject.toml")
    else:
        assert f'python -m pip install "{ROOT}[torch,gpu]"' in text
    wheel = tmp_path / "tunepilot-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "1", "--via", via, "--out", out,
                "--wheel", wheel)
    assert proc.returncode == 0, proc.stderr
    assert wheel.name in out.read_text()


def test_launch_warns_when_only_the_package_index_is_left():
    from tunepilot.launch import INDEX_INSTALL, install_plan

    got = install_plan("skypilot", None, None, source=None)
    assert got.command == INDEX_INSTALL and "package index" in got.warning
    assert "--wheel" in got.warning
    assert install_plan("slurm", "conda run pip install x", None, None).warning is None
