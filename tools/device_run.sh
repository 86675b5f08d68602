#!/usr/bin/env bash
# One H200 session's worth of checks and figures.  Run from the repository root on the device:
#   bash tools/device_run.sh            (logs and JSON under $OUT, default ./device_out)
set -u -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
step() { echo "=== $1"; shift; timeout "$@" || { echo "!!! exit $?"; status=1; }; }
step "env" 120 python -m ckv_jax.cli env 2>&1 | tee "$OUT/env.txt"
step "GPU test suite (compiled kernels)" 420 python -m pytest tests -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu.txt"
step "writer benchmark" 420 python -m ckv_jax.benchmarks.writer --json "$OUT/writer.json" 2>&1 | tee "$OUT/writer.txt"
step "gather benchmark" 300 python -m ckv_jax.benchmarks.gather --json "$OUT/gather.json" 2>&1 | tee "$OUT/gather.txt"
exit $status
