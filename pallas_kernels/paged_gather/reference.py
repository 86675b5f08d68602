"""XLA references of the paged gathers and of the gather by slot; also the `implementation="xla"`
backends.

Shared contract (`cp_gather_cache` semantics):
  cache: u8[num_blocks, block_size, R] paged records.
  block_table: i32[num_reqs, max_blocks]; request r's position l lives in block
    `block_table[r, l // block_size]`, row `l % block_size`.  Entries past a request's last
    valid block are never read (they may be stale).
  cu_lens: i32[num_reqs + 1] cumulative request lengths, cu_lens[0] = 0; request r fills output
    rows [cu_lens[r], cu_lens[r + 1]).
  num_rows: static output rows P >= cu_lens[-1]; rows [cu_lens[-1], P) are zero.
Rows whose block id lies outside [0, num_blocks), or whose block index lies outside the table,
are zero (never read); rows past P are never written.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import record_codec
from pallas_kernels.record_layout import RecordLayout


def source_slots(cache_shape, block_table, cu_lens, num_rows: int):
    """i32[num_rows]: the cache slot each output row copies, or num_slots for a zero row."""
    num_blocks, block_size, _ = cache_shape
    num_slots = num_blocks * block_size
    num_reqs, max_blocks = block_table.shape
    row = jnp.arange(num_rows, dtype=jnp.int32)
    if num_reqs == 0 or max_blocks == 0:             # no request: every row is padding
        return jnp.full((num_rows,), num_slots, jnp.int32)
    req = jnp.clip(jnp.searchsorted(cu_lens, row, side="right").astype(jnp.int32) - 1, 0, num_reqs - 1)
    local = row - cu_lens[req]
    in_req = (row < cu_lens[num_reqs]) & (local >= 0) & (local < cu_lens[req + 1] - cu_lens[req])
    blk_idx = jnp.where(in_req, local // block_size, 0)
    in_table = blk_idx < max_blocks
    block = jnp.where(in_req & in_table, block_table[req, jnp.minimum(blk_idx, max_blocks - 1)], -1)
    ok = in_req & in_table & (block >= 0) & (block < num_blocks)
    return jnp.where(ok, block * block_size + local % block_size, num_slots)


@functools.partial(jax.jit, static_argnames=("num_rows",))
def gather_records_reference(cache, block_table, cu_lens, out=None, *, num_rows: int):
    """-> u8[num_rows, R]: raw records of each request's positions, zero padded.  With `out`
    u8[M, R] (M >= num_rows): `out` with rows [0, num_rows) replaced by them, the rest kept."""
    num_blocks, block_size, record_bytes = cache.shape
    flat = cache.reshape(num_blocks * block_size, record_bytes)
    slots = source_slots(cache.shape, block_table, cu_lens, num_rows)
    rows = jnp.take(flat, slots, axis=0, mode="fill", fill_value=0)
    return rows if out is None else lax.dynamic_update_slice(out, rows, (0, 0))


@functools.partial(jax.jit, static_argnames=("num_rows", "layout"))
def gather_dequant_reference(cache, block_table, cu_lens, *, num_rows: int, layout: RecordLayout):
    """-> bf16[num_rows, nope_dim + rope_dim]: dequantized records, zero padded."""
    records = gather_records_reference(cache, block_table, cu_lens, num_rows=num_rows)
    return record_codec.dequantize_bf16(layout, records)


@jax.jit
def gather_slots_reference(cache, slots):
    """u8[num_blocks, block_size, R], i32[N] slots -> u8[N, R]: the record at each slot
    (slot = block * block_size + row); slots outside [0, num_blocks * block_size), -1 included,
    read as zero rows."""
    num_blocks, block_size, record_bytes = cache.shape
    num_slots = num_blocks * block_size
    flat = cache.reshape(num_slots, record_bytes)
    rows = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)   # -1 would wrap
    return jnp.take(flat, rows, axis=0, mode="fill", fill_value=0)
