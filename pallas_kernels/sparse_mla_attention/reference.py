"""Sparse-MLA attention over native records: the pure-jnp reference, and the same blocked over
query tokens so that its temporaries stay bounded.

    q       bf16|f16|f32[T, H, nope_dim + rope_dim]   absorbed queries (NoPE then RoPE)
    records u8[N, R]        records of `layout` (a gathered workspace, or a paged cache viewed flat)
    indices i32[T, K]       rows of `records`; a hole is -1 or any row outside [0, N)
    counts  i32[T]          only columns j < counts[t] are considered
    sm_scale                softmax scale (a host number or a scalar array)
  -> out f32[T, H, nope_dim]: sum_j softmax(s)_j V_j with K_j = decode(records[indices[t, j]]),
                              V_j = K_j[:nope_dim], s_j = sm_scale * <q[t, h], K_j>; zeros for
                              a row without a valid entry
     lse f32[T, H]:           natural log of sum_j exp(s_j); -inf for a row without a valid entry
A NaN in q[t, h] or in a selected record makes out[t, h] and lse[t, h] NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import record_codec
from pallas_kernels.record_layout import RecordLayout

# float32 bytes of the decoded rows and scores the blocked reference holds per query token and head
_TEMPORARY_BUDGET = 1 << 30


def attention_reference(q, records, indices, counts, sm_scale, *, layout: RecordLayout):
    """The contract above, in float32 with HIGHEST-precision products: (out f32, lse f32)."""
    n = records.shape[0]
    k = indices.shape[1]
    valid = (jnp.arange(k)[None, :] < counts[:, None]) & (indices >= 0) & (indices < n)
    rows = jnp.where(valid, indices, 0)
    kv = record_codec.decode(layout, records[rows.reshape(-1)]).reshape(*rows.shape, layout.value_dim)
    kv = jnp.where(valid[..., None], kv, 0.0)        # holes may point at garbage (NaN * 0 = NaN)
    scores = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), kv,
                        precision=lax.Precision.HIGHEST) * sm_scale
    scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("thk,tkd->thd", p, kv[..., :layout.nope_dim], precision=lax.Precision.HIGHEST)
    # a row is empty only when no index is valid: a NaN score (from q or a record) stays NaN
    nonempty = jnp.broadcast_to(valid.any(axis=-1)[:, None], denom.shape)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.where(nonempty[..., None], out / jnp.where(jnp.isnan(denom), denom, safe)[..., None], 0.0)
    lse = jnp.where(nonempty, jnp.log(denom) + m[..., 0], -jnp.inf)
    return out, lse


def block_tokens(num_heads: int, top_k: int, value_dim: int) -> int:
    """Query tokens per block of `attention_blocked`: as many as keep the decoded rows
    (K x value_dim) and the scores (H x K) of a block, in float32, within about 1 GiB."""
    per_token = 4 * top_k * (value_dim + 2 * num_heads) + 1
    return max(1, _TEMPORARY_BUDGET // per_token)


@functools.partial(jax.jit, static_argnames=("layout", "block"))
def attention_blocked(q, records, indices, counts, sm_scale, *, layout: RecordLayout, block: int | None = None):
    """`attention_reference` over blocks of `block` query tokens (default `block_tokens`), one
    block at a time (`lax.map`), so its temporaries stay bounded whatever T is."""
    t, h, _ = q.shape
    block = block or block_tokens(h, indices.shape[1], layout.value_dim)
    if t <= block:
        return attention_reference(q, records, indices, counts, sm_scale, layout=layout)
    pad = -t % block
    q_b, idx_b, cnt_b = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, block, *a.shape[1:])
                         for a in (q, indices, counts))     # padded tokens have count 0: empty rows

    def one(args):
        return attention_reference(*args[:1], records, *args[1:], sm_scale, layout=layout)

    out, lse = lax.map(one, (q_b, idx_b, cnt_b))
    return out.reshape(-1, h, layout.nope_dim)[:t], lse.reshape(-1, h)[:t]
