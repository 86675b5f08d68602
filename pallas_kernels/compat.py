"""What differs between the supported jax versions (0.10.2 on CPU, 0.11.x on GPU) and installs, in
one place: which Pallas backends import and lower here, their compiler parameters, Mosaic GPU's
interpret mode and Triton's deprecation warning; and the package's one entry to jax internals,
the MLIR dialects that inline Mosaic GPU code is built with (`pallas_kernels.mosaic_ptx`)."""
from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp

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


def mosaic_gpu_load(ref, *, layout, optimized: bool = True):
    """`plgpu.load` of the whole of `ref` in `layout`: jax 0.10 takes the index as an argument,
    0.11 deprecates passing one (the ref is indexed with `.at` instead)."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def mlir_builders():
    """(ir, arith, gpu, llvm, memref): jaxlib's MLIR bindings, which Mosaic GPU builds with and
    `plgpu.inline_mgpu` bodies use (`pallas_kernels.mosaic_ptx`)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, llvm, memref
    return ir, arith, gpu, llvm, memref


def barrier_at(ref, index):
    """Barrier `index` of a `plgpu.Barrier` scratch: a scratch of one barrier is a ref of shape
    (1,) in jax 0.10 and of shape () in 0.11 (where `index` can only be 0)."""
    return ref if ref.shape == () else ref.at[index]


def on_gpu(device: jax.Device | None = None) -> bool:
    device = device or jax.devices()[0]
    return device.platform == "gpu"


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
