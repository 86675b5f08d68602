"""Device-side timing of JAX programs without the host dispatch floor.

Per-call time = (t_R - t_1) / (R - 1), where t_R is the wall time of one jitted program that
runs the operation R times on R different inputs and t_1 that of the same program with one
input; the ~35 us dispatch and launch overhead cancels.  Medians over `trials`.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _wall(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def time_pure(op: Callable, inputs: Sequence[tuple], trials: int = 7) -> float:
    """Seconds per call of `op(*inputs[i])`; all R results are returned, so nothing is elided."""
    r = len(inputs)
    if r < 2:
        raise ValueError(f"inputs: expected at least 2 input tuples, got {r}")
    many = jax.jit(lambda *xs: tuple(op(*x) for x in xs))
    one = jax.jit(lambda x: op(*x))
    jax.block_until_ready(many(*inputs))
    jax.block_until_ready(one(inputs[0]))
    t_r = statistics.median(_wall(many, *inputs) for _ in range(trials))
    t_1 = statistics.median(_wall(one, inputs[0]) for _ in range(trials))
    return (t_r - t_1) / (r - 1)


def time_in_place(op: Callable, state, inputs: Sequence[tuple], trials: int = 5):
    """Seconds per call of `state = op(state, *inputs[i])` with `state` donated and chained.

    Returns (seconds, final state) so the caller can check the result.
    """
    r = len(inputs)
    if r < 2:
        raise ValueError(f"inputs: expected at least 2 input tuples, got {r}")

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
    return (statistics.median(t_rs) - statistics.median(t_1s)) / (r - 1), state


def copy_seconds(nbytes: int, repeats: int) -> float:
    """Per-call time of a contiguous copy of `nbytes` (reads + writes = 2 * nbytes).  The calls
    read disjoint slices of one source, so a copy smaller than L2 does not read from L2."""
    n = nbytes // 4
    src = jax.random.bits(jax.random.key(1), (n * repeats,), jnp.uint32)
    inputs = [(src, jnp.int32(i * n)) for i in range(repeats)]     # the buffer is an argument
    return time_pure(lambda s, off: lax.dynamic_slice_in_dim(s, off, n), inputs)


def repeats_for(output_bytes: int, budget_bytes: int = 6 * 2 ** 30, lo: int = 7, hi: int = 64) -> int:
    """R for `time_pure`: as many calls as `budget_bytes` of outputs allow, so that R calls of a
    short kernel take far longer than the host clock's jitter."""
    return int(min(hi, max(lo, budget_bytes // max(output_bytes, 1))))


def torch_copy_seconds(nbytes: int, iters: int = 20) -> float | None:
    """Per-call time of torch `copy_` of `nbytes` on the GPU (CUDA events), rotating over enough
    buffers that the working set exceeds L2; None without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    pairs = max(2, -(-256 * 2 ** 20 // nbytes))
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
             torch.empty(nbytes, dtype=torch.uint8, device="cuda")) for _ in range(pairs)]
    for src, dst in bufs:
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        dst, src = bufs[i % pairs]
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del bufs
    torch.cuda.empty_cache()
    return seconds


def torch_index_select_seconds(source_np, index_list, iters: int = 20) -> float | None:
    """CUDA-event time of `torch.index_select(source, 0, index)` rotating over the index arrays
    (torch's own op for the same movement: whole pages, or rows); None without torch or CUDA, or
    if its first result does not equal a fresh `index_select`."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.from_numpy(source_np).cuda()
    idx = [torch.from_numpy(i.astype(np.int64)).cuda() for i in index_list]
    outs = [src.index_select(0, i) for i in idx]                  # warm-up and output buffers
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(iters):
        torch.index_select(src, 0, idx[k % len(idx)], out=outs[k % len(outs)])
    end.record()
    end.synchronize()
    ok = bool(torch.equal(outs[0], src.index_select(0, idx[0])))
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, idx, outs
    torch.cuda.empty_cache()
    return seconds if ok else None
