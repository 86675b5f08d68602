"""Implementation registries: named backends with `supported_on` and ordered fallback."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax

from pallas_kernels import _pallas_compat as compat


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    supported_on: Callable[[jax.Device, int], tuple[bool, str]]   # (device, cache bytes) -> ok, why
    run: Callable[..., jax.Array]


def always_supported(device: jax.Device, nbytes: int) -> tuple[bool, str]:
    return True, ""


def triton_supported(device: jax.Device, nbytes: int) -> tuple[bool, str]:
    """Pallas Triton runs compiled on a GPU; it addresses a uint8 buffer of [2**31, 2**32] bytes
    with sign-extended int32 element offsets, so such caches go to another implementation."""
    if compat.pltriton is None:
        return False, f"jax.experimental.pallas.triton unavailable: {compat.TRITON_IMPORT_ERROR}"
    if not compat.on_gpu(device):
        return False, f"needs a GPU (device is {device.platform}); use interpret=True on CPU"
    if 2 ** 31 <= nbytes <= 2 ** 32:
        return False, (f"cache of {nbytes} bytes lies in [2**31, 2**32], where Pallas Triton "
                       "addresses uint8 buffers with sign-extended int32 offsets")
    return True, ""


def mosaic_gpu_supported(device: jax.Device, nbytes: int) -> tuple[bool, str]:
    """Mosaic GPU kernels with bulk async copies (TMA) need an SM90+ GPU."""
    if compat.plgpu is None:
        return False, f"jax.experimental.pallas.mosaic_gpu unavailable: {compat.MOSAIC_GPU_IMPORT_ERROR}"
    if not compat.on_gpu(device):
        return False, f"needs a GPU (device is {device.platform}); use interpret=True on CPU"
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return False, f"unknown compute capability {capability!r}"
    if major < 9:
        return False, f"needs compute capability 9.0+ (bulk async copies), device has {capability}"
    return True, ""


def choose(registry: Mapping[str, Implementation], default_order: Sequence[str],
           implementation: str | Sequence[str] | None, device: jax.Device, nbytes: int,
           *, interpret: bool = False, tuned_order: Sequence[str] | None = None) -> Implementation:
    """The first supported implementation of `implementation` (None: `tuned_order`, the measured
    order of `tuning.lookup`, followed by the rest of `default_order`).

    With `interpret=True` a Pallas implementation is always usable (interpret mode runs anywhere).
    """
    if implementation is None:       # the measured order, then whatever it left out as fallbacks
        tuned = tuple(tuned_order or ())
        names: Sequence[str] = tuned + tuple(n for n in default_order if n not in tuned)
    elif isinstance(implementation, str):
        names = (implementation,)
    else:
        names = tuple(implementation)
    reasons = []
    for name in names:
        if name not in registry:
            raise ValueError(f"implementation: expected one of {sorted(registry)} "
                             f"(or a sequence of them), got {name!r}")
        impl = registry[name]
        if interpret and name != "xla":
            return impl
        ok, why = impl.supported_on(device, nbytes)
        if ok:
            return impl
        reasons.append(f"{name}: {why}")
    raise ValueError(f"implementation: none of {list(names)} is supported here ({'; '.join(reasons)})")


def device_of(array) -> jax.Device:
    devices = getattr(array, "devices", None)
    if devices is None or isinstance(array, jax.core.Tracer):
        return jax.devices()[0]
    return next(iter(devices()))
