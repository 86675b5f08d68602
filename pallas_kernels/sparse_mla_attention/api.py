"""Sparse-MLA attention over native records: one `KernelOp` (SPARSE_MLA_ATTENTION).

Names: ``"pallas_triton"`` (the kernel that reads and dequantizes the records; GPU, interpret
mode on CPU for tests), ``"pallas_mosaic_gpu"`` (warp-specialized wgmma kernel; the three
record formats, SM90+, interpret mode on CPU) and ``"xla"`` (the reference blocked over
query tokens, any backend).  `implementation=None` takes the measured order for the device and size
(`pallas_kernels.tuning`, op "sparse_mla_attention"; no device kind has one yet), else
DEFAULT_ORDER: a kernel wherever one runs compiled (a GPU; the Mosaic GPU kernel only for
the records it reads), XLA elsewhere.  Triton comes first below MOSAIC_FIRST_HEADS heads of the
records' format; from there on, compiled on a GPU, the Mosaic GPU kernel does.  Its CTA always
computes 64 heads, so its time does not fall with fewer heads while Triton's does: on the H200
(BENCHMARKS.md, T = 4,096, top-k 2,048), fp8 runs at 231 against Triton's 84.5 TFLOP/s at
64 heads, 110 against 66.7 at 32 and 55.6 against 46.0 at 16 (5.2-5.5 ms a call at 16, 32 and 64
heads); nvfp4 at 239 against 70.4 at 64 and 61.7 against 32.2 at 16; bf16 (an earlier run) 80.4
against 57.4 at 16.  So it comes first from 16 heads for every format (fewer were not measured).
The work a measured table is keyed by (FLOPs) does not tell these apart (a decode step of 128
heads has less work than a prefill chunk of 16), so the head count decides, and a measured order
still comes first.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import compat, paged_gather, selection
from pallas_kernels.record_layout import RecordLayout
from pallas_kernels.sparse_mla_attention import pallas_mosaic_gpu, pallas_triton
from pallas_kernels.sparse_mla_attention.pallas_mosaic_gpu import MosaicAttentionTiles
from pallas_kernels.sparse_mla_attention.pallas_triton import AttentionTiles
from pallas_kernels.sparse_mla_attention.reference import attention_blocked

DEFAULT_ORDER = ("pallas_triton", "pallas_mosaic_gpu", "xla")
# the Mosaic GPU kernel first from this many heads a call on, by record layout kind (the same for
# every kind since nvfp4 is converted by the memory warpgroups too)
MOSAIC_FIRST_HEADS = {"fp8_tiles": 16, "bf16": 16, "nvfp4_groups": 16}
MANY_HEADS_ORDER = ("pallas_mosaic_gpu", "pallas_triton", "xla")


def reading(layout: RecordLayout) -> tuple[str, ...]:
    """The implementations that read records of `layout` (the Mosaic GPU kernel: the registered
    formats' bytes); the others are left out of the automatic order."""
    if layout in pallas_mosaic_gpu.LAYOUTS:
        return SPARSE_MLA_ATTENTION.names
    return tuple(name for name in SPARSE_MLA_ATTENTION.names if name != "pallas_mosaic_gpu")


def _run_triton(q, records, indices, counts, sm_scale, *, layout, out_dtype, interpret=False, config=None):
    if config is not None and not isinstance(config, AttentionTiles):
        raise TypeError(f"config: expected AttentionTiles for pallas_triton, got {type(config).__name__}")
    return pallas_triton.sparse_mla_attention_triton(q, records, indices, counts, sm_scale, layout=layout,
                                                     config=config or AttentionTiles(), out_dtype=out_dtype,
                                                     interpret=interpret)


def _run_mosaic(q, records, indices, counts, sm_scale, *, layout, out_dtype, interpret=False, config=None):
    if layout not in pallas_mosaic_gpu.LAYOUTS:
        raise ValueError(f"implementation: pallas_mosaic_gpu reads fp8_ds_mla, nvfp4_ds_mla and bf16 records, got "
                         f"records of layout {layout.kind} ({layout.record_bytes} bytes); use pallas_triton or xla")
    if config is not None and not isinstance(config, MosaicAttentionTiles):
        raise TypeError(f"config: expected MosaicAttentionTiles for pallas_mosaic_gpu, got {type(config).__name__}")
    params = compat.mosaic_gpu_interpret_params() if interpret else False
    if interpret and params is None:
        raise ValueError("interpret: this jax has no Mosaic GPU interpret mode")
    return pallas_mosaic_gpu.sparse_mla_attention_mosaic(
        q, records, indices, counts, sm_scale, layout=layout, config=config,
        out_dtype=out_dtype, interpret=params)


# Interpreted off a GPU, the Mosaic GPU kernel's warpgroups (three there) run as concurrent
# programs of the CPU client, which ran them together only with at least as many CPU devices: with
# one or two, jax 0.10's interpreter waited forever at the kernel's first barrier
INTERPRETED_WARPGROUPS = 3


def _mosaic_supported(device: jax.Device, nbytes: int, interpret: bool) -> tuple[bool, str]:
    """`selection.mosaic_gpu_supported`, and interpreted off a GPU, enough CPU devices."""
    ok, why = selection.mosaic_gpu_supported(device, nbytes, interpret)
    if ok and interpret and not compat.on_gpu(device):
        cpus = len(jax.devices("cpu"))
        if cpus < INTERPRETED_WARPGROUPS:
            return False, (f"interpreted on the CPU its {INTERPRETED_WARPGROUPS} warpgroups run as concurrent programs, "
                           f"which need as many CPU devices (set JAX_NUM_CPU_DEVICES={INTERPRETED_WARPGROUPS} before "
                           f"jax starts); this process has {cpus}")
    return ok, why


def _run_xla(q, records, indices, counts, sm_scale, *, layout, out_dtype, interpret=False, config=None):
    out, lse = attention_blocked(q, records, indices, counts, sm_scale, layout=layout)
    return out.astype(out_dtype), lse


SPARSE_MLA_ATTENTION = selection.KernelOp(
    "sparse_mla_attention",
    (selection.Implementation("pallas_triton", selection.triton_supported, _run_triton),
     selection.Implementation("pallas_mosaic_gpu", _mosaic_supported, _run_mosaic,
                              MosaicAttentionTiles),
     selection.Implementation("xla", selection.always_supported, _run_xla)),
    DEFAULT_ORDER, AttentionTiles)


def flops(num_tokens: int, num_heads: int, top_k: int, layout: RecordLayout) -> int:
    """2 T H K (value_dim + nope_dim): the products of the scores and of the values (FlashMLA's count)."""
    return 2 * num_tokens * num_heads * top_k * (layout.value_dim + layout.nope_dim)


# How record values reach the products: "exact" (each kernel dequantizes in its loop, and every
# value reaches the float32 products exactly: fp8's tile scales multiply the products), "bf16"
# (the table dequantized to bf16 records first, each value times its scale rounded to bf16, then
# the attention over bf16 records: FlashMLA's arithmetic, and vLLM's prefill path on Hopper)
KEYS = ("exact", "bf16")


def check_keys(keys):
    if keys not in KEYS:
        raise ValueError(f"keys: expected one of {KEYS}, got {keys!r}")


def keys_layout(layout: RecordLayout, keys: str) -> RecordLayout:
    """The layout of the records the kernels read for `keys`: the records' own, or with "bf16" the
    bf16 records their table is dequantized into."""
    check_keys(keys)
    return layout if keys == "exact" else pallas_mosaic_gpu.BF16


def bf16_records(records, *, layout: RecordLayout, implementation: str | Sequence[str] | None = None,
                 interpret: bool = False, device: jax.Device | None = None) -> jax.Array:
    """u8[N, R] records of a quantized `layout` -> u8[N, 1152]: the bf16 records of their values
    (`paged_gather.dequantize_records` with `implementation`, seen as bytes: no copy)."""
    table = paged_gather.dequantize_records(records, layout=layout, implementation=implementation,
                                            interpret=interpret, device=device)
    return lax.bitcast_convert_type(table, jnp.uint8).reshape(table.shape[0], pallas_mosaic_gpu.BF16.record_bytes)


def sparse_mla_attention(q, records, indices, counts, sm_scale, *, layout: RecordLayout,
                         implementation: str | Sequence[str] | None = None, interpret: bool = False,
                         config: AttentionTiles | MosaicAttentionTiles | None = None, out_dtype=jnp.bfloat16,
                         device: jax.Device | None = None, keys: str = "exact"):
    """Unchecked entry (`ckv_jax.sparse_mla_attention` checks): (out [T, H, nope_dim] out_dtype,
    lse f32[T, H]).  device: where it runs (default: the records'; pass it inside jit).
    keys: see KEYS; "bf16" with quantized records first dequantizes all N rows
    (`paged_gather.dequantize_records`, a bf16[N, 576] table of N * 1152 bytes): meant for
    prefill over a gathered workspace, where each record is read by many query tokens."""
    device = device or selection.device_of(records)
    read_layout = keys_layout(layout, keys)
    if read_layout != layout:
        records = bf16_records(records, layout=layout, interpret=interpret, device=device)
    run = select(implementation, device, read_layout, records.size, q.shape[0], q.shape[1], indices.shape[1],
                 interpret=interpret, config=config)
    return run(q, records, indices, counts, sm_scale, layout=read_layout, out_dtype=out_dtype, interpret=interpret)


def select(implementation: str | Sequence[str] | None, device: jax.Device, layout: RecordLayout, records_bytes: int,
           num_tokens: int, num_heads: int, top_k: int, *, interpret: bool = False,
           config: AttentionTiles | MosaicAttentionTiles | None = None) -> selection.Selected:
    """The implementation (and tiles) `sparse_mla_attention` runs for these records and this
    shape on `device`; the Mosaic GPU kernel is left out of the automatic order for records it
    does not read, and comes first (compiled on a GPU, without a measured order) from
    MOSAIC_FIRST_HEADS[layout.kind] heads on where a token's top-k fits its SMEM."""
    skip = tuple(name for name in SPARSE_MLA_ATTENTION.names if name not in reading(layout))
    many_heads = ("pallas_mosaic_gpu" not in skip and num_heads >= MOSAIC_FIRST_HEADS[layout.kind]
                  and pallas_mosaic_gpu.top_k_fits(layout, top_k) and compat.on_gpu(device) and not interpret)
    # the largest buffer a kernel addresses, in elements: the records' bytes, the queries and the
    # output, or the index rows; Triton pads the heads to a multiple of its program's (a power of
    # two no larger than this bound), the Mosaic kernel to a multiple of 8
    padded_heads = max(pallas_mosaic_gpu.HEADS_PER_CTA, 1 << max(num_heads - 1, 0).bit_length())
    largest = max(records_bytes, num_tokens * padded_heads * layout.value_dim, num_tokens * top_k)
    return SPARSE_MLA_ATTENTION.select(implementation, device, largest, flops(num_tokens, num_heads, top_k, layout),
                                       interpret=interpret, config=config, skip=skip,
                                       default_order=MANY_HEADS_ORDER if many_heads else None)
