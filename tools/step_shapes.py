"""How many programs a chunked prefill compiles, and how many rows its shapes pad: the step's
static shapes (P, the requests, the block table's columns, `dcp_step.StepArrays`) over every
step of one request's prefill, per `shape_buckets` (`step_plan.bucket_up`).  Host arithmetic
only: the real `build_step_plan` and `host_step_arrays`, no device.

    python tools/step_shapes.py --context 1048576 --chunk 4096 --world-sizes 1,8 --buckets 0,4,8,16

Per row: the steps, the distinct shape sets (each compiles the step's programs once), and the
rows the pack writes over the prefill against the exact P's (the padding is zero rows).
--table exact: the engine's table has the columns the step needs (they grow every step);
fixed: the columns of the whole context (as vLLM's block table, sized by max_model_len).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ckv_jax import dcp_step  # noqa: E402
from ckv_jax.dcp_layout import DcpLayout  # noqa: E402
from ckv_jax.step_plan import build_step_plan  # noqa: E402


def prefill_shapes(context: int, chunk: int, world_size: int, buckets: int, table: str, block_size: int = 64):
    """(steps, distinct shape sets, rows packed, rows packed with exact shapes) over the prefill."""
    layout = DcpLayout(world_size, 1, block_size)
    full_width = int(layout.blocks_needed(layout.local_seq_lens([context]).max()))
    kw = dict(max_num_seqs=1, max_tokens=context, min_tokens=1, min_world_size=1)
    shapes, rows, exact_rows, steps = set(), 0, 0, 0
    for done in range(chunk, context + chunk, chunk):
        seq, query = np.array([min(done, context)]), np.array([min(chunk, context - done + chunk)])
        plan = build_step_plan(layout, seq, query, shape_buckets=buckets, **kw)
        exact = build_step_plan(layout, seq, query, shape_buckets=0, **kw)
        width = full_width if table == "fixed" else int(layout.blocks_needed(layout.local_seq_lens(seq).max()))
        arrays = dcp_step.host_step_arrays(plan, np.zeros((1, width), np.int32), chunk_capacity=chunk)
        shapes.add((arrays.num_rows, arrays.block_table.shape, arrays.local_cu.shape))
        rows += world_size * plan.padded_tokens
        exact_rows += world_size * exact.padded_tokens
        steps += 1
    return steps, len(shapes), rows, exact_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--world-sizes", default="1,8")
    ap.add_argument("--buckets", default="0,4,8,16", help="shape_buckets values (0: exact shapes)")
    ap.add_argument("--table", choices=["exact", "fixed"], default="exact")
    args = ap.parse_args(argv)
    print(f"one request's prefill of {args.context} tokens in chunks of {args.chunk}, table {args.table}")
    print(f"{'D':>3} {'buckets':>7} {'steps':>6} {'shapes':>6} {'rows packed':>14} {'padding %':>9}")
    for d in (int(x) for x in args.world_sizes.split(",")):
        for b in (int(x) for x in args.buckets.split(",")):
            steps, shapes, rows, exact = prefill_shapes(args.context, args.chunk, d, b, args.table)
            print(f"{d:>3} {b:>7} {steps:>6} {shapes:>6} {rows:>14,} {100 * (rows - exact) / exact:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
