"""What differs between the supported jax versions (0.10.2 on CPU, 0.11.x on GPU), in one place."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

try:
    from jax.experimental.pallas import triton as pltriton
    TRITON_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the jaxlib build
    pltriton, TRITON_IMPORT_ERROR = None, f"{type(e).__name__}: {e}"

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MOSAIC_GPU_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the jaxlib build
    plgpu, MOSAIC_GPU_IMPORT_ERROR = None, f"{type(e).__name__}: {e}"


def triton_compiler_params(num_warps: int, num_stages: int = 1):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def silence_triton_deprecation():
    """jax >= 0.11 warns on every Pallas Triton lowering; the backend is still supported there."""
    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecated.*", category=DeprecationWarning)


def mosaic_gpu_interpret_params():
    """Mosaic GPU's interpret-mode parameters (a private module in jax 0.10-0.11), or None."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams()


def on_gpu(device: jax.Device | None = None) -> bool:
    device = device or jax.devices()[0]
    return device.platform == "gpu"


# Correctly rounded float32 division in compiled Triton kernels.  Triton lowers `/` on f32 to
# `div.full.f32` (up to 2 ulp off), which changes quantized bytes; `div.rn.f32` is IEEE.  The
# operands travel as b32 registers so the asm needs no float constraint letters.
_DIV_RN_F32_ASM = ("{ .reg .f32 a, b, q; mov.b32 a, $1; mov.b32 b, $2; "
                   "div.rn.f32 q, a, b; mov.b32 $0, q; }")


def triton_ieee_divide(x, y):
    x, y = jnp.broadcast_arrays(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    (q,) = pltriton.elementwise_inline_asm(
        _DIV_RN_F32_ASM,
        args=[lax.bitcast_convert_type(x, jnp.int32), lax.bitcast_convert_type(y, jnp.int32)],
        constraints="=r,r,r", pack=1,     # int32, not uint32: Triton asm takes signless integers
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
    return lax.bitcast_convert_type(q, jnp.float32)


def triton_e4m3_bytes(x):
    """float32 -> e4m3fn bytes with the hardware convert (`cvt.rn.satfinite`): the same bytes as
    `record_codec.e4m3_bytes`, at a fraction of its integer work."""
    clipped = jnp.minimum(jnp.maximum(x, -448.0), 448.0)
    byts = lax.bitcast_convert_type(clipped.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.where(jnp.isnan(x), jnp.uint8(0x7F), byts)


def triton_abs_max(x):
    """max |x| over the last axis, NaN ignored, 0 if all NaN: Pallas Triton lowers `max` to
    `maxnumf` (the hardware's NaN-ignoring FMNMX), so no NaN test per element."""
    return jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 0.0)


@functools.cache
def cuda_lowering_available(backend: str) -> tuple[bool, str]:
    """Whether a tiny kernel of `backend` ('triton' or 'mosaic_gpu') lowers for CUDA here."""
    from jax.experimental import pallas as pl
    try:
        if backend == "triton":
            if pltriton is None:
                return False, TRITON_IMPORT_ERROR or "not importable"

            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] + 1

            f = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
                               compiler_params=triton_compiler_params(1))
        elif backend == "mosaic_gpu":
            if plgpu is None:
                return False, MOSAIC_GPU_IMPORT_ERROR or "not importable"

            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] + 1

            f = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((128,), jnp.int32))
        else:
            raise ValueError(f"backend: expected 'triton' or 'mosaic_gpu', got {backend!r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = jax.ShapeDtypeStruct((16 if backend == "triton" else 128,), jnp.int32)
            jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
        return True, "lowers for cuda"
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
