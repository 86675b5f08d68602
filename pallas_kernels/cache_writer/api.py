"""Paged-cache writer: one `KernelOp` (WRITE_RECORDS) with ordered fallback.

`implementation` is None (automatic), one name, or a sequence of names tried in order; the
first that is supported on the cache's device and size runs.  Names:

* ``"pallas_triton"``: the fused encode + scatter Pallas Triton kernel (GPU; on CPU only in
  interpret mode, which tests use).
* ``"xla"``: the jnp reference (`reference.py`), any backend.

With `implementation=None` the order and the tiles are the measured ones for the device and the
bytes the write moves (`pallas_kernels.tuning`, op "write_records").
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import selection
from pallas_kernels.cache_writer import pallas_triton
from pallas_kernels.cache_writer.pallas_triton import WriterTiles
from pallas_kernels.cache_writer.reference import write_records_reference
from pallas_kernels.record_layout import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


def _run_triton(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    return pallas_triton.write_records_triton(cache, kv_c, k_pe, slot_mapping, layout=layout,
                                              config=config or WriterTiles(), interpret=interpret)


def _run_xla(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    del interpret, config
    return write_records_reference(cache, kv_c, k_pe, slot_mapping, layout=layout)


WRITE_RECORDS = selection.KernelOp(
    "write_records",
    (selection.Implementation("pallas_triton", selection.triton_supported, _run_triton),
     selection.Implementation("xla", selection.always_supported, _run_xla)),
    DEFAULT_ORDER, WriterTiles)


def work_bytes(num_tokens: int, layout: RecordLayout) -> int:
    """Bytes a write of `num_tokens` moves: bf16 latents and RoPE and an int32 slot in, a record out."""
    return num_tokens * (2 * layout.nope_dim + 2 * layout.rope_dim + 4 + layout.record_bytes)


def select(implementation: str | Sequence[str] | None, device: jax.Device, cache_bytes: int, num_tokens: int,
           layout: RecordLayout, *, interpret: bool = False, config: WriterTiles | None = None) -> selection.Selected:
    """The writer for `num_tokens` tokens into a cache of `cache_bytes` on `device`."""
    return WRITE_RECORDS.select(implementation, device, cache_bytes, work_bytes(num_tokens, layout),
                                interpret=interpret, config=config)


def write_records(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array, *,
                  layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                  interpret: bool = False, config: WriterTiles | None = None,
                  device: jax.Device | None = None) -> jax.Array:
    """Shape- and value-unchecked entry (ckv_jax.write_records validates); cache is donated.
    device: where the write runs (default: the cache's; pass it inside jit)."""
    run = select(implementation, device or selection.device_of(cache), cache.size, kv_c.shape[0], layout,
                 interpret=interpret, config=config)
    return run(cache, kv_c, k_pe, slot_mapping, layout=layout, interpret=interpret)


def write_records_to_all(caches: Sequence[jax.Array], kv_c: jax.Array, k_pe: jax.Array,
                         slot_mappings: Sequence[jax.Array], *, layout: RecordLayout,
                         implementation: str | Sequence[str] | None = None, interpret: bool = False,
                         config: WriterTiles | None = None, device: jax.Device | None = None,
                         skip_words: jax.Array | None = None, skip_index: int = 0) -> tuple:
    """`write_records` of the same tokens into several caches (donated), caches[k] at
    slot_mappings[k] i32[T]: the Pallas Triton writer encodes each record once and stores it into
    every cache in one kernel; the XLA reference writes each cache in turn.  The implementation
    is the one `write_records` would choose for the largest cache.

    skip_words: i32[n]; where skip_words[skip_index] (read on the device) is not 0 nothing is
    written.  The Pallas Triton writer reads the word itself; the reference masks the slots."""
    caches, slot_mappings = tuple(caches), tuple(slot_mappings)
    if len(caches) != len(slot_mappings) or not caches:
        raise ValueError(f"slot_mappings: expected one per cache ({len(caches)}), got {len(slot_mappings)}")
    if skip_words is not None and not (skip_words.ndim == 1 and skip_words.dtype == jnp.int32
                                       and 0 <= skip_index < skip_words.shape[0]):
        raise ValueError(f"skip_words, skip_index: expected int32[n] and an index in [0, n), got "
                         f"{skip_words.dtype}{list(skip_words.shape)} and {skip_index}")
    run = select(implementation, device or selection.device_of(caches[0]), max(c.size for c in caches),
                 kv_c.shape[0], layout, interpret=interpret, config=config)
    if run.name == "pallas_triton":
        return pallas_triton.write_records_to_all_triton(caches, kv_c, k_pe, slot_mappings, skip_words,
                                                         layout=layout, config=run.config or WriterTiles(),
                                                         skip_index=skip_index, interpret=interpret)
    if skip_words is not None:
        slot_mappings = tuple(jnp.where(skip_words[skip_index] == 0, s, -1) for s in slot_mappings)
    return tuple(run(c, kv_c, k_pe, s, layout=layout, interpret=interpret) for c, s in zip(caches, slot_mappings))

