#!/usr/bin/env bash
# Pilot a 1B full fine-tune (llama-3.2-1b) and an 8B LoRA (llama-3-8b) on this machine's CUDA GPU
# with random weights (nothing is downloaded), print each pilot summary and the plan-vs-measured
# residuals. Skips cleanly (exit 0) where there is no CUDA GPU. Exit 1 if a run does not fit.
#   scripts/gpu_check_pilot.sh [--max-steps 20] [--out runs/gpu-check]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# one process per spec: each pilot's pre-run baseline is then a GPU without our CUDA context
rc=0
for which in 1b 8b; do
  "$PY" scripts/gpu_check_pilot.py --only "$which" "$@" || rc=$?
done
exit "$rc"
