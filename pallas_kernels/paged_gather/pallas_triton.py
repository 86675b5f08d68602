"""Pallas Triton paged gathers: raw records (page-granular) and dequantized bf16 (row tiles).

Grid (num_reqs + 1, tiles): program (r, j) with r < num_reqs copies tile j of request r; the
programs of row r == num_reqs zero the padding rows [cu_lens[-1], num_rows).  A tile whose
request has no rows there returns at once, so block-table entries past a request's valid
blocks are never read.  See reference.py for the contract.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _pallas_compat as compat
from pallas_kernels import record_codec
from pallas_kernels.record_codec import RecordLayout


@dataclasses.dataclass(frozen=True, slots=True)
class GatherConfig:
    chunk_bytes: int = 4096       # raw gather: bytes per masked vector copy (power of two)
    rows_per_tile: int = 16       # dequant gather: rows per program (power of two dividing block_size)
    num_warps: int = 4

    def __post_init__(self):
        for name in ("chunk_bytes", "rows_per_tile", "num_warps"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name}: expected a power of two, got {v}")


def _scalar(ref, idx, valid):
    """Masked scalar load of ref[idx...] (returns 0 where not valid) without reading when masked."""
    vec = compat.pltriton.load(ref.at[(*idx[:-1], pl.ds(idx[-1], 1))], mask=jnp.full((1,), valid), other=0)
    return jnp.sum(vec)


def _tile(r, j, cu_ref, bt_ref, *, num_reqs, max_blocks, num_blocks, block_size, num_rows, tile_rows):
    """(rows in this tile, first output row, first source row in the cache, page ok) of program (r, j)."""
    is_copy = r < num_reqs
    r_safe = jnp.minimum(r, num_reqs - 1)
    start = jnp.where(is_copy, _scalar(cu_ref, (r_safe,), True), _scalar(cu_ref, (num_reqs,), True))
    end = jnp.where(is_copy, _scalar(cu_ref, (r_safe + 1,), True), num_rows)
    dst_row = start + j * tile_rows
    rows = jnp.clip(jnp.minimum(end, num_rows) - dst_row, 0, tile_rows)
    rows = jnp.where(dst_row >= 0, rows, 0)         # a negative cu_lens entry never addresses memory
    blk_idx = (j * tile_rows) // block_size
    need_page = is_copy & (rows > 0) & (blk_idx < max_blocks)
    page = _scalar(bt_ref, (r_safe, jnp.minimum(blk_idx, max_blocks - 1)), need_page)
    page_ok = need_page & (page >= 0) & (page < num_blocks)
    src_row = jnp.where(page_ok, page, 0) * block_size + (j * tile_rows) % block_size
    return rows, dst_row, src_row, page_ok


def _raw_kernel(cu_ref, bt_ref, cache_ref, out_ref, *, num_reqs, max_blocks, num_blocks, block_size,
                record_bytes, num_rows, chunk_bytes):
    # cu_ref: i32[num_reqs + 1]; bt_ref: i32[num_reqs, max_blocks]
    # cache_ref: u8[num_blocks * block_size * R] (flat); out_ref: u8[num_rows * R] (flat)
    r, j = pl.program_id(0), pl.program_id(1)
    rows, dst_row, src_row, page_ok = _tile(
        r, j, cu_ref, bt_ref, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
        block_size=block_size, num_rows=num_rows, tile_rows=block_size)
    nbytes = rows * record_bytes
    out_size = num_rows * record_bytes

    @pl.when(rows > 0)
    def _():
        for c in range(pl.cdiv(block_size * record_bytes, chunk_bytes)):
            cols = c * chunk_bytes + lax.broadcasted_iota(jnp.int32, (chunk_bytes,), 0)
            in_tile = cols < nbytes
            data = compat.pltriton.load(cache_ref.at[src_row * record_bytes + cols],
                                        mask=in_tile & page_ok, other=0)
            dst = jnp.where(in_tile, dst_row * record_bytes + cols, out_size)   # masked: past the end
            compat.pltriton.store(out_ref.at[dst], data, mask=in_tile)


def _dequant_kernel(cu_ref, bt_ref, cache_ref, out_ref, *, num_reqs, max_blocks, num_blocks,
                    block_size, num_rows, tile_rows, layout):
    # cache_ref: u8[num_blocks * block_size, R]; out_ref: bf16[num_rows, nope_dim + rope_dim]
    r, j = pl.program_id(0), pl.program_id(1)
    rows, dst_row, src_row, page_ok = _tile(
        r, j, cu_ref, bt_ref, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
        block_size=block_size, num_rows=num_rows, tile_rows=tile_rows)

    @pl.when(rows > 0)
    def _():
        i = lax.broadcasted_iota(jnp.int32, (tile_rows, 1), 0)
        in_tile = i < rows
        src = src_row + i
        segments = []
        for seg in layout.segments:
            cols = seg.offset + lax.broadcasted_iota(jnp.int32, (1, seg.width), 1)
            mask = jnp.broadcast_to(in_tile & page_ok, (tile_rows, seg.width))
            segments.append(compat.pltriton.load(cache_ref.at[src, cols], mask=mask, other=0))
        nope, rope = record_codec.decode_segments(layout, segments)
        dst = jnp.where(in_tile, dst_row + i, num_rows)       # masked rows point past the end
        for values, offset in ((nope.astype(jnp.bfloat16), 0), (rope, layout.nope_dim)):
            width = values.shape[1]
            cols = offset + lax.broadcasted_iota(jnp.int32, (1, width), 1)
            compat.pltriton.store(out_ref.at[dst, cols], values,
                                  mask=jnp.broadcast_to(in_tile, (tile_rows, width)))


def _grid(num_reqs, num_rows, tile_rows):
    return (num_reqs + 1, max(1, pl.cdiv(num_rows, tile_rows)))


@functools.partial(jax.jit, static_argnames=("num_rows", "config", "interpret"))
def gather_records_triton(cache, block_table, cu_lens, *, num_rows: int,
                          config: GatherConfig = GatherConfig(), interpret: bool = False):
    """Same contract as `gather_records_reference`: -> u8[num_rows, R]."""
    num_blocks, block_size, record_bytes = cache.shape
    num_reqs, max_blocks = block_table.shape
    kernel = functools.partial(
        _raw_kernel, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
        block_size=block_size, record_bytes=record_bytes, num_rows=num_rows,
        chunk_bytes=config.chunk_bytes)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_rows * record_bytes,), jnp.uint8),
        grid=_grid(num_reqs, num_rows, block_size),
        compiler_params=compat.triton_compiler_params(config.num_warps),
        interpret=interpret, name=f"ckv_gather_records_r{record_bytes}",
    )(cu_lens, block_table, cache.reshape(-1))
    return out.reshape(num_rows, record_bytes)


@functools.partial(jax.jit, static_argnames=("num_rows", "layout", "config", "interpret"))
def gather_dequant_triton(cache, block_table, cu_lens, *, num_rows: int, layout: RecordLayout,
                          config: GatherConfig = GatherConfig(), interpret: bool = False):
    """Same contract as `gather_dequant_reference`: -> bf16[num_rows, nope_dim + rope_dim]."""
    num_blocks, block_size, record_bytes = cache.shape
    num_reqs, max_blocks = block_table.shape
    tile_rows = min(config.rows_per_tile, block_size)
    if block_size % tile_rows:
        raise ValueError(f"rows_per_tile: expected a divisor of block_size={block_size}, got {tile_rows}")
    kernel = functools.partial(
        _dequant_kernel, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
        block_size=block_size, num_rows=num_rows, tile_rows=tile_rows, layout=layout)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_rows, layout.value_dim), jnp.bfloat16),
        grid=_grid(num_reqs, num_rows, tile_rows),
        compiler_params=compat.triton_compiler_params(config.num_warps),
        interpret=interpret, name=f"ckv_gather_dequant_{layout.kind}_r{record_bytes}",
    )(cu_lens, block_table, cache.reshape(num_blocks * block_size, record_bytes))
