#!/usr/bin/env bash
# device call 5 of 2026-12-03 (fifth session): the patch and the writer with the final tuning table
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
st() { echo "=== $1 $(date +%T)"; }
{
st patch_writer; timeout -k 5 150 python -m ckv_jax.cli bench --ops writer,patch --tokens 262144 --formats fp8_ds_mla,nvfp4_ds_mla --patterns random --chunk 131072 --out "$OUT/bench_final.json" > "$OUT/bench_final.txt" 2>&1; echo "rc $?"; grep -E "^(patch|write_records) " "$OUT/bench_final.txt"
st end
} 2>&1 | tee "$OUT/run.log"
