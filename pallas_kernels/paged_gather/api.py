"""Paged gathers (raw records and dequantized bf16): implementation registries.

Names: ``"pallas_triton"`` (GPU; interpret mode on CPU for tests) and ``"xla"`` (the jnp
references, any backend).  None picks the first supported of DEFAULT_ORDER.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax

from pallas_kernels import _registry
from pallas_kernels.paged_gather import pallas_triton
from pallas_kernels.paged_gather.reference import gather_dequant_reference, gather_records_reference
from pallas_kernels.record_codec import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


def _records_triton(cache, block_table, cu_lens, *, num_rows, interpret=False, config=None):
    return pallas_triton.gather_records_triton(cache, block_table, cu_lens, num_rows=num_rows,
                                               config=config or pallas_triton.GatherConfig(),
                                               interpret=interpret)


def _records_xla(cache, block_table, cu_lens, *, num_rows, interpret=False, config=None):
    return gather_records_reference(cache, block_table, cu_lens, num_rows=num_rows)


def _dequant_triton(cache, block_table, cu_lens, *, num_rows, layout, interpret=False, config=None):
    return pallas_triton.gather_dequant_triton(cache, block_table, cu_lens, num_rows=num_rows, layout=layout,
                                               config=config or pallas_triton.GatherConfig(),
                                               interpret=interpret)


def _dequant_xla(cache, block_table, cu_lens, *, num_rows, layout, interpret=False, config=None):
    return gather_dequant_reference(cache, block_table, cu_lens, num_rows=num_rows, layout=layout)


RECORDS = {
    "pallas_triton": _registry.Implementation("pallas_triton", _registry.triton_supported, _records_triton),
    "xla": _registry.Implementation("xla", _registry.always_supported, _records_xla),
}
DEQUANT = {
    "pallas_triton": _registry.Implementation("pallas_triton", _registry.triton_supported, _dequant_triton),
    "xla": _registry.Implementation("xla", _registry.always_supported, _dequant_xla),
}
choose_records = functools.partial(_registry.choose, RECORDS, DEFAULT_ORDER)
choose_dequant = functools.partial(_registry.choose, DEQUANT, DEFAULT_ORDER)


def gather_records(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   implementation: str | Sequence[str] | None = None, interpret: bool = False,
                   config: pallas_triton.GatherConfig | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> u8[num_rows, R] (see reference.py for the contract)."""
    impl = choose_records(implementation, _registry.device_of(cache), cache.size, interpret=interpret)
    return impl.run(cache, block_table, cu_lens, num_rows=num_rows, interpret=interpret, config=config)


def gather_dequant(cache: jax.Array, block_table: jax.Array, cu_lens: jax.Array, *, num_rows: int,
                   layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                   interpret: bool = False, config: pallas_triton.GatherConfig | None = None) -> jax.Array:
    """u8[num_blocks, block_size, R] -> bf16[num_rows, nope_dim + rope_dim]."""
    impl = choose_dequant(implementation, _registry.device_of(cache), cache.size, interpret=interpret)
    return impl.run(cache, block_table, cu_lens, num_rows=num_rows, layout=layout, interpret=interpret,
                    config=config)
