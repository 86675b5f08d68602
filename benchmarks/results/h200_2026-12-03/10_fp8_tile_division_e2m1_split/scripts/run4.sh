#!/usr/bin/env bash
# device call 4 of 2026-12-03 (fifth session): the GPU suite on the final tree, memcheck of the compiled
# writer tests, the small packs with more tile shapes
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st gpu_tests; timeout -k 5 170 python -m pytest tests -m gpu -q -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1; echo "rc $?"; tail -3 "$OUT/pytest_gpu.txt"
st memcheck; timeout -k 5 100 compute-sanitizer --tool memcheck --target-processes all python -m pytest tests/test_cache_writer.py -q -p no:cacheprovider -m gpu -k "not every_float32" > "$OUT/sanitizer_memcheck_writer.txt" 2>&1; echo "rc $?"; tail -3 "$OUT/sanitizer_memcheck_writer.txt"
st small_packs; timeout -k 5 130 python ab_old/small_pack_configs.py "$OUT/tune_small_packs.json" > "$OUT/tune_small_packs.txt" 2>&1; echo "rc $?"; grep -E "gather_records" "$OUT/tune_small_packs.txt" | cut -c1-150
st end
} 2>&1 | tee "$OUT/run.log"
