"""Timing of JAX programs without the host dispatch floor, on the host clock and on the device's.

Host clock: per-call time = (t_R - t_1) / (R - 1), where t_R is the wall time of one jitted
program that runs the operation R times on R different inputs and t_1 that of the same program
with one input; the ~35 us dispatch and launch overhead cancels.  Medians over `trials`.

Device timeline (`Timing.device_seconds`): the R-call program is run once more under
`jax.profiler`, and the span from the first kernel's start to the last kernel's end on the GPU's
streams (CUPTI's records, read with `jax.profiler.ProfileData`) is divided by R.  It counts the
kernels and the gaps between them, not the host's per-call cost, which the host-clock figure
still carries at small sizes (BENCHMARKS.md: 10-17 us per call for a 13 us pack).  torch's
counterpart replays the R calls as one CUDA graph between two CUDA events.
"""
from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class Timing(NamedTuple):
    seconds: float                   # host clock, (t_R - t_1) / (R - 1)
    device_seconds: float | None     # device timeline span / R; None without a GPU timeline


def fastest(timings) -> Timing:
    """The best host-clock and the best device time among `timings` (None entries skipped)."""
    timings = [t for t in timings if t is not None]
    device = [t.device_seconds for t in timings if t.device_seconds is not None]
    return Timing(min(t.seconds for t in timings), min(device) if device else None)


def result_fields(timing: Timing, moved: int, ceiling: Timing, interpreted: bool = False) -> dict:
    """A benchmark row's timing columns for `moved` bytes (read + written): us, gbps,
    ceiling_gbps, pct_of_copy on the host clock, and their device_* twins where both the timing
    and the copy ceiling have a device time.  An interpreted kernel (Pallas interpret mode) is
    marked mode="interpret" and gets no % of copy: its time says nothing about the kernel."""
    fields = dict(us=timing.seconds * 1e6, gbps=moved / timing.seconds / 1e9,
                  ceiling_gbps=moved / ceiling.seconds / 1e9)
    if interpreted:
        return dict(fields, mode="interpret")
    fields["pct_of_copy"] = 100 * ceiling.seconds / timing.seconds
    if timing.device_seconds is not None and ceiling.device_seconds is not None:
        fields.update(device_us=timing.device_seconds * 1e6, device_gbps=moved / timing.device_seconds / 1e9,
                      device_ceiling_gbps=moved / ceiling.device_seconds / 1e9,
                      device_pct_of_copy=100 * ceiling.device_seconds / timing.device_seconds)
    return fields


def _wall(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def gpu_span_ns(profile) -> int | None:
    """First start to last end, in ns, of the events on the stream lines ("Stream #...") of the
    GPU planes ("/device:GPU:<n>") of a `jax.profiler.ProfileData`; None if there are none."""
    starts, ends = [], []
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                for event in line.events:
                    starts.append(event.start_ns)
                    ends.append(event.end_ns)
    return int(max(ends) - min(starts)) if starts else None


def device_timeline_seconds(run: Callable[[], object], calls: int) -> float | None:
    """Run `run()` (which must block until its work is done) under the JAX profiler: seconds per
    call of its GPU timeline span over `calls`; None where the trace has no GPU streams (CPU)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0          # only the device activity is read
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, profiler_options=options)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        if len(files) != 1:
            raise RuntimeError(f"expected one profile under {log_dir}, found {files}")
        span = gpu_span_ns(jax.profiler.ProfileData.from_file(files[0]))
    return None if span is None else span * 1e-9 / calls


def _check_repeats(inputs):
    if len(inputs) < 2:
        raise ValueError(f"inputs: expected at least 2 input tuples, got {len(inputs)}")


def measure_pure(op: Callable, inputs: Sequence[tuple], trials: int = 7) -> Timing:
    """Per-call time of `op(*inputs[i])`; all R results are returned, so nothing is elided."""
    _check_repeats(inputs)
    many = jax.jit(lambda *xs: tuple(op(*x) for x in xs))
    one = jax.jit(lambda x: op(*x))
    jax.block_until_ready(many(*inputs))
    jax.block_until_ready(one(inputs[0]))
    t_r = statistics.median(_wall(many, *inputs) for _ in range(trials))
    t_1 = statistics.median(_wall(one, inputs[0]) for _ in range(trials))
    device = device_timeline_seconds(lambda: jax.block_until_ready(many(*inputs)), len(inputs))
    return Timing((t_r - t_1) / (len(inputs) - 1), device)


def measure_in_place(op: Callable, state, inputs: Sequence[tuple], trials: int = 5):
    """Per-call time of `state = op(state, *inputs[i])` with `state` donated and chained.

    Returns (Timing, final state) so the caller can check the result.
    """
    _check_repeats(inputs)

    def chain(s, *xs):
        for x in xs:
            s = op(s, *x)
        return s

    many = jax.jit(chain, donate_argnums=0)
    one = jax.jit(lambda s, x: op(s, *x), donate_argnums=0)
    state = jax.block_until_ready(many(state, *inputs))
    state = jax.block_until_ready(one(state, inputs[0]))
    t_rs, t_1s = [], []
    for _ in range(trials):
        start = time.perf_counter()
        state = jax.block_until_ready(many(state, *inputs))
        t_rs.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = jax.block_until_ready(one(state, inputs[0]))
        t_1s.append(time.perf_counter() - start)

    def run_chained():
        nonlocal state
        state = jax.block_until_ready(many(state, *inputs))

    device = device_timeline_seconds(run_chained, len(inputs))
    seconds = (statistics.median(t_rs) - statistics.median(t_1s)) / (len(inputs) - 1)
    return Timing(seconds, device), state


def measure_copy(nbytes: int, repeats: int) -> Timing:
    """Per-call time of a contiguous copy of `nbytes` (reads + writes = 2 * nbytes).  The calls
    read disjoint slices of one source, so a copy smaller than L2 does not read from L2."""
    n = nbytes // 4
    src = jax.random.bits(jax.random.key(1), (n * repeats,), jnp.uint32)
    inputs = [(src, jnp.int32(i * n)) for i in range(repeats)]     # the buffer is an argument
    return measure_pure(lambda s, off: lax.dynamic_slice_in_dim(s, off, n), inputs)


def repeats_for(output_bytes: int, budget_bytes: int = 6 * 2 ** 30, lo: int = 7, hi: int = 64) -> int:
    """R for `measure_pure`: as many calls as `budget_bytes` of outputs allow, so that R calls of a
    short kernel take far longer than the host clock's jitter."""
    return int(min(hi, max(lo, budget_bytes // max(output_bytes, 1))))


def _torch_cuda():
    """The torch module if torch with CUDA is installed and a GPU is visible, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_timing(torch, step: Callable[[int], None], iters: int) -> Timing:
    """Seconds per call of `step(k)` for k < iters between two CUDA events: launched one by one
    from Python (`seconds`), and captured once as a CUDA graph and replayed, which puts the
    kernels back to back as in a jitted program (`device_seconds`; None if capture fails)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(iters):
        step(k)
    end.record()
    end.synchronize()
    launched = start.elapsed_time(end) / 1e3 / iters
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.graph(graph, stream=side):
            for k in range(iters):
                step(k)
    except RuntimeError as err:
        print(f"torch CUDA graph capture failed, no device time: {err}")
        return Timing(launched, None)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return Timing(launched, start.elapsed_time(end) / 1e3 / iters)


def torch_copy_timing(nbytes: int, iters: int = 20) -> Timing | None:
    """Per-call time of torch `copy_` of `nbytes` on the GPU, rotating over enough buffers that
    the working set exceeds L2 (`_torch_timing`); None without torch or CUDA."""
    torch = _torch_cuda()
    if torch is None:
        return None
    pairs = max(2, -(-256 * 2 ** 20 // nbytes))
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
             torch.empty(nbytes, dtype=torch.uint8, device="cuda")) for _ in range(pairs)]
    for src, dst in bufs:
        dst.copy_(src)
    try:
        return _torch_timing(torch, lambda k: bufs[k % pairs][0].copy_(bufs[k % pairs][1]), iters)
    finally:
        bufs.clear()
        torch.cuda.empty_cache()


def torch_index_select_timing(source_np, index_list, iters: int = 20) -> Timing | None:
    """Per-call time of `torch.index_select(source, 0, index)` rotating over the index arrays
    (torch's own op for the same movement: whole pages, or rows), `_torch_timing`; None without
    torch or CUDA, or if its first result does not equal a fresh `index_select`."""
    torch = _torch_cuda()
    if torch is None:
        return None
    bufs = dict(src=torch.from_numpy(source_np).cuda())
    bufs["idx"] = [torch.from_numpy(i.astype(np.int64)).cuda() for i in index_list]
    bufs["outs"] = [bufs["src"].index_select(0, i) for i in bufs["idx"]]      # warm-up, output buffers

    def step(k):
        torch.index_select(bufs["src"], 0, bufs["idx"][k % len(index_list)],
                           out=bufs["outs"][k % len(index_list)])

    try:
        timing = _torch_timing(torch, step, iters)
        ok = bool(torch.equal(bufs["outs"][0], bufs["src"].index_select(0, bufs["idx"][0])))
        return timing if ok else None
    finally:
        bufs.clear()
        torch.cuda.empty_cache()
