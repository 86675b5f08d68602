#!/usr/bin/env bash
# The GPU checks and figures of the project in stages, each inside the device's 600 s per command.
# Run from the repository root:  [STAGES="..."] bash tools/device_run.sh   (output under $OUT)
# Stages (default all, in this order): env tests examples (with the demo) trace interop writer
# gather patch prefill attention sanitizer plot.  KERNEL_ARGS / PREFILL_ARGS / ATTENTION_ARGS /
# PYTEST_ARGS override the sweeps and the test selection (default: the GPU tests, `-m gpu`).  Extra stages, run only when named: tune (the
# tuning sweep, TUNE_ARGS), host (the adapter's host time by round and condition, and by piece inside a
# dispatch per round), ncu (Nsight Compute on our kernels and torch's, NCU_RUNS), ptxas (the Mosaic
# attention sweep assembled by the device's ptxas and by PTXAS_WHEEL's, PTXAS_TUNE_ARGS); NCU_SECTIONS
# and NCU_FORMAT override the ncu sections and the record format.  TRACE_BEFORE=DIR adds the
# adapter's kernel timeline of another checkout (e.g. an older commit) beside this one's.
# INTEROP_ARGS overrides the torch adapter benchmark's matrix.  SANITIZER_TESTS narrows the
# memcheck run to some test files, SANITIZER_TIMEOUT bounds it.
set -u -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STAGES=${STAGES:-env tests examples trace interop writer gather patch prefill attention sanitizer plot}
status=0
step() { echo "=== $1 ($(date +%T))"; shift; timeout -k 10 "$@" || { echo "!!! exit $?"; status=1; }; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
want env && step "env" 60 python -m ckv_jax.cli env 2>&1 | tee "$OUT/env.txt"
want tests && step "GPU tests" 270 python -m pytest tests -q -p no:cacheprovider -rs ${PYTEST_ARGS:--m gpu} 2>&1 \
  | tee "$OUT/pytest_gpu.txt"
if want examples; then
  step "torch engine example" 90 python examples/torch_engine.py 2>&1 | tee "$OUT/example_torch_engine.txt"
  step "flax example" 90 python examples/flax_mla.py --dcp 1 2>&1 | tee "$OUT/example_flax.txt"
  step "demo" 120 python -m ckv_jax.cli demo --dcp 1 2>&1 | tee "$OUT/demo.txt"
fi
if want host; then
  step "adapter host time by round" 150 python tools/adapter_host_drift.py 2>&1 | tee "$OUT/host_drift.txt"
  step "adapter host pieces by round" 150 python tools/adapter_host_timeline.py --history 262144 --depth 2 \
    --prefetch-programs 66 --rounds 8 2>&1 | tee "$OUT/host_rounds.txt"
fi
want tune && step "tuning sweep" ${TUNE_TIMEOUT:-420} python tools/tune.py ${TUNE_ARGS:-} \
  --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.txt"
# ncu: one process running each NCU_RUNS entry once (tools/profile_target.py), every
# kernel profiled at the GPU's own clocks with a flushed L2 (ncu's default cache control)
want ncu && step "ncu" 240 ncu --target-processes all --clock-control none --kernel-name regex:'ckv_|indexSelect|gather_kernel' \
  ${NCU_SECTIONS:---section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy} \
  python tools/profile_target.py ${NCU_FORMAT:+--format $NCU_FORMAT} ${NCU_RUNS:-gather_records:32768:8:4 gather_records_mosaic:32768 \
  torch_pages:32768 gather_records:1048576:8:4 gather_records_mosaic:1048576 torch_pages:1048576 \
  gather_dequant:1048576:8:4 gather_slots:2048:16:8 torch_rows:2048 gather_slots:1048576:16:8 torch_rows:1048576} \
  2>&1 | tee "$OUT/ncu.txt"
# ptxas: the same configs timed (and checked exact) once assembled by the device's ptxas and once by
# that of PTXAS_WHEEL (a carried nvidia-cuda-nvcc wheel; tools/cuda_root_overlay.py), one process
# each; each assembler's report (registers, spills, C7512 where it serializes wgmmas) under
# $OUT/ptxas_<which>/
if want ptxas; then
  assemblers="device overlay"
  overlay=$(python tools/cuda_root_overlay.py --wheel "${PTXAS_WHEEL:?ptxas: PTXAS_WHEEL names no wheel}" \
    --out /tmp/cuda_overlay 2> "$OUT/ptxas_versions.txt") || { echo "!!! no overlay"; status=1; assemblers=device; }
  cat "$OUT/ptxas_versions.txt"
  for which in $assemblers; do
    # the overlay on every route to an assembler: jax's CUDA root, XLA's data dir, Mosaic GPU's
    # default data dir (./cuda_sdk_lib, relative to the working directory) and PATH
    root=; [ $which = overlay ] && { root=$overlay; ln -sfn "$root" cuda_sdk_lib; }
    mkdir -p "$OUT/ptxas_$which"
    step "attention sweep, the $which ptxas" 240 env ${root:+CUDA_ROOT=$root PATH=$root/bin:$PATH \
      XLA_FLAGS=--xla_gpu_cuda_data_dir=$root} MOSAIC_GPU_DUMP_PTXAS=1 \
      MOSAIC_GPU_DUMP_TO="$OUT/ptxas_$which" python tools/tune.py ${PTXAS_TUNE_ARGS:---ops sparse_mla_attention \
      --formats fp8_ds_mla --implementations pallas_mosaic_gpu --attention-heads 64 --mosaic-configs \
      'copy_issuers=128,k_slots=2,memory_warpgroups=2,compute_registers=208;copy_issuers=128,k_slots=2,memory_warpgroups=2,compute_registers=216'} \
      --out "$OUT/ptxas_$which.json" 2>&1 | tee "$OUT/ptxas_$which.txt"
    rm -f cuda_sdk_lib
    grep -l C7512 "$OUT/ptxas_$which"/* 2>/dev/null | sed "s/^/C7512 (wgmmas serialized) in /"
  done
fi
if want trace; then
  step "adapter trace" 150 python tools/adapter_trace.py --out "$OUT/trace" 2>&1 | tee "$OUT/trace.txt"
  [ -n "${TRACE_BEFORE:-}" ] && step "adapter trace ($TRACE_BEFORE)" 150 python tools/adapter_trace.py \
    --code "$TRACE_BEFORE" --latents copied --out "$OUT/trace_before" 2>&1 | tee "$OUT/trace_before.txt"
fi
want interop && step "interop bench" 360 python -m interop.bench ${INTEROP_ARGS:-} --out "$OUT/interop.json" 2>&1 \
  | tee "$OUT/interop.txt"
for op in writer gather patch; do
  want $op && step "bench $op" 150 python -m ckv_jax.cli bench --ops $op ${KERNEL_ARGS:-} --out "$OUT/$op.json" 2>&1 \
    | tee "$OUT/bench_$op.txt"
done
# the GPU defaults of --ops prefill: a GLM-5-shaped step (64 heads, top-k 2,048, an 8,192-token
# chunk on a 1M-token context) with the attention the library selects
want prefill && step "bench prefill" 300 python -m ckv_jax.cli bench --ops prefill \
  ${PREFILL_ARGS:---depths 0,1,2,3 --layers 8} --out "$OUT/prefill.json" 2>&1 | tee "$OUT/bench_prefill.txt"
want attention && step "bench attention" 300 python -m ckv_jax.cli bench --ops attention \
  ${ATTENTION_ARGS:---formats fp8_ds_mla,nvfp4_ds_mla,bf16 --heads 16,64,128 --attention-tokens 4096 \
  --attention-rows 262144 --top-k 2048} --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench_attention.txt"
# memcheck: the whole log goes to the file as it comes (a pipe through tail would hold it until the
# end, and a target left behind by the timeout would hold the pipe open)
want sanitizer && { step "compute-sanitizer memcheck (compiled kernels)" ${SANITIZER_TIMEOUT:-300} compute-sanitizer \
  --tool memcheck --leak-check no --error-exitcode 9 python -m pytest ${SANITIZER_TESTS:-tests} -v -p no:cacheprovider \
  -m gpu -k "compiled" -x > "$OUT/sanitizer_memcheck.txt" 2>&1; tail -5 "$OUT/sanitizer_memcheck.txt"; }
want plot && step "plot" 60 python -m ckv_jax.cli plot $(ls "$OUT"/{writer,gather,patch,prefill,attention}.json 2>/dev/null) \
  --out-dir "$OUT"
exit $status
