"""Every GPU check tunepilot has, in one run, into one JSON of figures (scripts/gpu_check.sh).

The one GPU check (the default, under 9 minutes on one H100 or H200): env, run-8b, liger, fp8,
dpo - in that order. Every section below runs with --only (or --only all).

Sections (each a child process with its own time limit, so one failure or hang does not cost the
others; the JSON is rewritten after each, so a run cut short keeps what it measured):
  env       torch/CUDA/driver, tunepilot's device probe and catalog match, the NVML sampler
            against a known allocation, a bf16 and an fp8 matmul and a copy timed by CUDA events
  run-8b    the README's example end to end: `tunepilot run examples/llama3-8b-lora.yaml --card
            CARD --count 1 --hours 72` (plan, pilot, restore proof, quote: decision.json)
  liger     `tunepilot pilot` of a Llama-3.2-1B full fine-tune whose spec names Liger's kernels
            (what ran, or which stand-in, is in pilot.json's notes)
  fp8       `tunepilot pilot` of a Llama-3.2-3B full fine-tune at precision fp8-tensorwise
            (torchao's recipe; the stand-in and what it leaves unmeasured are in pilot.json)
  sharded   `tunepilot restore` of a Llama-3.2-1B FSDP spec on 1 rank: the meta-device build
            materialised one unit at a time, FSDP2 on NCCL, a sharded DCP save and load on CUDA
            (until the sharded pilot lands, the one 1-rank sharded run tunepilot has)
  pilot-1b  `tunepilot pilot` of a Llama-3.2-1B full fine-tune (bf16-mixed, 2 x 2048)
  pilot-8b  `tunepilot pilot` of a Llama-3-8B LoRA r16 q,v (bf16-mixed, 2 x 4096, accumulation 2)
  hf        HF Trainer + TunepilotCallback, Llama-3.2-1B full bf16 (scripts/gpu_check_hf.py)
  hf-liger  the same with use_liger_kernel=True (Liger's kernels; the twin of hf)
  dpo       `tunepilot pilot` of a Llama-3.2-1B LoRA DPO on the shipped preference pairs
  qlora     `tunepilot pilot` of a Llama-3.2-1B QLoRA (bitsandbytes NF4)
  trace     plan --trace vs the tracker on CUDA vs max_memory_allocated vs NVML, three specs
            (scripts/gpu_check_trace.py)
  scale     `tunepilot scale` preflight and the 1-rank baseline on the GPU
  lightning the Lightning callback on the GPU (examples/own-loop/lightning_train.py)

    python scripts/gpu_check.py --out DIR [--budget-s 470] [--only env,hf] [--cpu-smoke]

Without CUDA every section says "skipped" and the exit code is 0; --cpu-smoke runs the
orchestration on the tiny model on the CPU (what CI can check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

PILOT_1B = {"name": "gpu-1b-full", "model": {"preset": "llama-3.2-1b"}, "method": {"kind": "full"},
            "optimizer": {"name": "adamw", "lr": 1.0e-5}, "precision": "bf16-mixed",
            "sequence_length": 2048, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
            "data": {"source": "synthetic"}, "validation": {"num_batches": 3}}
PILOT_8B = {"name": "gpu-8b-lora", "model": {"preset": "llama-3-8b"},
            "method": {"kind": "lora", "lora_rank": 16, "lora_alpha": 32,
                       "lora_targets": ["q_proj", "v_proj"]},
            "optimizer": {"name": "adamw", "lr": 2.0e-4}, "precision": "bf16-mixed",
            "sequence_length": 4096, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
            "data": {"source": "synthetic"}, "validation": {"num_batches": 3}}
# DPO, LoRA r16 all-linear on Llama-3.2-1B, the shipped preference pairs: chosen and rejected
# through the policy as 2 x micro_batch rows, the reference with the adapters disabled
DPO_1B = {"name": "gpu-1b-dpo", "model": {"preset": "llama-3.2-1b"},
          "method": {"kind": "lora", "lora_rank": 16, "lora_alpha": 32,
                     "lora_targets": "all-linear"},
          "optimizer": {"name": "adamw", "lr": 5.0e-6}, "precision": "bf16-mixed",
          "sequence_length": 1024, "micro_batch_size": 8, "gradient_accumulation_steps": 1,
          "objective": {"kind": "dpo", "beta": 0.1}, "data": {"source": "tiny-preference"},
          "validation": {"num_batches": 2}, "target": {"epochs": 1}}
QLORA_1B = {"name": "gpu-1b-qlora", "model": {"preset": "llama-3.2-1b"},
            "method": {"kind": "qlora", "lora_rank": 16, "lora_alpha": 32,
                       "lora_targets": "all-linear"},
            "optimizer": {"name": "adamw", "lr": 2.0e-4}, "precision": "bf16-mixed",
            "sequence_length": 2048, "micro_batch_size": 4, "gradient_accumulation_steps": 1,
            "data": {"source": "synthetic"}, "validation": {"num_batches": 3}}
# Liger's four kernels on a 1B full fine-tune (the plan's liger rows)
LIGER_1B = dict(PILOT_1B, name="gpu-1b-liger", kernels={"liger": ["rms_norm", "swiglu", "rope",
                                                                   "fused_linear_cross_entropy"]})
# torchao's tensorwise FP8 recipe on a 3B full fine-tune, checkpointed (a size where FP8's
# matmuls are a visible share of the step)
FP8_3B = {"name": "gpu-3b-fp8", "model": {"preset": "llama-3.2-3b"}, "method": {"kind": "full"},
          "optimizer": {"name": "adamw", "lr": 1.0e-5}, "precision": "fp8-tensorwise",
          "sequence_length": 2048, "micro_batch_size": 2, "activation_checkpointing": "full",
          "data": {"source": "synthetic"}, "validation": {"num_batches": 2}}
RUN_8B = "examples/llama3-8b-lora.yaml"  # the README's example
FSDP_1B = dict(PILOT_1B, name="gpu-1b-fsdp1rank", sequence_length=1024,
               parallel={"strategy": "fsdp", "devices": 1})
DEFAULT = ("env", "run-8b", "liger", "fp8", "dpo")
SMOKE_SLACK = 3
TINY = {"name": "cpu-smoke-tiny", "model": {"preset": "tiny"}, "method": {"kind": "full"},
        "optimizer": {"name": "adamw", "lr": 1.0e-3}, "precision": "fp32",
        "sequence_length": 64, "micro_batch_size": 2, "data": {"source": "synthetic"},
        "validation": {"num_batches": 1}}

ENV_CODE = r'''
import json, time, importlib, subprocess
import torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available()}
for mod in ("transformers", "peft", "accelerate", "bitsandbytes", "trl", "lightning", "pynvml"):
    try:
        out[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except Exception as exc:
        out[mod] = f"unavailable: {type(exc).__name__}: {exc}"[:200]
try:
    out["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm",
         "--format=csv"], capture_output=True, text=True, timeout=20).stdout
except Exception as exc:
    out["nvidia_smi"] = f"unavailable: {exc}"
from tunepilot.catalog import load_catalog
from tunepilot.device import probe_device, make_sampler
info = probe_device(load_catalog())
out["probe"] = info.to_dict()
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info"] = {"free": free, "total": total}
    sampler = make_sampler(info)
    if sampler is not None:
        sampler.start()
        x = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda").fill_(1)
        torch.cuda.synchronize(); time.sleep(0.5)
        reading = sampler.stop()
        out["sampler"] = {"source": reading.source if hasattr(reading, "source") else None,
                          "reading": {k: v for k, v in vars(reading).items()
                                      if isinstance(v, (int, float, str, type(None)))},
                          "peak_minus_baseline": reading.peak_minus_baseline_bytes,
                          "allocated_bytes": 4 * 2**30}
        del x; torch.cuda.empty_cache()
    def timed(fn, n=10):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n): fn()
        b.record(); torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / n
    n = 8192
    A = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["bf16_matmul_tflops"] = 2 * n**3 / timed(lambda: A @ B) / 1e12
    try:
        A8 = A.to(torch.float8_e4m3fn); B8 = B.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device="cuda")
        f = lambda: torch._scaled_mm(A8, B8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        out["fp8_matmul_tflops"] = 2 * n**3 / timed(f) / 1e12
    except Exception as exc:
        out["fp8_matmul_tflops"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    C = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    D = torch.empty_like(C)
    out["copy_tb_per_s_read_plus_write"] = 2 * C.numel() / timed(lambda: D.copy_(C)) / 1e12
print("GPU_CHECK_JSON " + json.dumps(out, default=str))
'''


class Check:
    """Runs the sections, keeps the figures, rewrites OUT/gpu_check.json after each."""

    def __init__(self, out: Path, budget_s: float, python: str, smoke: bool):
        self.out, self.python, self.smoke = out, python, smoke
        self.deadline = time.monotonic() + budget_s
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.figures: dict = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "budget_s": budget_s, "sections": {}}
        self.log = open(out / "gpu_check.log", "a")  # noqa: SIM115 - open for the whole run

    def env(self) -> dict:
        e = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH"))
                                          if p)
        return e

    def run(self, name: str, cmd: list[str], limit_s: float) -> dict:
        """One child process, its time limit the smaller of limit_s and what the budget has."""
        left = self.deadline - time.monotonic()
        if left < 15:
            return {"status": "skipped", "why": f"the budget was spent ({left:.0f} s left)"}
        # a section's limit is a GPU's; the CPU smoke run on a shared runner gets three times it
        limit = min(limit_s * (SMOKE_SLACK if self.smoke else 1), left)
        self.log.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit:.0f} s)\n")
        self.log.flush()
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text, _ = p.communicate(timeout=limit)
            status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            text, _ = p.communicate()
            status = f"timed out after {limit:.0f} s"
        self.log.write(text)
        self.log.flush()
        return {"status": status, "wall_s": round(time.monotonic() - t0, 1),
                "tail": text[-2500:], "_text": text}

    def record(self, name: str, result: dict) -> None:
        result.pop("_text", None)
        self.figures["sections"][name] = result
        self.figures["elapsed_s"] = round(time.monotonic() - self.deadline
                                          + self.figures["budget_s"], 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.figures, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")
        print(f"[gpu_check] {name}: {result.get('status')} ({result.get('wall_s', 0)} s)",
              flush=True)

    def tunepilot(self, *args: str) -> list[str]:
        return [self.python, "-m", "tunepilot.cli", *args]

    # --- sections --------------------------------------------------------------------------
    def section_env(self) -> dict:
        r = self.run("env", [self.python, "-c", ENV_CODE], 90)
        r["figures"] = _tagged_json(r.get("_text", ""), "GPU_CHECK_JSON ")
        return r

    def section_pilot(self, name: str, spec: dict, steps: int, limit_s: float) -> dict:
        import yaml

        spec_path = self.work / f"{name}.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        run_dir = self.work / name
        r = self.run(name, self.tunepilot("pilot", str(spec_path), "--steps", str(steps),
                                          "--out", str(run_dir), "--json"), limit_s)
        r["figures"] = _pilot_figures(run_dir / "pilot.json")
        plan = self.run(f"{name}-plan", self.tunepilot("plan", str(spec_path), "--json"), 60)
        r["analytic_plan"] = _plan_figures(_last_json(plan.get("_text", "")))
        return r

    def section_hf(self, name: str = "hf", liger: bool = False) -> dict:
        """The HF Trainer callback on a 1B model (with ``liger``: use_liger_kernel=True, the
        twin of the plain run), and the analytic plan of the spec the callback derived."""
        out = self.work / name
        cmd = [self.python, "scripts/gpu_check_hf.py", "--out", str(out), "--steps", "12"] + \
            (["--cpu-smoke"] if self.smoke else []) + (["--liger"] if liger else [])
        r = self.run(name, cmd, 120)
        got = _last_json(r.get("_text", "")) or {}
        r["figures"] = {"torch_direct": got.get("torch_direct"),
                        "pilot": _pilot_figures(out / "pilot.json")}
        spec_yaml = out / "spec.yaml"
        if spec_yaml.exists():
            r["derived_spec"] = spec_yaml.read_text()
            plan = self.run(f"{name}-plan", self.tunepilot("plan", str(spec_yaml), "--json"), 60)
            r["analytic_plan_of_derived_spec"] = _plan_figures(_last_json(plan.get("_text", "")))
        return r

    def section_trace(self) -> dict:
        out = self.work / "trace"
        cmd = [self.python, "scripts/gpu_check_trace.py", "--out", str(out)]
        r = self.run("trace", cmd + (["--cpu-smoke"] if self.smoke else []), 200)
        f = out / "gpu_check_trace.json"
        r["rows"] = json.loads(f.read_text()) if f.exists() else None
        return r

    def section_scale(self) -> dict:
        device = "cpu" if self.smoke else "cuda"
        out = self.work / "scale"
        r = self.run("scale", self.tunepilot(
            "scale", "examples/tiny.yaml", "--nproc", "1", "--device", device, "--steps", "5",
            "--strategy", "ddp", "--out", str(out), "--timeout-s", "120", "--json"), 150)
        f = out / "scale.json"
        if f.exists():
            d = json.loads(f.read_text())
            r["figures"] = {"preflight": d.get("preflight"), "baseline": d.get("baseline")}
        return r

    def section_run(self, spec: str, card: str | None) -> dict:
        """`tunepilot run` end to end on this device: every gate and the decision."""
        out = self.work / "run-8b"
        args = ["run", spec, "--out", str(out), "--json"] + (
            ["--card", card, "--count", "1", "--hours", "72"] if card else []) + (
            # the CPU's smoke run leaves the 2-rank scaling to the demo's own test
            ["--nproc", "1", "--pilot-max-steps", "10"] if self.smoke else [])
        r = self.run("run-8b", self.tunepilot(*args), 330)
        d = out / "decision.json"
        r["figures"] = {"decision": json.loads(d.read_text()) if d.exists() else None,
                        **{stage: _pilot_figures(out / f"{stage}.json")
                           for stage in ("pilot", "restore", "quote")}}
        return r

    def section_sharded(self, spec: dict) -> dict:
        """The 1-rank sharded run: restore --nproc 1 of an FSDP spec (meta-device build)."""
        import yaml

        spec_path = self.work / "sharded.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        out = self.work / "sharded"
        r = self.run("sharded", self.tunepilot("restore", str(spec_path), "--nproc", "1",
                                               "--steps-before", "2", "--steps-after", "2",
                                               "--out", str(out), "--json"), 150)
        r["figures"] = _pilot_figures(out / "restore.json")
        return r

    def section_lightning(self) -> dict:
        out = self.work / "lightning"
        r = self.run("lightning", [self.python, "examples/own-loop/lightning_train.py", "--out",
                                   str(out), "--steps", "12", "--accelerator",
                                   "cpu" if self.smoke else "gpu"], 90)
        r["figures"] = _pilot_figures(out / "pilot.json")
        return r


def _card_here() -> str | None:
    """The catalog card this GPU is (the quote of `run` is for it), or None."""
    from tunepilot.catalog import load_catalog
    from tunepilot.device import probe_device

    return probe_device(load_catalog()).card_id


def _tagged_json(text: str, tag: str):
    for line in reversed(text.splitlines()):
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    return None


def _last_json(text: str):
    """The last JSON object in a child's output that starts at the beginning of a line (its
    --json result, pretty-printed or not; anything printed after it is ignored)."""
    dec = json.JSONDecoder()
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            v, _ = dec.raw_decode(text, i)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


def _pilot_figures(path: Path) -> dict | None:
    """The whole pilot.json (it is small), or None when the run wrote none."""
    return json.loads(path.read_text()) if path.exists() else None


def _plan_figures(plan: dict | None) -> dict | None:
    if not plan:
        return None
    per = plan.get("per_device") or {}
    return {k: per.get(k) for k in ("allocated_peak_bytes", "reserved_peak_bytes",
                                     "device_peak_bytes")} | {"peak_phase": plan.get("peak_phase"),
                                                              "components": per.get("components")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--only", default=None, help="comma-separated section names, or all "
                    f"(default: {','.join(DEFAULT)})")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available() and not a.cpu_smoke:
        print("SKIP: torch sees no CUDA device here; nothing to check (the CPU tests cover the "
              "rest; --cpu-smoke runs this script's plumbing on the tiny model)")
        return 0
    c = Check(a.out, a.budget_s, sys.executable, a.cpu_smoke)
    smoke = a.cpu_smoke
    tiny = dict(TINY, sequence_length=64)
    sections = {
        "env": c.section_env,
        "run-8b": lambda: c.section_run("examples/tiny.yaml" if smoke else RUN_8B,
                                        None if smoke else _card_here()),
        "liger": lambda: c.section_pilot("liger", dict(tiny, name="cpu-smoke-liger",
                                                       kernels=LIGER_1B["kernels"])
                                         if smoke else LIGER_1B, 6, 90),
        "fp8": lambda: c.section_pilot("fp8", dict(tiny, name="cpu-smoke-fp8",
                                                   precision="fp8-tensorwise")
                                       if smoke else FP8_3B, 6, 110),
        "trace": c.section_trace,
        "pilot-1b": lambda: c.section_pilot("pilot-1b", TINY if smoke else PILOT_1B, 8, 110),
        "pilot-8b": lambda: c.section_pilot("pilot-8b", TINY if smoke else PILOT_8B, 6, 120),
        "hf": c.section_hf,
        "hf-liger": lambda: c.section_hf("hf-liger", liger=not smoke),
        "dpo": lambda: c.section_pilot("dpo", dict(DPO_1B, model={"preset": "tiny"},
                                                   precision="fp32", sequence_length=256,
                                                   micro_batch_size=4) if smoke else DPO_1B,
                                       6, 100),
        "qlora": lambda: c.section_pilot("qlora", TINY if smoke else QLORA_1B, 6, 100),
        "sharded": lambda: c.section_sharded(dict(tiny, name="cpu-smoke-fsdp1rank",
                                                  parallel={"strategy": "fsdp", "devices": 1})
                                             if smoke else FSDP_1B),
        "scale": c.section_scale,
        "lightning": c.section_lightning,
    }
    order = (list(sections) if a.only == "all" else a.only.split(",") if a.only
             else list(DEFAULT))  # --only runs in the order given
    unknown = [n for n in order if n not in sections]
    if unknown:
        print(f"unknown section(s) {unknown}: choose from {list(sections)}")
        return 2
    for name in order:
        fn = sections[name]
        try:
            c.record(name, fn())
        except Exception as exc:  # the orchestration's own failure is a finding too
            c.record(name, {"status": f"orchestration failed: {type(exc).__name__}: {exc}"})
    print(f"[gpu_check] figures: {a.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
