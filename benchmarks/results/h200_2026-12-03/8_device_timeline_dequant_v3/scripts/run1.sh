#!/usr/bin/env bash
# device call 1 of 2026-12-03 (fourth session): GPU tests, nvfp4 dequant A/B (main vs v3) + ncu,
# gather tune with device timelines, memcheck of the bf16 config test
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st tests; timeout -k 10 120 python -m pytest tests -q -p no:cacheprovider -m gpu > "$OUT/pytest_gpu.txt" 2>&1; tail -3 "$OUT/pytest_gpu.txt"
st ab; timeout -k 10 110 python ab_old/ab_dequant.py all nvfp4_ds_mla > "$OUT/ab_dequant.txt" 2>&1; grep -c AB "$OUT/ab_dequant.txt"
st ncu; timeout -k 10 70 ncu --target-processes all --clock-control none --kernel-name regex:ckv_ \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis \
  python ab_old/ab_dequant.py once nvfp4_ds_mla > "$OUT/ncu_dequant.txt" 2>&1; grep -c Duration "$OUT/ncu_dequant.txt"
st memcheck_bf16; timeout -k 10 60 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python -m pytest \
  tests/test_paged_gather.py -v -p no:cacheprovider -m gpu -k "compiled and bf16 and tile4" > "$OUT/memcheck_bf16.txt" 2>&1; echo "rc $?"; tail -3 "$OUT/memcheck_bf16.txt"
st tune; timeout -k 10 230 python -m ckv_jax.benchmarks.tune --ops gather_records,gather_dequant --json "$OUT/tune_gathers.json" > "$OUT/tune_gathers.txt" 2>&1; echo "rc $?"; tail -12 "$OUT/tune_gathers.txt"
st end
} 2>&1 | tee "$OUT/run.log"
