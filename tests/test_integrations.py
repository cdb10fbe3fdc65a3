"""The user's own run: real HF Trainer and real Lightning with TunepilotCallback, `tunepilot watch`
on a child of known size and length, `tunepilot verify` on HF and tunepilot checkpoints, and
`resume_from`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
OWN = ROOT / "examples" / "own-loop"
EXE = Path(sys.executable).with_name("tunepilot")
sys.path.insert(0, str(OWN))

from tiny_data import VariedLengths, collate, tiny_config  # noqa: E402


def _cli(*args, timeout=300):
    return subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _hf_run(tmp_path, *, steps=8, out=None, save_steps=100, callback=None):
    """An in-process HF Trainer run on the tiny model; the batches it trained on."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from tunepilot.integrations.hf import TunepilotCallback

    seen = []

    def recording_collate(rows):
        b = collate(rows)
        seen.append(b)
        return b

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_config()),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=steps,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             logging_steps=2, save_steps=save_steps, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, seed=0, disable_tqdm=True)
    cb = callback or TunepilotCallback(out_dir=out or tmp_path / "run")
    trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(128, 512),
                      data_collator=recording_collate, callbacks=[cb])
    trainer.train()
    cb.global_step = trainer.state.global_step
    cb.global_log = trainer.state.log_history
    return cb, seen


@pytest.mark.slow
def test_hf_trainer_callback_counts_steps_and_useful_vs_padded_tokens(tmp_path):
    cb, seen = _hf_run(tmp_path, steps=8)
    d = json.loads((tmp_path / "run" / "pilot.json").read_text())
    assert d["source"] == "hf-callback" and d["run"]["trainer"] == "transformers.Trainer"
    assert d["steps"]["warmup"]["value"] == 2 and d["steps"]["measured"]["value"] == 6
    measured = seen[2 * 2:2 * 2 + 12]  # after 2 warm-up steps x 2 micro-batches (accelerate's
    # loader fetches one batch ahead: the last one seen is never trained)
    assert len(measured) == 12
    useful = sum(int((b["labels"][:, 1:] != -100).sum()) for b in measured)
    padded = sum(b["input_ids"].numel() for b in measured)
    t = d["throughput"]
    assert t["useful_tokens"]["value"] == useful and t["padded_tokens"]["value"] == padded
    assert 0 < useful < padded  # varied lengths: padding, and prompts not trained
    assert d["per_step"]["padded_tokens"]["value"] == [
        sum(b["input_ids"].numel() for b in measured[i:i + 2]) for i in range(0, 12, 2)]
    assert d["step_time"]["p50_s"]["basis"] == "measured"
    assert d["step_time"]["p50_s"]["value"] > 0
    spec = (tmp_path / "run" / "spec.yaml").read_text()
    assert "lora_rank: 4" in spec and "micro_batch_size: 4" in spec
    logged = [h["loss"] for h in cb.global_log if "loss" in h]  # logging_steps=2: steps 2..8
    assert d["loss"]["first"]["value"] == logged[0] and d["loss"]["last"]["value"] == logged[-1]


@pytest.mark.slow
def test_quote_and_report_read_the_callbacks_run_directory(tmp_path):
    _hf_run(tmp_path, steps=5, save_steps=4)
    run = tmp_path / "run"
    d = json.loads((run / "pilot.json").read_text())
    assert d["timings"]["checkpoint_bytes"]["value"] > 0
    proc = _cli("quote", run / "spec.yaml", "--from", run, "--card", "h100-sxm-80gb",
                "--hours", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    q = json.loads(proc.stdout)
    assert q["run_dir"]["files"] == ["pilot.json"]
    proc = _cli("report", run)
    assert proc.returncode == 0, proc.stderr
    assert (run / "report.html").stat().st_size > 1000


@pytest.mark.slow
def test_a_failing_callback_warns_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should go")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb, seen = _hf_run(tmp_path, steps=4, out=blocker)
    assert cb.global_step == 4 and len(seen) >= 8  # every step trained
    assert any("tunepilot" in str(w.message) and "your run goes on" in str(w.message)
               for w in caught)
    assert blocker.read_text().startswith("a file")


@pytest.mark.slow
def test_lightning_callback_counts_steps_and_tokens(tmp_path):
    import lightning as L
    from lightning_train import CausalLM  # the example's own LightningModule

    from tunepilot.integrations.lightning import TunepilotCallback

    seen = []

    def recording_collate(rows):
        b = collate(rows)
        seen.append(b)
        return b

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(VariedLengths(64, 512), batch_size=4,
                                         collate_fn=recording_collate)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[TunepilotCallback(out_dir=tmp_path / "run")])
    trainer.fit(CausalLM(), loader)
    d = json.loads((tmp_path / "run" / "pilot.json").read_text())
    assert d["source"] == "lightning-callback"
    assert d["steps"]["measured"]["value"] == 4
    measured = seen[4:12]
    assert d["throughput"]["useful_tokens"]["value"] == sum(
        int((b["labels"][:, 1:] != -100).sum()) for b in measured)
    assert d["throughput"]["padded_tokens"]["value"] == sum(b["input_ids"].numel()
                                                           for b in measured)
    assert "kind: full" in (tmp_path / "run" / "spec.yaml").read_text()


@pytest.mark.slow
def test_watch_measures_a_child_of_known_size_and_length(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import time, sys\nb = bytearray(200 << 20)\nb[::4096] = b'\\x01' * "
                     "len(b[::4096])\ntime.sleep(1.0)\nsys.exit(3)\n")
    proc = _cli("watch", "--out", tmp_path / "w", "--interval-s", "0.05", "--json", "--",
                sys.executable, child)
    assert proc.returncode == 1  # the command's own failure is reported
    d = json.loads(proc.stdout)
    w = d["watched"]
    assert w["exit_code"] == 3 and w["wall_s"]["value"] >= 1.0  # it slept 1 s
    assert d["memory"]["process"]["peak_rss_bytes"]["value"] >= 200 << 20
    assert d["source"] == "watch" and d["step_time"]["mean_s"]["basis"] == "not measured"
    assert _cli("report", tmp_path / "w").returncode == 0


@pytest.mark.slow
def test_watch_forwards_sigterm_to_the_whole_tree_and_leaves_no_orphans(tmp_path):
    pidfile = tmp_path / "pids"
    child = tmp_path / "tree.py"
    child.write_text(textwrap_tree(pidfile))
    proc = subprocess.Popen([str(EXE), "watch", "--out", str(tmp_path / "w"), "--json", "--",
                             sys.executable, str(child)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while time.time() < deadline and not (pidfile.exists() and
                                          len(pidfile.read_text().split()) >= 2):
        time.sleep(0.1)
    pids = [int(x) for x in pidfile.read_text().split()]
    # no wait: watch's forwarding is in place before the command starts
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    d = json.loads(out)
    assert d["watched"]["signal"] == "SIGTERM"
    assert _ended(pids, within_s=10.0), "a process of the watched tree outlived watch"


def _ended(pids: list[int], *, within_s: float) -> bool:
    """Every pid gone or a zombie (ended, not yet reaped: a grandchild reparented to a PID 1
    that reaps slowly still answers kill(pid, 0)), polled for up to ``within_s``."""
    import psutil

    deadline = time.time() + within_s
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not running or time.time() > deadline:
            return not running
        time.sleep(0.1)


def textwrap_tree(pidfile: Path) -> str:
    return (
        "import os, subprocess, sys, time\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{kid.pid}}')\n"
        "time.sleep(120)\n")


@pytest.mark.slow
def test_verify_an_hf_checkpoint_and_resume_from(tmp_path):
    from tunepilot.integrations.hf import resume_from

    _hf_run(tmp_path, steps=4, save_steps=2)
    out = tmp_path / "trainer"
    ck2, ck4 = out / "checkpoint-2", out / "checkpoint-4"
    proc = _cli("verify", ck4, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout)
    assert r["kind"] == "hf-trainer" and r["ok"] and r["step"] == 4
    assert r["loaded_in_fresh_process"]
    assert resume_from(out) == str(ck4)
    (ck4 / "scheduler.pt").unlink()
    proc = _cli("verify", ck4)
    assert proc.returncode == 1 and "scheduler.pt" in proc.stdout
    assert "restarts at step 0" in proc.stdout and "Traceback" not in proc.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume_from(out) == str(ck2)  # the incomplete newer one is skipped
    assert any("scheduler.pt" in str(w.message) for w in caught)
    weights = next(ck2.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    proc = _cli("verify", ck2, "--json")
    assert proc.returncode == 1
    bad = json.loads(proc.stdout)["problems"]
    assert any(p["file"] == weights.name and p["component"] == "model" for p in bad)


@pytest.mark.slow
def test_verify_a_tunepilot_checkpoint_and_name_the_damage(tmp_path):
    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.restore.worker import build, train
    from tunepilot.spec import load_spec

    spec = load_spec(ROOT / "examples" / "tiny.yaml")
    state, stream = build(spec, 4, None, "cpu")
    train(state, stream, spec, 2)
    path = tmp_path / "ck"
    save_checkpoint(path, state, stream, spec)
    proc = _cli("verify", path, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout)
    assert r["kind"] == "tunepilot" and r["ok"] and r["loaded_in_fresh_process"]
    assert {c["name"] for c in r["components"]} >= {"model", "optimizer", "rng"}
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    shard = max((p for p in (damaged / "optimizer").iterdir() if p.suffix == ".distcp"),
                key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    proc = _cli("verify", damaged, "--json")
    assert proc.returncode == 1
    bad = json.loads(proc.stdout)["problems"]
    assert bad[0]["component"] == "optimizer" and "altered" in bad[0]["problem"]
    proc = _cli("verify", tmp_path / "nowhere")
    assert proc.returncode == 1 and "not a directory" in proc.stdout


@pytest.mark.slow
def test_the_hf_trainer_restore_proof_passes_and_catches_ignore_data_skip(tmp_path):
    script = [sys.executable, str(OWN / "hf_train.py"), "--out", str(tmp_path / "own")]
    ok = _cli("restore", "--trainer", "hf", "--out", tmp_path / "good", "--json", "--", *script)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    r = json.loads(ok.stdout)
    assert r["passed"] and r["trainer"] == "hf"
    assert r["loss_max_abs_diff"]["value"] == 0.0 and len(r["steps"]["restored"]) == 4
    bad = _cli("restore", "--trainer", "hf", "--out", tmp_path / "bad", "--json", "--", *script,
               "--ignore-data-skip")
    assert bad.returncode == 1
    r = json.loads(bad.stdout)
    failed = {c["name"]: c for c in r["components"] if not c["passed"]}
    assert "data_position" in failed and "scheduler" not in failed
    assert "ignore_data_skip" in failed["data_position"]["detail"]
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_lightning_restore_proof_passes_with_a_stateful_loader_and_names_a_plain_one(
        tmp_path):
    script = [sys.executable, str(OWN / "lightning_train.py"), "--out", str(tmp_path / "own")]
    ok = _cli("restore", "--trainer", "lightning", "--out", tmp_path / "good", "--json", "--",
              *script)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    r = json.loads(ok.stdout)
    assert r["passed"] and r["trainer"] == "lightning"
    assert r["checkpoint"]["kind"] == "lightning-trainer" and r["save_s"]["value"] > 0
    assert r["loss_max_abs_diff"]["value"] == 0.0 and len(r["steps"]["restored"]) == 4
    # a plain DataLoader: Lightning re-reads the epoch from its start after a mid-epoch resume
    bad = _cli("restore", "--trainer", "lightning", "--out", tmp_path / "bad", "--json", "--",
               *script, "--plain-loader")
    assert bad.returncode == 1
    r = json.loads(bad.stdout)
    failed = {c["name"] for c in r["components"] if not c["passed"]}
    assert "data_position" in failed and "scheduler" not in failed
    checks = next(c for c in r["components"] if c["name"] == "checksums")
    assert "StatefulDataLoader" in checks["detail"]
    assert "Traceback" not in bad.stderr


def test_a_model_loaded_in_bf16_is_derived_as_bf16_true_not_mixed(tmp_path):
    """Found on an H200: a full fine-tune of a bfloat16-loaded model under bf16=True keeps bf16
    weights, gradients and AdamW state (8 B/param), but was planned as bf16-mixed (16 B/param:
    +34% over the measured peak). The derived spec follows the trained parameters' dtype."""
    from transformers import LlamaForCausalLM

    from tunepilot.integrations.derive import derive_spec

    full = LlamaForCausalLM(tiny_config()).to(torch.bfloat16)
    spec, _, notes = derive_spec(full, tmp_path / "full", micro_batch_size=2, accumulation=1,
                                 sequence_length=64, bf16=True)
    assert spec.precision == "bf16-true" and spec.trainable_dtype == "bf16"
    assert any("bf16-true" in n for n in notes)
    fp32 = derive_spec(LlamaForCausalLM(tiny_config()), tmp_path / "fp32", micro_batch_size=2,
                       accumulation=1, sequence_length=64, bf16=True)[0]
    assert fp32.precision == "bf16-mixed"  # fp32 master weights under autocast


def _gone(pids: list[int], within_s: float) -> bool:
    end = time.time() + within_s
    while time.time() < end:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_sigkill_of_watch_leaves_neither_the_command_nor_its_children(tmp_path):
    """SIGKILL cannot be caught: the watched command dies with watch (parent-death signal) and
    the sentinel ends what the command started (issue 26: it was left running)."""
    pidfile = tmp_path / "pids"
    child = tmp_path / "tree.py"
    child.write_text(textwrap_tree(pidfile))
    proc = subprocess.Popen([str(EXE), "watch", "--out", str(tmp_path / "w"), "--",
                             sys.executable, str(child)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline and not (pidfile.exists() and
                                          len(pidfile.read_text().split()) >= 2):
        time.sleep(0.1)
    pids = [int(x) for x in pidfile.read_text().split()]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(pids, within_s=20), "the watched command outlived a SIGKILLed watch"


def _flip_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))


@pytest.mark.slow
def test_an_hf_checkpoint_is_intact_only_against_the_manifest_written_at_save(tmp_path):
    """The callback hashes checkpoint-N/ at on_save; verify checks every byte against it. A
    flipped byte that still loads is caught with the manifest - and without one verify says it
    cannot tell, never 'intact'."""
    from tunepilot.checkpoint.hf import HF_MANIFEST, write_hf_manifest

    _hf_run(tmp_path, steps=2, save_steps=2)
    ck = tmp_path / "trainer" / "checkpoint-2"
    written = json.loads((ck / HF_MANIFEST).read_text())
    assert written["step"] == 2 and "optimizer.pt" in written["files"]
    r = json.loads(_cli("verify", ck, "--json").stdout)
    assert r["ok"] and r["intact"] and r["hashes_checked"], r
    assert "intact" in _cli("verify", ck).stdout
    for name in ("adapter_model.safetensors", "optimizer.pt"):
        bad = tmp_path / f"flipped-{name}"
        shutil.copytree(ck, bad)
        _flip_byte(bad / name)
        proc = _cli("verify", bad, "--json")
        assert proc.returncode == 1, proc.stdout
        problems = json.loads(proc.stdout)["problems"]
        assert any(p["file"] == name and "altered" in p["problem"] for p in problems)
        (bad / HF_MANIFEST).unlink()  # no manifest: it loads, and verify cannot tell
        proc = _cli("verify", bad, "--json")
        assert proc.returncode == 0, proc.stdout
        r = json.loads(proc.stdout)
        assert not r["intact"] and not r["hashes_checked"]
        text = _cli("verify", bad).stdout
        assert "intact" not in text.split("\n")[0] and "not verified" in text
    extra = tmp_path / "extra"
    shutil.copytree(ck, extra)
    (extra / "rng_state_1.pth").write_bytes((ck / "rng_state.pth").read_bytes())
    problems = json.loads(_cli("verify", extra, "--json").stdout)["problems"]
    assert any(p["file"] == "rng_state_1.pth" and "not in the manifest" in p["problem"]
               for p in problems)
    # the library function on the Trainer's own directory writes the same record
    (ck / HF_MANIFEST).unlink()
    write_hf_manifest(ck, 2)
    again = json.loads((ck / HF_MANIFEST).read_text())
    assert again["files"] == written["files"] and again["manifest_sha256"]


def _rehash(ck: Path, rel: str) -> None:
    """Edit the manifest by hand as a tamperer would: the file's new size and SHA-256, and the
    manifest's own digest."""
    import hashlib

    from tunepilot.checkpoint.manifest import digest

    body = json.loads((ck / "manifest.json").read_text())
    data = (ck / rel).read_bytes()
    body["files"][rel].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    body["manifest_sha256"] = digest(body)
    (ck / "manifest.json").write_text(json.dumps(body))


@pytest.mark.slow
def test_verify_a_tunepilot_checkpoint_checks_shapes_steps_and_unlisted_files(tmp_path):
    from tunepilot.checkpoint import save_checkpoint
    from tunepilot.restore.worker import build, train
    from tunepilot.spec import load_spec

    spec = load_spec(ROOT / "examples" / "tiny.yaml")
    state, stream = build(spec, 4, None, "cpu")
    train(state, stream, spec, 2)
    path = tmp_path / "ck"
    save_checkpoint(path, state, stream, spec)
    cases = {
        "unlisted": lambda d: (d / "model" / "stray.distcp").write_bytes(b"\0" * 64),
        "rng": lambda d: ((d / "rng.rank0.json").write_text('{"bogus": 1}'),
                          _rehash(d, "rng.rank0.json")),
        "progress": lambda d: ((d / "progress.json").write_text(json.dumps(
            {**json.loads((d / "progress.json").read_text()), "step": 99})),
            _rehash(d, "progress.json")),
    }
    want = {"unlisted": ("model", "model/stray.distcp", "not in the manifest"),
            "rng": ("rng", "rng.rank0.json", "no python, numpy, torch_cpu"),
            "progress": ("progress", "progress.json", "step 99, the manifest step 2")}
    for name, tamper in cases.items():
        d = tmp_path / name
        shutil.copytree(path, d)
        tamper(d)
        proc = _cli("verify", d, "--json")
        assert proc.returncode == 1, (name, proc.stdout)
        problems = json.loads(proc.stdout)["problems"]
        comp, rel, words = want[name]
        assert any(p["component"] == comp and p["file"] == rel and words in p["problem"]
                   for p in problems), (name, problems)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_the_hf_callback_measures_trls_dpo_and_grpo_trainers(tmp_path, trainer):
    """TRL's own DPOTrainer / GRPOTrainer on the tiny model (examples/own-loop/trl_train.py):
    the callback counts only the trained forwards (not the reference's or generation's), times
    GRPO's generate as its own phase, and derives the objective into spec.yaml."""
    pytest.importorskip("trl")
    out = tmp_path / trainer
    r = subprocess.run([sys.executable, str(OWN / "trl_train.py"), "--trainer", trainer,
                        "--out", str(out), "--steps", "4"], capture_output=True, text=True,
                       timeout=600, cwd=OWN)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "pilot.json").read_text())
    from tunepilot.spec import load_spec

    spec = load_spec(out / "spec.yaml")
    assert spec.objective.kind == trainer and doc["run"]["objective"] == trainer
    tp = doc["throughput"]
    assert 0 < tp["useful_tokens"]["value"] < tp["padded_tokens"]["value"]
    per_step = doc["per_step"]["padded_tokens"]["value"]
    if trainer == "dpo":  # chosen + rejected of 4 pairs x 2 micro-batches, the reference not
        assert doc["generation"] is None
        assert all(p % 8 == 0 for p in per_step)
    else:
        g = doc["generation"]
        assert g["seconds_per_step"]["basis"] == "measured"
        assert g["seconds_per_step"]["value"] > 0 and 0 < g["fraction_of_step_time"]["value"] < 1
        assert spec.objective.generations == 4 and spec.objective.max_completion_length == 32
