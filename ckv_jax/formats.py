"""Native CKV record formats: a registry of named descriptors.

>>> fmt = ckv_jax.formats.get("fp8_ds_mla")
>>> fmt.record_bytes
656
>>> records = fmt.encode(kv_c, k_pe)       # u8[T, 656]
>>> values = fmt.decode(records)           # f32[T, 576]

The byte layouts and the encoding rules (rounding, NaN/Inf, all-zero groups, subnormals) are
documented in `pallas_kernels.record_codec`.  Nothing outside a format descriptor hard-codes a
record size.
"""
from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import record_codec
from pallas_kernels.record_layout import RecordLayout


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """A named record format.  `quantized` formats carry their own per-tile/per-group scales;
    `lookahead` formats may be gathered ahead of their layer (depth-N prefetch) and patched
    there, others are gathered synchronously (upstream prefetches its quantized formats only)."""
    name: str
    layout: RecordLayout
    description: str = ""
    aliases: tuple[str, ...] = ()
    lookahead: bool = False

    record_bytes = property(lambda self: self.layout.record_bytes, doc="bytes per record")
    nope_dim = property(lambda self: self.layout.nope_dim, doc="latent (NoPE) values per record")
    rope_dim = property(lambda self: self.layout.rope_dim, doc="RoPE values per record")
    value_dim = property(lambda self: self.layout.value_dim, doc="decoded values per record: NoPE then RoPE")

    @property
    def quantized(self) -> bool:
        return self.layout.kind != "bf16"

    def encode(self, kv_c: jax.Array, k_pe: jax.Array) -> jax.Array:
        """kv_c: bf16|f16|f32[T, nope_dim], k_pe: bf16[T, rope_dim] -> u8[T, record_bytes]."""
        from ckv_jax import validation
        validation.check_values(self, kv_c, k_pe)
        return _encode(self.layout, kv_c, k_pe)

    def decode(self, records: jax.Array) -> jax.Array:
        """u8[T, record_bytes] -> f32[T, nope_dim + rope_dim] (dequantized NoPE, then RoPE)."""
        from ckv_jax import validation
        validation.check_records(self, records)
        return _decode(self.layout, records)


_encode = jax.jit(record_codec.encode, static_argnums=0)
_decode = jax.jit(record_codec.decode, static_argnums=0)


_REGISTRY: dict[str, RecordFormat] = {}
_ALIASES: dict[str, str] = {}


def register(fmt: RecordFormat) -> RecordFormat:
    """Add a format (e.g. a different nope/rope geometry) under its name and aliases."""
    for key in (fmt.name, *fmt.aliases):
        if key in _REGISTRY or key in _ALIASES:
            raise ValueError(f"format name {key!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    for alias in fmt.aliases:
        _ALIASES[alias] = fmt.name
    return fmt


def get(name: str | RecordFormat) -> RecordFormat:
    """The format registered under `name` (or an alias); a RecordFormat passes through."""
    if isinstance(name, RecordFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format: expected a format name or RecordFormat, got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"format: unknown record format {name!r}; known: {names()}")
    return _REGISTRY[key]


def names() -> list[str]:
    return sorted(_REGISTRY)


FP8_DS_MLA = register(RecordFormat(
    "fp8_ds_mla", RecordLayout("fp8_tiles", nope_dim=512, rope_dim=64, quant_block=128),
    "e4m3fn NoPE with one float32 scale per 128-element tile, bf16 RoPE (DeepSeek-V3.2 / GLM-5)",
    aliases=("fp8", "fp8_e4m3"), lookahead=True))
NVFP4_DS_MLA = register(RecordFormat(
    "nvfp4_ds_mla", RecordLayout("nvfp4_groups", nope_dim=512, rope_dim=64, quant_block=16, pad_bytes=16),
    "packed e2m1 NoPE with one e4m3 scale per 16-element group, 16 zero bytes, bf16 RoPE", lookahead=True))
BF16 = register(RecordFormat(
    "bf16", RecordLayout("bf16", nope_dim=512, rope_dim=64),
    "bf16 NoPE then bf16 RoPE, unquantized", aliases=("auto", "bfloat16")))
