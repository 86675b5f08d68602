#!/usr/bin/env bash
# One H200 session's worth of checks and figures.  Run from the repository root on the device:
#   bash tools/device_run.sh            (logs, JSON and PNGs under $OUT, default ./device_out)
set -u -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
step() { echo "=== $1"; shift; timeout "$@" || { echo "!!! exit $?"; status=1; }; }
step "env" 120 python -m ckv_jax.cli env 2>&1 | tee "$OUT/env.txt"
step "GPU test suite (compiled kernels)" 420 python -m pytest tests -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu.txt"
step "bench" 540 python -m ckv_jax.cli bench --out "$OUT/results.json" 2>&1 | tee "$OUT/bench.txt"
step "plot" 60 python -m ckv_jax.cli plot "$OUT/results.json" --out-dir "$OUT"
exit $status
