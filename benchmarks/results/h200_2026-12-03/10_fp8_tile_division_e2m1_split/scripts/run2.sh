#!/usr/bin/env bash
# device call 2 of 2026-12-03 (fifth session): writer tune on the fp8 per-tile division; SASS of the nvfp4 writer with
# execution counts and pipe utilization; memcheck of the compiled writer tests
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st tune; timeout -k 10 300 python -m ckv_jax.benchmarks.tune --ops write_records --json "$OUT/tune_writer.json" > "$OUT/tune_writer.txt" 2>&1; echo "rc $?"; grep -E "pallas_triton|xla" "$OUT/tune_writer.txt" | tail -45
st sass
timeout -k 10 60 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write \
  --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters --page source --print-source sass \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:131072:4:2 > "$OUT/ncu_writer_nvfp4_sass.txt" 2>&1; echo "rc $?"
timeout -k 10 60 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write \
  --section ComputeWorkloadAnalysis --section InstructionStats --section SpeedOfLight --page details --print-details all \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:131072:4:2 > "$OUT/ncu_writer_nvfp4_pipes.txt" 2>&1; echo "rc $?"
grep -iE "pipe|Duration|Issue Slots" "$OUT/ncu_writer_nvfp4_pipes.txt" | head -30
st memcheck
timeout -k 10 150 compute-sanitizer --tool memcheck --target-processes all python -m pytest tests/test_cache_writer.py -q -p no:cacheprovider -m gpu > "$OUT/sanitizer_memcheck_writer.txt" 2>&1; echo "rc $?"; tail -4 "$OUT/sanitizer_memcheck_writer.txt"
st end
} 2>&1 | tee "$OUT/run.log"
