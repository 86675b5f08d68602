"""Paged gathers (raw records, dequantized bf16) and the gather by slot: implementation registries.

Names: ``"pallas_triton"`` (GPU; interpret mode on CPU for tests), ``"pallas_mosaic_gpu"`` (raw
records only; SM90+, GPU interpret mode on CPU) and ``"xla"`` (the jnp references, any backend).
None picks the first supported implementation of the measured order for the device and size
(`pallas_kernels.tuning`), or of DEFAULT_ORDER where nothing was measured; the config, unless
given, is the tuned one for that size, else the kernel's default.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax

from pallas_kernels import _pallas_compat as compat
from pallas_kernels import _registry, tuning
from pallas_kernels.paged_gather import pallas_mosaic_gpu, pallas_triton
from pallas_kernels.paged_gather.pallas_triton import GatherConfig
from pallas_kernels.paged_gather.reference import (gather_dequant_reference, gather_records_reference,
                                                   gather_slots_reference)
from pallas_kernels.record_codec import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


def _records_triton(cache, block_table, cu_lens, out=None, *, num_rows, interpret=False, config=None):
    return pallas_triton.gather_records_triton(cache, block_table, cu_lens, out, num_rows=num_rows,
                                               config=config or pallas_triton.RECORDS_CONFIG, interpret=interpret)


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
                                               config=config or pallas_triton.DEQUANT_CONFIG,
                                               interpret=interpret)


def _dequant_xla(cache, block_table, cu_lens, *, num_rows, layout, interpret=False, config=None):
    return gather_dequant_reference(cache, block_table, cu_lens, num_rows=num_rows, layout=layout)


def _slots_triton(cache, slots, *, interpret=False, config=None):
    return pallas_triton.gather_slots_triton(cache, slots, config=config or pallas_triton.SLOTS_CONFIG,
                                             interpret=interpret)


def _slots_xla(cache, slots, *, interpret=False, config=None):
    return gather_slots_reference(cache, slots)


def _registry_of(triton_run, xla_run):
    return {"pallas_triton": _registry.Implementation("pallas_triton", _registry.triton_supported, triton_run),
            "xla": _registry.Implementation("xla", _registry.always_supported, xla_run)}


RECORDS = dict(_registry_of(_records_triton, _records_xla), pallas_mosaic_gpu=_registry.Implementation(
    "pallas_mosaic_gpu", _registry.mosaic_gpu_supported, _records_mosaic))
DEQUANT = _registry_of(_dequant_triton, _dequant_xla)
SLOTS = _registry_of(_slots_triton, _slots_xla)
choose_records = functools.partial(_registry.choose, RECORDS, DEFAULT_ORDER)
choose_dequant = functools.partial(_registry.choose, DEQUANT, DEFAULT_ORDER)
choose_slots = functools.partial(_registry.choose, SLOTS, DEFAULT_ORDER)


def _pick(op, choose, implementation, cache, work_bytes, interpret, config, skip=()):
    return tuning.pick(op, choose, implementation, _registry.device_of(cache), cache.size, work_bytes,
                       config_type=GatherConfig, interpret=interpret, config=config, skip=skip)


def gather_records(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   out: jax.Array | None = None, implementation: str | Sequence[str] | None = None,
                   interpret: bool = False, config: GatherConfig | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> u8[num_rows, R] (see reference.py for the contract).

    out: None, or u8[M, R] with M >= num_rows that receives the rows in place (its rows
    [0, num_rows) are replaced, the rest kept; donate it to the enclosing jit, or XLA copies
    it first), so a caller that owns the destination (a ring slot) gets no second copy.
    """
    if out is not None:
        if out.dtype != cache.dtype or out.ndim != 2 or out.shape[1] != cache.shape[-1] or out.shape[0] < num_rows:
            raise ValueError(f"out: expected uint8[>= {num_rows}, {cache.shape[-1]}] (num_rows rows of the cache's "
                             f"records), got {out.dtype}{list(out.shape)}")
    # the Mosaic GPU grid has a CTA per page slot per request (mostly empty ones for several
    # requests) and was measured with one: the automatic choice uses it for one request only;
    # it writes a fresh output only
    skip = ("pallas_mosaic_gpu",) if block_table.shape[0] > 1 or out is not None else ()
    impl, config = _pick("gather_records", choose_records, implementation, cache,
                         2 * num_rows * cache.shape[-1], interpret, config, skip)
    return impl.run(cache, block_table, cu_lens, out, num_rows=num_rows, interpret=interpret, config=config)


def gather_dequant(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                   interpret: bool = False, config: GatherConfig | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> bf16[num_rows, nope_dim + rope_dim]."""
    impl, config = _pick("gather_dequant", choose_dequant, implementation, cache,
                         num_rows * (cache.shape[-1] + 2 * layout.value_dim), interpret, config)
    return impl.run(cache, block_table, cu_lens, num_rows=num_rows, layout=layout, interpret=interpret,
                    config=config)


def gather_slots(cache: jax.Array, slots: jax.Array, *, implementation: str | Sequence[str] | None = None,
                 interpret: bool = False, config: GatherConfig | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R], i32[N] -> u8[N, R] (see `gather_slots_reference`)."""
    impl, config = _pick("gather_slots", choose_slots, implementation, cache, 2 * slots.shape[0] * cache.shape[-1],
                         interpret, config)
    return impl.run(cache, slots, interpret=interpret, config=config)
