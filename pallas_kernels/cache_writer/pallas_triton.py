"""Pallas Triton paged-cache writer: encode fused with the scatter, in place.

One program encodes `tokens_per_block` tokens and stores each record segment (a power-of-two
byte range) with one masked scatter into the aliased cache.  Invalid slots (negative, past the
cache, or rows past T) are masked, so they are never read or written.

The encode was bound by the integer-ALU pipe (measured with `ncu`), so the nvfp4
path reads the NoPE as element pairs (one uint32 word per two 2-byte values) and builds each
byte's two nibbles side by side, instead of interleaving codes through a reshape; and the
compiled kernel takes its arithmetic from `gpu_arithmetic.GPU_ARITHMETIC`: e2m1 codes mostly on
the FMA pipe, one reciprocal per fp8 tile instead of a division per element, and the GPU's NaN
rules instead of a NaN test per element.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, float_codes, record_codec, selection
from pallas_kernels.cache_writer.gpu_arithmetic import GPU_ARITHMETIC
from pallas_kernels.record_layout import RecordLayout


@dataclasses.dataclass(frozen=True, slots=True)
class WriterTiles:
    """Tokens encoded per program and its warps.  The default serves where no tuned row applies:
    summed over both quantized formats at 8K, 256K and 1M tokens on an H200 it is within 1% of the
    fastest config."""
    tokens_per_block: int = 8
    num_warps: int = 4

    def __post_init__(self):
        selection.check_power_of_two_fields(self, ("tokens_per_block", "num_warps"))


def _load_rows(ref, tok, in_range, *, first=0, stride=1):
    """ref[tok, first::stride] as a [tokens, ref.shape[1] // stride] tile; rows past T read 0."""
    width = ref.shape[1] // stride
    cols = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    if (first, stride) != (0, 1):      # the plain tile keeps the column iota Triton vectorizes
        cols = first + stride * cols
    mask = jnp.broadcast_to(in_range[:, None], (tok.shape[0], width))
    return compat.pltriton.load(ref.at[tok[:, None], cols], mask=mask, other=0)


def _load_nope_pairs(kv_c_ref, tok, in_range, kv_dtype):
    """(even, odd): f32[T, nope_dim / 2], NoPE elements 2k and 2k + 1 of each token.

    A 2-byte kv_c arrives as uint32 words, one per element pair (low half: element 2k), so both
    halves come from one vector load; float32 kv_c is read at even and odd columns."""
    if kv_c_ref.dtype == jnp.uint32:
        words = _load_rows(kv_c_ref, tok, in_range)
        if kv_dtype == jnp.bfloat16:               # a bf16 is the top half of its float32
            return (lax.bitcast_convert_type(words << 16, jnp.float32),
                    lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32))
        halves = (words & 0xFFFF, words >> 16)
        return tuple(lax.bitcast_convert_type(h.astype(jnp.uint16), kv_dtype).astype(jnp.float32)
                     for h in halves)
    return tuple(_load_rows(kv_c_ref, tok, in_range, first=parity, stride=2).astype(jnp.float32)
                 for parity in (0, 1))


def _writer_kernel(*refs, layout: RecordLayout, kv_dtype, num_tokens: int, num_slots: tuple[int, ...],
                   tokens_per_block: int, skip_index: int | None, interpret: bool):
    # refs, for K destinations: slot_refs i32[T] (K of them); kv_c_ref: [T, nope_dim], or
    # u32[T, nope_dim / 2] (2-byte kv_c for nvfp4); k_pe_ref: bf16[T, rope_dim]; with a
    # skip_index, skip_ref i32[n]; the K inputs u8[num_slots[k], record_bytes], then the K
    # outputs they alias
    k = len(num_slots)
    slot_refs, (kv_c_ref, k_pe_ref) = refs[:k], refs[k:k + 2]
    skip_ref = None if skip_index is None else refs[k + 2]
    cache_refs = refs[len(refs) - k:]
    tok = pl.program_id(0) * tokens_per_block + lax.broadcasted_iota(jnp.int32, (tokens_per_block,), 0)
    in_range = tok < num_tokens
    if skip_ref is not None:
        # a word set on the device (a step's abandon word) turns every store off
        in_range &= skip_ref[skip_index] == 0

    load_rows = functools.partial(_load_rows, tok=tok, in_range=in_range)
    arith = float_codes.PORTABLE if interpret else GPU_ARITHMETIC
    if layout.kind == "nvfp4_groups":
        # the two nibbles of a byte come from one element pair: no interleaving of the codes
        rope = record_codec.rope_bytes(load_rows(k_pe_ref))
        even, odd = _load_nope_pairs(kv_c_ref, tok, in_range, kv_dtype)
        segments = record_codec.encode_nvfp4_segments(layout, even, odd, rope, arith)
    else:
        segments = record_codec.encode_segments(layout, load_rows(kv_c_ref), load_rows(k_pe_ref), arith)
    # the records are encoded once and stored into every destination
    for slot_ref, cache_ref, slots in zip(slot_refs, cache_refs, num_slots):
        slot = compat.pltriton.load(slot_ref.at[tok], mask=in_range, other=-1)
        valid = in_range & (slot >= 0) & (slot < slots)
        rows = jnp.where(valid, slot, slots)[:, None]   # masked rows point past the cache
        for seg, data in zip(layout.segments, segments):
            cols = seg.offset + lax.broadcasted_iota(jnp.int32, (1, seg.width), 1)
            mask = jnp.broadcast_to(valid[:, None], (tokens_per_block, seg.width))
            compat.pltriton.store(cache_ref.at[rows, cols], data, mask=mask)


@functools.partial(jax.jit, static_argnames=("layout", "config", "interpret"), donate_argnums=(0,))
def write_records_triton(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array,
                         *, layout: RecordLayout, config: WriterTiles = WriterTiles(),
                         interpret: bool = False) -> jax.Array:
    """Same contract as `write_records_reference` (cache u8[num_blocks, block_size, R], donated)."""
    return write_records_to_all_triton((cache,), kv_c, k_pe, (slot_mapping,), layout=layout, config=config,
                                       interpret=interpret)[0]


@functools.partial(jax.jit, static_argnames=("layout", "config", "interpret", "skip_index"), donate_argnums=(0,))
def write_records_to_all_triton(caches: tuple, kv_c: jax.Array, k_pe: jax.Array, slot_mappings: tuple,
                                skip_words: jax.Array | None = None, *, layout: RecordLayout,
                                config: WriterTiles = WriterTiles(), skip_index: int = 0,
                                interpret: bool = False) -> tuple:
    """`write_records_triton` into several caches at once (one kernel; each token's record is
    encoded once and stored into every cache at its own slot): caches[k] u8[num_blocks_k,
    block_size_k, R] (donated), slot_mappings[k] i32[T].  skip_words: i32[n]; where
    skip_words[skip_index] is not 0 the kernel stores nothing (read by the kernel itself, so a
    word written on the device just before needs no kernel of its own to mask the slots)."""
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return tuple(caches)
    record_bytes = caches[0].shape[2]
    num_slots = tuple(c.shape[0] * c.shape[1] for c in caches)
    kv_dtype = kv_c.dtype
    if layout.kind == "nvfp4_groups" and kv_dtype.itemsize == 2:
        # one uint32 word per element pair (a bitcast, no copy): see `_load_nope_pairs`
        kv_c = lax.bitcast_convert_type(kv_c.reshape(num_tokens, -1, 2), jnp.uint32)
    kernel = functools.partial(
        _writer_kernel, layout=layout, kv_dtype=kv_dtype, num_tokens=num_tokens, num_slots=num_slots,
        tokens_per_block=config.tokens_per_block, skip_index=None if skip_words is None else skip_index,
        interpret=interpret)
    flats = [c.reshape(n, record_bytes) for c, n in zip(caches, num_slots)]
    k = len(caches)
    skip = () if skip_words is None else (skip_words,)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flats],
        grid=(pl.cdiv(num_tokens, config.tokens_per_block),),
        input_output_aliases={k + 2 + len(skip) + i: i for i in range(k)},
        compiler_params=compat.triton_compiler_params(config.num_warps),
        interpret=interpret,
        name=f"ckv_write_records_{layout.kind}_r{record_bytes}" + ("" if k == 1 else f"_to_{k}"),
    )(*slot_mappings, kv_c, k_pe, *skip, *flats)
    return tuple(o.reshape(c.shape) for o, c in zip(outs, caches))
