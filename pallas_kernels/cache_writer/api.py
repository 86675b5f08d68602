"""Paged-cache writer: implementation registry with ordered fallback.

`implementation` is None (automatic), one name, or a sequence of names tried in order; the
first that is supported on the cache's device and shape runs.  Names:

* ``"pallas_triton"``: the fused encode + scatter Pallas Triton kernel (GPU; on CPU only in
  interpret mode, which tests use).
* ``"xla"``: the jnp reference (`reference.py`), any backend.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

from pallas_kernels import _pallas_compat as compat
from pallas_kernels.cache_writer import pallas_triton
from pallas_kernels.cache_writer.reference import write_records_reference
from pallas_kernels.record_codec import RecordLayout

DEFAULT_ORDER = ("pallas_triton", "xla")


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    supported_on: Callable[[jax.Device, int], tuple[bool, str]]   # (device, cache bytes) -> ok, why
    run: Callable[..., jax.Array]


def _triton_supported(device: jax.Device, cache_bytes: int) -> tuple[bool, str]:
    if compat.pltriton is None:
        return False, f"jax.experimental.pallas.triton unavailable: {compat.TRITON_IMPORT_ERROR}"
    if not compat.on_gpu(device):
        return False, f"needs a GPU (device is {device.platform}); use interpret=True on CPU"
    if not pallas_triton.supported_cache_bytes(cache_bytes):
        return False, (f"cache of {cache_bytes} bytes lies in [2**31, 2**32], where Pallas Triton "
                       "addresses uint8 buffers with sign-extended int32 offsets")
    return True, ""


def _run_triton(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    return pallas_triton.write_records_triton(
        cache, kv_c, k_pe, slot_mapping, layout=layout,
        config=config or pallas_triton.WriterConfig(), interpret=interpret)


def _run_xla(cache, kv_c, k_pe, slot_mapping, *, layout, interpret=False, config=None):
    del interpret, config
    return write_records_reference(cache, kv_c, k_pe, slot_mapping, layout=layout)


IMPLEMENTATIONS = {
    "pallas_triton": Implementation("pallas_triton", _triton_supported, _run_triton),
    "xla": Implementation("xla", lambda device, nbytes: (True, ""), _run_xla),
}


def choose(implementation: str | Sequence[str] | None, device: jax.Device, cache_bytes: int,
           *, interpret: bool = False) -> Implementation:
    """The first supported implementation of `implementation` (None: DEFAULT_ORDER)."""
    if implementation is None:
        names: Sequence[str] = DEFAULT_ORDER
    elif isinstance(implementation, str):
        names = (implementation,)
    else:
        names = tuple(implementation)
    reasons = []
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"implementation: expected one of {sorted(IMPLEMENTATIONS)} "
                             f"(or a sequence of them), got {name!r}")
        impl = IMPLEMENTATIONS[name]
        if interpret and name != "xla":
            return impl                                   # interpret mode runs anywhere
        ok, why = impl.supported_on(device, cache_bytes)
        if ok:
            return impl
        reasons.append(f"{name}: {why}")
    raise ValueError(f"implementation: none of {list(names)} is supported here ({'; '.join(reasons)})")


def write_records(cache: jax.Array, kv_c: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array, *,
                  layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                  interpret: bool = False, config: pallas_triton.WriterConfig | None = None) -> jax.Array:
    """Shape- and value-unchecked entry (ckv_jax.write_records validates); cache is donated."""
    device = next(iter(cache.devices())) if hasattr(cache, "devices") else jax.devices()[0]
    impl = choose(implementation, device, cache.size, interpret=interpret)
    return impl.run(cache, kv_c, k_pe, slot_mapping, layout=layout, interpret=interpret, config=config)
