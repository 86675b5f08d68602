"""Byte layouts and codecs of native CKV records (one record per token).

A record holds one token's compressed latent ("NoPE", `nope_dim` values) and its RoPE key
(`rope_dim` bf16 values) in `record_bytes` bytes.  The layout is a list of byte segments; the
encoder returns one uint8 array per segment, so that a kernel can store each segment with a
single power-of-two-wide store and the XLA reference can concatenate them.

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

import dataclasses
from typing import Callable, Literal

import jax.numpy as jnp
import numpy as np
from jax import lax


FP8_MAX = 448.0          # largest finite float8_e4m3fn
FP8_NAN_BYTE = 0x7F      # canonical float8_e4m3fn NaN
E2M1_MAX = 6.0           # largest float4_e2m1fn
FLT_MIN = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a record: bytes ``[offset, offset + width)``."""
    name: str
    offset: int
    width: int


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one record kind.  ``quant_block`` is the tile (fp8) or group (nvfp4) size."""
    kind: Literal["fp8_tiles", "nvfp4_groups", "bf16"]
    nope_dim: int = 512
    rope_dim: int = 64
    quant_block: int = 0
    pad_bytes: int = 0

    def __post_init__(self):
        if self.kind not in ("fp8_tiles", "nvfp4_groups", "bf16"):
            raise ValueError(f"kind: expected 'fp8_tiles', 'nvfp4_groups' or 'bf16', got {self.kind!r}")
        if self.kind != "bf16" and (self.quant_block <= 0 or self.nope_dim % self.quant_block):
            raise ValueError(f"quant_block: expected a positive divisor of nope_dim={self.nope_dim}, "
                             f"got {self.quant_block}")
        if self.kind == "nvfp4_groups" and self.quant_block % 2:
            raise ValueError(f"quant_block: nvfp4 packs two elements per byte, so groups have an even "
                             f"size, got {self.quant_block}")

    @property
    def num_blocks(self) -> int:
        return self.nope_dim // self.quant_block if self.quant_block else 0

    @property
    def segments(self) -> tuple[Segment, ...]:
        rope_bytes = 2 * self.rope_dim
        if self.kind == "fp8_tiles":
            widths = [("nope_e4m3", self.nope_dim), ("tile_scales_f32", 4 * self.num_blocks),
                      ("rope_bf16", rope_bytes)]
        elif self.kind == "nvfp4_groups":
            widths = [("nope_e2m1", self.nope_dim // 2), ("group_scales_e4m3", self.num_blocks),
                      ("pad", self.pad_bytes), ("rope_bf16", rope_bytes)]
        else:
            widths = [("nope_bf16", 2 * self.nope_dim), ("rope_bf16", rope_bytes)]
        out, offset = [], 0
        for name, width in widths:
            if width:
                out.append(Segment(name, offset, width))
                offset += width
        return tuple(out)

    @property
    def record_bytes(self) -> int:
        last = self.segments[-1]
        return last.offset + last.width

    @property
    def value_dim(self) -> int:
        """Values per decoded record: NoPE then RoPE."""
        return self.nope_dim + self.rope_dim

    def segment(self, name: str) -> Segment:
        for seg in self.segments:
            if seg.name == name:
                return seg
        raise KeyError(name)


# ------------------------------------------------------------------------------------------
# IEEE division.  A float `/` is not portable here: XLA rewrites `x / broadcast(s)` and
# `x / constant` into `x * (1 / s)`, XLA on GPU emits an approximate division, and XLA on CPU
# flushes subnormal operands.  Each changes the last bit of some quotients, and with it the
# stored scales and quantized bytes.  `xla_ieee_divide` therefore divides the significands with
# integer long division, which every backend executes exactly.  Compiled Triton kernels pass
# their own (`Arithmetic`: the `div.rn.f32` instruction, and a per-tile reciprocal with an fma
# correction for the fp8 elements).
# ------------------------------------------------------------------------------------------
_QUOTIENT_BITS = 26       # 24 significand bits, a guard bit, and one more for quotients < 1


def _unpack_f32(bits: jnp.ndarray):
    """uint32 bits of finite non-zero floats -> (significand in [2**23, 2**24), unbiased exponent)."""
    exp_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = bits & 0x7FFFFF
    # subnormals: shift the leading one up to bit 23
    shift = jnp.where(exp_field == 0, lax.clz(frac.astype(jnp.int32) | 1) - 8, 0)
    sig = jnp.where(exp_field == 0, frac << shift.astype(jnp.uint32), frac | 0x800000)
    exp = jnp.where(exp_field == 0, -126 - shift, exp_field - 127)
    return sig, exp


def xla_ieee_divide(x, y) -> jnp.ndarray:
    """float32 x / y, correctly rounded (round-to-nearest-even, subnormals kept) on every backend."""
    x, y = jnp.broadcast_arrays(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    xb, yb = lax.bitcast_convert_type(x, jnp.uint32), lax.bitcast_convert_type(y, jnp.uint32)
    sign = (xb ^ yb) & jnp.uint32(0x80000000)
    x_sig, x_exp = _unpack_f32(xb)
    y_sig, y_exp = _unpack_f32(yb)

    quotient = jnp.zeros_like(xb)
    rem = x_sig
    for _ in range(_QUOTIENT_BITS):              # restoring long division, one bit per step
        bit = rem >= y_sig
        quotient = (quotient << 1) | bit.astype(jnp.uint32)
        rem = jnp.where(bit, rem - y_sig, rem) << 1
    at_least_one = quotient >= (1 << (_QUOTIENT_BITS - 1))
    exp = x_exp - y_exp - jnp.where(at_least_one, 0, 1)
    # bits of the quotient below the 24-bit significand, plus those a subnormal result loses
    drop = jnp.where(at_least_one, 2, 1) + jnp.clip(-126 - exp, 0, _QUOTIENT_BITS)
    drop = drop.astype(jnp.uint32)
    kept = quotient >> drop
    guard = (quotient >> (drop - 1)) & 1
    sticky = ((quotient & ((jnp.uint32(1) << (drop - 1)) - 1)) != 0) | (rem != 0)
    round_up = (guard == 1) & (sticky | ((kept & 1) == 1))
    mag = kept + round_up.astype(jnp.uint32)      # a carry moves into the exponent field
    normal_bits = ((exp + 126).astype(jnp.uint32) << 23) + mag
    mag = jnp.where(exp < -126, mag, normal_bits)
    mag = jnp.where(exp > 127, jnp.uint32(0x7F800000), mag)

    x_abs, y_abs = xb & jnp.uint32(0x7FFFFFFF), yb & jnp.uint32(0x7FFFFFFF)
    x_nan, y_nan = x_abs > 0x7F800000, y_abs > 0x7F800000
    x_inf, y_inf = x_abs == 0x7F800000, y_abs == 0x7F800000
    x_zero, y_zero = x_abs == 0, y_abs == 0
    mag = jnp.where(x_zero | y_inf, jnp.uint32(0), mag)
    mag = jnp.where(x_inf | y_zero, jnp.uint32(0x7F800000), mag)
    nan = x_nan | y_nan | (x_zero & y_zero) | (x_inf & y_inf)
    out = jnp.where(nan, jnp.uint32(0x7FC00000), mag | sign)
    return lax.bitcast_convert_type(out, jnp.float32)


# ------------------------------------------------------------------------------------------
# bit and byte helpers (Triton-lowerable: shifts, masks, reshapes, reductions over iota)
# ------------------------------------------------------------------------------------------
def _little_endian_bytes(words: jnp.ndarray, word_bytes: int) -> jnp.ndarray:
    """uint{8*word_bytes}[T, n] -> uint8[T, n * word_bytes], least significant byte first."""
    t, n = words.shape
    shifts = lax.broadcasted_iota(words.dtype, (1, 1, word_bytes), 2) * 8
    parts = (words[:, :, None] >> shifts) & 0xFF
    return parts.astype(jnp.uint8).reshape(t, n * word_bytes)


def _nan_ignoring_amax(x: jnp.ndarray) -> jnp.ndarray:
    """max |x| over the last axis; NaN counts as 0 (CUDA fmaxf semantics)."""
    return jnp.max(jnp.where(jnp.isnan(x), 0.0, jnp.abs(x)), axis=-1)


def e4m3_bytes(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> float8_e4m3fn bytes: round-to-nearest-even, saturated to +-448, NaN -> 0x7F.

    Integer arithmetic on the float32 bits, so every backend gives the same bytes (a float
    convert is not portable: XLA on GPU rounds some values differently from the hardware cvt).
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = (bits >> 24).astype(jnp.uint8) & 0x80
    mag = bits & jnp.uint32(0x7FFFFFFF)
    exp = (mag >> 23).astype(jnp.int32) - 127
    sig = (mag & 0x7FFFFF) | 0x800000
    # keep 3 fraction bits of a normal e4m3 (exponent >= -6), fewer for its subnormals
    shift = jnp.clip(20 + jnp.maximum(-6 - exp, 0), 0, 31).astype(jnp.uint32)
    q = sig >> shift
    rem = sig & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.uint32)
    # normal: exponent field exp + 7 over the 3 fraction bits of q in [8, 16] (a carry to 16
    # moves into the exponent); subnormal: q counts 2**-9 steps (q == 8 is the smallest normal)
    normal = ((exp + 6) << 3).astype(jnp.uint32) + q
    code = jnp.where(exp < -6, q, normal).astype(jnp.uint8)
    code = jnp.where(mag >= jnp.uint32(0x43E00000), jnp.uint8(0x7E), code)   # |x| >= 448
    return jnp.where(mag > jnp.uint32(0x7F800000), jnp.uint8(FP8_NAN_BYTE), code | sign)


def e4m3_values(byts: jnp.ndarray) -> jnp.ndarray:
    """float8_e4m3fn bytes (finite) -> float32 values, exactly, by integer assembly."""
    b = byts.astype(jnp.uint32)
    exp_field = (b >> 3) & 0xF
    frac = b & 0x7
    normal = lax.bitcast_convert_type(((exp_field + 120) << 23) | (frac << 20), jnp.float32)
    subnormal = frac.astype(jnp.float32) * (2.0 ** -9)
    mag = jnp.where(exp_field == 0, subnormal, normal)
    return jnp.where((b & 0x80) != 0, -mag, mag)


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """The operations whose float implementations differ between backends.

    `divide(x, y)`: correctly rounded float32 division; `divide_by_scale(x, scale)`:
    ``x / scale[..., None]`` for a tile of x and its fp8 scale (``max(amax / 448, FLT_MIN)``
    or +Inf; x is finite where the scale is), whose e4m3 bytes must equal those of the correctly
    rounded quotient; `to_e4m3(x)`: float32 -> e4m3fn bytes (RNE, saturated, NaN -> 0x7F);
    `to_e2m1(x)`: float32 -> e2m1 codes 0..15 as any unsigned integer type (RNE, saturated,
    NaN -> 0x7); `abs_max(x)`: max |x| over the last axis, NaN ignored, 0 for none.  The
    defaults are exact on every backend; compiled GPU kernels substitute hardware instructions
    and hardware NaN rules with the same results.
    """
    divide: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]
    divide_by_scale: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]
    to_e4m3: Callable[[jnp.ndarray], jnp.ndarray]
    to_e2m1: Callable[[jnp.ndarray], jnp.ndarray]
    abs_max: Callable[[jnp.ndarray], jnp.ndarray]


def e2m1_sign_magnitude_codes(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> float4_e2m1fn codes (uint32 0..15): RNE, saturated to +-6; a NaN saturates like
    an Inf and keeps its sign bit (0x7, or 0xF when the sign bit is set).

    Magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} have codes 0..7.  From 1 up the code is the float32
    exponent and first fraction bit, rounded to nearest even on the bits (saturating at 7); below
    1, where e2m1 steps by 0.5, the float adder rounds: 2**22 + |x| is the nearest multiple of 0.5
    (ties to even), so its low significand bits count the half steps.  This takes about half the
    instructions of comparing against the seven midpoints, and gives the same codes for every
    float32 (checked for all 2**32 bit patterns when it was written).  The codes stay 32-bit, so a
    kernel packs them without byte conversions.  The compiled writer computes the same codes with
    fewer integer instructions (`_pallas_compat.triton_e2m1_codes`); its inputs are products,
    which the GPU returns as the positive canonical NaN, so the sign-keeping NaN rule is never
    seen there.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    mag = bits & jnp.uint32(0x7FFFFFFF)
    # bit 22 is the first fraction bit; (exponent field << 1 | bit) - 252 is the code of 1.0 .. 6.0,
    # the -252 folded into the add before the shift (modulo 2**32): from 1.0 up the true sum is
    # positive, below 1.0 it is not selected
    lsb = (mag >> 22) & 1
    from_one = jnp.minimum((mag + lsb + jnp.uint32((0x1FFFFF - (252 << 22)) % 2 ** 32)) >> 22, jnp.uint32(7))
    below_one = lax.bitcast_convert_type(jnp.abs(x) + 4194304.0, jnp.uint32) - jnp.uint32(0x4A800000)
    code = jnp.where(mag < jnp.uint32(0x3F800000), below_one, from_one)
    return code | ((bits >> 28) & 8)


def e2m1_nibbles(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> float4_e2m1fn codes (uint8 0..15): RNE, saturated to +-6, NaN -> +6 (0x7)."""
    nan = (lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
    return jnp.where(nan, jnp.uint32(0x7), e2m1_sign_magnitude_codes(x)).astype(jnp.uint8)


def _divide_by_scale(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    return xla_ieee_divide(x, scale[..., None])


PORTABLE = Arithmetic(divide=xla_ieee_divide, divide_by_scale=_divide_by_scale, to_e4m3=e4m3_bytes,
                      to_e2m1=e2m1_nibbles, abs_max=_nan_ignoring_amax)


# ------------------------------------------------------------------------------------------
# encode
# ------------------------------------------------------------------------------------------
def rope_bytes(k_pe: jnp.ndarray) -> jnp.ndarray:
    """bf16[T, rope_dim] -> uint8[T, 2 * rope_dim]: the RoPE segment (a bit copy, little-endian)."""
    return _little_endian_bytes(lax.bitcast_convert_type(k_pe, jnp.uint16), 2)


def encode_segments(layout: RecordLayout, kv_c: jnp.ndarray, k_pe: jnp.ndarray,
                    arith: Arithmetic = PORTABLE) -> tuple[jnp.ndarray, ...]:
    """Encode T tokens into the bytes of each segment of `layout`.

    kv_c: bf16|f16|f32[T, nope_dim]; k_pe: bf16[T, rope_dim].
    Returns one uint8[T, segment.width] per entry of `layout.segments`, in order.
    """
    t = kv_c.shape[0]
    rope = rope_bytes(k_pe)
    if layout.kind == "bf16":
        nope = _little_endian_bytes(lax.bitcast_convert_type(kv_c.astype(jnp.bfloat16), jnp.uint16), 2)
        return nope, rope

    x = kv_c.astype(jnp.float32).reshape(t, layout.num_blocks, layout.quant_block)
    amax = arith.abs_max(x)                                           # f32[T, blocks]
    if layout.kind == "fp8_tiles":
        scale = jnp.maximum(arith.divide(amax, FP8_MAX), FLT_MIN)       # f32[T, tiles]
        nope = arith.to_e4m3(arith.divide_by_scale(x, scale)).reshape(t, layout.nope_dim)
        scales = _little_endian_bytes(lax.bitcast_convert_type(scale, jnp.uint32), 4)
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
def le_words(byts: jnp.ndarray, dtype) -> jnp.ndarray:
    """uint8[T, n * k] -> dtype[T, n] little-endian (k = itemsize), by shifts: no value slicing."""
    k = jnp.dtype(dtype).itemsize
    word = {2: jnp.uint16, 4: jnp.uint32}[k]
    t, n = byts.shape
    parts = byts.reshape(t, n // k, k).astype(word)
    shifts = lax.broadcasted_iota(word, (1, 1, k), 2) * 8
    words = jnp.sum(parts << shifts, axis=-1).astype(word)
    return lax.bitcast_convert_type(words, dtype)


def _e2m1_values(codes: jnp.ndarray) -> jnp.ndarray:
    """float4_e2m1fn codes (uint8 0..15) -> float32 {0, .5, 1, 1.5, 2, 3, 4, 6} with sign.

    Assembled from integer bits, without an int-to-float conversion (on the GPU conversions run on
    a narrow pipe, which limited the dequantizing gather): codes 0 and 1 are 0 and 0.5
    (0x3F000000); from 2 up, ``(code << 22) + 0x3F000000`` puts the code's two high bits in the
    exponent above 0.5 and its low bit in the first fraction bit.  The sign goes in as a bit
    (compiled Triton negates as 0 - x, which loses the sign of -0).
    """
    c = (codes & 0x7).astype(jnp.uint32)
    mag = jnp.where(c < 2, c * jnp.uint32(0x3F000000), (c << 22) + jnp.uint32(0x3F000000))
    sign = (codes & 0x8).astype(jnp.uint32) << 28
    return lax.bitcast_convert_type(mag | sign, jnp.float32)


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
    return tuple((_e2m1_values(codes).reshape(shape) * scale).reshape(t, layout.nope_dim // 2)
                 for codes in (packed & 0xF, packed >> 4))


def exact_bf16_pair_words(even: jnp.ndarray, odd: jnp.ndarray) -> jnp.ndarray:
    """f32[T, n] twice -> uint32[T, n]: bf16 pairs, even in the low half (the little-endian bytes
    of bf16[T, 2n] with the two interleaved), by keeping the top 16 bits of each float32.

    Only for values exactly representable in bf16, where that equals rounding, and quiet NaNs
    (a NaN with only low payload bits would become Inf): true of `decode_nvfp4_pairs`' output.
    It replaces two float conversions per pair with a shift and a mask.
    """
    low = lax.bitcast_convert_type(even, jnp.uint32) >> 16
    high = lax.bitcast_convert_type(odd, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return low | high


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
