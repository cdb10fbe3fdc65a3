#!/usr/bin/env bash
# GPU check of the traced plan (tunepilot plan --trace), for a machine with one CUDA GPU:
# for 1B full, 8B LoRA and 8B full bf16-true with checkpointing it traces the step on fake CPU
# tensors, runs the same step for real on the GPU, and prints traced vs the tracker on CUDA vs
# torch.cuda.max_memory_allocated vs max_memory_reserved vs NVML used (target: traced within 3%
# of allocated). Without CUDA it prints SKIP and exits 0. Rows go to $OUT/gpu_check_trace.json.
#
#   scripts/gpu_check_trace.sh                 # or: OUT=/some/dir ONLY=8b scripts/gpu_check_trace.sh
#   SMOKE=1 scripts/gpu_check_trace.sh         # the same code on the tiny model on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-runs/gpu-check-trace}
ARGS=(--out "$OUT")
[ -n "${ONLY:-}" ] && ARGS+=(--only "$ONLY")
if [ -n "${SMOKE:-}" ]; then
    exec "$PY" scripts/gpu_check_trace.py --cpu-smoke "${ARGS[@]}"
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "SKIP: torch sees no CUDA device here; nothing to check (tests/test_trace.py checks the"
    echo "      fake trace against the same step on real CPU tensors)"
    exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
"$PY" scripts/gpu_check_trace.py "${ARGS[@]}"
echo "OK: $OUT/gpu_check_trace.json"
