"""Encode and decode native CKV records (one record per token).

A record holds one token's compressed latent ("NoPE", `nope_dim` values) and its RoPE key
(`rope_dim` bf16 values) in `record_bytes` bytes, laid out as `record_layout.RecordLayout`
segments; the encoder returns one uint8 array per segment, so that a kernel can store each
segment with a single power-of-two-wide store and the XLA reference can concatenate them.

Every function here is written with operations that Pallas Triton can lower (no value slicing,
no gathers, power-of-two shapes per segment), so kernels and the XLA reference share one
definition of the bytes.

Encodings (`RecordLayout.kind`):

* ``fp8_tiles`` (``fp8_ds_mla``, 656 B for 512 + 64):
  ``[0, nope)`` e4m3fn NoPE, ``[nope, nope + 4 * nope/128)`` float32 tile scales (tile t covers
  elements ``128t .. 128t+127``), then ``rope_dim`` bf16 RoPE bit-copied.
  ``scale_t = max(amax_t / 448, FLT_MIN)``; ``q = e4m3fn(x / scale_t)`` (IEEE division,
  round-to-nearest-even, saturated to +-448).
* ``nvfp4_groups`` (``nvfp4_ds_mla``, 432 B): ``[0, nope/2)`` packed e2m1 (element 2k in the
  low nibble of byte k, 2k+1 in the high nibble), ``nope/16`` e4m3fn group scales
  ``e4m3(amax_g / 6)``, ``pad_bytes`` zeros, then bf16 RoPE.  Elements are
  ``e2m1(x * (1 / float(scale_g)))`` (round-to-nearest-even, saturated to +-6).
* ``bf16`` (1152 B): ``nope + rope`` bf16 values, little-endian.

Special values (the same on every backend):

* NaN inputs are ignored by the scale's amax (as CUDA ``fmaxf`` does).  In fp8 a NaN element
  encodes as the canonical e4m3fn NaN byte 0x7F; in nvfp4, which has no NaN, as +6 (nibble 0x7).
* +-Inf in a tile makes its scale Inf (fp8) or 448 (nvfp4, saturated); finite elements of that
  tile then encode as (signed) zero, the Inf element as NaN (fp8) or +-6 (nvfp4).
* An all-zero nvfp4 group (scale byte 0, also when ``amax/6`` underflows e4m3) encodes as zero
  nibbles: its reciprocal is taken as 0, not Inf.
* float32 subnormal NoPE inputs are kept: the divisions are exact on every backend (see
  `xla_ieee_divide`), and where XLA on CPU flushes a subnormal elsewhere (in amax, or in the
  nvfp4 product) the encoded bytes are the same either way.  RoPE is bit-copied.
* `decode` multiplies in float32 on the backend: XLA on CPU flushes subnormal products to zero.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.float_codes import (E2M1_MAX, FLT_MIN, FP8_MAX, PORTABLE, Arithmetic, e2m1_values, e4m3_values,
                                        le_words, little_endian_bytes)
from pallas_kernels.record_layout import RecordLayout


# ------------------------------------------------------------------------------------------
# encode
# ------------------------------------------------------------------------------------------
def rope_bytes(k_pe: jnp.ndarray) -> jnp.ndarray:
    """bf16[T, rope_dim] -> uint8[T, 2 * rope_dim]: the RoPE segment (a bit copy, little-endian)."""
    return little_endian_bytes(lax.bitcast_convert_type(k_pe, jnp.uint16), 2)


def encode_segments(layout: RecordLayout, kv_c: jnp.ndarray, k_pe: jnp.ndarray,
                    arith: Arithmetic = PORTABLE) -> tuple[jnp.ndarray, ...]:
    """Encode T tokens into the bytes of each segment of `layout`.

    kv_c: bf16|f16|f32[T, nope_dim]; k_pe: bf16[T, rope_dim].
    Returns one uint8[T, segment.width] per entry of `layout.segments`, in order.
    """
    t = kv_c.shape[0]
    rope = rope_bytes(k_pe)
    if layout.kind == "bf16":
        nope = little_endian_bytes(lax.bitcast_convert_type(kv_c.astype(jnp.bfloat16), jnp.uint16), 2)
        return nope, rope

    x = kv_c.astype(jnp.float32).reshape(t, layout.num_blocks, layout.quant_block)
    amax = arith.abs_max(x)                                           # f32[T, blocks]
    if layout.kind == "fp8_tiles":
        scale = jnp.maximum(arith.divide(amax, FP8_MAX), FLT_MIN)       # f32[T, tiles]
        nope = arith.to_e4m3(arith.divide_by_scale(x, scale)).reshape(t, layout.nope_dim)
        scales = little_endian_bytes(lax.bitcast_convert_type(scale, jnp.uint32), 4)
        return nope, scales, rope

    # nvfp4_groups: elements 2k and 2k+1 share byte k
    pairs = kv_c.astype(jnp.float32).reshape(t, layout.nope_dim // 2, 2)
    return encode_nvfp4_segments(layout, pairs[:, :, 0], pairs[:, :, 1], rope, arith)


def encode_nvfp4_segments(layout: RecordLayout, even: jnp.ndarray, odd: jnp.ndarray, rope: jnp.ndarray,
                          arith: Arithmetic = PORTABLE) -> tuple[jnp.ndarray, ...]:
    """The nvfp4_groups segments from the NoPE split by parity (no interleaving step: the two
    nibbles of byte k come from even[:, k] and odd[:, k]).

    even, odd: f32[T, nope_dim / 2], elements 2k and 2k + 1; rope: uint8[T, 2 * rope_dim] (the
    RoPE segment's bytes).  Returns what `encode_segments` returns for the layout.
    """
    t = even.shape[0]
    half_group = layout.quant_block // 2
    even_g = even.reshape(t, layout.num_blocks, half_group)
    odd_g = odd.reshape(t, layout.num_blocks, half_group)
    amax = jnp.maximum(arith.abs_max(even_g), arith.abs_max(odd_g))   # f32[T, groups]
    scale_bytes = arith.to_e4m3(arith.divide(amax, E2M1_MAX))       # u8[T, groups], finite
    scale = e4m3_values(scale_bytes)
    inv_scale = jnp.where(scale == 0.0, 0.0, arith.divide(1.0, scale))[:, :, None]
    low, high = (arith.to_e2m1(x * inv_scale).astype(jnp.uint32).reshape(t, layout.nope_dim // 2)
                 for x in (even_g, odd_g))
    segments = [(low | (high << 4)).astype(jnp.uint8), scale_bytes]
    if layout.pad_bytes:
        segments.append(jnp.zeros((t, layout.pad_bytes), jnp.uint8))
    segments.append(rope)
    return tuple(segments)


def encode(layout: RecordLayout, kv_c: jnp.ndarray, k_pe: jnp.ndarray,
           arith: Arithmetic = PORTABLE) -> jnp.ndarray:
    """kv_c: bf16|f16|f32[T, nope_dim], k_pe: bf16[T, rope_dim] -> uint8[T, record_bytes]."""
    return jnp.concatenate(encode_segments(layout, kv_c, k_pe, arith), axis=-1)


# ------------------------------------------------------------------------------------------
# decode (Triton-lowerable once the record is split into segments)
# ------------------------------------------------------------------------------------------
def _interleave(even: jnp.ndarray, odd: jnp.ndarray) -> jnp.ndarray:
    """f32[T, n] twice -> f32[T, 2n] with even[:, k], odd[:, k] at 2k, 2k + 1 (a select over a
    broadcast, which Triton lowers, instead of a stack)."""
    t, n = even.shape
    first = lax.broadcasted_iota(jnp.int32, (1, 1, 2), 2) == 0
    return jnp.where(first, even[:, :, None], odd[:, :, None]).reshape(t, 2 * n)


def decode_segments(layout: RecordLayout, segments) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-segment bytes (as `encode_segments` returns them) -> (f32[T, nope_dim], bf16[T, rope_dim])."""
    seg = dict(zip((s.name for s in layout.segments), segments))
    rope = le_words(seg["rope_bf16"], jnp.bfloat16)
    if layout.kind == "bf16":
        return le_words(seg["nope_bf16"], jnp.bfloat16).astype(jnp.float32), rope
    if layout.kind == "nvfp4_groups":
        return _interleave(*decode_nvfp4_pairs(layout, seg["nope_e2m1"], seg["group_scales_e4m3"])), rope
    t = rope.shape[0]
    q = lax.bitcast_convert_type(seg["nope_e4m3"], jnp.float8_e4m3fn).astype(jnp.float32)
    scale = le_words(seg["tile_scales_f32"], jnp.float32)
    nope = (q.reshape(t, layout.num_blocks, layout.quant_block) * scale[:, :, None]).reshape(t, layout.nope_dim)
    return nope, rope


def decode_nvfp4_pairs(layout: RecordLayout, packed: jnp.ndarray, scale_bytes: jnp.ndarray):
    """(even, odd): f32[T, nope_dim / 2], the NoPE elements 2k and 2k + 1 of nvfp4_groups records,
    from their packed nibbles u8[T, nope_dim / 2] and group scales u8[T, groups] (no
    interleaving: byte k's low and high nibbles give even[:, k] and odd[:, k]).

    Each value is an e2m1 value (at most 2 significant bits) times an e4m3 scale (at most 4), so
    the float32 product is exact and its magnitude lies in [2**-10, 2688]: every finite value is
    exactly representable in bf16 (`exact_bf16_pair_words`).  A NaN scale byte gives NaN.
    """
    t = packed.shape[0]
    shape = (t, layout.num_blocks, layout.quant_block // 2)
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)[:, :, None]
    return tuple((e2m1_values(codes).reshape(shape) * scale).reshape(t, layout.nope_dim // 2)
                 for codes in (packed & 0xF, packed >> 4))


def split_even_odd(x: jnp.ndarray) -> jnp.ndarray:
    """[..., n] -> [..., n]: the even elements, then the odd ones.  The order in which attention
    kernels keep nvfp4 NoPE values (a byte's low and high nibbles land in the two halves), so
    queries go in in this order and outputs come out in it (`join_even_odd`)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def join_even_odd(x: jnp.ndarray) -> jnp.ndarray:
    """The inverse of `split_even_odd`: [..., n] as even elements then odd ones -> interleaved."""
    n = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, n // 2).swapaxes(-1, -2).reshape(x.shape)


def split_segments(layout: RecordLayout, records: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """uint8[T, record_bytes] -> one uint8[T, width] per segment (XLA slicing)."""
    return tuple(records[:, s.offset:s.offset + s.width] for s in layout.segments)


def decode(layout: RecordLayout, records: jnp.ndarray) -> jnp.ndarray:
    """uint8[T, record_bytes] -> float32[T, nope_dim + rope_dim] (dequantized NoPE ++ RoPE)."""
    nope, rope = decode_segments(layout, split_segments(layout, records))
    return jnp.concatenate([nope, rope.astype(jnp.float32)], axis=-1)


def dequantize_bf16(layout: RecordLayout, records: jnp.ndarray) -> jnp.ndarray:
    """uint8[T, record_bytes] -> bfloat16[T, nope_dim + rope_dim]; NoPE rounded once, RoPE bit-exact."""
    nope, rope = decode_segments(layout, split_segments(layout, records))
    return jnp.concatenate([nope.astype(jnp.bfloat16), rope], axis=-1)
