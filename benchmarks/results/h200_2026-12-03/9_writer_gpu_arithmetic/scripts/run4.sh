#!/usr/bin/env bash
# device call 4: SASS of the nvfp4 writer with per-instruction execution counts (ncu source page)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
echo "=== sass $(date +%T)"
timeout -k 10 90 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write \
  --section SourceCounters --section InstructionStats --page source --print-source sass \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:262144:4:2 > "$OUT/ncu_writer_sass.txt" 2>&1; echo "rc $?"; wc -l "$OUT/ncu_writer_sass.txt"
echo "=== opcodes $(date +%T)"
timeout -k 10 90 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write \
  --section InstructionStats --page details --print-details all \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla write_records:262144:4:2 > "$OUT/ncu_writer_opcodes.txt" 2>&1; echo "rc $?"; wc -l "$OUT/ncu_writer_opcodes.txt"
echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/run.log"
