"""XLA reference of the paged-cache writer; also the `implementation="xla"` backend."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import record_codec
from pallas_kernels.record_layout import RecordLayout


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def write_records_reference(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array,
                            slot_mapping: jax.Array, *, layout: RecordLayout) -> jax.Array:
    """Encode T tokens and scatter their records into a paged cache, in place.

    Args:
      cache: u8[num_blocks, block_size, R], R = layout.record_bytes; donated.
      kv_c: bf16|f16|f32[T, nope_dim] compressed latent.
      k_pe: bf16[T, rope_dim] RoPE key (bit-copied).
      slot_mapping: i32[T]; token t goes to row `slot % block_size` of block
        `slot // block_size`.  -1 (or any negative) skips the token; slots >= num_blocks *
        block_size are never written.
    Returns:
      u8[num_blocks, block_size, R]: the cache with the valid slots rewritten, every other row
      unchanged.  Duplicate valid slots leave one of the duplicates' records (unspecified which).
    """
    num_blocks, block_size, record_bytes = cache.shape
    num_slots = num_blocks * block_size
    records = record_codec.encode(layout, kv_c, k_pe)
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)
    rows = jnp.where(valid, slot_mapping, num_slots)      # out of range -> dropped
    flat = cache.reshape(num_slots, record_bytes).at[rows].set(records, mode="drop")
    return flat.reshape(cache.shape)
