"""Paged gathers (raw and dequantizing): kernels against the references and a numpy model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckv_jax import formats
from helpers import FLUSHES_SUBNORMALS, random_kv
from pallas_kernels import paged_gather
from pallas_kernels.paged_gather import pallas_triton

NAMES = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]




def _case(name, seed=0, num_blocks=14, block_size=8):
    """A cache of real records, ragged requests (incl. empty and exactly-one-block ones), stale
    table entries past each valid prefix, one out-of-range id inside a valid prefix."""
    rng = np.random.default_rng(seed)
    fmt = formats.get(name)
    kv_c, k_pe = random_kv(rng, num_blocks * block_size)
    cache = np.asarray(fmt.encode(jnp.asarray(kv_c), jnp.asarray(k_pe))).reshape(num_blocks, block_size, -1)
    lens = np.array([13, 0, block_size, 1, 2 * block_size + 3], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = rng.integers(0, num_blocks, (len(lens), 4)).astype(np.int32)
    for r, n in enumerate(lens):
        table[r, -(-n // block_size):] = rng.choice([-1, num_blocks, 2 ** 31 - 1, 3])  # stale
    table[0, 1] = num_blocks + 2          # out of range inside the valid prefix: zeros, never read
    return fmt, cache, table, cu, int(cu[-1]) + 11


def _numpy_model(cache, table, cu, num_rows):
    nb, bs, rb = cache.shape
    out = np.zeros((num_rows, rb), np.uint8)
    for r in range(len(cu) - 1):
        for local in range(cu[r + 1] - cu[r]):
            blk = table[r, local // bs]
            if 0 <= blk < nb:
                out[cu[r] + local] = cache[blk, local % bs]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_gather_records_matches_numpy_model(name, implementation):
    fmt, cache, table, cu, rows = _case(name)
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                      num_rows=rows, **implementation)
    want = _numpy_model(cache, table, cu, rows)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got)[cu[-1]:].max() == 0, "padding rows are zero"
    assert want[:8].any(axis=1).all() and want[8:13].max() == 0, "the out-of-range block reads as zeros"


@pytest.mark.parametrize("name", NAMES)
def test_gather_dequant_matches_decode(name, implementation):
    fmt, cache, table, cu, rows = _case(name, seed=1)
    got = paged_gather.gather_dequant(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                      num_rows=rows, layout=fmt.layout, **implementation)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 576)
    records = _numpy_model(cache, table, cu, rows)
    import oracle
    want = oracle.decode(name, records)
    if FLUSHES_SUBNORMALS:
        nope = want[:, :512]
        want[:, :512] = np.where(np.abs(nope) < np.finfo(np.float32).tiny, np.copysign(0, nope), nope)
    want_bf16 = want.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want_bf16.view(np.uint16))


def test_gather_with_more_rows_than_tiles_and_empty_requests(implementation):
    fmt, cache, table, cu, _ = _case("fp8_ds_mla", seed=2)
    cu_empty = np.zeros_like(cu)
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu_empty),
                                      num_rows=64, **implementation)
    assert np.asarray(got).shape == (64, 656) and np.asarray(got).max() == 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("config", [pallas_triton.GatherConfig(), pallas_triton.GatherConfig(8192, 32, 8)])
def test_gathers_lower_for_cuda(name, config):
    layout = formats.get(name).layout
    sds = jax.ShapeDtypeStruct
    args = (sds((5000, 64, layout.record_bytes), jnp.uint8), sds((8, 600), jnp.int32), sds((9,), jnp.int32))
    for f in (lambda c, b, u: pallas_triton.gather_records_triton(c, b, u, num_rows=32768, config=config),
              lambda c, b, u: pallas_triton.gather_dequant_triton(c, b, u, num_rows=32768, layout=layout,
                                                                  config=config)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call") == 1 and "ckv_gather_" in text


def test_gather_config_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="chunk_bytes"):
        pallas_triton.GatherConfig(chunk_bytes=3000)

