#!/usr/bin/env bash
# One H200 session's worth of checks and figures, inside the device's 600 s per command.
# Run from the repository root:  bash tools/device_run.sh   (logs, JSON and PNGs under $OUT)
# KERNEL_ARGS / PREFILL_ARGS override the two bench sweeps; PYTEST_ARGS the test selection
# (default: the compiled GPU tests, `-m gpu`).
set -u -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
step() { echo "=== $1 ($(date +%T))"; shift; timeout "$@" || { echo "!!! exit $?"; status=1; }; }
step "env" 60 python -m ckv_jax.cli env 2>&1 | tee "$OUT/env.txt"
step "GPU tests (compiled kernels)" 150 python -m pytest tests -q -p no:cacheprovider -rs ${PYTEST_ARGS:--m gpu} 2>&1 \
  | tee "$OUT/pytest_gpu.txt"
step "bench kernels" 240 python -m ckv_jax.cli bench --ops writer,gather,patch ${KERNEL_ARGS:-} \
  --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.txt"
step "bench prefill" 150 python -m ckv_jax.cli bench --ops prefill \
  ${PREFILL_ARGS:---depths 0,1,2,3 --layers 8 --context 32768 --prefill-chunk 4096} \
  --out "$OUT/prefill.json" 2>&1 | tee "$OUT/bench_prefill.txt"
step "plot" 60 python -m ckv_jax.cli plot "$OUT/kernels.json" "$OUT/prefill.json" --out-dir "$OUT"
exit $status
