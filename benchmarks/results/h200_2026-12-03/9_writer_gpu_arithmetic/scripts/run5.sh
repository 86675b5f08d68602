#!/usr/bin/env bash
# device call 5: writer with GPU arithmetic (e2m1 codes without a NaN case, NaN-ignoring FMNMX amax):
# compiled writer tests, A/B against main, ncu
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st tests; timeout -k 10 70 python -m pytest tests/test_cache_writer.py -q -p no:cacheprovider -m gpu > "$OUT/pytest_gpu_writer.txt" 2>&1; tail -3 "$OUT/pytest_gpu_writer.txt"
st ab; timeout -k 10 140 python ab_old/ab_writer.py > "$OUT/ab_writer.txt" 2>&1; echo "rc $?"; grep AB "$OUT/ab_writer.txt"
st ncu; timeout -k 10 45 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:262144:4:2 > "$OUT/ncu_writer.txt" 2>&1; echo "rc $?"
grep -E "Duration|DRAM Throughput|highest-utilized|Executed Instructions  |Registers Per|Achieved Occ" "$OUT/ncu_writer.txt"
st patch; timeout -k 10 55 python -m ckv_jax.cli bench --ops patch --tokens 262144 --chunk 131072 --formats fp8_ds_mla,nvfp4_ds_mla --out "$OUT/patch.json" > "$OUT/bench_patch.txt" 2>&1; echo "rc $?"; grep "patch " "$OUT/bench_patch.txt"
st end
} 2>&1 | tee "$OUT/run.log"
