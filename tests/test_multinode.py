"""Past one node: NVSwitch seen by the NVML topology, the cross-node preflight against the
offer's fabric (and NCCL's own report of the network it used), the multi-node scale.json the
quote reads as measured, and launch files that copy back, tear down and ask Slurm for CPUs,
memory and a pilot's time. No cluster is contacted: fake NVML, fake commands, fake srun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tunepilot.catalog import load_catalog
from tunepilot.errors import UserError
from tunepilot.scaling import fabric as fab
from tunepilot.scaling.topology import topology_from_nvml

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "llama3-8b-lora.yaml"
EXE = Path(sys.executable).with_name("tunepilot")
CAT = load_catalog()


def _cli(*args, env=None, cwd=None):
    return subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


# --- NVSwitch ------------------------------------------------------------------------------


class _HgxNvml:
    """An HGX H100 board as NVML describes it: 18 active NVLinks per GPU, every one ending at
    an NVSwitch (its PCI id is the switch's, never a peer GPU's)."""

    def __init__(self, n: int = 8, switch_type: bool = True):
        self.n, self.switch_type = n, switch_type

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=f"00000008:00:{link % 4:02X}.0")  # a switch

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        if not self.switch_type:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return 0  # NVML_P2P_STATUS_OK

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50  # SYS: what the PCIe tree says without the NVLinks

    def nvmlDeviceGetCpuAffinity(self, h, words):
        return [0xFF]

    def nvmlDeviceGetNumaNodeId(self, h):
        return 0


@pytest.mark.parametrize("switch_type", [True, False], ids=["remote-type", "p2p-status"])
def test_nvml_sees_nvlink_through_nvswitch(switch_type):
    """Every pair of an HGX board talks over NVLink through NVSwitch (nvidia-smi: NV18); NVML's
    remote PCI ids are the switch's, so the topology said SYS and the preflight warned
    'pcie-only'. The link's remote device type (or, where NVML does not say it, the pair's
    NVLink P2P status) shows the switch."""
    from tunepilot.scaling.preflight import NodeProbe, rank_placement, topology_warnings

    topo = topology_from_nvml(_HgxNvml(8, switch_type), list(range(8)))
    assert len(topo.links) == 28 and set(topo.links.values()) == {"NV18"}
    node = NodeProbe(kind="cuda", device_count=8, usable_cpus=list(range(8)))
    codes = {w["code"] for w in topology_warnings(node, topo, rank_placement(
        node, topo, 8, None), 8)}
    assert "pcie-only" not in codes and "cross-numa-link" not in codes


# --- the fabric between nodes ----------------------------------------------------------------


def test_every_shipped_offer_names_its_fabric_with_a_source():
    for card in CAT.cards:
        f = card.pricing.fabric
        assert f is not None and f.kind in ("infiniband", "efa", "roce", "tcp"), card.id
        assert f.source and f.as_of
    f, cards = fab.offer_fabric("h100-sxm-80gb", CAT)
    assert (f.kind, f.gbps_per_node, cards) == ("efa", 3200, 8)  # p5.48xlarge: 32 x 100 Gb/s


def _bench(busbw_gbps: float, size=16 * 2**30) -> dict:
    return {"rows": [{"op": "all_reduce", "size_bytes": size, "busbw_gbps": busbw_gbps}]}


def test_cross_node_busbw_is_compared_with_the_fabric_not_nvlink():
    """2 x p5.48xlarge: AWS's published 487 GB/s all-reduce busbw over 16 H100s is 32 GB/s per
    card on the wire, 65% of EFA's 50 GB/s per card - no warning (compared with NVLink's
    450 GB/s it looked like a PCIe problem); a tenth of it is named, with the fabric."""
    f, cards = fab.offer_fabric("h100-sxm-80gb", CAT)
    net = {"network": "AWS Libfabric", "provider": "efa"}
    link, warns = fab.compare_cross_node(_bench(487.09), f, cards, 2, 16, net)
    assert warns == [] and link["fraction_of_fabric"] == pytest.approx(487.09 / 15 / 50)
    assert link["fabric"] == "efa" and "NVLink" not in link["link"]
    link, warns = fab.compare_cross_node(_bench(48.7), f, cards, 2, 16, None)
    assert [w["code"] for w in warns] == ["fabric-low"]
    assert "EFA" in warns[0]["message"] and "PCIe" not in warns[0]["message"]


def test_nccl_on_sockets_over_an_rdma_fabric_is_named():
    f, cards = fab.offer_fabric("mi300x-192gb", CAT)
    _, warns = fab.compare_cross_node(_bench(300), f, cards, 2, 16, {"network": "Socket"})
    assert "fabric-unused" in {w["code"] for w in warns}
    assert "InfiniBand" in warns[0]["message"] and "Socket" in warns[0]["message"]


def test_an_offer_without_a_fabric_says_what_nccl_used(tmp_path):
    log = tmp_path / "stdout.log"
    log.write_text("node1:1:1 [0] NCCL INFO NET/OFI Selected provider is efa\n"
                   "node1:1:1 [0] NCCL INFO Using network AWS Libfabric\n")
    net = fab.nccl_network([None, tmp_path / "missing.log", log])
    assert net == {"network": "AWS Libfabric", "provider": "efa"}
    link, warns = fab.compare_cross_node(_bench(400), None, 8, 2, 16, net)
    assert warns == [] and "lists no fabric" in link["unavailable"]
    assert "AWS Libfabric" in link["unavailable"]


# --- the quote reads a multi-node scale.json as measured ----------------------------------


def test_a_two_node_scale_json_is_measured_at_its_world_size(tmp_path):
    """nproc is ranks per node: 8 x 2 nodes is 16 cards measured (the quote compared nproc=8
    with 16 and projected)."""
    from test_cost import MEASURED, PROJECTED, TINY, write_run_dir
    from tunepilot.cost.quote import quote

    two_nodes = {"nproc": 8, "world_size": 16, "efficiency": 0.8,
                 "useful_tokens_per_s": 640_000.0}
    run = write_run_dir(tmp_path / "run", TINY, "h100-sxm-80gb", scale={"strategies": {
        "ddp": two_nodes, "fsdp": two_nodes}})
    q = quote(TINY, card_id="h100", count=16, term_s=3600, run_dir=run)
    assert q.throughput.total.basis == MEASURED and q.throughput.total.value == 640_000
    assert "8 per node x 2 nodes" in q.throughput.total.how
    eight = quote(TINY, card_id="h100", count=8, term_s=3600, run_dir=run)
    assert eight.throughput.efficiency.basis == PROJECTED


# --- SkyPilot -------------------------------------------------------------------------------


def test_skypilot_copies_back_over_ssh_and_tears_the_cluster_down(tmp_path):
    out = tmp_path / "pilot.sky.yaml"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "16", "--via", "skypilot",
                "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    name = plan["cluster"]
    assert plan["launch_command"].startswith(f"sky launch -c {name} -i 30 --down -y ")
    rd = plan["run_dir"]
    assert plan["commands_after"][:2] == [f"rsync -Pavz {name}:~/sky_workdir/{rd}/ {rd}/",
                                          f"sky down -y {name}"]
    assert not any("rsync-down" in c for c in plan["commands_after"])
    task = yaml.safe_load(out.read_text())
    assert task["name"] == name
    # a torch that works: the image's when it sees the GPUs, else PyPI's CUDA build, first
    setup = task["setup"].splitlines()
    torch_line = next(i for i, s in enumerate(setup) if "torch.cuda.is_available()" in s)
    assert "pip install \"torch>=" in setup[torch_line]
    assert torch_line < next(i for i, s in enumerate(setup) if "[torch,gpu]" in s)
    # node 0 writes RUN_DIR itself (scale.json the run reuses); the others their own dirs
    assert f"OUT={rd}\n" in task["run"] and f"OUT={rd}-node$SKYPILOT_NODE_RANK" in task["run"]
    stop = _cli("launch", SPEC, "--card", "h100", "--via", "skypilot", "--out", out,
                "--teardown", "stop", "--idle-minutes", "10", "--json")
    p = json.loads(stop.stdout)
    assert " -i 10 -y " in p["launch_command"] and "--down" not in p["launch_command"]
    assert p["commands_after"][1] == f"sky stop -y {p['cluster']}"


def test_a_rocm_card_needs_an_image_with_a_rocm_torch(tmp_path):
    out = tmp_path / "t.yaml"
    assert _cli("launch", SPEC, "--card", "mi300x", "--via", "skypilot", "--out",
                out).returncode == 0
    setup = yaml.safe_load(out.read_text())["setup"]
    assert "torch.version.hip" in setup and "image_id" in setup and "pip install \"torch" \
        not in setup


def _plan(teardown="down"):
    from tunepilot.launch import plan_launch
    from tunepilot.spec import load_spec

    _, plan = plan_launch(SPEC, load_spec(SPEC), CAT.get("h100"), count=8, via="skypilot",
                          out=Path("t.yaml"), hours=None, teardown=teardown)
    return plan


class _Recorder:
    def __init__(self, fail: str | None = None):
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, cmd, **kw):
        line = " ".join(cmd)
        self.calls.append(line)
        code = 1 if self.fail and line.startswith(self.fail) else 0
        return SimpleNamespace(returncode=code, stdout="", stderr="no route" if code else "")


@pytest.fixture
def sky_on_path(tmp_path, monkeypatch):
    b = tmp_path / "bin"
    b.mkdir()
    (b / "sky").write_text("#!/bin/sh\n")
    (b / "sky").chmod(0o755)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")


def test_submit_launches_the_named_cluster_copies_back_then_tears_down(sky_on_path):
    from tunepilot.launch import submit

    plan, rec = _plan(), _Recorder()
    submit(plan, Path("t.yaml"), run=rec)
    assert rec.calls[0].startswith(f"sky launch -c {plan.cluster} ")
    assert rec.calls[1].startswith(f"rsync -Pavz {plan.cluster}:~/sky_workdir/")
    assert rec.calls[2] == f"sky down -y {plan.cluster}" and len(rec.calls) == 3


def test_a_failed_job_still_comes_back_and_the_cluster_still_goes(sky_on_path):
    from tunepilot.launch import submit

    plan, rec = _plan(), _Recorder(fail="sky launch")
    with pytest.raises(UserError, match="copied back"):
        submit(plan, Path("t.yaml"), run=rec)
    assert [c.split()[0] + " " + c.split()[1] for c in rec.calls] == [
        "sky launch", "rsync -Pavz", "sky down"]


def test_a_failed_copy_back_stops_the_cluster_instead_of_deleting_it(sky_on_path):
    from tunepilot.launch import submit

    plan, rec = _plan(), _Recorder(fail="rsync")
    with pytest.raises(UserError, match="STOPPED"):
        submit(plan, Path("t.yaml"), run=rec)
    assert rec.calls[-1] == f"sky stop -y {plan.cluster}"
    assert not any(c.startswith("sky down") for c in rec.calls)


# --- Slurm ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_slurm_asks_for_cpus_memory_and_the_pilots_own_time(tmp_path):
    out = tmp_path / "p.sbatch"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "16", "--via", "slurm", "--out",
                out, "--hours", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    plan, text = json.loads(proc.stdout), out.read_text()
    # p5.48xlarge: 192 vCPUs and 2048 GiB for 8 GPUs; one task per node takes all 8
    assert "#SBATCH --cpus-per-task=192" in text and "#SBATCH --mem=1843G" in text
    assert "#SBATCH --time=24:00:00" not in text  # not the quote's whole term
    hh, mm, _ = plan["time_limit"].split(":")
    assert 0.5 <= int(hh) + int(mm) / 60 < 24 and "margin" in plan["time_limit_how"]
    assert f"#SBATCH --time={plan['time_limit']}" in text
    given = _cli("launch", SPEC, "--card", "h100", "--via", "slurm", "--out", out,
                 "--time-limit", "90m")
    assert given.returncode == 0 and "#SBATCH --time=01:30:00" in out.read_text()
    bad = _cli("launch", SPEC, "--card", "h100", "--via", "slurm", "--out", out,
               "--time-limit", "soon")
    assert bad.returncode == 2 and "--time-limit" in bad.stderr


FAKE_SRUN = r'''#!/bin/bash
nodes=1
while [ $# -gt 0 ]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}";; -w) shift;; --*) ;; *) break;; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
'''
# writes a result where --out points, as tunepilot would, and records the call
FAKE_TUNEPILOT = r'''#!/bin/bash
echo "node=$SLURM_NODEID $*" >> "$CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out="$a"; prev="$a"; done
mkdir -p "$out" && echo "{\"node\": \"$SLURM_NODEID\"}" > "$out/$1.json"
[ -n "${FAIL:-}" ] && [ "$1" = run ] && exit 1
exit 0
'''


def _slurm_env(tmp_path: Path) -> dict:
    b = tmp_path / "bin"
    b.mkdir()
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    files = {b / "srun": FAKE_SRUN, b / "scontrol": "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n",
             venv / "tunepilot": FAKE_TUNEPILOT,
             venv / "python": "#!/bin/bash\necho \"venv-python $*\" >> \"$CALLS\"\n",
             b / "python3": "#!/bin/bash\necho \"SYSTEM python3 $*\" >> \"$CALLS\"\n"}
    for p, body in files.items():
        p.write_text(body)
        p.chmod(0o755)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    return {**os.environ, "PATH": f"{b}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_NODEID": "0", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path / "home"),
            "TUNEPILOT_VENV": str(tmp_path / "venv"), "TMPDIR": str(tmp_path / "scratch"),
            "CALLS": str(tmp_path / "calls")}


@pytest.mark.parametrize("fail", [False, True], ids=["passed", "failed"])
def test_slurm_installs_into_a_venv_and_copies_the_run_back(tmp_path, fail):
    """The batch script on a fake 2-node allocation: pip runs in the venv on the shared
    filesystem (never the python first on PATH), the run happens in node-local scratch, and
    its directory comes back to the submit directory also when the job fails."""
    out = tmp_path / "p.sbatch"
    proc = _cli("launch", SPEC, "--card", "h100", "--count", "16", "--via", "slurm", "--out",
                out, "--time-limit", "1h", "--json")
    assert proc.returncode == 0, proc.stderr
    rd = json.loads(proc.stdout)["run_dir"]
    env = _slurm_env(tmp_path) | ({"FAIL": "1"} if fail else {})
    (tmp_path / "home").mkdir()
    run = subprocess.run(["bash", str(out)], cwd=tmp_path / "home", env=env,
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode != 0) == fail, run.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert any(c.startswith("venv-python -m pip install") for c in calls)
    assert not any(c.startswith("SYSTEM python3 -m pip") for c in calls)
    home = tmp_path / "home"
    assert json.loads((home / rd / "run.json").read_text())["node"] == "0"
    assert (home / rd / "scale.json").exists()  # node 0's multi-node result, in RUN_DIR
    assert (home / f"{rd}-node1" / "scale.json").exists()  # node 1's own directory
    scratch = [c for c in calls if " scale " in c or " run " in c]
    assert all(str(tmp_path / "scratch") in c for c in scratch)
