#!/usr/bin/env bash
# The one GPU check: every check tunepilot has for a CUDA card, within about 8 minutes, into one
# JSON of figures ($OUT/gpu_check.json; the children's output in $OUT/gpu_check.log):
#   env (probe, NVML sampler vs a known allocation, bf16/fp8 matmul and copy rates), the pilot of
#   a 1B full fine-tune and of an 8B LoRA, the HF Trainer callback on a 1B model, a bitsandbytes
#   QLoRA pilot, the traced plan vs the allocator vs NVML, the scale preflight, the Lightning
#   callback. See scripts/gpu_check.py for what each section measures.
# Without CUDA it prints SKIP and exits 0. Packages the machine lacks can travel as wheels in
# .whl/ (installed into /tmp/site, never into the machine's Python).
#
#   scripts/gpu_check.sh                      # OUT=/some/dir BUDGET_S=470 ONLY=env,hf PY=python3
#   SMOKE=1 scripts/gpu_check.sh              # the same plumbing on the tiny model on the CPU
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
ARGS=(--out "$OUT" --budget-s "${BUDGET_S:-470}")
[ -n "${ONLY:-}" ] && ARGS+=(--only "$ONLY")
[ -n "${SMOKE:-}" ] && ARGS+=(--cpu-smoke)
exec "$PY" scripts/gpu_check.py "${ARGS[@]}"
