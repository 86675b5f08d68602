#!/usr/bin/env bash
# device call 1 of 2026-12-03 (third session)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st tests; STAGES=tests bash tools/device_run.sh > /dev/null 2>&1; tail -3 "$OUT/pytest_gpu.txt"
st ab; timeout -k 10 150 python ab_old/ab_dequant.py all nvfp4_ds_mla > "$OUT/ab_dequant.txt" 2>&1; grep -c AB "$OUT/ab_dequant.txt"
st ncu; timeout -k 10 120 ncu --target-processes all --clock-control none --kernel-name regex:ckv_ \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
  python ab_old/ab_dequant.py once nvfp4_ds_mla fp8_ds_mla > "$OUT/ncu_dequant.txt" 2>&1; grep -c Duration "$OUT/ncu_dequant.txt"
st trace; timeout -k 10 150 python ab_old/trace_pack.py fp8_ds_mla > "$OUT/trace_pack.txt" 2>&1; tail -2 "$OUT/trace_pack.txt"
st memcheck; SANITIZER_TESTS=tests/test_paged_gather.py SANITIZER_TIMEOUT=120 STAGES=sanitizer bash tools/device_run.sh 2>&1 | tail -4
rm -f "$OUT/env.txt"
st end
} 2>&1 | tee "$OUT/run.log"
