"""Paged gathers (raw records, dequantized bf16) and the gather by slot: one `KernelOp` each.

Names: ``"pallas_triton"`` (GPU; interpret mode on CPU for tests), ``"pallas_mosaic_gpu"`` (raw
records only; SM90+, GPU interpret mode on CPU) and ``"xla"`` (the jnp references, any backend).
`implementation=None` takes the measured order for the device and size (`pallas_kernels.tuning`),
else DEFAULT_ORDER; the tiles, unless given, are the measured ones for that size, else the
kernel's default (`selection.KernelOp.select`).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import compat, selection
from pallas_kernels.paged_gather import pallas_mosaic_gpu, pallas_triton
from pallas_kernels.paged_gather.pallas_triton import GatherTiles
from pallas_kernels.paged_gather.reference import (gather_dequant_reference, gather_records_reference,
                                                   gather_slots_reference)
from pallas_kernels.record_layout import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


def _records_triton(cache, block_table, cu_lens, out=None, *, num_rows, interpret=False, config=None):
    return pallas_triton.gather_records_triton(cache, block_table, cu_lens, out, num_rows=num_rows,
                                               config=config or pallas_triton.RECORDS_TILES, interpret=interpret)


def _records_mosaic(cache, block_table, cu_lens, out=None, *, num_rows, interpret=False, config=None):
    del config                                     # one page per CTA: nothing to tune
    if out is not None:
        raise ValueError("out: the pallas_mosaic_gpu gather writes a fresh output only; "
                         "use pallas_triton or xla to gather into an existing buffer")
    params = compat.mosaic_gpu_interpret_params() if interpret else False
    if interpret and params is None:
        raise ValueError("interpret: this jax has no Mosaic GPU interpret mode")
    return pallas_mosaic_gpu.gather_records_mosaic(cache, block_table, cu_lens, num_rows=num_rows,
                                                   interpret=params)


def _records_xla(cache, block_table, cu_lens, out=None, *, num_rows, interpret=False, config=None):
    return gather_records_reference(cache, block_table, cu_lens, out, num_rows=num_rows)


def _dequant_triton(cache, block_table, cu_lens, *, num_rows, layout, interpret=False, config=None):
    return pallas_triton.gather_dequant_triton(cache, block_table, cu_lens, num_rows=num_rows, layout=layout,
                                               config=config or pallas_triton.DEQUANT_TILES, interpret=interpret)


def _dequant_xla(cache, block_table, cu_lens, *, num_rows, layout, interpret=False, config=None):
    return gather_dequant_reference(cache, block_table, cu_lens, num_rows=num_rows, layout=layout)


def _slots_triton(cache, slots, *, interpret=False, config=None):
    return pallas_triton.gather_slots_triton(cache, slots, config=config or pallas_triton.SLOTS_TILES,
                                             interpret=interpret)


def _slots_xla(cache, slots, *, interpret=False, config=None):
    return gather_slots_reference(cache, slots)


def _op(name, triton_run, xla_run, *extra):
    impls = (selection.Implementation("pallas_triton", selection.triton_supported, triton_run),
             selection.Implementation("xla", selection.always_supported, xla_run), *extra)
    return selection.KernelOp(name, impls, DEFAULT_ORDER, GatherTiles)


GATHER_RECORDS = _op("gather_records", _records_triton, _records_xla, selection.Implementation(
    "pallas_mosaic_gpu", selection.mosaic_gpu_supported, _records_mosaic))
GATHER_DEQUANT = _op("gather_dequant", _dequant_triton, _dequant_xla)
GATHER_SLOTS = _op("gather_slots", _slots_triton, _slots_xla)


def select_records(implementation, device: jax.Device, cache_bytes: int, num_rows: int, record_bytes: int, *,
                   num_reqs: int = 1, out_rows: int | None = None, interpret: bool = False,
                   config: GatherTiles | None = None) -> selection.Selected:
    """The raw paged gather's choice for a pack of `num_rows` records (`gather_records`' rule);
    out_rows: the rows of the buffer it writes into in place (None: a fresh one of num_rows).

    The Mosaic GPU grid has a CTA per page slot per request (mostly empty ones for several
    requests) and was measured with one request, and it writes a fresh output only: the
    automatic choice skips it for several requests or a gather into a given buffer."""
    skip = ("pallas_mosaic_gpu",) if num_reqs > 1 or out_rows is not None else ()
    largest = max(cache_bytes, (num_rows if out_rows is None else out_rows) * record_bytes)
    return GATHER_RECORDS.select(implementation, device, largest, 2 * num_rows * record_bytes,
                                 interpret=interpret, config=config, skip=skip)


def select_dequant(implementation, device: jax.Device, cache_bytes: int, num_rows: int, record_bytes: int,
                   layout: RecordLayout, *, interpret: bool = False,
                   config: GatherTiles | None = None) -> selection.Selected:
    """The dequantizing gather's choice for `num_rows` rows of bf16 values (`gather_dequant`'s
    rule); the largest buffer is the cache (its bytes) or the output (its bf16 values)."""
    return GATHER_DEQUANT.select(implementation, device, max(cache_bytes, num_rows * layout.value_dim),
                                 num_rows * (record_bytes + 2 * layout.value_dim), interpret=interpret, config=config)


def gather_records(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   out: jax.Array | None = None, implementation: str | Sequence[str] | None = None,
                   interpret: bool = False, config: GatherTiles | None = None,
                   device: jax.Device | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> u8[num_rows, R] (see reference.py for the contract).

    out: None, or u8[M, R] with M >= num_rows that receives the rows in place (its rows
    [0, num_rows) are replaced, the rest kept; donate it to the enclosing jit, or XLA copies
    it first), so a caller that owns the destination (a ring slot) gets no second copy.
    device: where the gather runs (default: the cache's device; pass it inside jit, where the
    cache is a tracer).
    """
    if out is not None:
        if out.dtype != cache.dtype or out.ndim != 2 or out.shape[1] != cache.shape[-1] or out.shape[0] < num_rows:
            raise ValueError(f"out: expected uint8[>= {num_rows}, {cache.shape[-1]}] (num_rows rows of the cache's "
                             f"records), got {out.dtype}{list(out.shape)}")
    run = select_records(implementation, device or selection.device_of(cache), cache.size, num_rows,
                         cache.shape[-1], num_reqs=block_table.shape[0], out_rows=None if out is None else out.shape[0],
                         interpret=interpret, config=config)
    return run(cache, block_table, cu_lens, out, num_rows=num_rows, interpret=interpret)


def gather_dequant(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                   interpret: bool = False, config: GatherTiles | None = None,
                   device: jax.Device | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> bf16[num_rows, nope_dim + rope_dim]."""
    run = select_dequant(implementation, device or selection.device_of(cache), cache.size, num_rows, cache.shape[-1],
                         layout, interpret=interpret, config=config)
    return run(cache, block_table, cu_lens, num_rows=num_rows, layout=layout, interpret=interpret)


# the page size a flat table is dequantized in: one block-table read per this many rows
DEQUANTIZE_PAGE_ROWS = 64


def dequantize_records(records: jax.Array, *, layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                       interpret: bool = False, config: GatherTiles | None = None,
                       device: jax.Device | None = None) -> jax.Array:
    """u8[N, R] records of `layout`, every row -> bf16[N, nope_dim + rope_dim] (the bf16 record's
    values; NoPE rounded once, RoPE bit-exact): `gather_dequant` over the table seen as one
    request on pages of the largest power of two up to DEQUANTIZE_PAGE_ROWS rows dividing N, in
    order (a view and a [1, N / page] block table: no copy of the records)."""
    n, record_bytes = records.shape
    page = 1
    while page < DEQUANTIZE_PAGE_ROWS and n % (2 * page) == 0:
        page *= 2
    table = jnp.arange(n // page, dtype=jnp.int32)[None, :]
    cu_lens = jnp.array([0, n], jnp.int32)
    return gather_dequant(records.reshape(n // page, page, record_bytes), table, cu_lens, num_rows=n, layout=layout,
                          implementation=implementation, interpret=interpret, config=config, device=device)


def gather_slots(cache: jax.Array, slots: jax.Array, *, implementation: str | Sequence[str] | None = None,
                 interpret: bool = False, config: GatherTiles | None = None,
                 device: jax.Device | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R], i32[N] -> u8[N, R] (see `gather_slots_reference`)."""
    out_bytes = slots.shape[0] * cache.shape[-1]
    run = GATHER_SLOTS.select(implementation, device or selection.device_of(cache), max(cache.size, out_bytes),
                              2 * out_bytes, interpret=interpret, config=config)
    return run(cache, slots, interpret=interpret)
