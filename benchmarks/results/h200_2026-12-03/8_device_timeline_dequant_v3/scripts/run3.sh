#!/usr/bin/env bash
# device call 3 of 2026-12-03 (fourth session): the patch with device times, the small packs again,
# ncu of the nvfp4 writer
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st patch; timeout -k 10 90 python -m ckv_jax.cli bench --ops patch --tokens 262144 --chunk 131072 --formats fp8_ds_mla,nvfp4_ds_mla --out "$OUT/patch.json" > "$OUT/bench_patch.txt" 2>&1; echo "rc $?"; grep "patch " "$OUT/bench_patch.txt"
st tune_small; timeout -k 10 150 python -m ckv_jax.benchmarks.tune --ops gather_records --tokens 32768,65536 --json "$OUT/tune_small_packs.json" > "$OUT/tune_small_packs.txt" 2>&1; echo "rc $?"
st ncu; timeout -k 10 60 ncu --target-processes all --clock-control none --kernel-name regex:ckv_ \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:262144:4:2 > "$OUT/ncu_writer.txt" 2>&1; echo "rc $?"; grep -c Duration "$OUT/ncu_writer.txt"
st end
} 2>&1 | tee "$OUT/run.log"
