"""Paged-cache writer: implementation registry with ordered fallback.

`implementation` is None (automatic), one name, or a sequence of names tried in order; the
first that is supported on the cache's device and size runs.  Names:

* ``"pallas_triton"``: the fused encode + scatter Pallas Triton kernel (GPU; on CPU only in
  interpret mode, which tests use).
* ``"xla"``: the jnp reference (`reference.py`), any backend.

With `implementation=None` the order and the config are the measured ones for the device and the
bytes the write moves (`pallas_kernels.tuning`, op "write_records").
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax

from pallas_kernels import _registry, tuning
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


def work_bytes(num_tokens: int, layout: RecordLayout) -> int:
    """Bytes a write of `num_tokens` moves: bf16 latents and RoPE and an int32 slot in, a record out."""
    return num_tokens * (2 * layout.nope_dim + 2 * layout.rope_dim + 4 + layout.record_bytes)


def select(implementation: str | Sequence[str] | None, device: jax.Device, cache_bytes: int, num_tokens: int,
           layout: RecordLayout, interpret: bool = False):
    """The backend's `run` with its tuned config bound (cached, so jit caches keyed on it hit)."""
    if not isinstance(implementation, (str, type(None))):
        implementation = tuple(implementation)
    return _select(implementation, device, cache_bytes, num_tokens, layout, interpret)


@functools.lru_cache(maxsize=256)
def _select(implementation, device, cache_bytes, num_tokens, layout, interpret):
    impl, config = tuning.pick("write_records", choose, implementation, device, cache_bytes,
                               work_bytes(num_tokens, layout), config_type=pallas_triton.WriterConfig,
                               interpret=interpret)
    return functools.partial(impl.run, config=config) if config is not None else impl.run


def write_records(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array, *,
                  layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                  interpret: bool = False, config: pallas_triton.WriterConfig | None = None) -> jax.Array:
    """Shape- and value-unchecked entry (ckv_jax.write_records validates); cache is donated."""
    run = select(implementation, _registry.device_of(cache), cache.size, kv_c.shape[0], layout, interpret)
    if config is not None:
        run = functools.partial(run, config=config)
    return run(cache, kv_c, k_pe, slot_mapping, layout=layout, interpret=interpret)
