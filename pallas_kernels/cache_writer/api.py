"""Paged-cache writer: implementation registry with ordered fallback.

`implementation` is None (automatic), one name, or a sequence of names tried in order; the
first that is supported on the cache's device and size runs.  Names:

* ``"pallas_triton"``: the fused encode + scatter Pallas Triton kernel (GPU; on CPU only in
  interpret mode, which tests use).
* ``"xla"``: the jnp reference (`reference.py`), any backend.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax

from pallas_kernels import _registry
from pallas_kernels.cache_writer import pallas_triton
from pallas_kernels.cache_writer.reference import write_records_reference
from pallas_kernels.record_codec import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


def _run_triton(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    return pallas_triton.write_records_triton(
        cache, kv_c, k_pe, slot_mapping, layout=layout,
        config=config or pallas_triton.WriterConfig(), interpret=interpret)


def _run_xla(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    del interpret, config
    return write_records_reference(cache, kv_c, k_pe, slot_mapping, layout=layout)


IMPLEMENTATIONS = {
    "pallas_triton": _registry.Implementation("pallas_triton", _registry.triton_supported, _run_triton),
    "xla": _registry.Implementation("xla", _registry.always_supported, _run_xla),
}

choose = functools.partial(_registry.choose, IMPLEMENTATIONS, DEFAULT_ORDER)


def write_records(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array, *,
                  layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                  interpret: bool = False, config: pallas_triton.WriterConfig | None = None) -> jax.Array:
    """Shape- and value-unchecked entry (ckv_jax.write_records validates); cache is donated."""
    impl = choose(implementation, _registry.device_of(cache), cache.size, interpret=interpret)
    return impl.run(cache, kv_c, k_pe, slot_mapping, layout=layout, interpret=interpret, config=config)
