"""Pallas Triton paged gathers: raw records, dequantized bf16, and records by slot.

Paged gathers: grid (cdiv(num_rows, rows_per_tile),); program j writes output rows
[j * rows_per_tile, (j + 1) * rows_per_tile) and nothing else, so every row is written exactly
once, by one program, whatever the number of requests.  The raw gather can instead run
`programs` persistent programs that stride over the same tiles: a grid that is resident at once
leaves no queue of pending programs ahead of another stream's kernels (the prefetch path, whose
gather runs beside torch's compute).  Each row finds its request by a binary
search over cu_lens (none with one request), then its block-table entry, so a tile may span
requests and pages of any block size; rows outside every request (the padding
[cu_lens[-1], num_rows)) are zero and never read the table.

Why this shape (BENCHMARKS.md, "kernel notes"): each record is moved as a few power-of-two-wide
2-D loads and stores ([rows, 512] + [rows, 128] + [rows, 16] bytes for fp8_ds_mla) whose column
offsets are `row * R + constant + iota`.  Triton then proves 16-byte alignment and contiguity
(R is a multiple of 16) and emits 16-byte vector accesses; all loads of a tile are issued before
its stores, so each thread has several independent 16-byte loads in flight.  Masks are per row,
so they do not break the vectorization either.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, float_codes, record_codec, selection
from pallas_kernels.record_layout import RecordLayout


@dataclasses.dataclass(frozen=True, slots=True)
class GatherTiles:
    rows_per_tile: int = 8        # records per program (power of two)
    num_warps: int = 4
    max_piece_bytes: int = 512    # raw gathers: widest single load/store of a record (power of two)
    evict_first: bool = False     # loads hint L2 to evict the (read-once) records first
    programs: int = 0             # raw paged gather: 0 = one program per tile; n > 0 = n persistent
                                  # programs striding over the tiles (a bounded SM footprint)

    def __post_init__(self):
        selection.check_power_of_two_fields(self, ("rows_per_tile", "num_warps", "max_piece_bytes"))
        if isinstance(self.programs, bool) or not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"programs: expected an int >= 0, got {self.programs!r}")


# The defaults where no tuned row applies (`pallas_kernels.tuning`): configs that won, or came
# within 1% of the winner, at the large sizes of the H200 sweeps (BENCHMARKS.md, "Tuning table").
RECORDS_TILES = GatherTiles(rows_per_tile=8, num_warps=4)
DEQUANT_TILES = GatherTiles(rows_per_tile=8, num_warps=4)
SLOTS_TILES = GatherTiles(rows_per_tile=16, num_warps=8)


def record_pieces(record_bytes: int, max_piece_bytes: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) byte ranges covering a record, each a power of two <= max_piece_bytes,
    widest first (656 -> 512, 128, 16), so every piece starts 16-byte aligned when R is a
    multiple of 16."""
    pieces, offset = [], 0
    while offset < record_bytes:
        width = min(max_piece_bytes, 1 << ((record_bytes - offset).bit_length() - 1))
        pieces.append((offset, width))
        offset += width
    return tuple(pieces)


def _scalar(ref, idx):
    """ref[idx...] as a scalar (Triton loads vectors; a 1-element one is summed)."""
    return jnp.sum(compat.pltriton.load(ref.at[(*idx[:-1], pl.ds(idx[-1], 1))]))


def _eviction(config: GatherTiles) -> str | None:
    return "evict_first" if config.evict_first else None


def _request_of(rows, cu_ref, num_reqs):
    """i32[T, 1]: the request of each output row, the last r <= num_reqs - 1 with
    cu_lens[r] <= row (0 if none): the reference's clip(searchsorted(cu_lens, row, "right") - 1,
    0, num_reqs - 1) for non-decreasing cu_lens, as a binary search of ceil(log2(num_reqs)) gathers
    from the (cached) cu_lens."""
    req = jnp.zeros_like(rows)
    step = 1 << ((num_reqs - 1).bit_length() - 1) if num_reqs > 1 else 0
    while step:
        cand = jnp.minimum(req + step, num_reqs - 1)
        req = jnp.where(compat.pltriton.load(cu_ref.at[cand]) <= rows, cand, req)
        step //= 2
    return req


def _tile_rows(j, cu_ref, bt_ref, *, num_reqs, max_blocks, num_blocks, block_size, num_rows, tile_rows):
    """Rows of program j: (source slot, output row, read ok, write ok), each [tile_rows, 1].

    write ok: the output row lies in [0, num_rows); read ok: a row of a request whose block index
    is in the table and whose block id is in the cache.  Rows that are not ok are masked, so they
    never address memory; their source index is 0 and their output index num_rows (past the end:
    interpret mode drops such a scatter index, where an in-range one could collide with a real
    row's write).
    """
    dst = j * tile_rows + lax.broadcasted_iota(jnp.int32, (tile_rows, 1), 0)
    write_ok = dst < num_rows
    if num_reqs == 1:                                  # no search: two scalars per program
        req = jnp.zeros_like(dst)
        start, end = _scalar(cu_ref, (0,)), _scalar(cu_ref, (1,))
        total = end
    else:
        req = _request_of(dst, cu_ref, num_reqs)
        start, end = compat.pltriton.load(cu_ref.at[req]), compat.pltriton.load(cu_ref.at[req + 1])
        total = _scalar(cu_ref, (num_reqs,))
    local = dst - start
    is_copy = write_ok & (dst < total) & (local >= 0) & (local < end - start)
    blk = local // block_size
    need_page = is_copy & (blk < max_blocks)
    entry = jnp.where(need_page, req * max_blocks + blk, 0)       # bt_ref is the flat table
    page = compat.pltriton.load(bt_ref.at[entry], mask=need_page, other=-1)
    read_ok = need_page & (page >= 0) & (page < num_blocks)
    src = jnp.where(read_ok, page * block_size + local % block_size, 0)
    return src, jnp.where(write_ok, dst, num_rows), read_ok, write_ok


def _copy_rows(src_ref, src, read_ok, dst_ref, dst, write_ok, pieces, eviction_policy):
    """dst_ref[dst[i]] = src_ref[src[i]] if read_ok[i] else 0, for rows with write_ok[i]: every
    load first, then every store."""
    tile_rows = src.shape[0]
    loaded = []
    for offset, width in pieces:
        cols = offset + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        mask = jnp.broadcast_to(read_ok, (tile_rows, width))
        loaded.append((cols, compat.pltriton.load(src_ref.at[src, cols], mask=mask, other=0,
                                                  eviction_policy=eviction_policy)))
    for cols, data in loaded:
        compat.pltriton.store(dst_ref.at[dst, cols], data, mask=jnp.broadcast_to(write_ok, data.shape))


def _raw_kernel(cu_ref, bt_ref, cache_ref, out_ref, *, tile, pieces, eviction_policy, programs=0, num_tiles=0):
    # cu_ref: i32[num_reqs + 1]; bt_ref: i32[num_reqs * max_blocks] (the table, flat)
    # cache_ref: u8[num_blocks * block_size, R]; out_ref: u8[num_rows, R]
    def copy_tile(j):
        src, dst, read_ok, write_ok = tile(j, cu_ref, bt_ref)
        _copy_rows(cache_ref, src, read_ok, out_ref, dst, write_ok, pieces, eviction_policy)

    if not programs:
        copy_tile(pl.program_id(0))
        return
    # persistent: program p copies tiles p, p + programs, ...; a tile past the last one has no
    # row below num_rows, so every access of it is masked.  Issuing a tile's loads before the
    # previous tile's stores (two tiles in flight per program) was no faster than larger tiles:
    # BENCHMARKS.md, "Two tiles in flight"
    first = pl.program_id(0)

    def step(i, carry):
        copy_tile(first + i * programs)
        return carry

    lax.fori_loop(0, pl.cdiv(num_tiles, programs), step, 0)


def _dequant_kernel(cu_ref, bt_ref, cache_ref, out_ref, *, tile, layout, eviction_policy):
    # cache_ref: u8[num_blocks * block_size, R]; out_ref: bf16[num_rows, nope_dim + rope_dim], for
    # nvfp4 u32[num_rows, (nope_dim + rope_dim) / 2] (the same bytes as bf16 pairs)
    src, dst, read_ok, write_ok = tile(pl.program_id(0), cu_ref, bt_ref)
    tile_rows = src.shape[0]
    segments = []
    for seg in layout.segments:
        cols = seg.offset + lax.broadcasted_iota(jnp.int32, (1, seg.width), 1)
        mask = jnp.broadcast_to(read_ok, (tile_rows, seg.width))
        segments.append(compat.pltriton.load(cache_ref.at[src, cols], mask=mask, other=0,
                                             eviction_policy=eviction_policy))
    if layout.kind == "nvfp4_groups":
        # a byte's two nibbles become one u32 word of two bf16: no interleaving, no float conversion
        seg = dict(zip((s.name for s in layout.segments), segments))
        even, odd = record_codec.decode_nvfp4_pairs(layout, seg["nope_e2m1"], seg["group_scales_e4m3"])
        outputs = ((float_codes.exact_bf16_pair_words(even, odd), 0),
                   (float_codes.le_words(seg["rope_bf16"], jnp.uint32), layout.nope_dim // 2))
    else:
        nope, rope = record_codec.decode_segments(layout, segments)
        outputs = ((nope.astype(jnp.bfloat16), 0), (rope, layout.nope_dim))
    for values, offset in outputs:
        cols = offset + lax.broadcasted_iota(jnp.int32, (1, values.shape[1]), 1)
        compat.pltriton.store(out_ref.at[dst, cols], values, mask=jnp.broadcast_to(write_ok, values.shape))


def _slots_kernel(slot_ref, cache_ref, out_ref, *, num_slots, num_out, tile_rows, pieces, eviction_policy):
    # slot_ref: i32[N]; cache_ref: u8[num_slots, R]; out_ref: u8[N, R]
    row = pl.program_id(0) * tile_rows + lax.broadcasted_iota(jnp.int32, (tile_rows, 1), 0)
    write_ok = row < num_out
    slot = compat.pltriton.load(slot_ref.at[jnp.where(write_ok, row, 0)], mask=write_ok, other=-1)
    read_ok = write_ok & (slot >= 0) & (slot < num_slots)
    _copy_rows(cache_ref, jnp.where(read_ok, slot, 0), read_ok, out_ref, jnp.where(write_ok, row, num_out),
               write_ok, pieces, eviction_policy)


def _into_kernel(cu_ref, bt_ref, cache_ref, dest_ref, out_ref, *, kernel, **params):
    # dest_ref: u8[M, R], aliased to out_ref: the kernel writes rows [0, num_rows) of out_ref
    # and leaves the others as they are
    del dest_ref
    kernel(cu_ref, bt_ref, cache_ref, out_ref, **params)


def _paged_call(kernel, out_shape, cache, block_table, cu_lens, num_rows, config, interpret, name, out=None,
                **params):
    """out: None (a fresh [num_rows, ...] output), or u8[M, R] with M >= num_rows, aliased in place."""
    num_blocks, block_size, record_bytes = cache.shape
    num_reqs, max_blocks = block_table.shape
    if num_reqs == 0 or max_blocks == 0 or num_rows == 0:    # nothing to read: every row is zero
        if out is None:
            return jnp.zeros(out_shape.shape, out_shape.dtype)
        return lax.dynamic_update_slice(out, jnp.zeros((num_rows,) + out.shape[1:], out.dtype), (0, 0))
    tile_rows = config.rows_per_tile
    tile = functools.partial(_tile_rows, num_reqs=num_reqs, max_blocks=max_blocks, num_blocks=num_blocks,
                             block_size=block_size, num_rows=num_rows, tile_rows=tile_rows)
    num_tiles = pl.cdiv(num_rows, tile_rows)
    grid = num_tiles
    if config.programs and kernel is _raw_kernel:
        grid = min(config.programs, num_tiles)
        params = dict(params, programs=grid, num_tiles=num_tiles)
    body = functools.partial(kernel, tile=tile, eviction_policy=_eviction(config), **params)
    args = (cu_lens, block_table.reshape(num_reqs * max_blocks), cache.reshape(num_blocks * block_size, record_bytes))
    aliases = {}
    if out is not None:
        body = functools.partial(_into_kernel, kernel=body)
        out_shape, args, aliases = jax.ShapeDtypeStruct(out.shape, out.dtype), args + (out,), {3: 0}
    return pl.pallas_call(
        body, out_shape=out_shape, grid=(grid,),
        compiler_params=compat.triton_compiler_params(config.num_warps),
        input_output_aliases=aliases, interpret=interpret, name=name,
    )(*args)


@functools.partial(jax.jit, static_argnames=("num_rows", "config", "interpret"))
def gather_records_triton(cache, block_table, cu_lens, out=None, *, num_rows: int,
                          config: GatherTiles = RECORDS_TILES, interpret: bool = False):
    """Same contract as `gather_records_reference`: -> u8[num_rows, R], or `out` u8[M, R] with
    its rows [0, num_rows) written in place (aliased: donate it to the caller's jit)."""
    record_bytes = cache.shape[2]
    return _paged_call(_raw_kernel, jax.ShapeDtypeStruct((num_rows, record_bytes), jnp.uint8), cache,
                       block_table, cu_lens, num_rows, config, interpret, f"ckv_gather_records_r{record_bytes}",
                       out=out, pieces=record_pieces(record_bytes, config.max_piece_bytes))


@functools.partial(jax.jit, static_argnames=("num_rows", "layout", "config", "interpret"))
def gather_dequant_triton(cache, block_table, cu_lens, *, num_rows: int, layout: RecordLayout,
                          config: GatherTiles = DEQUANT_TILES, interpret: bool = False):
    """Same contract as `gather_dequant_reference`: -> bf16[num_rows, nope_dim + rope_dim]."""
    pairs = layout.kind == "nvfp4_groups"       # the kernel writes bf16 pairs as uint32 words
    out_shape = (jax.ShapeDtypeStruct((num_rows, layout.value_dim // 2), jnp.uint32) if pairs
                 else jax.ShapeDtypeStruct((num_rows, layout.value_dim), jnp.bfloat16))
    out = _paged_call(_dequant_kernel, out_shape, cache, block_table, cu_lens, num_rows, config, interpret,
                      f"ckv_gather_dequant_{layout.kind}_r{cache.shape[2]}", layout=layout)
    if pairs:                                   # a bitcast: no copy
        out = lax.bitcast_convert_type(out, jnp.bfloat16).reshape(num_rows, layout.value_dim)
    return out


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gather_slots_triton(cache, slots, *, config: GatherTiles = SLOTS_TILES,
                        interpret: bool = False):
    """Same contract as `gather_slots_reference`: -> u8[N, R]."""
    num_blocks, block_size, record_bytes = cache.shape
    num_out = slots.shape[0]
    if num_out == 0:
        return jnp.zeros((0, record_bytes), jnp.uint8)
    kernel = functools.partial(_slots_kernel, num_slots=num_blocks * block_size, num_out=num_out,
                               tile_rows=config.rows_per_tile, eviction_policy=_eviction(config),
                               pieces=record_pieces(record_bytes, config.max_piece_bytes))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_out, record_bytes), jnp.uint8),
        grid=(pl.cdiv(num_out, config.rows_per_tile),),
        compiler_params=compat.triton_compiler_params(config.num_warps),
        interpret=interpret, name=f"ckv_gather_slots_r{record_bytes}",
    )(slots, cache.reshape(num_blocks * block_size, record_bytes))
