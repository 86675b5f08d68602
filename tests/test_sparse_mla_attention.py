"""Sparse-MLA attention over native records: every implementation against a float64 numpy oracle
(over the oracle's own record decode), its NaN and hole rules, its checks, its bounded memory."""
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ckv_jax
import oracle
from helpers import FakeDevice, fp8_every_code, nvfp4_every_code_and_scale
from ckv_jax import formats, sparse_mla
from pallas_kernels import sparse_mla_attention as attention_op
from pallas_kernels.record_layout import RecordLayout
from pallas_kernels.sparse_mla_attention import (AttentionTiles, MosaicAttentionTiles, pallas_mosaic_gpu, pallas_triton,
                                                 reference)

NAMES = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]
N = 96                     # records
K = 37                     # top-k columns: not a multiple of any tile
MOSAIC = "fp8_ds_mla"      # the format of the Mosaic GPU kernel's tests that run one format


@np.errstate(invalid="ignore", over="ignore")
def oracle_attention(name, q, records, indices, counts, sm_scale, keys="exact"):
    """float64 (out [T, H, 512], lse [T, H], vmax [T]) of the contract, from `oracle.decode`;
    vmax: the largest |V| a row averages (its output's scale: a convex combination of V rows).
    keys="bf16": every decoded value first rounded to bf16 (to nearest, ties to even)."""
    kv = oracle.decode(name, np.asarray(records))                               # [N, 576]
    if keys == "bf16":
        kv = kv.astype(ml_dtypes.bfloat16)
    kv = kv.astype(np.float64)
    q = np.asarray(q, np.float32).astype(np.float64)
    t, h, _ = q.shape
    out, lse, vmax = np.zeros((t, h, 512)), np.full((t, h), -np.inf), np.zeros(t)
    for i in range(t):
        sel = [int(r) for r in np.asarray(indices)[i, :int(np.asarray(counts)[i])] if 0 <= r < kv.shape[0]]
        if not sel:
            continue
        keys = kv[sel]                                                          # [k, 576]
        vmax[i] = np.abs(keys[:, :512]).max()
        s = sm_scale * q[i] @ keys.T                                            # [h, k]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[i] = (p @ keys[:, :512]) / p.sum(axis=1, keepdims=True)
        lse[i] = np.log(p.sum(axis=1)) + m[:, 0]
    return out, lse, vmax


def make_case(name, t, h, seed, k=K):
    """Records of random latents, bf16 queries, indices with holes (-1), rows outside [0, N) and
    duplicates, counts from 0 to K (row 1: 0, row 2: fewer than K)."""
    rng = np.random.default_rng(seed)
    fmt = formats.get(name)
    mag = 10.0 ** rng.uniform(-1, 1, (N, 1))
    kv = jnp.asarray(rng.standard_normal((N, 512)) * mag, jnp.bfloat16)
    pe = jnp.asarray(rng.standard_normal((N, 64)), jnp.bfloat16)
    records = np.array(fmt.encode(kv, pe))
    q = (rng.standard_normal((t, h, 576)) * 0.5).astype(ml_dtypes.bfloat16)
    indices = rng.integers(0, N, (t, k)).astype(np.int32)
    indices[:, 3] = -1                                   # a hole
    indices[:, 5] = N + 7                                # past the records
    indices[:, 6] = -9
    indices[:, 8] = indices[:, 9]                        # a duplicate
    counts = np.full(t, k, np.int32)
    counts[1 % t] = 0
    counts[2 % t] = min(k, 19)
    return q, records, indices, counts, 1 / math.sqrt(576)


def assert_close(name, got, want, what):
    """bf16 products with float32 accumulation: errors within 1e-2 of the scale of the values a
    row averages (its largest |V|), lse within 1e-2 (relative above 1)."""
    out, lse = (np.asarray(a, np.float32) for a in got)
    want_out, want_lse, vmax = want
    empty = np.isneginf(want_lse)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape, what
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg=f"{what}: -inf lse exactly for empty rows")
    assert (out[empty] == 0).all(), f"{what}: empty rows are zero"
    err = np.abs(out - want_out) / (vmax[:, None, None] + 1e-30)
    assert err.max() <= 1e-2, f"{what}: out error {err.max():.2e} of the row's largest |V|"
    lse_err = np.abs(lse[~empty] - want_lse[~empty]) / np.maximum(1.0, np.abs(want_lse[~empty]))
    assert lse_err.max(initial=0) <= 1e-2, f"{what}: lse error {lse_err.max():.2e}"


@pytest.mark.parametrize("heads", [16, 128, 5])
@pytest.mark.parametrize("name", NAMES)
def test_every_implementation_matches_the_oracle(name, heads, implementation):
    q, records, indices, counts, sm_scale = make_case(name, 3, heads, seed=heads)
    got = ckv_jax.sparse_mla_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                       jnp.asarray(counts), sm_scale, format=name, **implementation)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert_close(name, got, oracle_attention(name, q, records, indices, counts, sm_scale),
                 f"{name} H={heads} {implementation}")


@pytest.mark.parametrize("name", NAMES)
def test_large_scores_keep_their_precision(name, implementation):
    """Scores in the tens (an lse near 80): every record value must reach the products exactly,
    or the softmax turns a bf16 rounding of 2**-9 into errors of several percent."""
    q, records, indices, counts, sm_scale = make_case(name, 3, 16, seed=11)
    q = (q.astype(np.float32) * 16).astype(ml_dtypes.bfloat16)
    want = oracle_attention(name, q, records, indices, counts, sm_scale)
    assert np.abs(want[1][np.isfinite(want[1])]).max() > 40, "the case must reach large scores"
    got = ckv_jax.sparse_mla_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                       jnp.asarray(counts), sm_scale, format=name, **implementation)
    assert_close(name, got, want, f"{name} large scores {implementation}")


@pytest.mark.parametrize("tiles", [AttentionTiles(16, 16, 4), AttentionTiles(64, 32, 8, 2)])
def test_kernel_tiles_give_the_same_attention(tiles, kernel_mode):
    """Heads per program above and below the head count, several K tiles, fp8 records."""
    name = "fp8_ds_mla"
    q, records, indices, counts, sm_scale = make_case(name, 2, 48, seed=7, k=70)
    got = pallas_triton.sparse_mla_attention_triton(
        jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices), jnp.asarray(counts), sm_scale,
        layout=formats.get(name).layout, config=tiles, interpret=kernel_mode == "interpret")
    assert_close(name, got, oracle_attention(name, q, records, indices, counts, sm_scale), str(tiles))


@pytest.mark.parametrize("name", ["bf16", "fp8_ds_mla"])
def test_a_nan_reaches_its_row_and_only_its_row(name, implementation):
    """A NaN in q[t, h] poisons (t, h) only; a NaN in a selected record poisons every head of the
    rows that select it within their counts; a NaN record behind a hole or past a count does not."""
    check_the_nan_rule(name, implementation)


# the per-thread copies and fp8's conversion in the memory warpgroup are inline PTX, which runs
# compiled only (interpreted, those configs take one issuer's Pallas copies, the cases beside them)
COMPILED_ONLY = pytest.mark.compiled_only


# interpreted, the cases whose NaN crosses from one compute warpgroup's half to the other's (split
# scores), over one K tile and two; a NaN in unsplit scores (one warpgroup's own tile) runs compiled
@pytest.mark.parametrize("name, split_scores, k_slots, copy_issuers", [
    pytest.param(MOSAIC, False, 1, 4, marks=COMPILED_ONLY), (MOSAIC, True, 1, 4), ("nvfp4_ds_mla", True, 1, 4),
    ("bf16", True, 1, 4), pytest.param("bf16", False, 2, 4, marks=COMPILED_ONLY), ("bf16", True, 2, 4),
    pytest.param(MOSAIC, False, 2, 128, marks=COMPILED_ONLY),
    pytest.param(MOSAIC, True, 2, 128, marks=COMPILED_ONLY), pytest.param("nvfp4_ds_mla", True, 2, 128, marks=COMPILED_ONLY)])
def test_the_mosaic_kernel_keeps_the_nan_rule(name, split_scores, k_slots, copy_issuers, kernel_mode):
    """Either way of computing the scores: split, a NaN in one warpgroup's half must still reach
    the other's output columns (nvfp4: a NaN group scale of the second compute warpgroup's bytes;
    bf16: one K tile, or two in flight; fp8 converted by the memory warpgroup into two K tiles;
    split with two K tiles: Q's RoPE columns in registers)."""
    check_the_nan_rule(name, dict(implementation="pallas_mosaic_gpu", interpret=kernel_mode == "interpret"),
                       k=70, selected_column=40,
                       config=MosaicAttentionTiles(split_scores=split_scores, k_slots=k_slots,
                                                   copy_issuers=copy_issuers))


def check_the_nan_rule(name, implementation, k=K, selected_column=4, config=None, heads=16):
    """selected_column: where row 3 (of k columns) selects the NaN record (the Mosaic kernel's
    entries 32-63 of a tile are its second compute warpgroup's half when the scores are split;
    with two memory warpgroups, each converts half of every 32); config: a kernel config, run
    through the kernels' entry point instead of the public one."""
    q, records, indices, counts, sm_scale = make_case(name, 4, heads, seed=3, k=k)
    q[0, 2, 7] = np.nan
    bad = N - 1
    indices[indices == bad] = 0
    indices[1, 0] = bad                                   # row 1: count 0, not selected
    indices[2, 30] = bad                                  # row 2: past its count of 19
    indices[3, selected_column] = bad                     # row 3: selected
    if name == "bf16":
        records[bad, :2] = np.array([0x7FC0], np.uint16).view(np.uint8)          # a NaN latent
    elif name == "nvfp4_ds_mla":
        records[bad, 256 + 20] = 0x7F                                            # a NaN group scale
    else:
        records[bad, 512:516] = np.array([np.nan], np.float32).view(np.uint8)    # a NaN tile scale
    args = (jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices), jnp.asarray(counts), sm_scale)
    if config is None:
        got = ckv_jax.sparse_mla_attention(*args, format=name, **implementation)
    else:
        got = attention_op.sparse_mla_attention(*args, layout=formats.get(name).layout, config=config,
                                                **implementation)
    out, lse = (np.asarray(a, np.float32) for a in got)
    nan_rows = np.isnan(lse)
    want = np.zeros_like(nan_rows)
    want[0, 2] = True
    want[3, :] = True
    np.testing.assert_array_equal(nan_rows, want)
    assert np.isnan(out[want]).all() and np.isfinite(out[~want]).all()


# fp8 or nvfp4 converted into two K tiles by one memory warpgroup, and by two (the default), each
# converting half of every tile's rows
ONE_MEMORY = MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=208)
TWO_MEMORY = MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=208, memory_warpgroups=2)


@COMPILED_ONLY
@pytest.mark.parametrize("selected_column", [4, 20, 40, 60])
@pytest.mark.parametrize("name, heads, config", [(MOSAIC, 16, ONE_MEMORY), (MOSAIC, 16, TWO_MEMORY),
                                                 (MOSAIC, 128, TWO_MEMORY), ("nvfp4_ds_mla", 16, TWO_MEMORY)])
def test_the_memory_warpgroups_conversions_keep_the_nan_rule(name, heads, config, selected_column, kernel_mode):
    """A NaN record in any quarter of a tile (with two memory warpgroups, entries 0-15 and 32-47
    converted by the first, 16-31 and 48-63 by the second) reaches every head of its row, and a
    NaN query only its own head."""
    check_the_nan_rule(name, dict(implementation="pallas_mosaic_gpu", interpret=kernel_mode == "interpret"),
                       k=70, selected_column=selected_column, config=config, heads=heads)


@COMPILED_ONLY
@pytest.mark.parametrize("name, heads, config", [(MOSAIC, 64, TWO_MEMORY), (MOSAIC, 192, TWO_MEMORY),
                                                 (MOSAIC, 128, ONE_MEMORY), ("nvfp4_ds_mla", 128, TWO_MEMORY)])
def test_the_memory_warpgroups_conversions_give_every_head_every_row(name, heads, config, kernel_mode):
    """One and two memory warpgroups converting 130 entries (three tiles, the last partial; each
    memory warpgroup its share of each tile's rows) for one to three 64-head blocks, with scores
    in the tens, holes, rows outside [0, N), duplicates and counts 0 (no tile) and 19."""
    check_three_tiles_of_large_scores(name, heads, config, kernel_mode, seed=17)


def test_two_memory_warpgroups_where_they_convert():
    """The default for fp8 and nvfp4 converts in two memory warpgroups where the memory
    warpgroup converts at all (compiled, per-thread copies, two K tiles); bf16 (copied), one raw
    slot and interpret mode run one."""
    fp8, nvfp4, bf16 = (formats.get(n).layout for n in ("fp8_ds_mla", "nvfp4_ds_mla", "bf16"))
    of = pallas_mosaic_gpu.memory_warpgroups_of
    assert pallas_mosaic_gpu.default_tiles(fp8) == pallas_mosaic_gpu.default_tiles(nvfp4) == TWO_MEMORY
    assert of(fp8, TWO_MEMORY) == of(nvfp4, TWO_MEMORY) == 2 and of(fp8, ONE_MEMORY) == 1
    assert of(fp8, TWO_MEMORY, interpret=True) == 1 and of(bf16, TWO_MEMORY) == 1
    assert of(fp8, MosaicAttentionTiles(copy_issuers=4, k_slots=2, memory_warpgroups=2)) == 1


def test_triton_is_left_out_where_a_buffer_has_wrapping_offsets():
    """Pallas Triton's int32 element offsets wrap in buffers of [2**31, 2**32] elements: the
    automatic choice weighs the queries and the output (heads padded) beside the records."""
    gpu, layout = FakeDevice(), formats.get("fp8_ds_mla").layout

    def choose(tokens, heads, implementation=None):
        return attention_op.api.select(implementation, gpu, layout, 2 ** 30, tokens, heads, 2048).name

    assert choose(32768, 8) == "pallas_triton"
    # 8 heads padded to 64: 2.4e9 query values; the next in the default order is taken
    assert choose(65536, 8) == "pallas_mosaic_gpu"
    assert choose(65536, 8, ("pallas_triton", "xla")) == "xla"
    assert choose(32768, 120, ("pallas_triton", "xla")) == "xla"        # 128 padded heads
    assert choose(16384, 120, ("pallas_triton", "xla")) == "pallas_triton"


def test_the_interpreted_mosaic_kernel_refuses_too_few_cpu_devices():
    """Interpreted with one CPU device its warpgroups would wait on each other forever: a named
    error instead, and an ordered choice passes it over (a fresh process: the device count is
    fixed when jax starts)."""
    import subprocess
    import sys
    code = """
import jax.numpy as jnp, numpy as np, ckv_jax
q = jnp.zeros((1, 16, 576), jnp.bfloat16); records = jnp.zeros((4, 656), jnp.uint8)
idx, cnt = jnp.zeros((1, 8), jnp.int32), jnp.ones((1,), jnp.int32)
try:
    ckv_jax.sparse_mla_attention(q, records, idx, cnt, 0.1, format="fp8_ds_mla", implementation="pallas_mosaic_gpu",
                                 interpret=True)
except ValueError as e:
    print("refused:", e)
out, lse = ckv_jax.sparse_mla_attention(q, records, idx, cnt, 0.1, format="fp8_ds_mla",
                                       implementation=("pallas_mosaic_gpu", "xla"), interpret=True)
print("ordered:", float(lse[0, 0]))
"""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "refused: implementation: none of ['pallas_mosaic_gpu'] is supported here" in proc.stdout, proc.stdout
    assert "need as many CPU devices (set JAX_NUM_CPU_DEVICES=3 before jax starts); this process has 1" in proc.stdout
    assert "ordered: " in proc.stdout


def test_bad_input_is_named_before_anything_runs():
    q, records, indices, counts, sm_scale = (jnp.asarray(a) if isinstance(a, np.ndarray) else a
                                             for a in make_case("fp8_ds_mla", 2, 16, seed=1))
    call = ckv_jax.sparse_mla_attention
    with pytest.raises(ValueError, match=r"records: expected uint8\[N, 432\] for format nvfp4_ds_mla"):
        call(q, records, indices, counts, sm_scale, format="nvfp4_ds_mla")
    with pytest.raises(ValueError, match=r"q: expected \[T, H, 576\]"):
        call(q[..., :512], records, indices, counts, sm_scale, format="fp8_ds_mla")
    with pytest.raises(TypeError, match=r"indices: expected int32\[2, K\]"):
        call(q, records, indices.astype(jnp.int16), counts, sm_scale, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"counts: expected int32\[2\]"):
        call(q, records, indices, counts[:1], sm_scale, format="fp8_ds_mla")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sm_scale: expected a positive finite number"):
            call(q, records, indices, counts, bad, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"implementation: expected one of \['pallas_mosaic_gpu', 'pallas_triton', 'xla'\]"):
        call(q, records, indices, counts, sm_scale, format="fp8_ds_mla", implementation="flashmla")
    with pytest.raises(ValueError, match=r"keys: expected one of \('exact', 'bf16'\), got 'fp16'"):
        call(q, records, indices, counts, sm_scale, format="fp8_ds_mla", keys="fp16")


BF16_KEYS_CASES = [(name, scale) for name in ("fp8_ds_mla", "nvfp4_ds_mla") for scale in (1, 16)]


def check_bf16_keys(name, scale, kernel):
    """keys="bf16" against the oracle of keys rounded to bf16: at q's normal scale and at 16 times
    it (the case of `test_large_scores_keep_their_precision`, an lse near 130, where the rounding
    of fp8's keys moves the exact output by 1.5e-2 of a row's largest |V| and its lse by 1.3e-2,
    beyond the tolerance: there only the rounded oracle holds)."""
    q, records, indices, counts, sm_scale = make_case(name, 3, 16, seed=11)
    q = (q.astype(np.float32) * scale).astype(ml_dtypes.bfloat16)
    got = ckv_jax.sparse_mla_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                       jnp.asarray(counts), sm_scale, format=name, keys="bf16", **kernel)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert_close(name, got, oracle_attention(name, q, records, indices, counts, sm_scale, keys="bf16"),
                 f"{name} bf16 keys, q x {scale}, {kernel}")


@pytest.mark.parametrize("name, scale", BF16_KEYS_CASES)
def test_bf16_keys_are_the_records_rounded_to_bf16(name, scale, implementation):
    check_bf16_keys(name, scale, implementation)


def test_the_mosaic_kernel_over_bf16_keys(kernel_mode):
    """fp8 at large scores, where only the rounded oracle holds (the kernel over bf16 records has its
    own tests)."""
    check_bf16_keys("fp8_ds_mla", 16, dict(implementation="pallas_mosaic_gpu", interpret=kernel_mode == "interpret"))


@pytest.mark.parametrize("name", ["fp8_ds_mla", "nvfp4_ds_mla"])
def test_bf16_keys_keep_the_nan_rule(name, implementation):
    """A NaN scale dequantizes to NaN values in the bf16 table: the rows that select the record
    within their counts turn NaN, no other."""
    check_the_nan_rule(name, dict(implementation, keys="bf16"))


# Interpreted, 16 heads repeat the other Mosaic cases (all at 16 heads, every format; those of
# three tiles over the same holes, duplicates and counts), two full CTAs (128 heads) the path of
# 80's full CTA, and 80 heads' split into CTAs is the same for every format: one format runs it.
@pytest.mark.parametrize("name, heads", [
    pytest.param(name, heads, marks=COMPILED_ONLY) if heads in (16, 128) or (heads == 80 and name != MOSAIC)
    else (name, heads) for name in NAMES for heads in (16, 128, 5, 80)])
def test_the_mosaic_kernel_matches_the_oracle(name, heads, kernel_mode):
    """One CTA a token with fewer heads than its 64 (16; 5, padded to 8 in GMEM), two full CTAs
    (128), a full CTA and one of 16 heads (80); K = 37 (one partial tile of 64), holes, rows
    outside [0, N), duplicates, counts 0 and 19."""
    q, records, indices, counts, sm_scale = make_case(name, 3, heads, seed=heads)
    got = ckv_jax.sparse_mla_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                       jnp.asarray(counts), sm_scale, format=name, implementation="pallas_mosaic_gpu",
                                       interpret=kernel_mode == "interpret")
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert_close(name, got, oracle_attention(name, q, records, indices, counts, sm_scale), f"mosaic {name} H={heads}")


# interpreted, one issuer's copies over four barriers; over one (copy_issuers=1) they run compiled
@pytest.mark.parametrize("name, copy_issuers, split_scores, k_slots", [
    (MOSAIC, 4, False, 1), (MOSAIC, 4, True, 1), ("nvfp4_ds_mla", 4, True, 1), ("bf16", 4, True, 1),
    ("bf16", 4, False, 2), ("bf16", 4, True, 2)] + [
    pytest.param(*case, marks=COMPILED_ONLY) for case in ((MOSAIC, 1, False, 1), ("bf16", 1, False, 2),
                                                        (MOSAIC, 128, True, 1), (MOSAIC, 128, False, 2),
                                                        (MOSAIC, 128, True, 2), ("nvfp4_ds_mla", 128, True, 1),
                                                        ("nvfp4_ds_mla", 128, True, 2),
                                                        ("bf16", 128, True, 1), ("bf16", 128, False, 2),
                                                        ("bf16", 128, True, 2))])
def test_the_mosaic_kernel_spans_several_tiles_and_keeps_large_scores_exact(name, copy_issuers, split_scores, k_slots,
                                                                            kernel_mode):
    """130 entries (three tiles of 64, the last partial) with scores in the tens: each tile's fp8
    scale (each group's nvfp4 scale) must multiply its own products, exactly; with the record
    copies issued by the memory warpgroup as one, by its four warps and by each of its threads
    (interpreted: one issuer, over the four barriers), and with the scores computed by both compute
    warpgroups or split between them; bf16 records copied straight into one K tile, or into two in
    turn; fp8 and nvfp4 records converted by the memory warpgroup into two (split with two K
    tiles: Q's RoPE columns in registers)."""
    check_three_tiles_of_large_scores(name, 16, MosaicAttentionTiles(copy_issuers=copy_issuers, split_scores=split_scores,
                                                                     k_slots=k_slots), kernel_mode, seed=13)


def check_three_tiles_of_large_scores(name, heads, config, kernel_mode, seed):
    """The Mosaic kernel with `config` against the oracle over 130 entries a token (three tiles,
    the last partial) of scores in the tens, `make_case`'s holes, rows outside [0, N), duplicates
    and counts (0, 19, 130)."""
    q, records, indices, counts, sm_scale = make_case(name, 3, heads, seed=seed, k=130)
    q = (q.astype(np.float32) * 16).astype(ml_dtypes.bfloat16)
    want = oracle_attention(name, q, records, indices, counts, sm_scale)
    assert np.abs(want[1][np.isfinite(want[1])]).max() > 40, "the case must reach large scores"
    got = attention_op.sparse_mla_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                            jnp.asarray(counts), sm_scale, layout=formats.get(name).layout,
                                            implementation="pallas_mosaic_gpu", interpret=kernel_mode == "interpret",
                                            config=config)
    assert_close(name, got, want, f"mosaic {name}, H={heads}, three tiles, large scores, {config}")


# compiled only: interpreted, the default config's case was the suite's slowest (110 s on CI's
# two cores); `test_the_mosaic_kernel_matches_the_oracle` decodes random codes of both formats
# interpreted
@pytest.mark.parametrize("heads, config", [
    pytest.param(h, c, marks=COMPILED_ONLY) for h, c in ((16, None), (16, ONE_MEMORY), (128, TWO_MEMORY))])
def test_the_mosaic_kernel_decodes_every_nvfp4_code_and_scale(heads, config, kernel_mode):
    """Token t selects only record t of `nvfp4_every_code_and_scale` (every e2m1 code times every
    e4m3 scale byte, subnormal and NaN ones included, at both parities; random finite RoPE), so
    its output is that record's values exactly and a NaN scale makes its row NaN
    (`check_each_token_decodes_its_record`); converted by the default config (two memory
    warpgroups into two K tiles), by one memory warpgroup and by two at 128 heads."""
    records = nvfp4_every_code_and_scale()
    t = records.shape[0]
    rng = np.random.default_rng(5)
    # finite RoPE values instead of random bytes (a NaN or Inf there would poison its row too)
    records[:, 304:] = rng.standard_normal((t, 64)).astype(ml_dtypes.bfloat16).view(np.uint8)
    q = jnp.asarray(rng.standard_normal((t, heads, 576)) * 0.01, jnp.bfloat16)
    nan_record = check_each_token_decodes_its_record("nvfp4_ds_mla", records, q, kernel_mode, config)
    assert nan_record.sum() == 4


def check_each_token_decodes_its_record(name, records, q, kernel_mode, config=None):
    """The Mosaic kernel (with `config`; None: the default) over `records` with token t of q
    selecting only record t: its output is that record's values exactly (a softmax weight of 1;
    the products are exact in bf16), and its row is NaN (lse and every output) exactly where the
    record holds a NaN.  Returns which do."""
    t, heads = q.shape[:2]
    indices = jnp.asarray(np.arange(t, dtype=np.int32)[:, None])
    out, lse = attention_op.sparse_mla_attention(q, jnp.asarray(records), indices, jnp.ones(t, jnp.int32), 0.05,
                                                 layout=formats.get(name).layout, implementation="pallas_mosaic_gpu",
                                                 interpret=kernel_mode == "interpret", config=config)
    values = oracle.decode(name, records)[:, :512]
    nan_record = np.isnan(values).any(axis=1)
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), np.broadcast_to(nan_record[:, None], (t, heads)))
    assert np.isnan(out[nan_record]).all()
    want = np.broadcast_to(values[~nan_record][:, None, :], out[~nan_record].shape)
    np.testing.assert_array_equal(out[~nan_record], want.astype(ml_dtypes.bfloat16).astype(np.float32))
    return nan_record


# compiled only, as the nvfp4 case above (49 s interpreted)
@pytest.mark.parametrize("heads, config", [
    pytest.param(h, c, marks=COMPILED_ONLY) for h, c in ((16, None), (16, ONE_MEMORY), (128, TWO_MEMORY))])
def test_the_mosaic_kernel_decodes_every_fp8_code(heads, config, kernel_mode):
    """Token t selects only record t of `fp8_every_code` (every e4m3 code at both parities, NaN
    codes at every place of a 16-byte chunk and in every tile; power-of-two tile scales), so its
    output is that record's values exactly and a NaN code makes its row NaN
    (`check_each_token_decodes_its_record`).  Compiled, the default config converts in two
    memory warpgroups (each half of the rows); and one memory warpgroup, and two at 128 heads."""
    records = fp8_every_code()
    q = jnp.asarray(np.random.default_rng(6).standard_normal((records.shape[0], heads, 576)) * 0.01, jnp.bfloat16)
    nan_record = check_each_token_decodes_its_record(MOSAIC, records, q, kernel_mode, config)
    assert nan_record.tolist() == [False] * 2 + [True] * 8


def test_the_mosaic_kernel_names_what_it_does_not_read():
    q8, records8, indices8, counts8, sm_scale = (jnp.asarray(a) if isinstance(a, np.ndarray) else a
                                                 for a in make_case(MOSAIC, 2, 16, seed=1))
    tiles_of_64 = RecordLayout("fp8_tiles", quant_block=64)           # a layout of no registered format
    records64 = jnp.zeros((N, tiles_of_64.record_bytes), jnp.uint8)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu reads fp8_ds_mla, nvfp4_ds_mla and bf16 records, got "
                                         "records of layout fp8_tiles"):
        attention_op.sparse_mla_attention(q8, records64, indices8, counts8, sm_scale, layout=tiles_of_64,
                                          implementation="pallas_mosaic_gpu", interpret=True)
    with pytest.raises(TypeError, match="config: expected MosaicAttentionTiles"):
        attention_op.sparse_mla_attention(q8, records8, indices8, counts8, sm_scale, layout=formats.get(MOSAIC).layout,
                                          implementation="pallas_mosaic_gpu", interpret=True,
                                          config=AttentionTiles())
    with pytest.raises(ValueError, match="block_k: expected 64"):
        MosaicAttentionTiles(block_k=32)
    with pytest.raises(ValueError, match=r"copy_issuers: expected one of \(1, 4, 128\), got 2"):
        MosaicAttentionTiles(copy_issuers=2)
    with pytest.raises(ValueError, match="k_slots: expected 1 or 2, got 3"):
        MosaicAttentionTiles(k_slots=3)
    for registers in (236, 248, 16):
        with pytest.raises(ValueError, match=rf"compute_registers: expected a multiple of 8 in \[24, 240\] "
                                             rf"\(each memory warpgroup keeps at least 24\), got {registers}"):
            MosaicAttentionTiles(compute_registers=registers)
    assert MosaicAttentionTiles().memory_registers() == 40 and TWO_MEMORY.memory_registers(2) == 48
    with pytest.raises(ValueError, match=r"compute_registers: expected a multiple of 8 in \[24, 232\] \(each memory "
                                         r"warpgroup keeps at least 24\), got 240"):
        MosaicAttentionTiles(compute_registers=240, memory_warpgroups=2)
    with pytest.raises(ValueError, match="memory_warpgroups: expected 1 or 2, got 3"):
        MosaicAttentionTiles(memory_warpgroups=3)
    fp8, bf16 = formats.get(MOSAIC).layout, formats.get("bf16").layout
    assert [pallas_mosaic_gpu.memory_warpgroups_of(layout, TWO_MEMORY, interpret)
            for layout, interpret in ((fp8, False), (fp8, True), (bf16, False))] == [2, 1, 1]
    wide = jnp.zeros((2, 4097), jnp.int32)
    with pytest.raises(ValueError, match=r"indices: .* at most 4096 entries; got int32\[2, 4097\]"):
        attention_op.sparse_mla_attention(q8, records8, wide, counts8, sm_scale, layout=formats.get(MOSAIC).layout,
                                          implementation="pallas_mosaic_gpu", interpret=True)


def test_the_mosaic_kernel_lowers_for_cuda():
    """Every copy issuer lowers for CUDA (the four-warp and the per-thread ones run on a GPU only:
    the interpreter has no warp-level scopes or inline PTX), to different kernels; so does every
    format, bf16 with two K tiles and per-thread copies too, and both with split scores beside two
    K tiles; fp8 and nvfp4 converted by one memory warpgroup and by two."""
    sds = jax.ShapeDtypeStruct
    texts = {}
    for name, issuers, slots, split, memory in ((MOSAIC, 1, 1, True, 1), (MOSAIC, 4, 1, True, 1),
                                                (MOSAIC, 128, 1, True, 1), (MOSAIC, 128, 2, False, 1),
                                                (MOSAIC, 128, 2, True, 1), (MOSAIC, 128, 2, True, 2),
                                                ("nvfp4_ds_mla", 4, 1, True, 1), ("nvfp4_ds_mla", 128, 1, True, 1),
                                                ("nvfp4_ds_mla", 128, 2, True, 1), ("nvfp4_ds_mla", 128, 2, True, 2),
                                                ("bf16", 4, 2, False, 1), ("bf16", 128, 2, False, 1),
                                                ("bf16", 128, 2, True, 1)):
        layout = formats.get(name).layout
        tiles = MosaicAttentionTiles(copy_issuers=issuers, split_scores=split, k_slots=slots, memory_warpgroups=memory)
        texts[name, issuers, slots, split, memory] = jax.jit(lambda q, r, i, c: attention_op.sparse_mla_attention_mosaic(
            q, r, i, c, 0.04, layout=layout, config=tiles)).trace(
            sds((64, 64, 576), jnp.bfloat16),
            sds((4096, layout.record_bytes), jnp.uint8),
            sds((64, 2048), jnp.int32), sds((64,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    for (name, *_), text in texts.items():
        kind = formats.get(name).layout.kind
        assert text.count("stablehlo.custom_call") == 1 and f"ckv_sparse_mla_attention_mgpu_{kind}" in text
    assert len(set(texts.values())) == len(texts)


@pytest.mark.parametrize("name", NAMES)
def test_the_kernel_lowers_for_cuda(name):
    layout = formats.get(name).layout
    sds = jax.ShapeDtypeStruct

    def f(q, records, indices, counts):
        return pallas_triton.sparse_mla_attention_triton(q, records, indices, counts, 0.04, layout=layout)

    text = jax.jit(f).trace(sds((64, 64, 576), jnp.bfloat16), sds((4096, layout.record_bytes), jnp.uint8),
                            sds((64, 2048), jnp.int32), sds((64,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and f"ckv_sparse_mla_attention_{layout.kind}" in text


def test_the_xla_implementation_bounds_its_temporaries():
    """T = 4,096 query tokens, 16 heads, top-k 2,048 over a 256K-row fp8 workspace: the blocked
    reference compiles to at most 4 GiB of temporaries (the unblocked one needs about 52 GiB)."""
    layout = formats.get("fp8_ds_mla").layout
    sds = jax.ShapeDtypeStruct
    args = (sds((4096, 16, 576), jnp.bfloat16), sds((262144, 656), jnp.uint8), sds((4096, 2048), jnp.int32),
            sds((4096,), jnp.int32))
    compiled = jax.jit(lambda q, r, i, c: reference.attention_blocked(q, r, i, c, 0.04, layout=layout)).lower(
        *args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 4 * 2 ** 30, f"{temp / 2 ** 30:.1f} GiB of temporaries"


@pytest.mark.parametrize("device, name, records_bytes, heads, top_k, interpret, chosen", [
    (FakeDevice(), "fp8_ds_mla", 1 << 30, 8, 2048, False, "pallas_triton"),
    (FakeDevice(), "bf16", 1 << 30, 8, 2048, False, "pallas_triton"),
    (FakeDevice(), "nvfp4_ds_mla", 1 << 30, 8, 2048, False, "pallas_triton"),
    # Triton cannot address a u8 buffer of 2-4 GiB: the Mosaic GPU kernel where it reads the records
    (FakeDevice(), "fp8_ds_mla", 3 << 30, 8, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "bf16", 3 << 30, 8, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(compute_capability="8.0"), "fp8_ds_mla", 3 << 30, 16, 2048, False, "xla"),
    (FakeDevice(), "nvfp4_ds_mla", 5 << 30, 8, 2048, False, "pallas_triton"),
    (FakeDevice(platform="cpu"), "fp8_ds_mla", 1 << 30, 16, 2048, False, "xla"),
    (FakeDevice(platform="cpu"), "fp8_ds_mla", 1 << 20, 16, 2048, True, "pallas_triton"),
    # from MOSAIC_FIRST_HEADS heads on (16), compiled on a GPU,
    # the Mosaic GPU kernel first where it runs; the next of the default order where it does not
    (FakeDevice(), "fp8_ds_mla", 1 << 30, 16, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "bf16", 1 << 30, 16, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "fp8_ds_mla", 1 << 30, 64, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "fp8_ds_mla", 1 << 30, 128, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "nvfp4_ds_mla", 1 << 30, 16, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "nvfp4_ds_mla", 1 << 30, 64, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "bf16", 1 << 30, 64, 2048, False, "pallas_mosaic_gpu"),
    (FakeDevice(), "fp8_ds_mla", 1 << 30, 64, 8192, False, "pallas_triton"),       # a top-k past its SMEM
    (FakeDevice(), "bf16", 1 << 30, 64, 8192, False, "pallas_mosaic_gpu"),          # indices in a ring
    (FakeDevice(compute_capability="8.0"), "fp8_ds_mla", 1 << 30, 64, 2048, False, "pallas_triton"),
    (FakeDevice(platform="cpu"), "fp8_ds_mla", 1 << 30, 64, 2048, True, "pallas_triton"),
])
def test_the_automatic_choice_is_a_kernel_where_one_runs_compiled(device, name, records_bytes, heads, top_k,
                                                                   interpret, chosen):
    fmt = formats.get(name)
    got = sparse_mla.attention_implementation(name, device, records_bytes // fmt.record_bytes, 64, heads, top_k,
                                              interpret=interpret)
    assert got == chosen
    assert sparse_mla.attention_implementation(name, device, 1024, 64, 16, 2048, implementation="xla") == "xla"
    assert set(sparse_mla.IMPLEMENTATIONS) == {"pallas_mosaic_gpu", "pallas_triton", "xla"}


@pytest.mark.parametrize("name, keys", [("nvfp4_ds_mla", "exact"), ("fp8_ds_mla", "bf16")])
def test_full_ckv_attention_runs_the_kernel(name, keys, kernel_mode):
    """The full-CKV path with the Pallas kernel (each rank its heads; bf16 keys: each rank's
    dequantized workspace) against the oracle: two CPU ranks interpreted, every GPU compiled."""
    from helpers import mesh_of
    q, records, indices, counts, sm_scale = make_case(name, 3, 32, seed=5)
    ranks = 2 if kernel_mode == "interpret" else len(jax.devices())
    got = sparse_mla.full_ckv_attention(jnp.asarray(q), jnp.asarray(records), jnp.asarray(indices),
                                        jnp.asarray(counts), sm_scale, format=name, mesh=mesh_of(ranks),
                                        implementation="pallas_triton", interpret=kernel_mode == "interpret",
                                        keys=keys)
    assert_close(name, got, oracle_attention(name, q, records, indices, counts, sm_scale, keys=keys),
                 f"full_ckv_attention, {keys} keys")


def test_the_mosaic_kernel_on_both_dcp_paths(kernel_mode):
    """Full-CKV (each rank its heads over the gathered workspace) and stock DCP (each rank all
    heads over its own shard, float32 partials merged by LSE) with the Mosaic GPU kernel, against
    one device's XLA attention over the same records in global order: one CPU rank interpreted,
    every GPU compiled."""
    import dcp_scenario
    from ckv_jax import full_ckv, placement
    from helpers import mesh_of
    # Interpreted, one rank and three tokens (compiled: seven): the Mosaic GPU interpreter runs
    # each program's warpgroups as threads; with two CPU devices interpreting at once it hung (jax
    # 0.10.2), and it takes seconds a token.
    interpreted = kernel_mode == "interpret"
    d = 1 if interpreted else len(jax.devices())
    sc = dcp_scenario.build(d, 1, MOSAIC, [45, 70], [2, 1] if interpreted else [4, 3], seed=3)
    plan, mesh = sc.plan, mesh_of(d)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((plan.num_tokens, 2 * d, 576)), jnp.bfloat16)
    pos = plan.positions()
    topk = np.full((plan.num_tokens, 24), -1, np.int32)
    for t, p in enumerate(pos):
        n = min(24, p + 1)
        topk[t, :n] = rng.choice(p + 1, size=n, replace=False)
    caches = placement.place_caches(sc.caches, mesh)
    kernel = dict(implementation="pallas_mosaic_gpu", interpret=interpreted)
    ws = full_ckv.all_gather_ckv(caches, jnp.asarray(sc.block_table), plan, mesh=mesh, format=MOSAIC)
    idx, cnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
    full = sparse_mla.full_ckv_attention(q, ws, idx, cnt, 576 ** -0.5, format=MOSAIC, mesh=mesh, **kernel)
    stock = sparse_mla.stock_dcp_attention(q, caches, sc.block_table, jnp.asarray(topk), plan, 576 ** -0.5,
                                           format=MOSAIC, mesh=mesh, **kernel)
    starts = np.concatenate([[0], np.cumsum(plan.seq_lens)])[plan.req_id_per_token]
    rows = np.where(topk >= 0, starts[:, None] + topk, -1).astype(np.int32)
    one = ckv_jax.sparse_mla_attention(q, jnp.asarray(dcp_scenario.global_records(sc)), jnp.asarray(rows),
                                       jnp.asarray((topk >= 0).sum(1).astype(np.int32)), 576 ** -0.5,
                                       format=MOSAIC, implementation="xla")
    scale = np.abs(np.asarray(one[0], np.float32)).max()
    for got, what in ((full, "full-CKV"), (stock, "stock DCP")):
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(one[0], np.float32),
                                   atol=1e-2 * scale, err_msg=f"{what} out")
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(one[1]), rtol=1e-3, atol=1e-3,
                                   err_msg=f"{what} lse")


@pytest.mark.parametrize("d", [1, 2, 4])
def test_the_kernel_on_the_full_ckv_path_equals_it_on_global_order_records(d, kernel_mode):
    """Full-CKV (each rank its heads over the gathered workspace) and one device over the same
    records in global token order give the same bits: same records, same columns in the same
    order, and a head's result does not depend on the others of its program.  Large scores."""
    import dcp_scenario
    from ckv_jax import full_ckv, placement
    from helpers import mesh_of
    if kernel_mode == "compiled" and d > len(jax.devices()):
        pytest.skip(f"needs {d} GPUs")
    name = "fp8_ds_mla"
    sc = dcp_scenario.build(d, 1, name, [45, 23, 70], [12, 23, 9], seed=7 + d)
    plan, mesh = sc.plan, mesh_of(d)
    rng = np.random.default_rng(d)
    q = jnp.asarray(rng.standard_normal((plan.num_tokens, 4, 576)) * 4, jnp.bfloat16)
    pos = plan.positions()
    topk = np.full((plan.num_tokens, 24), -1, np.int32)
    for t, p in enumerate(pos):
        n = min(24, p + 1)
        topk[t, :n] = rng.choice(p + 1, size=n, replace=False)
    ws = full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table), plan,
                                 mesh=mesh, format=name)
    idx, cnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
    kernel = dict(implementation="pallas_triton", interpret=kernel_mode == "interpret")
    full = sparse_mla.full_ckv_attention(q, ws, idx, cnt, 576 ** -0.5, format=name, mesh=mesh, **kernel)
    starts = np.concatenate([[0], np.cumsum(plan.seq_lens)])[plan.req_id_per_token]
    rows = np.where(topk >= 0, starts[:, None] + topk, -1).astype(np.int32)
    one = ckv_jax.sparse_mla_attention(q, jnp.asarray(dcp_scenario.global_records(sc)), jnp.asarray(rows),
                                       jnp.asarray((topk >= 0).sum(1).astype(np.int32)), 576 ** -0.5, format=name,
                                       **kernel)
    for got, want, what in zip(full, one, ("out", "lse")):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what)
