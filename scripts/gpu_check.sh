#!/usr/bin/env bash
# The one GPU check: under 9 minutes on one H100 or H200, into one JSON of figures
# ($OUT/gpu_check.json; the children's output in $OUT/gpu_check.log):
#   env     probe, NVML sampler vs a known allocation, bf16/fp8 matmul and copy rates
#   run-8b  the README's example end to end: tunepilot run examples/llama3-8b-lora.yaml
#   liger   a pilot of a spec that names Liger's kernels (1B full)
#   fp8     a pilot of a torchao FP8 spec (3B full, fp8-tensorwise)
#   dpo     a pilot of a LoRA DPO spec (1B, the shipped preference pairs)
# ONLY=all adds the older sections (trace, pilot-1b, pilot-8b, hf, hf-liger, qlora, sharded, scale,
# lightning; see scripts/gpu_check.py); ONLY=env,fp8 runs some, in that order.
# Without CUDA it prints SKIP and exits 0. Packages the machine lacks can travel as wheels in
# .whl/ (installed into /tmp/site, never into the machine's Python).
#
#   scripts/gpu_check.sh                      # OUT=/some/dir BUDGET_S=520 ONLY=env,hf PY=python3
#   SMOKE=1 scripts/gpu_check.sh              # the same sections on the tiny model on the CPU (CI)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY="$(command -v python3)"
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
ARGS=(--out "$OUT" --budget-s "${BUDGET_S:-520}")
[ -n "${ONLY:-}" ] && ARGS+=(--only "$ONLY")
[ -n "${SMOKE:-}" ] && ARGS+=(--cpu-smoke)
exec "$PY" scripts/gpu_check.py "${ARGS[@]}"
