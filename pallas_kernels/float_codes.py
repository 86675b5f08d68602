"""Bit-level float codecs of the record formats, exact on every backend.

float32 division correctly rounded (`xla_ieee_divide`), float32 -> e4m3fn bytes and e2m1 codes
and back, little-endian byte packing; and `Arithmetic`, the set of those operations a compiled
kernel may replace with hardware instructions of the same results (`PORTABLE` is this module's).
Every function is written with operations that Pallas Triton can lower (shifts, masks,
reshapes, reductions over iota; no value slicing, no gathers).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_MAX = 448.0          # largest finite float8_e4m3fn
FP8_NAN_BYTE = 0x7F      # canonical float8_e4m3fn NaN
E2M1_MAX = 6.0           # largest float4_e2m1fn
FLT_MIN = float(np.finfo(np.float32).tiny)

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
def little_endian_bytes(words: jnp.ndarray, word_bytes: int) -> jnp.ndarray:
    """uint{8*word_bytes}[T, n] -> uint8[T, n * word_bytes], least significant byte first."""
    t, n = words.shape
    shifts = lax.broadcasted_iota(words.dtype, (1, 1, word_bytes), 2) * 8
    parts = (words[:, :, None] >> shifts) & 0xFF
    return parts.astype(jnp.uint8).reshape(t, n * word_bytes)


def nan_ignoring_amax(x: jnp.ndarray) -> jnp.ndarray:
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
    fewer integer instructions (`cache_writer.gpu_arithmetic.triton_e2m1_codes`); its inputs are products,
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
                      to_e2m1=e2m1_nibbles, abs_max=nan_ignoring_amax)


def le_words(byts: jnp.ndarray, dtype) -> jnp.ndarray:
    """uint8[T, n * k] -> dtype[T, n] little-endian (k = itemsize), by shifts: no value slicing."""
    k = jnp.dtype(dtype).itemsize
    word = {2: jnp.uint16, 4: jnp.uint32}[k]
    t, n = byts.shape
    parts = byts.reshape(t, n // k, k).astype(word)
    shifts = lax.broadcasted_iota(word, (1, 1, k), 2) * 8
    words = jnp.sum(parts << shifts, axis=-1).astype(word)
    return lax.bitcast_convert_type(words, dtype)


def e2m1_values(codes: jnp.ndarray) -> jnp.ndarray:
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
