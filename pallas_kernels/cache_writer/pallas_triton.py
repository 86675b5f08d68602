"""Pallas Triton paged-cache writer: encode fused with the scatter, in place.

One program encodes `tokens_per_block` tokens and stores each record segment (a power-of-two
byte range) with one masked scatter into the aliased cache.  Invalid slots (negative, past the
cache, or rows past T) are masked, so they are never read or written.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _pallas_compat as compat
from pallas_kernels import record_codec, tuning
from pallas_kernels.record_codec import RecordLayout

_TRITON_ARITHMETIC = record_codec.Arithmetic(divide=compat.triton_ieee_divide,
                                             to_e4m3=compat.triton_e4m3_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class WriterConfig:
    # default: fastest over both quantized formats from 8K to 1M tokens in the H200 sweeps of
    # BENCHMARKS.md ("Tuning table"), where no tuned row applies
    tokens_per_block: int = 8
    num_warps: int = 4

    def __post_init__(self):
        tuning.check_power_of_two_fields(self, ("tokens_per_block", "num_warps"))


def _writer_kernel(slot_ref, kv_c_ref, k_pe_ref, cache_in_ref, cache_ref, *,
                   layout: RecordLayout, num_tokens: int, num_slots: int,
                   tokens_per_block: int, interpret: bool):
    # slot_ref: i32[T]; kv_c_ref: [T, nope_dim]; k_pe_ref: bf16[T, rope_dim]
    # cache_in_ref / cache_ref: u8[num_slots, record_bytes] (the same buffer, aliased)
    del cache_in_ref
    tok = pl.program_id(0) * tokens_per_block + lax.broadcasted_iota(jnp.int32, (tokens_per_block,), 0)
    in_range = tok < num_tokens
    slot = compat.pltriton.load(slot_ref.at[tok], mask=in_range, other=-1)
    valid = in_range & (slot >= 0) & (slot < num_slots)

    def load_rows(ref):
        cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[1]), 1)
        mask = jnp.broadcast_to(in_range[:, None], (tokens_per_block, ref.shape[1]))
        return compat.pltriton.load(ref.at[tok[:, None], cols], mask=mask, other=0)

    segments = record_codec.encode_segments(layout, load_rows(kv_c_ref), load_rows(k_pe_ref),
                                            record_codec.PORTABLE if interpret else _TRITON_ARITHMETIC)
    rows = jnp.where(valid, slot, num_slots)[:, None]   # masked rows point past the cache
    for seg, data in zip(layout.segments, segments):
        cols = seg.offset + lax.broadcasted_iota(jnp.int32, (1, seg.width), 1)
        mask = jnp.broadcast_to(valid[:, None], (tokens_per_block, seg.width))
        compat.pltriton.store(cache_ref.at[rows, cols], data, mask=mask)


@functools.partial(jax.jit, static_argnames=("layout", "config", "interpret"), donate_argnums=(0,))
def write_records_triton(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array,
                         *, layout: RecordLayout, config: WriterConfig = WriterConfig(),
                         interpret: bool = False) -> jax.Array:
    """Same contract as `write_records_reference` (cache u8[num_blocks, block_size, R], donated)."""
    num_blocks, block_size, record_bytes = cache.shape
    num_slots = num_blocks * block_size
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return cache
    kernel = functools.partial(
        _writer_kernel, layout=layout, num_tokens=num_tokens, num_slots=num_slots,
        tokens_per_block=config.tokens_per_block, interpret=interpret)
    flat = cache.reshape(num_slots, record_bytes)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(pl.cdiv(num_tokens, config.tokens_per_block),),
        input_output_aliases={3: 0},
        compiler_params=compat.triton_compiler_params(config.num_warps),
        interpret=interpret,
        name=f"ckv_write_records_{layout.kind}_r{record_bytes}",
    )(slot_mapping, kv_c, k_pe, flat)
    return out.reshape(cache.shape)
