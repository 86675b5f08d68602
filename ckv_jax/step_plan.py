"""Host-side step plan of the full-CKV gather (the metadata builder).

Built once per step from the global sequence lengths (history + current chunk) and query
lengths, in numpy, identically on every rank, with no device sync.  The gathered workspace is
rank-major: rank o's local shard of request r occupies rows
`o * P + rank_req_starts[o, r] + local`, rows past a rank's total up to P are zero.

P is a static shape of every program that touches the workspace, and so are the step's request
count and block-table width (`dcp_step.StepArrays`): a step whose shapes differ compiles anew.
In chunked prefill the history grows every step, so the plan rounds P up to one of a few
values per doubling (`shape_buckets`, `bucket_up`), and the step's arrays pad the requests and
the table's columns the same way: a prefill that grows its history step by step compiles a few
programs per doubling of its length, not one a step, at the cost of the zero rows the pack
writes up to P (at most 1 / shape_buckets of the rows).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ckv_jax.dcp_layout import DcpLayout

ROW_ALIGN = 64
DEFAULT_MIN_TOKENS = 16
DEFAULT_MAX_TOKENS = 131072
# shapes per doubling of a step's sizes: 8 keeps the padding under 1/8 of the rows
DEFAULT_SHAPE_BUCKETS = 8


def ceil_to(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def bucket_up(n: int, per_doubling: int, align: int = 1) -> int:
    """The shape a size n >= 0 is padded to: the smallest multiple of `align` >= n, rounded up
    further, once above per_doubling * align, to a multiple of 2**k * align with k chosen so
    that each doubling holds per_doubling such values.  So a size that grows step by step takes
    at most `per_doubling` shapes per doubling, and the shape exceeds ceil(n / align) * align by
    less than 1 / per_doubling of it.  per_doubling: a power of two, or 0 (align only)."""
    units = -(-int(n) // align)
    if per_doubling and units > per_doubling:
        step = 1 << ((units - 1).bit_length() - per_doubling.bit_length())
        units = -(-units // step) * step
    return units * align


def _check_shape_buckets(shape_buckets) -> int:
    if isinstance(shape_buckets, bool) or not isinstance(shape_buckets, (int, np.integer)) or shape_buckets < 0 \
            or shape_buckets & (shape_buckets - 1):
        raise ValueError(f"shape_buckets: expected 0 (exact shapes) or a power of two (shapes per doubling), "
                         f"got {shape_buckets!r}")
    return int(shape_buckets)


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything the gather, the top-k remap and the patch need about one step.

    Arrays (numpy, int32):
      seq_lens [R]          global lengths including the current chunk
      query_lens [R]        current-chunk tokens per request
      query_start_loc [R+1] exclusive prefix sum of query_lens
      req_id_per_token [T]  request of each query row
      rank_req_lens [D, R]  local lengths per rank
      rank_req_starts [D, R] exclusive prefix sums of rank_req_lens along requests
      local_cu_seq_lens [D, R+1] per-rank cumulative local lengths, leading 0
    Ints: padded_tokens P (the workspace rows per rank: the largest local total rounded up to
    64 rows and to `shape_buckets` shapes per doubling, at most the capacity C when that total
    fits it), capacity C, shape_buckets (also the step arrays' padding of the requests and the
    block table's columns, `dcp_step.host_step_arrays`), eligible and why (the reason when not
    eligible).
    """
    layout: DcpLayout
    seq_lens: np.ndarray
    query_lens: np.ndarray
    query_start_loc: np.ndarray
    req_id_per_token: np.ndarray
    rank_req_lens: np.ndarray
    rank_req_starts: np.ndarray
    local_cu_seq_lens: np.ndarray
    padded_tokens: int
    capacity: int
    shape_buckets: int
    eligible: bool
    why: str

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.req_id_per_token.shape[0])

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def positions(self) -> np.ndarray:
        """Global position of every query row: seq_len - q_len + (t - q_start)."""
        start = self.seq_lens - self.query_lens - self.query_start_loc[:-1]           # [R]
        return (np.arange(self.num_tokens, dtype=np.int32) + np.repeat(start, self.query_lens)).astype(np.int32)

    def causal_lens(self) -> np.ndarray:
        """i32[T]: tokens each query row may attend (its global position + 1)."""
        return self.positions() + 1


def capacity(layout: DcpLayout, max_tokens: int, max_num_seqs: int) -> int:
    """C = ceil64(ceil(MAX_TOKENS / D) + max_num_seqs * I): local rows per rank the pool holds."""
    return ceil_to(-(-max_tokens // layout.world_size) + max_num_seqs * layout.interleave, ROW_ALIGN)


def build_step_plan(layout: DcpLayout, seq_lens, query_lens, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                    max_num_seqs: int | None = None, min_tokens: int = DEFAULT_MIN_TOKENS,
                    min_world_size: int = 2, shape_buckets: int = DEFAULT_SHAPE_BUCKETS) -> StepPlan:
    """The plan of one step.  seq_lens, query_lens: int[R] (seq_lens include the current chunk).

    shape_buckets: the static shapes per doubling of the step's sizes (see the module docstring);
    0 for P = the largest local total rounded up to 64 rows, a compile for every such value.

    min_world_size: the smallest D that is eligible; 2 in serving (with one rank there is nothing
    to gather), 1 to run the full path on a single device in tests and benchmarks."""
    seq_lens = np.asarray(seq_lens)
    query_lens = np.asarray(query_lens)
    for name, a in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected int[num_reqs], got {a.dtype}{list(a.shape)}")
        if (a < 0).any():
            raise ValueError(f"{name}: expected non-negative lengths, got {a.tolist()}")
    if seq_lens.shape != query_lens.shape:
        raise ValueError(f"query_lens: expected the shape of seq_lens {list(seq_lens.shape)}, "
                         f"got {list(query_lens.shape)}")
    if (query_lens > seq_lens).any():
        i = int(np.flatnonzero(query_lens > seq_lens)[0])
        raise ValueError(f"query_lens: request {i} has {int(query_lens[i])} query tokens but only "
                         f"{int(seq_lens[i])} tokens in total")
    seq_lens = seq_lens.astype(np.int32)
    query_lens = query_lens.astype(np.int32)
    num_reqs = seq_lens.shape[0]
    max_num_seqs = num_reqs if max_num_seqs is None else max_num_seqs
    if num_reqs > max_num_seqs:
        raise ValueError(f"seq_lens: {num_reqs} requests exceed max_num_seqs={max_num_seqs}")

    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    req_id_per_token = np.repeat(np.arange(num_reqs, dtype=np.int32), query_lens)
    rank_req_lens = layout.local_seq_lens(seq_lens).T.copy()                     # [D, R]
    cums = np.cumsum(rank_req_lens, axis=1)
    rank_req_starts = (cums - rank_req_lens).astype(np.int32)
    local_cu = np.concatenate([np.zeros((layout.world_size, 1), np.int64), cums], axis=1).astype(np.int32)
    shape_buckets = _check_shape_buckets(shape_buckets)
    most = local_cu[:, -1].max(initial=0)
    cap = capacity(layout, max_tokens, max_num_seqs)
    padded = ceil_to(most, ROW_ALIGN)
    if padded <= cap:               # (past C the step is not eligible; the reason names the exact P)
        padded = min(bucket_up(most, shape_buckets, ROW_ALIGN), cap)

    if layout.world_size < min_world_size:
        why = f"world_size {layout.world_size} < {min_world_size}: no DCP"
    elif num_reqs == 0 or (query_lens <= 1).any():
        why = "not a pure prefill step (a request has at most one query token)"
    elif query_lens.max() <= min_tokens:
        why = f"max query length {int(query_lens.max())} <= min_tokens {min_tokens}"
    elif padded > cap:
        why = f"padded local tokens P={padded} exceed capacity C={cap}"
    else:
        why = ""
    return StepPlan(layout, seq_lens, query_lens, query_start_loc, req_id_per_token,
                    rank_req_lens.astype(np.int32), rank_req_starts, local_cu, int(padded), int(cap), shape_buckets,
                    eligible=not why, why=why)
