"""Kernel selection: one `KernelOp` per op resolves `implementation=` to a runnable `Selected`.

An op lists its implementations (each with a `supported_on` predicate), its default order and
its tile-config type; `KernelOp.select` resolves `implementation=None | name | sequence` on a
device: None takes the measured order for the op's size on that device kind (`tuning`, a JSON
table per device kind), then the default order's remaining names, and runs the first supported
one with the measured tiles (unless the caller gives tiles).  A name or a sequence is tried in
the caller's order.  Nothing else in the library chooses an implementation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from pallas_kernels import compat, tuning

# (device, bytes of the buffer the kernel addresses, interpret) -> (supported, why not)
SupportPredicate = Callable[[jax.Device, int, bool], "tuple[bool, str]"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend of an op: `run(*args, config=tiles or None, interpret=..., **kwargs)`.
    config_type: its tile type where it differs from the op's."""
    name: str
    supported_on: SupportPredicate
    run: Callable[..., Any]
    config_type: type | None = None


@dataclasses.dataclass(frozen=True)
class Selected:
    """An implementation with its tiles bound; hashable, so jit caches keyed on it hit."""
    implementation: Implementation
    config: Any = None            # the tile config, or None for the kernel's default

    @property
    def name(self) -> str:
        return self.implementation.name

    def __call__(self, *args, **kwargs):
        return self.implementation.run(*args, config=self.config, **kwargs)


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """An op's implementations, default order, tile type and measured table (key `name`)."""
    name: str
    implementations: tuple[Implementation, ...]
    default_order: tuple[str, ...]
    config_type: type | None = None

    def __post_init__(self):
        unknown = set(self.default_order) - set(self.names)
        if unknown:
            raise ValueError(f"default_order: names {sorted(unknown)} are not implementations of {self.name}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(impl.name for impl in self.implementations)

    def tile_type(self, name: str) -> type | None:
        """The tile config type of implementation `name` (its own, else the op's)."""
        return self.implementation(name).config_type or self.config_type

    def implementation(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        raise ValueError(f"implementation: expected one of {sorted(self.names)} (or a sequence of them), "
                         f"got {name!r}")

    def candidates(self, implementation: str | Sequence[str] | None, device: jax.Device,
                   work_bytes: int, skip: Sequence[str] = (),
                   default_order: Sequence[str] | None = None) -> tuple[tuple[str, ...], tuning.Entry]:
        """The names to try in order, and the measured entry for `work_bytes` on `device`.

        skip: names left out of the automatic order, and default_order: the order after the
        measured one instead of the op's (heuristics for shapes the measured table does not
        cover); a caller who names implementations still gets them."""
        entry = tuning.lookup(self.name, device, work_bytes)
        if implementation is None:
            tuned = tuple(n for n in entry.order if n not in skip)
            rest = self.default_order if default_order is None else default_order
            return tuned + tuple(n for n in rest if n not in tuned and n not in skip), entry
        if isinstance(implementation, str):
            return (implementation,), entry
        if not isinstance(implementation, (tuple, list)) or not all(isinstance(n, str) for n in implementation):
            raise TypeError(f"implementation: expected None, a name or a sequence of names, got {implementation!r}")
        return tuple(implementation), entry

    def select(self, implementation: str | Sequence[str] | None, device: jax.Device, buffer_bytes: int,
               work_bytes: int, *, interpret: bool = False, config=None, skip: Sequence[str] = (),
               default_order: Sequence[str] | None = None) -> Selected:
        """The first supported implementation of the candidates on `device` (see `candidates`),
        with `config` if given, else the measured tiles for `work_bytes`, else None (the kernel's
        default).  buffer_bytes: the size of the largest buffer the kernel addresses, in elements
        of its dtype (a uint8 cache's bytes; an output's values)."""
        names, entry = self.candidates(implementation, device, work_bytes, skip, default_order)
        reasons = []
        for name in names:
            impl = self.implementation(name)
            ok, why = impl.supported_on(device, buffer_bytes, interpret)
            if ok:
                tiles = self.tile_type(name)
                if config is None and tiles is not None and name in entry.configs:
                    config = tiles(**entry.configs[name])
                return Selected(impl, config)
            reasons.append(f"{name}: {why}")
        raise ValueError(f"implementation: none of {list(names)} is supported here ({'; '.join(reasons)})")


def always_supported(device: jax.Device, nbytes: int, interpret: bool) -> tuple[bool, str]:
    return True, ""


def _pallas_backend(module, import_error: str | None, name: str, device: jax.Device,
                    interpret: bool) -> tuple[bool, str] | None:
    """The verdict shared by the Pallas backends (importable; interpret mode runs anywhere;
    compiled needs a GPU), or None where the backend's own checks decide."""
    if module is None:
        return False, f"jax.experimental.pallas.{name} unavailable: {import_error}"
    if interpret:
        return True, ""
    if not compat.on_gpu(device):
        return False, f"needs a GPU (device is {device.platform}); use interpret=True on CPU"
    return None


def triton_supported(device: jax.Device, nbytes: int, interpret: bool) -> tuple[bool, str]:
    """Pallas Triton runs compiled on a GPU, or in interpret mode anywhere; compiled, it addresses
    a buffer of [2**31, 2**32] elements (a uint8 one's bytes) with sign-extended int32 element
    offsets, so kernels with such a buffer (`nbytes`: the largest's elements) go to another
    implementation."""
    verdict = _pallas_backend(compat.pltriton, compat.TRITON_IMPORT_ERROR, "triton", device, interpret)
    if verdict is not None:
        return verdict
    if 2 ** 31 <= nbytes <= 2 ** 32:
        return False, (f"a buffer of {nbytes} elements lies in [2**31, 2**32], where Pallas Triton "
                       "addresses elements with sign-extended int32 offsets")
    return True, ""


def mosaic_gpu_supported(device: jax.Device, nbytes: int, interpret: bool) -> tuple[bool, str]:
    """Mosaic GPU kernels with bulk async copies (TMA) need an SM90+ GPU, or interpret mode."""
    verdict = _pallas_backend(compat.plgpu, compat.MOSAIC_GPU_IMPORT_ERROR, "mosaic_gpu", device, interpret)
    if verdict is not None:
        return verdict
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return False, f"unknown compute capability {capability!r}"
    if major < 9:
        return False, f"needs compute capability 9.0+ (bulk async copies), device has {capability}"
    return True, ""


def device_of(array) -> jax.Device:
    """The device an op on `array` runs on (the first of its devices; the default device for a
    tracer, whose placement is not known at trace time: callers inside jit pass `device=`)."""
    devices = getattr(array, "devices", None)
    if devices is None or isinstance(array, jax.core.Tracer):
        return jax.devices()[0]
    return next(iter(devices()))


def check_power_of_two_fields(config, names) -> None:
    """Tile fields that must be positive powers of two (tile sizes, warps): TypeError for a
    non-int, ValueError otherwise."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v <= 0 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v}")
