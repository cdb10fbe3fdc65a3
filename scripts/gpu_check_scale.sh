#!/usr/bin/env bash
# GPU check of the scaling test (tunepilot scale), for a machine with one CUDA GPU:
#   1. the preflight and the 1-rank baseline on the GPU (NCCL version, nvidia-smi topology,
#      NUMA/affinity of the rank, the catalog link of the card; no bus bandwidth with one rank)
#   2. the full 2-rank test on the CPU with gloo (DDP and FSDP against the 1-rank baseline)
# Without CUDA it prints SKIP and exits 0. Results go to $OUT (default runs/gpu-check-scale).
#
#   scripts/gpu_check_scale.sh            # or: OUT=/some/dir PY=python3 scripts/gpu_check_scale.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-runs/gpu-check-scale}
STEPS=${STEPS:-5}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "SKIP: torch sees no CUDA device here; nothing to check (the CPU tests cover the rest)"
    exit 0
fi
mkdir -p "$OUT"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
command -v nvidia-smi >/dev/null && nvidia-smi topo -m | tee "$OUT/nvidia-smi-topo.txt" || true

echo "== 1. preflight + 1-rank baseline on the GPU"
"$PY" -m tunepilot.cli scale examples/tiny.yaml --nproc 1 --device cuda --steps "$STEPS" \
    --out "$OUT/gpu" --timeout-s 300
"$PY" - "$OUT/gpu/scale.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
p = d["preflight"]
print("preflight on the GPU:")
print("  device:", p["node"]["device_names"], "card:", p["node"]["card_id"])
print("  collective:", p["collective"])
print("  topology:", p["topology"]["source"], p["topology"]["links"], p["topology"]["cpu_affinity"],
      p["topology"]["notes"])
print("  ranks:", p["ranks"])
print("  link:", p["link"])
print("  bus bandwidth:", p["bus_bandwidth"])
print("  warnings:", p["warnings"], "notes:", p["notes"] + p["node"]["notes"])
b = d["baseline"]
print("baseline: %.0f useful tokens/s, step median %.2f ms, peak %.1f MiB (%s)" % (
    b["useful_tokens_per_s"], b["step_time_s"]["median"] * 1e3,
    b["peak_memory_bytes_per_rank"] / 2**20, b["per_rank"][0]["memory_measure"]))
PYEOF

echo "== 2. 2 ranks on the CPU with gloo"
"$PY" -m tunepilot.cli scale examples/tiny.yaml --nproc 2 --device cpu --strategy both \
    --steps "$STEPS" --out "$OUT/cpu" --timeout-s 300
echo "OK: $OUT/gpu/scale.json and $OUT/cpu/scale.json"
