"""Pallas Triton sparse-MLA attention that reads the native records and dequantizes in the kernel.

Grid (T, H / block_h): program (t, b) holds heads [b * block_h, (b + 1) * block_h) of query
token t.  All heads of a token share its top-k rows, so the heads are the MMA's M dimension: per
tile of `block_k` indices the program gathers those rows' records (one masked 2-D load per
segment, rows of holes masked to zeros), dequantizes them to bf16 (fp8: the e4m3 values, their
float32 tile scales read per row; nvfp4: e2m1 times the e4m3 group scale, kept as its even and
odd elements; bf16: as is), computes the scores of the NoPE and RoPE parts with bf16 MMAs with float32 accumulation,
and folds them into an online softmax whose values V are the tile's NoPE part.  The loop stops
after the token's `counts[t]` columns.

Every record value reaches the MMAs exactly: bf16 and nvfp4 values are bf16 numbers, and fp8's
are kept as their e4m3 values (exact in bf16) with the float32 tile scale applied to the products
(the scores of each 128-element tile, and the softmax weights of its values).  Rounding the
dequantized fp8 values to bf16 instead costs about 2**-9 of each score, which the softmax turns
into errors of several percent once scores reach tens.

nvfp4 keeps each record's NoPE as its even and odd elements (no interleaving in the kernel): the
queries come in split the same way (q[..., 0::2] then q[..., 1::2]) and the output leaves in
that order; `sparse_mla_attention_triton` permutes both outside the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, float_codes, record_codec, selection
from pallas_kernels.record_layout import RecordLayout


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionTiles:
    # 64 heads x 64 rows: 80 TFLOP/s at 64 heads on the H200, 32 x 32 46 (BENCHMARKS.md)
    block_h: int = 64           # query heads per program (the MMA's M; at least 16)
    block_k: int = 64           # top-k rows per step of the online softmax (at least 16)
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        selection.check_power_of_two_fields(self, ("block_h", "block_k", "num_warps", "num_stages"))
        if self.block_h < 16 or self.block_k < 16:
            raise ValueError(f"block_h, block_k: expected at least 16 (the MMA's smallest tile), "
                             f"got {self.block_h}, {self.block_k}")


def _dot(a, b, trans_b: bool = False):
    """a @ b (a @ b.T with trans_b) with float32 accumulation: one MMA in the Triton lowering."""
    return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), preferred_element_type=jnp.float32)


def _scalar(ref, index):
    """ref[index] of a 1-D ref as a scalar (Triton loads vectors; a 1-element one is summed)."""
    return jnp.sum(compat.pltriton.load(ref.at[pl.ds(index, 1)]))


def nope_parts(layout: RecordLayout) -> int:
    """How many column parts the kernel keeps a record's NoPE in: fp8 one per scale tile (its
    e4m3 values are exact in bf16 and the float32 tile scale is applied to the products), nvfp4
    its even and odd elements, bf16 one."""
    if layout.kind == "fp8_tiles":
        return layout.num_blocks
    return 2 if layout.kind == "nvfp4_groups" else 1


def _dequantized_tile(rec_ref, rows, valid, rows_t, valid_t, layout: RecordLayout):
    """(parts, rope) of the records at rows [BK, 1] (the same rows as rows_t [1, BK]), holes
    (valid False) as zeros.  parts: one (bf16[BK, width] values, f32[1, BK] per-row factor or
    None) per NoPE part (`nope_parts`), exactly the record's values once multiplied by the factor;
    rope: bf16[BK, rope_dim]."""
    block_k = rows.shape[0]

    def load(offset, width):
        cols = offset + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        return compat.pltriton.load(rec_ref.at[rows, cols], mask=jnp.broadcast_to(valid, (block_k, width)), other=0)

    rope_seg = layout.segment("rope_bf16")
    rope = float_codes.le_words(load(rope_seg.offset, rope_seg.width), jnp.bfloat16)
    if layout.kind == "bf16":
        nope = layout.segment("nope_bf16")
        return [(float_codes.le_words(load(nope.offset, nope.width), jnp.bfloat16), None)], rope
    if layout.kind == "nvfp4_groups":
        packed, scales = layout.segment("nope_e2m1"), layout.segment("group_scales_e4m3")
        even, odd = record_codec.decode_nvfp4_pairs(layout, load(packed.offset, packed.width),
                                                    load(scales.offset, scales.width))
        return [(even.astype(jnp.bfloat16), None), (odd.astype(jnp.bfloat16), None)], rope   # exact
    # fp8: e4m3 tile values (exact in bf16) and each row's float32 tile scale, read as [1, BK]
    values, scales = layout.segment("nope_e4m3"), layout.segment("tile_scales_f32")
    byte = lax.broadcasted_iota(jnp.int32, (4, 1), 0)
    parts = []
    for tile in range(layout.num_blocks):
        e4m3 = load(values.offset + tile * layout.quant_block, layout.quant_block)
        k = lax.bitcast_convert_type(e4m3, jnp.float8_e4m3fn).astype(jnp.float32).astype(jnp.bfloat16)
        scale_bytes = compat.pltriton.load(rec_ref.at[rows_t, scales.offset + 4 * tile + byte],
                                           mask=jnp.broadcast_to(valid_t, (4, block_k)), other=0)
        bits = jnp.sum(scale_bytes.astype(jnp.uint32) << (8 * byte).astype(jnp.uint32), axis=0, keepdims=True)
        parts.append((k, lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)))
    return parts, rope


def _attention_kernel(idx_ref, count_ref, scale_ref, q_nope_ref, q_rope_ref, rec_ref, out_ref, lse_ref, *,
                      layout: RecordLayout, num_heads: int, top_k: int, block_h: int, block_k: int):
    # idx_ref: i32[T * K] (K a multiple of block_k); count_ref: i32[T]; scale_ref: f32[1]
    # q_nope_ref: bf16[T * num_heads, nope_dim] (nvfp4: even elements, then odd); q_rope_ref: bf16[T * num_heads, 64]
    # (a query's NoPE is used in `nope_parts` column parts, each against its part of the records)
    # rec_ref: u8[N, R]; out_ref: [T * num_heads, nope_dim] (nvfp4: even, then odd); lse_ref: f32[T * num_heads]
    t, hb = pl.program_id(0), pl.program_id(1)
    num_records = rec_ref.shape[0]
    nope_dim = layout.nope_dim
    head_rows = t * num_heads + hb * block_h + lax.broadcasted_iota(jnp.int32, (block_h, 1), 0)
    parts = nope_parts(layout)
    width = nope_dim // parts
    part_cols = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    q_parts = [compat.pltriton.load(q_nope_ref.at[head_rows, p * width + part_cols])
               for p in range(parts)]                  # loaded apart: Triton has no value slicing
    q_rope = compat.pltriton.load(q_rope_ref.at[head_rows, lax.broadcasted_iota(jnp.int32, (1, layout.rope_dim), 1)])
    scale = _scalar(scale_ref, 0)
    count = jnp.minimum(_scalar(count_ref, t), top_k)

    def step(j, carry):
        accs, m_prev, l_prev, nan_seen, seen = carry
        k0 = t * top_k + j * block_k
        col_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        row_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        idx_col = compat.pltriton.load(idx_ref.at[k0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)])
        idx_row = compat.pltriton.load(idx_ref.at[k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)])
        valid_col = (col_pos < count) & (idx_col >= 0) & (idx_col < num_records)
        valid_row = (row_pos < count) & (idx_row >= 0) & (idx_row < num_records)
        k_parts, k_rope = _dequantized_tile(rec_ref, jnp.where(valid_col, idx_col, 0), valid_col,
                                            jnp.where(valid_row, idx_row, 0), valid_row, layout)
        s = _dot(q_rope, k_rope, trans_b=True)
        for qp, (kp, factor) in zip(q_parts, k_parts):
            part = _dot(qp, kp, trans_b=True)
            s += part if factor is None else part * factor
        s = jnp.where(valid_row, s * scale, -jnp.inf)                      # f32[block_h, block_k]
        nan_seen = jnp.maximum(nan_seen, jnp.max(jnp.where(jnp.isnan(s) & valid_row, 1, 0), axis=1))
        seen = seen + jnp.sum(valid_row.astype(jnp.int32))
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)                  # no valid entry yet: exp(-inf) = 0
        correction = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use[:, None])
        l_new = l_prev * correction + jnp.sum(p, axis=1)
        p16 = p.astype(jnp.bfloat16)
        accs = tuple(acc * correction[:, None]
                     + _dot(p16 if factor is None else (p * factor).astype(jnp.bfloat16), kp)
                     for acc, (kp, factor) in zip(accs, k_parts))
        return accs, m_new, l_new, nan_seen, seen

    init = (tuple(jnp.zeros((block_h, width), jnp.float32) for _ in range(parts)),
            jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            jnp.zeros((block_h,), jnp.int32), jnp.int32(0))
    accs, m, l, nan_seen, seen = lax.fori_loop(0, pl.cdiv(count, block_k), step, init)
    nan_seen = nan_seen > 0
    nonempty = seen > 0
    denom = jnp.where(l > 0, l, 1.0)
    lse = jnp.where(nonempty, jnp.log(denom) + m, -jnp.inf)
    lse_rows = t * num_heads + hb * block_h + lax.broadcasted_iota(jnp.int32, (block_h,), 0)
    compat.pltriton.store(lse_ref.at[lse_rows], jnp.where(nan_seen, jnp.nan, lse))
    for p, acc in enumerate(accs):
        out = jnp.where(nonempty, acc / denom[:, None], 0.0)
        out = jnp.where(nan_seen[:, None], jnp.nan, out)
        cols = p * width + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        compat.pltriton.store(out_ref.at[head_rows, cols], out.astype(out_ref.dtype))


def padded_heads(num_heads: int, tiles: AttentionTiles) -> tuple[int, int]:
    """(heads per program, padded head count): programs of min(block_h, H rounded up to 16) heads."""
    block_h = min(tiles.block_h, max(16, 1 << math.ceil(math.log2(max(num_heads, 1)))))
    return block_h, -(-num_heads // block_h) * block_h


@functools.partial(jax.jit, static_argnames=("layout", "config", "out_dtype", "interpret"))
def sparse_mla_attention_triton(q, records, indices, counts, sm_scale, *, layout: RecordLayout,
                                config: AttentionTiles = AttentionTiles(), out_dtype=jnp.bfloat16,
                                interpret: bool = False):
    """The contract of `reference.attention_reference`, out in `out_dtype` (bf16 products with
    float32 accumulation, so relative errors of about 1e-2 against the float32 reference)."""
    t, h, value_dim = q.shape
    nope_dim = layout.nope_dim
    if t == 0 or h == 0:
        return jnp.zeros((t, h, nope_dim), out_dtype), jnp.zeros((t, h), jnp.float32)
    block_h, hp = padded_heads(h, config)
    block_k = config.block_k
    k = max(indices.shape[1], 1)
    kp = -(-k // block_k) * block_k
    q16 = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, hp - h), (0, 0)))
    q_nope, q_rope = q16[..., :nope_dim], q16[..., nope_dim:]
    if layout.kind == "nvfp4_groups":                   # the kernel's even / odd order
        q_nope = record_codec.split_even_odd(q_nope)
    idx = jnp.pad(indices, ((0, 0), (0, kp - indices.shape[1])), constant_values=-1).reshape(t * kp)
    scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
    kernel = functools.partial(_attention_kernel, layout=layout, num_heads=hp, top_k=kp, block_h=block_h,
                               block_k=block_k)
    out, lse = pl.pallas_call(
        kernel, grid=(t, hp // block_h),
        out_shape=(jax.ShapeDtypeStruct((t * hp, nope_dim), out_dtype), jax.ShapeDtypeStruct((t * hp,), jnp.float32)),
        compiler_params=compat.triton_compiler_params(config.num_warps, config.num_stages),
        interpret=interpret, name=f"ckv_sparse_mla_attention_{layout.kind}",
    )(idx, counts, scale, q_nope.reshape(t * hp, nope_dim), q_rope.reshape(t * hp, layout.rope_dim), records)
    out = out.reshape(t, hp, nope_dim)[:, :h]
    if layout.kind == "nvfp4_groups":                   # even elements, then odd -> interleaved
        out = record_codec.join_even_odd(out)
    return out, lse.reshape(t, hp)[:, :h]
