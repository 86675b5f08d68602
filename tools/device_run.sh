#!/usr/bin/env bash
# One H200 session's worth of checks and figures, inside the device's 600 s per command.
# Run from the repository root:  [STAGES="..."] bash tools/device_run.sh   (output under $OUT)
# Stages (default all, in this order): env tests examples interop writer gather patch prefill
# sanitizer plot.  KERNEL_ARGS / PREFILL_ARGS / PYTEST_ARGS override the sweeps and the test
# selection (default: the GPU tests, `-m gpu`).
set -u -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STAGES=${STAGES:-env tests examples interop writer gather patch prefill sanitizer plot}
status=0
step() { echo "=== $1 ($(date +%T))"; shift; timeout "$@" || { echo "!!! exit $?"; status=1; }; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
want env && step "env" 60 python -m ckv_jax.cli env 2>&1 | tee "$OUT/env.txt"
want tests && step "GPU tests" 180 python -m pytest tests -q -p no:cacheprovider -rs ${PYTEST_ARGS:--m gpu} 2>&1 \
  | tee "$OUT/pytest_gpu.txt"
if want examples; then
  step "torch engine example" 90 python examples/torch_engine.py 2>&1 | tee "$OUT/example_torch_engine.txt"
  step "flax example" 90 python examples/flax_mla.py --dcp 1 2>&1 | tee "$OUT/example_flax.txt"
fi
want interop && step "interop bench" 150 python -m interop.bench --out "$OUT/interop.json" 2>&1 | tee "$OUT/interop.txt"
for op in writer gather patch; do
  want $op && step "bench $op" 150 python -m ckv_jax.cli bench --ops $op ${KERNEL_ARGS:-} --out "$OUT/$op.json" 2>&1 \
    | tee "$OUT/bench_$op.txt"
done
want prefill && step "bench prefill" 150 python -m ckv_jax.cli bench --ops prefill \
  ${PREFILL_ARGS:---depths 0,1,2,3 --layers 8 --context 32768 --prefill-chunk 4096} \
  --out "$OUT/prefill.json" 2>&1 | tee "$OUT/bench_prefill.txt"
want sanitizer && step "compute-sanitizer memcheck (compiled kernels)" 300 compute-sanitizer --tool memcheck \
  --leak-check no --error-exitcode 9 python -m pytest tests -q -p no:cacheprovider -m gpu -k "compiled" -x 2>&1 \
  | tail -40 | tee "$OUT/sanitizer_memcheck.txt"
want plot && step "plot" 60 python -m ckv_jax.cli plot $(ls "$OUT"/{writer,gather,patch,prefill}.json 2>/dev/null) \
  --out-dir "$OUT"
exit $status
