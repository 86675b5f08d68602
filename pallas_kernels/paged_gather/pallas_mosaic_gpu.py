"""Mosaic GPU paged gather of raw records: one page per CTA, bulk async copies through SMEM.

Grid (tiles, num_reqs), tiles = cdiv(num_rows, block_size): CTA (j, r) moves block j of request r
(so with several requests most CTAs find no rows and exit; the automatic choice in `api.py` uses
this kernel for one request only).
It issues one bulk copy (`cp.async.bulk`, no tensor map, so no 256-element limit) of the whole
page GMEM -> SMEM, waits on its barrier, and stores the request's rows SMEM -> GMEM as at most
log2(block_size) + 1 bulk copies (the binary digits of the row count: a full page is one copy,
a partial last page a few).  The last request's CTAs past its end store zero rows from a second
SMEM buffer (filled once from a zero page in GMEM), which is the padding.  A page id outside the
cache, or a block index outside the table, stores zero rows and never reads the cache.

Needs row offsets that are multiples of 16 bytes (bulk copies): R % 16 == 0, which every
registered format meets.  SM90+ (TMA); `supported_on` checks the device.  Same contract as
`reference.gather_records_reference`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat


def _store_rows(smem, first, count, out_ref, dst_row, *, block_size, record_bytes):
    """out rows [dst_row + first, + count) <- smem rows [first, + count), as one bulk copy per
    set bit of `count` (count < 2 * block_size)."""
    plgpu = compat.plgpu
    offset = first
    k = block_size
    while k >= 1:
        take = (count & k) != 0

        @pl.when(take)
        def _(offset=offset, k=k):
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(offset * record_bytes, k * record_bytes)],
                                    out_ref.at[pl.ds((dst_row + offset) * record_bytes, k * record_bytes)])

        offset = offset + jnp.where(take, k, 0)
        k //= 2


def _kernel(cu_ref, bt_ref, cache_ref, zeros_ref, out_ref, page_smem, zero_smem, barriers, *,
            num_reqs, max_blocks, num_blocks, block_size, record_bytes, num_rows):
    # cu_ref: i32[num_reqs + 1]; bt_ref: i32[num_reqs, max_blocks]
    # cache_ref: u8[num_blocks, block_size * R]; zeros_ref: u8[block_size * R]
    # out_ref: u8[num_rows * R]; page_smem, zero_smem: u8[block_size * R]
    plgpu = compat.plgpu
    j, r = lax.axis_index("j"), lax.axis_index("r")
    start, end = cu_ref[r], cu_ref[r + 1]
    dst_row = start + j * block_size
    ok = (start >= 0) & (dst_row >= 0)
    n_copy = jnp.where(ok, jnp.clip(jnp.minimum(end, num_rows) - dst_row, 0, block_size), 0)
    n_all = jnp.where(ok & (r == num_reqs - 1), jnp.clip(num_rows - dst_row, 0, block_size), n_copy)
    in_table = (n_copy > 0) & (j < max_blocks)
    page = bt_ref[r, jnp.where(in_table, j, 0)]
    page_ok = in_table & (page >= 0) & (page < num_blocks)
    n_page = jnp.where(page_ok, n_copy, 0)           # rows from the page; rows [n_page, n_all) are zero
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS   # contiguous page: the plain bulk copy

    @pl.when(n_page > 0)
    def _():
        plgpu.copy_gmem_to_smem(cache_ref.at[jnp.where(page_ok, page, 0)], page_smem, barriers.at[0],
                                oob_mode=in_bounds)
        plgpu.barrier_wait(barriers.at[0])

    @pl.when(n_all > n_page)
    def _():
        plgpu.copy_gmem_to_smem(zeros_ref, zero_smem, barriers.at[1], oob_mode=in_bounds)
        plgpu.barrier_wait(barriers.at[1])

    store = functools.partial(_store_rows, out_ref=out_ref, dst_row=dst_row, block_size=block_size,
                              record_bytes=record_bytes)
    store(page_smem, 0, n_page)
    store(zero_smem, n_page, n_all - n_page)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("num_rows", "interpret"))
def gather_records_mosaic(cache, block_table, cu_lens, *, num_rows: int, interpret=False):
    """Same contract as `gather_records_reference`: -> u8[num_rows, R].

    interpret: False, or a Mosaic GPU interpret-params object (GPU interpret mode, for tests)."""
    plgpu = compat.plgpu
    num_blocks, block_size, record_bytes = cache.shape
    num_reqs, max_blocks = block_table.shape
    if record_bytes % 16:
        raise ValueError(f"cache: bulk copies need records of a multiple of 16 bytes, got {record_bytes}")
    if num_reqs == 0 or max_blocks == 0 or num_rows == 0:
        return jnp.zeros((num_rows, record_bytes), jnp.uint8)
    page_bytes = block_size * record_bytes
    kernel = functools.partial(_kernel, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
                               block_size=block_size, record_bytes=record_bytes, num_rows=num_rows)
    extra = {"interpret": interpret} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((num_rows * record_bytes,), jnp.uint8),
        grid=(pl.cdiv(num_rows, block_size), num_reqs), grid_names=("j", "r"),
        scratch_types=[plgpu.SMEM((page_bytes,), jnp.uint8), plgpu.SMEM((page_bytes,), jnp.uint8),
                        plgpu.Barrier(num_arrivals=1, num_barriers=2)],
        kernel_name=f"ckv_gather_records_mgpu_r{record_bytes}", **extra)
    out = call(cu_lens, block_table, cache.reshape(num_blocks, page_bytes), jnp.zeros((page_bytes,), jnp.uint8))
    return out.reshape(num_rows, record_bytes)
