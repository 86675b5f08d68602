"""The compiled writer's GPU arithmetic: the `float_codes.Arithmetic` of the Pallas Triton writer.

Each operation gives the bytes of its portable counterpart in `float_codes` (the writer tests
compare them) with fewer instructions: PTX division and e2m1 rounding through inline asm, the
hardware e4m3 convert, and Triton's NaN-ignoring max.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import compat, float_codes


def _b32_inline_asm(asm: str, *args):
    """One elementwise PTX `asm` over float32 `args` (broadcast together): its operands travel as
    b32 registers ($1, $2, ...), so the asm needs no float constraint letters; its result $0 comes
    back as int32 bits (int32, not uint32: Triton asm takes signless integers)."""
    args = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.float32) for a in args))
    (out,) = compat.pltriton.elementwise_inline_asm(
        asm, args=[lax.bitcast_convert_type(a, jnp.int32) for a in args],
        constraints=",".join(["=r"] + ["r"] * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.int32)])
    return out


# Correctly rounded float32 division in compiled Triton kernels.  Triton lowers `/` on f32 to
# `div.full.f32` (up to 2 ulp off), which changes quantized bytes; `div.rn.f32` is IEEE.
_DIV_RN_F32_ASM = ("{ .reg .f32 a, b, q; mov.b32 a, $1; mov.b32 b, $2; "
                   "div.rn.f32 q, a, b; mov.b32 $0, q; }")


def triton_ieee_divide(x, y):
    return lax.bitcast_convert_type(_b32_inline_asm(_DIV_RN_F32_ASM, x, y), jnp.float32)


# x / s for a whole tile from one reciprocal r = 1/s (correctly rounded, once per tile), with
# Markstein's correction: q = x*r is within an ulp of x/s, the residual e = s*q - x is then exact
# in an fma, and q - e*r rounds to the correctly rounded quotient.  Four FP instructions per
# element instead of div.rn.f32's reciprocal, refinement and range check.  The residual is
# negated (s*q - x, not x - s*q) so that x = -0 gives -0.  The residual is exact only while s*q
# keeps its low bits above the subnormal range; tiles with s < 2**-92 are therefore scaled by
# k = 2**64 (x*k and s*k, both exact) first.  Where a tiny x still loses bits, the quotient is
# far below 2**-10 and encodes as e4m3 zero either way.  Checked against the long division of
# `float_codes.xla_ieee_divide`, in an exact emulation, on 4 million random (x, scale) pairs and
# 72 million quotients within 3 ulps of every e4m3 value and midpoint; a GPU test runs such
# quotients through this function, and the writer tests compare its bytes with the reference.
_DIV_BY_RECIPROCAL_ASM = ("{ .reg .f32 x, k, s, r, q, e; mov.b32 x, $1; mov.b32 k, $2; mov.b32 s, $3; "
                          "mov.b32 r, $4; mul.rn.f32 x, x, k; mul.rn.f32 q, x, r; neg.f32 x, x; "
                          "fma.rn.f32 e, s, q, x; neg.f32 e, e; fma.rn.f32 q, e, r, q; mov.b32 $0, q; }")
_PRESCALE_BELOW = 2.0 ** -92


def triton_divide_by_scale(x, scale):
    """x / scale[..., None], correctly rounded, for a tile scale (>= FLT_MIN or +Inf, x finite
    where it is finite): see `float_codes.Arithmetic`."""
    k = jnp.where(scale < _PRESCALE_BELOW, 2.0 ** 64, 1.0).astype(jnp.float32)
    scaled = scale * k                                     # exact: a power of two
    reciprocal = triton_ieee_divide(1.0, scaled)           # 0 for an Inf scale
    # an Inf scale: s = 0 makes the residual -x and the quotient x * 0 (+-0, or NaN for NaN x)
    scaled = jnp.where(scaled == jnp.inf, 0.0, scaled)
    q = _b32_inline_asm(_DIV_BY_RECIPROCAL_ASM, x, *(v[..., None] for v in (k, scaled, reciprocal)))
    return lax.bitcast_convert_type(q, jnp.float32)


# float32 -> e2m1 codes with most of the work on the FMA pipe (the integer-ALU pipe limited the
# nvfp4 writer, measured with ncu).  From 1 up, Veltkamp's split h = c - (c - a) with
# c = a * (2**22 + 1) rounds |y| to 2 significant bits, ties to even, and (h >> 22) - 252 is
# the code (saturated at 7; an overflow of c, an Inf or a NaN gives a NaN h, which saturates
# too); below 1, a + 2**22 rounds to the 0.5 grid and its low bits count the half steps.  The
# `.rn` operations are never fused into an fma, which would break the split.  Checked against
# `float_codes.e2m1_sign_magnitude_codes` for every float32 bit pattern (a GPU test does it).
_E2M1_CODE_ASM = ("{ .reg .f32 y, a, c, d, h, l; .reg .b32 yb, hb, lb, s; .reg .pred small; "
                  "mov.b32 yb, $1; mov.b32 y, yb; abs.f32 a, y; "
                  "mul.rn.f32 c, a, 0f4A800002; sub.rn.f32 d, c, a; sub.rn.f32 h, c, d; "
                  "add.rn.f32 l, a, 0f4A800000; setp.lt.f32 small, a, 0f3F800000; "
                  "mov.b32 hb, h; mov.b32 lb, l; shr.u32 hb, hb, 22; sub.u32 hb, hb, 252; "
                  "min.u32 hb, hb, 7; sub.u32 lb, lb, 0x4A800000; selp.b32 hb, lb, hb, small; "
                  "shr.u32 s, yb, 28; and.b32 s, s, 8; or.b32 $0, hb, s; }")


def triton_e2m1_codes(y):
    """float32 -> e2m1 codes (int32 0..15), as `float_codes.e2m1_sign_magnitude_codes`: RNE,
    saturated to +-6, a NaN saturates and keeps its sign bit."""
    return _b32_inline_asm(_E2M1_CODE_ASM, y)


def triton_e4m3_bytes(x):
    """float32 -> e4m3fn bytes with the hardware convert (`cvt.rn.satfinite`): the same bytes as
    `float_codes.e4m3_bytes`, at a fraction of its integer work."""
    clipped = jnp.minimum(jnp.maximum(x, -448.0), 448.0)
    byts = lax.bitcast_convert_type(clipped.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.where(jnp.isnan(x), jnp.uint8(0x7F), byts)


def triton_abs_max(x):
    """max |x| over the last axis, NaN ignored, 0 if all NaN: Pallas Triton lowers `max` to
    `maxnumf` (the hardware's NaN-ignoring FMNMX), so no NaN test per element."""
    return jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 0.0)


GPU_ARITHMETIC = float_codes.Arithmetic(divide=triton_ieee_divide, divide_by_scale=triton_divide_by_scale,
                                        to_e4m3=triton_e4m3_bytes, to_e2m1=triton_e2m1_codes,
                                        abs_max=triton_abs_max)
