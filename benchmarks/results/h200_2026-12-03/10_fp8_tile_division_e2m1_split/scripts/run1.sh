#!/usr/bin/env bash
# device call 1 of 2026-12-03 (fifth session): fp8 per-tile division (Markstein) tests + A/B; ncu of the fp8 writer
# (old/new) and of the small packs against torch; patch bench on the new writer
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
SECT="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
{
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
st tests; timeout -k 10 90 python -m pytest tests/test_cache_writer.py -q -p no:cacheprovider -m gpu > "$OUT/pytest_gpu_writer.txt" 2>&1; tail -3 "$OUT/pytest_gpu_writer.txt"
st ab; timeout -k 10 170 python ab_old/ab_writer.py fp8_ds_mla 131072,262144,1048576 4x2,4x4,8x4 > "$OUT/ab_writer.txt" 2>&1; echo "rc $?"; grep AB "$OUT/ab_writer.txt"
st patch; timeout -k 10 60 python -m ckv_jax.cli bench --ops patch --tokens 262144 --chunk 131072 --formats fp8_ds_mla,nvfp4_ds_mla --out "$OUT/patch.json" > "$OUT/bench_patch.txt" 2>&1; echo "rc $?"; grep "patch " "$OUT/bench_patch.txt"
st ncu_writer
timeout -k 10 40 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write $SECT \
  python ab_old/profile_old_writer.py fp8_ds_mla 131072 4 2 > "$OUT/ncu_writer_fp8_old.txt" 2>&1; echo "rc $?"
timeout -k 10 40 ncu --target-processes all --clock-control none --kernel-name regex:ckv_write $SECT \
  python -m ckv_jax.benchmarks.profile_target --format fp8_ds_mla write_records:131072:4:2 > "$OUT/ncu_writer_fp8_new.txt" 2>&1; echo "rc $?"
for f in old new; do echo "-- $f"; grep -E "Duration|DRAM Throughput|highest-utilized|Executed Instructions  |Registers Per|Achieved Occ|Issue Slots Busy" "$OUT/ncu_writer_fp8_$f.txt"; done
st ncu_small
for fmt in fp8_ds_mla nvfp4_ds_mla; do
timeout -k 10 60 ncu --target-processes all --clock-control none --kernel-name regex:'ckv_|indexSelect|index_select|gather' $SECT \
  python -m ckv_jax.benchmarks.profile_target --format $fmt gather_records:32768:8:4 torch_pages:32768 gather_records:65536:8:4 torch_pages:65536 > "$OUT/ncu_small_$fmt.txt" 2>&1; echo "rc $?"
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Grid Size|Block Size|Waves Per SM|Achieved Occ|Registers Per" "$OUT/ncu_small_$fmt.txt"
done
timeout -k 10 40 ncu --target-processes all --clock-control none --kernel-name regex:'ckv_|indexSelect|index_select|gather' $SECT \
  python -m ckv_jax.benchmarks.profile_target gather_slots:2048:4:2 torch_rows:2048 > "$OUT/ncu_slots_2048.txt" 2>&1; echo "rc $?"
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Grid Size|Block Size|Waves Per SM|Achieved Occ" "$OUT/ncu_slots_2048.txt"
st end
} 2>&1 | tee "$OUT/run.log"
