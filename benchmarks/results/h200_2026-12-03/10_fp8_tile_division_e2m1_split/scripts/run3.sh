#!/usr/bin/env bash
# device call 3 of 2026-12-03 (fifth session): nvfp4 e2m1 codes by Veltkamp's split: GPU tests (exhaustive e2m1),
# A/B against main, writer tune, ckv-jax bench (writer, gather, patch) with device timelines, ncu
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
SECT="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
{
st tests; timeout -k 5 100 python -m pytest tests/test_cache_writer.py -q -p no:cacheprovider -m gpu > "$OUT/pytest_gpu_writer.txt" 2>&1; rc=$?; tail -3 "$OUT/pytest_gpu_writer.txt"
if [ $rc -ne 0 ]; then grep -E "^FAILED|Error|assert" "$OUT/pytest_gpu_writer.txt" | head -20; exit 1; fi
st ab; timeout -k 5 55 python ab_old/ab_writer.py nvfp4_ds_mla 131072,1048576 4x2 > "$OUT/ab_writer.txt" 2>&1; echo "rc $?"; grep AB "$OUT/ab_writer.txt"
st ncu; timeout -k 5 35 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write $SECT \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:131072:4:2 > "$OUT/ncu_writer_nvfp4.txt" 2>&1; echo "rc $?"
grep -E "Duration|DRAM Throughput|highest-utilized|Executed Instructions  |Registers Per|Achieved Occ|Issue Slots Busy" "$OUT/ncu_writer_nvfp4.txt"
st tune; timeout -k 5 270 python -m ckv_jax.benchmarks.tune --ops write_records --json "$OUT/tune_writer.json" > "$OUT/tune_writer.txt" 2>&1; echo "rc $?"; grep -E "pallas_triton" "$OUT/tune_writer.txt" | cut -c1-40,100-160; tail -12 "$OUT/tune_writer.txt"
st bench; timeout -k 5 110 python -m ckv_jax.cli bench --ops writer,gather,patch --tokens 262144 --formats fp8_ds_mla,nvfp4_ds_mla --patterns random --chunk 131072 --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1; echo "rc $?"; tail -30 "$OUT/bench.txt"
st end
} 2>&1 | tee "$OUT/run.log"
