"""Provenance: what produced a measurement, so a number can be traced and reproduced.

Software (tunepilot, python, torch and its CUDA/HIP, cuDNN, NCCL/RCCL builds, the driver), the
hardware (GPU names and UUIDs, ECC and MIG state where NVML reads them), the model (config hash
and revision), the data (path, size, content hash), the spec and its hash, the environment
variables that change memory or numerics, and the git commit of the user's working directory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from tunepilot.spec import RunSpec

# Environment variables that change memory, speed or numerics of a step (prefixes end in _).
ENV_PREFIXES = ("NCCL_", "HIP_", "ROCM_", "HSA_", "TORCH_NCCL_", "RCCL_")
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
             "CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
             "CUDA_MODULE_LOADING", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "TORCH_CUDNN_V8_API_ENABLED", "NVIDIA_TF32_OVERRIDE")
GIT_TIMEOUT_S = 5


def tunepilot_version() -> str:
    try:
        return importlib.metadata.version("tunepilot")
    except importlib.metadata.PackageNotFoundError:
        from tunepilot import __version__

        return __version__


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def git_state(cwd: Path) -> dict | None:
    """{"commit", "dirty", "root"} of the git repository containing `cwd`, or None."""
    from tunepilot.proc.spawn import run_tool

    def git(*args: str) -> str | None:
        try:
            r = run_tool(["git", *args], cwd=cwd, capture_output=True, text=True,
                         timeout_s=GIT_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "root": git("rev-parse", "--show-toplevel")}


def software() -> dict:
    """Versions of everything a step's speed and memory depend on."""
    import torch

    out: dict = {"tunepilot": tunepilot_version(), "python": platform.python_version(),
                 "python_implementation": platform.python_implementation(),
                 "platform": platform.platform(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "hip": torch.version.hip,
                 "cudnn": None, "nccl": None, "debug_build": bool(torch.version.debug)}
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            out["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            out["nccl" if not torch.version.hip else "rccl"] = \
                ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    for pkg in ("transformers", "peft", "torchdata", "accelerate", "bitsandbytes", "numpy",
                "nvidia-ml-py", "amdsmi"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.setdefault("packages", {})[pkg] = importlib.metadata.version(pkg)
    return out


def collect_provenance(spec: RunSpec, *, device: dict, data: dict, model: dict,
                       cwd: Path | None = None) -> dict:
    """The manifest's provenance block. `device` is DeviceInfo.to_dict(); `data` holds the data
    stage's path/size/hash; `model` the config hash, revision and weights."""
    cwd = Path.cwd() if cwd is None else cwd
    return {
        "software": software(),
        "host": {"hostname": socket.gethostname(), "machine": platform.machine(),
                 "logical_cores": os.cpu_count(), "argv": list(sys.argv)},
        "device": {k: device.get(k) for k in (
            "kind", "name", "card_id", "count", "memory_bytes", "uuids", "driver_version",
            "cuda_version", "hip_version", "cudnn_version", "nccl_version",
            "compute_capability", "bf16_supported", "sdpa_backends", "ecc_enabled",
            "mig_enabled", "missing", "cpu")},
        "model": model,
        "data": data,
        "spec_hash": spec.spec_hash(),
        "spec": spec.model_dump(mode="json"),
        "env": relevant_env(),
        "git": git_state(cwd),
        "cwd": str(cwd),
    }
