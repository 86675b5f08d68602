"""The paged CKV cache of one layer on one rank: allocation, the writer, record reads.

Cache: u8[num_blocks, block_size, record_bytes].  Slot s is row `s % block_size` of block
`s // block_size`; slot -1 means "no slot" (skip on write, zero record on read).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ckv_jax import formats, validation
from pallas_kernels import cache_writer, paged_gather


def empty_cache(num_blocks: int, block_size: int, format: str | formats.RecordFormat,
                *, device: jax.Device | None = None) -> jax.Array:
    """A zeroed u8[num_blocks, block_size, record_bytes] cache."""
    fmt = formats.get(format)
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks, block_size: expected positive sizes, got {num_blocks}, {block_size}")
    cache = jnp.zeros((num_blocks, block_size, fmt.record_bytes), jnp.uint8)
    return jax.device_put(cache, device) if device is not None else cache


def write_records(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array,
                  format: str | formats.RecordFormat, *,
                  implementation: str | Sequence[str] | None = None,
                  validate: bool | None = None, interpret: bool = False) -> jax.Array:
    """Encode T tokens with `format` and write each record at its slot, in place.

    Args:
      cache: u8[num_blocks, block_size, R] with R = format's record_bytes.  Donated: the
        returned array reuses its buffer (no full-cache copy) and `cache` must not be used again.
      kv_c: bf16|f16|f32[T, nope_dim] compressed latent (kv_c_normed).
      k_pe: bf16[T, rope_dim] post-RoPE key, copied bit for bit.
      slot_mapping: i32[T]; -1 skips a token.  Slots outside [0, num_blocks * block_size) are
        never written (masked); with validation on they raise instead.
      format: a registered format name (e.g. "fp8_ds_mla") or a RecordFormat.
      implementation: None (automatic: Pallas Triton on GPU, XLA otherwise), "pallas_triton",
        "xla", or a sequence tried in order.
      validate: data checks on the host (slot range, duplicate slots); default from
        CKV_JAX_VALIDATE.  Needs concrete arrays (call outside jax.jit).
      interpret: run Pallas kernels in interpret mode (CPU testing).
    Returns:
      u8[num_blocks, block_size, R]: the updated cache.
    """
    fmt = formats.get(format)
    validation.check_cache(fmt, cache)
    num_tokens = validation.check_values(fmt, kv_c, k_pe)
    validation.check_slot_mapping(slot_mapping, num_tokens)
    if validation.validation_enabled(validate):
        validation.check_slot_values(slot_mapping, cache.shape[0] * cache.shape[1])
    return cache_writer.write_records(cache, kv_c, k_pe, slot_mapping, layout=fmt.layout,
                                      implementation=implementation, interpret=interpret)


def read_records(cache: jax.Array, slots: jax.Array, *, implementation: str | Sequence[str] | None = None,
                 interpret: bool = False) -> jax.Array:
    """The records at `slots` (the token gather: decode-sized lists, top-k rows).

    Args:
      cache: u8[num_blocks, block_size, R].
      slots: i32[N]; slots outside [0, num_blocks * block_size), -1 included, read zero rows.
      implementation: None (the measured choice for the device and size), "pallas_triton",
        "xla", or a sequence tried in order.
    Returns:
      u8[N, R].
    """
    if cache.ndim != 3 or cache.dtype != jnp.uint8:
        raise TypeError(f"cache: expected uint8[num_blocks, block_size, R], got {cache.dtype}{list(cache.shape)}")
    if slots.ndim != 1 or slots.dtype != jnp.int32:
        raise TypeError(f"slots: expected int32[N], got {slots.dtype}{list(slots.shape)}")
    return paged_gather.gather_slots(cache, slots, implementation=implementation, interpret=interpret)
