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


def _wall(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def time_pure(op: Callable, inputs: Sequence[tuple], trials: int = 5) -> float:
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
