"""The host-side pieces of a torch adapter's `begin_step` that need no GPU, timed on this host:
the plan, the block table's check, the step's host arrays and the top-k tables (on CPU tensors).

    python tools/step_host_pieces.py [--world-sizes 1,4] [--requests 1,8] [--history 262144]
                                     [--chunk 4096] [--calls 200] [--rounds 5]

Each figure is the best round's mean over `calls` calls, in us (the host's speed varies between
rounds and processes: compare trees in alternating processes).  One request row per world size
and request count; every request has `history` tokens before a chunk of `chunk / requests`.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ckv_jax import dcp_step
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan
from interop import torch_topk


def best_mean_us(fn, calls: int, rounds: int) -> float:
    fn()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return min(means)


def pieces(world_size: int, requests: int, history: int, chunk: int, calls: int = 200, rounds: int = 5) -> dict:
    """us per call of each piece for one step shape."""
    layout = DcpLayout(world_size, 1, 64)
    query = np.full(requests, chunk // requests)
    seq = query + history
    blocks = int(layout.blocks_needed(layout.local_seq_lens(seq).max())) + 1
    table = np.random.default_rng(0).permutation(requests * blocks).astype(np.int32).reshape(requests, blocks)
    kw = dict(max_tokens=int(seq.sum()), max_num_seqs=requests, min_tokens=1, min_world_size=1)
    plan = build_step_plan(layout, seq, query, **kw)
    capacity = 1 << (plan.num_tokens - 1).bit_length()
    timed = dict(
        build_step_plan=lambda: build_step_plan(layout, seq, query, **kw),
        check_block_table=lambda: dcp_step.check_block_table(plan, table),
        host_step_arrays=lambda: dcp_step.host_step_arrays(plan, table, chunk_capacity=capacity),
        topk_tables=lambda: torch_topk.TopkTables(plan, torch.device("cpu")))
    return {name: best_mean_us(fn, calls, rounds) for name, fn in timed.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(x) for x in text.split(",")]        # noqa: E731
    parser.add_argument("--world-sizes", type=ints, default=[1, 4])
    parser.add_argument("--requests", type=ints, default=[1, 8])
    parser.add_argument("--history", type=int, default=262144)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'D':>3} {'R':>3} {'T':>6}  " + "  ".join(f"{n:>18}" for n in
                                                     ("build_step_plan", "check_block_table", "host_step_arrays",
                                                      "topk_tables")) + "  (us per call)")
    for d, r in zip(args.world_sizes, args.requests):
        got = pieces(d, r, args.history, args.chunk, args.calls, args.rounds)
        print(f"{d:>3} {r:>3} {args.chunk:>6}  " + "  ".join(f"{v:>18.1f}" for v in got.values()))


if __name__ == "__main__":
    main()
