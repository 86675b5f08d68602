"""Sparse-MLA attention over CKV records: the reference, the stock-DCP path and the full-CKV path.

Semantics per query row t and head h (upstream b12x reference):
  K_j = decode(records[indices[t, j]])  (nope ++ rope, 576 values);  V_j = K_j[:512]
  valid_j = j < counts[t] and 0 <= indices[t, j] < num_records
  s_j = sm_scale * <q[t, h], K_j> in float32, -inf where not valid
  out[t, h] = sum_j softmax(s)_j V_j  (zero when no j is valid)
  lse[t, h] = log(sum_j exp(s_j))    natural log, -inf when no j is valid
A NaN in q[t] or in a selected record makes that row's out and lse NaN, as a plain softmax
would: a row is empty (zeros, -inf) only when no index of it is valid.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ckv_jax import dcp_step, formats, placement, validation
from ckv_jax.placement import DCP_AXIS
from ckv_jax.step_plan import StepPlan
from pallas_kernels import selection
from pallas_kernels.sparse_mla_attention import SPARSE_MLA_ATTENTION, attention_blocked
from pallas_kernels.sparse_mla_attention import api as attention_op


def check_attention_inputs(q, records, indices, counts, sm_scale, fmt: formats.RecordFormat, *,
                           records_name: str = "records"):
    """Host checks of the attention inputs (shapes and dtypes; no device sync): q [T, H, 576] of a
    float dtype, `records` u8[N, R] of `fmt`, indices i32[T, K], counts i32[T], a positive finite
    sm_scale (when it is a host number)."""
    check_query(q, fmt)
    validation.check_records(fmt, records, name=records_name, rows="N")
    t = q.shape[0]
    check_rows("indices", indices, t)
    validation.check_array("counts", counts, (jnp.int32,), f"[{t}]", 1)
    if counts.shape[0] != t:
        raise ValueError(f"counts: expected int32[{t}] (one count per query token of q), "
                         f"got {validation.describe(counts)}")
    check_sm_scale(sm_scale)


def check_query(q, fmt: formats.RecordFormat):
    value_dim = fmt.layout.value_dim
    validation.check_array("q", q, (jnp.bfloat16, jnp.float16, jnp.float32), f"[T, H, {value_dim}]", 3)
    if q.shape[2] != value_dim:
        raise ValueError(f"q: expected [T, H, {value_dim}] ({fmt.nope_dim} latent + {fmt.rope_dim} RoPE), "
                         f"got {validation.describe(q)}")


def check_rows(name: str, rows, t: int):
    """int32[t, K] index rows, one per query token."""
    validation.check_array(name, rows, (jnp.int32,), f"[{t}, K]", 2)
    if rows.shape[0] != t:
        raise ValueError(f"{name}: expected int32[{t}, K] (one row per query token of q), "
                         f"got {validation.describe(rows)}")


def check_sm_scale(sm_scale):
    if isinstance(sm_scale, (int, float, np.floating, np.integer)) and not isinstance(sm_scale, bool):
        if not (math.isfinite(float(sm_scale)) and sm_scale > 0):
            raise ValueError(f"sm_scale: expected a positive finite number, got {sm_scale!r}")
    elif isinstance(sm_scale, bool) or not hasattr(sm_scale, "dtype"):
        raise TypeError(f"sm_scale: expected a number, got {type(sm_scale).__name__}")


IMPLEMENTATIONS = SPARSE_MLA_ATTENTION.names
# how record values reach the products (`keys=`): "exact" or "bf16" (see `sparse_mla_attention`)
KEYS = attention_op.KEYS


def attention_implementation(format: str | formats.RecordFormat, device: jax.Device, num_records: int,
                             num_tokens: int, num_heads: int, top_k: int, *,
                             implementation: str | Sequence[str] | None = None, interpret: bool = False,
                             keys: str = "exact") -> str:
    """The name of the implementation `sparse_mla_attention` (and `attend`) runs on `device` for
    records of `format` and this shape (num_heads: those of one call, a rank's own on the
    full-CKV path): for reports, e.g. which one `implementation=None` chose (with keys="bf16", the
    one that reads the dequantized bf16 records)."""
    layout = attention_op.keys_layout(formats.get(format).layout, keys)
    return attention_op.select(dcp_step.static_implementation(implementation), device, layout,
                               num_records * layout.record_bytes, num_tokens, num_heads, top_k, interpret=interpret).name


def attend(q, records, indices, counts, sm_scale, layout, *, implementation=None, interpret: bool = False,
           device=None, out_dtype=jnp.float32, keys: str = "exact"):
    """The attention body (no checks; usable inside jit and shard_map): q [T, H, 576], records
    u8[N, R] of `layout`, indices i32[T, K], counts i32[T] -> (out [T, H, 512] out_dtype, lse
    f32[T, H]), by the implementation `implementation` selects (None: the measured choice for
    the device, else the first of a GPU kernel and XLA that runs there; `device` is where it
    runs, default the default one; keys: see `sparse_mla_attention`)."""
    return attention_op.sparse_mla_attention(q, records, indices, counts, sm_scale, layout=layout,
                                             implementation=implementation, interpret=interpret,
                                             out_dtype=out_dtype, device=device, keys=keys)


def sparse_mla_attention(q, records, indices, counts, sm_scale, *, format: str | formats.RecordFormat,
                         implementation: str | Sequence[str] | None = None, interpret: bool = False,
                         keys: str = "exact"):
    """Sparse MLA over selected records, by a kernel that reads the records directly.

    The semantics of `sparse_mla_reference` (this module's docstring), computed with bf16
    products and float32 accumulation by a Pallas kernel (relative errors about 1e-2), or by
    the blocked XLA reference.

    Args:
      q: bf16|f16|f32[T, H, 576]; records: u8[N, R] of `format` (a gathered workspace, or a paged
        cache viewed flat with slots as indices); indices: i32[T, K]; counts: i32[T];
      sm_scale: positive and finite.
      implementation: None (the measured choice for the device, else a kernel where one runs
        compiled, XLA elsewhere), one of
        IMPLEMENTATIONS ("pallas_triton": the Triton kernel, every format; "pallas_mosaic_gpu":
        the warp-specialized wgmma kernel, every format, SM90+), or a sequence tried in order.
      interpret: run a Pallas kernel in interpret mode (CPU testing).
      keys: how fp8 and nvfp4 record values reach the products (bf16 records: the same either way).
        "exact": dequantized inside the kernel, every value exactly (fp8's tile scales multiply
        the float32 products).  "bf16": the whole table dequantized first into bf16 records (each
        value times its scale rounded to bf16; a temporary of N * 1152 bytes), then the attention
        over those: the arithmetic of FlashMLA's kernels and of vLLM's prefill on Hopper.  Meant
        for prefill over a gathered workspace, where each record is read by many query tokens
        and the kernels then read bf16 records, which need no conversion; not for decode over
        a paged cache, most of whose records no token selects.  nvfp4 values are exact in bf16,
        so there only the speed differs.  Where scores are large, fp8's rounding shows: in the
        tests' large-score case (lse up to 130) it moves the output by 1.5e-2 of a row's
        largest |V| and the lse by 1.3e-2 relative (3.7e-3 and 2.3e-3 at q's normal scale).
    Returns:
      out bf16[T, H, 512], lse f32[T, H].
    """
    fmt = formats.get(format)
    check_attention_inputs(q, records, indices, counts, sm_scale, fmt)
    attention_op.check_keys(keys)
    return _attention_jit(q, records, indices, counts, sm_scale, layout=fmt.layout,
                          implementation=dcp_step.static_implementation(implementation), interpret=interpret,
                          device=selection.device_of(records), keys=keys)


@functools.partial(jax.jit, static_argnames=("layout", "implementation", "interpret", "device", "keys"))
def _attention_jit(q, records, indices, counts, sm_scale, *, layout, implementation, interpret, device, keys):
    return attend(q, records, indices, counts, sm_scale, layout, implementation=implementation,
                  interpret=interpret, device=device, out_dtype=jnp.bfloat16, keys=keys)


def sparse_mla_reference(q, records, indices, counts, sm_scale, *, format: str | formats.RecordFormat):
    """Sparse MLA over selected records.

    Args:
      q: bf16|f16|f32[T, H, 576] absorbed query (512 nope ++ 64 rope).
      records: u8[N, R] records of `format` (a workspace, or a flattened paged cache).
      indices: i32[T, K] rows of `records`; -1 (or any row outside [0, N)) is a hole.
      counts: i32[T]: only columns j < counts[t] are considered.
      sm_scale: softmax scale, positive.
    Returns:
      out bf16[T, H, 512], lse f32[T, H] (natural log; -inf and zero output for an empty row;
      NaN where q's row or a selected record holds a NaN).
    """
    fmt = formats.get(format)
    check_attention_inputs(q, records, indices, counts, sm_scale, fmt)
    return _reference_jit(q, records, indices, counts, sm_scale, layout=fmt.layout)


@functools.partial(jax.jit, static_argnames=("layout",))
def _reference_jit(q, records, indices, counts, sm_scale, *, layout):
    out, lse = attention_blocked(q, records, indices, counts, sm_scale, layout=layout)
    return out.astype(jnp.bfloat16), lse


def merge_partials(out, lse, axis_name: str):
    """LSE merge across ranks of per-rank partials (out f32[T, H, V], lse f32[T, H]).

    lse_g = logsumexp_r lse_r; out = sum_r exp(lse_r - lse_g) out_r.  A NaN (or +inf) partial
    makes the merged row NaN, so a NaN in q or in a record is not dropped by the merge.
    """
    poisoned = lax.psum((jnp.isnan(lse) | (lse == jnp.inf)).astype(jnp.int32), axis_name) > 0
    lse = jnp.where(jnp.isnan(lse) | (lse == jnp.inf), -jnp.inf, lse)
    all_lse = lax.all_gather(lse, axis_name)                       # [D, T, H]
    m = jnp.max(all_lse, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(all_lse - m_safe), axis=0)
    lse_g = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + m_safe, -jnp.inf)
    weight = jnp.where(jnp.isfinite(lse) & jnp.isfinite(lse_g), jnp.exp(lse - lse_g), 0.0)
    merged = lax.psum(weight[..., None] * jnp.where(jnp.isfinite(lse)[..., None], out, 0.0), axis_name)
    return jnp.where(poisoned[..., None], jnp.nan, merged), jnp.where(poisoned, jnp.nan, lse_g)


def full_ckv_attention(q, workspace, indices, counts, sm_scale, *, format: str | formats.RecordFormat, mesh,
                       axis_name: str = DCP_AXIS, implementation: str | Sequence[str] | None = None,
                       interpret: bool = False, keys: str = "exact"):
    """Full-CKV path: each rank runs its own H/D query heads over the whole gathered workspace.

    q: bf16[T, H, 576] (H divisible by D); workspace: u8[D * P, R] replicated; indices/counts from
    `remap_topk`.  Returns out bf16[T, H, 512], lse f32[T, H] (heads rank-major, as q), sharded
    by heads on an Auto-typed copy of `mesh`, so they index like ordinary arrays.
    implementation, interpret, keys: the attention's, as for `sparse_mla_attention` (keys="bf16":
    every rank dequantizes the whole workspace once, then its heads read the bf16 records).
    """
    fmt = formats.get(format)
    d = placement.mesh_axis_size(mesh, axis_name)
    check_attention_inputs(q, workspace, indices, counts, sm_scale, fmt, records_name="workspace")
    attention_op.check_keys(keys)
    if q.shape[1] % d:
        raise ValueError(f"q: expected a head count divisible by the DCP size {d}, got {q.shape[1]}")
    mesh = placement.auto_axes(mesh)
    layout = fmt.layout

    def body(q_local, ws, idx, cnt):
        return attend(q_local, ws, idx, cnt, sm_scale, layout, implementation=implementation, interpret=interpret,
                      device=placement.mesh_device(mesh), out_dtype=jnp.bfloat16, keys=keys)

    specs = (P(None, axis_name), P(), P(), P())
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip((q, workspace, indices, counts), specs)]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                                 out_specs=(P(None, axis_name), P(None, axis_name)), check_vma=False))(*args)


def stock_dcp_attention(q, caches, block_table, topk, plan: StepPlan, sm_scale, *,
                        format: str | formats.RecordFormat, mesh, axis_name: str = DCP_AXIS,
                        implementation: str | Sequence[str] | None = None, interpret: bool = False):
    """Stock DCP path: every rank attends its own shard with all heads and the global top-k
    filtered to the entries it owns (as local physical slots, moved to the front: its attention
    walks only those, `dcp_step.owned_topk_slots`), then the LSE merge.

    caches: u8[D * num_blocks, block_size, R] sharded as for `all_gather_ckv`; topk: i32[T, K]
    global positions.  Returns out bf16[T, H, 512], lse f32[T, H], replicated.  The per-rank
    partials are float32 (`attend` with implementation, interpret as for `sparse_mla_attention`).
    """
    fmt = formats.get(format)
    placement.mesh_axis_size(mesh, axis_name, plan.world_size)
    dcp_step.check_caches(fmt, caches, plan)
    implementation = dcp_step.static_implementation(implementation)
    t = plan.num_tokens
    check_query(q, fmt)
    check_rows("topk", topk, q.shape[0])
    check_sm_scale(sm_scale)
    if q.shape[0] != t:
        raise ValueError(f"q: expected [{t}, H, {fmt.layout.value_dim}] (the plan's query tokens), "
                         f"got {validation.describe(q)}")
    dcp_step.check_block_table(plan, block_table)
    mesh = placement.auto_axes(mesh)
    rec_layout = fmt.layout

    def body(q_all, cache, tk, arrays):
        num_blocks, block_size, record_bytes = cache.shape
        slots, counts = dcp_step.owned_topk_slots(tk, arrays, lax.axis_index(axis_name), block_size)
        out, lse = attend(q_all, cache.reshape(num_blocks * block_size, record_bytes), slots, counts,
                          sm_scale, rec_layout, implementation=implementation, interpret=interpret,
                          device=placement.mesh_device(mesh))
        out, lse = merge_partials(out, lse, axis_name)
        return out.astype(jnp.bfloat16), lse

    specs = (P(), P(axis_name), P(), P())
    q, topk = placement.replicated(mesh, q, topk)
    args = (q, jax.device_put(caches, NamedSharding(mesh, specs[1])), topk,
            dcp_step.step_arrays(plan, block_table, mesh))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P()), check_vma=False))(*args)
