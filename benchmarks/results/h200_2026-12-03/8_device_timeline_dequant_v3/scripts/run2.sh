#!/usr/bin/env bash
# device call 2 of 2026-12-03 (fourth session): slot gather + writer tune with device timelines,
# the patch at a large chunk, ncu of the v3 dequant and the 4/2 pack, memcheck of the paged gathers
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st tune; timeout -k 10 270 python -m ckv_jax.benchmarks.tune --ops gather_slots,write_records --json "$OUT/tune_slots_writer.json" > "$OUT/tune_slots_writer.txt" 2>&1; echo "rc $?"; tail -22 "$OUT/tune_slots_writer.txt"
st patch; timeout -k 10 60 python -m ckv_jax.cli bench --ops patch --tokens 262144 --chunk 131072 --formats fp8_ds_mla,nvfp4_ds_mla --out "$OUT/patch.json" > "$OUT/bench_patch.txt" 2>&1; echo "rc $?"; grep "patch " "$OUT/bench_patch.txt"
st ncu; timeout -k 10 70 ncu --target-processes all --clock-control none --kernel-name regex:ckv_ \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis \
  python -m ckv_jax.benchmarks.profile_target --format nvfp4_ds_mla gather_dequant:1048576:8:4 gather_records:1048576:4:2 > "$OUT/ncu.txt" 2>&1; echo "rc $?"; grep -c Duration "$OUT/ncu.txt"
st memcheck; timeout -k 10 130 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python -m pytest \
  tests/test_paged_gather.py -v -p no:cacheprovider -m gpu -k compiled > "$OUT/sanitizer_memcheck.txt" 2>&1; echo "rc $?"; tail -3 "$OUT/sanitizer_memcheck.txt"
st end
} 2>&1 | tee "$OUT/run.log"
