"""Record formats: registry, byte-exact encoding against the numpy oracle, decode, round trips."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import oracle
from ckv_jax import formats
from helpers import (edge_case_kv, FLUSHES_SUBNORMALS, assert_bf16_bits_equal, assert_bytes_equal, nvfp4_every_code_and_scale,
                     oracle_records, random_kv)

NAMES = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]


def test_registry_sizes_and_layouts():
    assert formats.names() == sorted(NAMES)
    sizes = {n: formats.get(n).record_bytes for n in NAMES}
    assert sizes == {"fp8_ds_mla": 656, "nvfp4_ds_mla": 432, "bf16": 1152}
    for name in NAMES:
        segs = formats.get(name).layout.segments
        assert segs[0].offset == 0
        for a, b in zip(segs, segs[1:]):
            assert a.offset + a.width == b.offset
        assert all(s.width & (s.width - 1) == 0 for s in segs), "kernels store power-of-two segments"
    fp8 = formats.get("fp8_ds_mla").layout
    assert [(s.offset, s.width) for s in fp8.segments] == [(0, 512), (512, 16), (528, 128)]
    nv = formats.get("nvfp4_ds_mla").layout
    assert [(s.offset, s.width) for s in nv.segments] == [(0, 256), (256, 32), (288, 16), (304, 128)]
    assert formats.get("fp8") is formats.get("fp8_ds_mla")
    assert formats.get("auto") is formats.get("bf16")


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown record format 'fp9'"):
        formats.get("fp9")
    with pytest.raises(TypeError, match="format"):
        formats.get(656)
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.RecordFormat("bf16", formats.get("bf16").layout))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_encode_matches_oracle_on_random_data(name, dtype):
    rng = np.random.default_rng(hash((name, np.dtype(dtype).name)) % 2**32)
    kv_c, k_pe = random_kv(rng, 48, dtype=dtype)
    got = formats.get(name).encode(jnp.asarray(kv_c), jnp.asarray(k_pe))
    assert_bytes_equal(got, oracle_records(name, kv_c, k_pe))


def test_random_data_exercises_ieee_division():
    """Multiplying by a reciprocal (what XLA does to `amax / 448` and `x / broadcast(s)`) changes
    stored fp8_ds_mla scale bytes on the data above, so the byte-exact test would catch it."""
    rng = np.random.default_rng(hash(("fp8_ds_mla", "float32")) % 2**32)
    kv_c, _ = random_kv(rng, 48, dtype=np.float32)
    amax = np.abs(kv_c.reshape(48, 4, 128)).max(-1)
    exact = amax / np.float32(448)
    recip = amax * (np.float32(1) / np.float32(448))
    assert (exact.view(np.uint32) != recip.view(np.uint32)).sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_encode_edge_cases_match_oracle(name):
    kv_c, k_pe = edge_case_kv()
    got = np.asarray(formats.get(name).encode(jnp.asarray(kv_c), jnp.asarray(k_pe)))
    assert_bytes_equal(got, oracle_records(name, kv_c, k_pe))
    if name == "fp8_ds_mla":
        assert got[5, 7] == 0x7F and got[5, 300] == 0x7F, "NaN encodes as the canonical 0x7F"
        assert got[0, :512].max() == 0
    if name == "nvfp4_ds_mla":
        assert got[0, :256].max() == 0 and got[0, 256:288].max() == 0, "all-zero groups stay zero"
        assert got[:, 288:304].max() == 0, "pad bytes are zero"
    # RoPE is a bit copy, NaN payloads included
    rope = formats.get(name).layout.segment("rope_bf16")
    assert_bytes_equal(got[:, rope.offset:rope.offset + rope.width], np.asarray(k_pe).view(np.uint8))


@pytest.mark.parametrize("name", ["fp8_ds_mla", "nvfp4_ds_mla"])
def test_subnormal_inputs_are_kept_on_every_backend(name):
    """Encoding is IEEE on every backend, XLA on CPU (which flushes subnormal operands of float
    arithmetic) included.  For fp8 a flushing encoder would give other bytes on this input;
    nvfp4's e2m1 steps are too coarse for a subnormal to survive either way."""
    kv_c, k_pe = edge_case_kv()
    got = np.asarray(formats.get(name).encode(jnp.asarray(kv_c), jnp.asarray(k_pe)))
    flushed, ieee = oracle_records(name, kv_c, k_pe, flush=True), oracle_records(name, kv_c, k_pe)
    assert np.array_equal(flushed, ieee) == (name == "nvfp4_ds_mla")
    assert_bytes_equal(got, ieee)


def test_ieee_divide_is_exact_on_random_bit_patterns():
    """The integer long division against numpy's IEEE division: random bit patterns (subnormals,
    Inf, NaN, zeros of both signs) and the divisors the encoders use."""
    from pallas_kernels.float_codes import xla_ieee_divide
    rng = np.random.default_rng(9)
    n = 200_000
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    y = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    y[: n // 4] = np.float32(448)
    y[n // 4: n // 2] = np.float32(6)
    x[n // 2: n // 2 + 1000] = np.float32(1)
    y[-1000:] = np.float32(np.finfo(np.float32).tiny)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e-39, 3.4e38]
    y[:8] = [0.0, 5.0, np.inf, 2.0, 1.0, 1e-45, 1e-40, 1e-38]
    got = np.asarray(jax.jit(xla_ieee_divide)(x, y))
    with np.errstate(all="ignore"):
        want = x / y
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} quotients differ, e.g. {x[~same][:3]} / {y[~same][:3]}"


def _roundtrip_bound(name, x):
    ax = np.abs(x)
    if name == "bf16":
        return ax * 2.0 ** -8
    block = 128 if name == "fp8_ds_mla" else 16
    amax = np.repeat(ax.reshape(ax.shape[0], -1, block).max(-1), block, axis=1)
    if name == "fp8_ds_mla":
        return np.maximum(ax * 2.0 ** -4, amax / 448 * 2.0 ** -10) * 1.0001
    # e4m3 group scale within 1/16 of amax/6 (or 2**-10 absolute as a subnormal); the top e2m1
    # step spans two scale units, and saturation at 6 loses at most 6 * 2**-10
    return amax / 6 * 1.0625 + 6 * 2.0 ** -10


@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_error_within_format_bound(name):
    rng = np.random.default_rng(11)
    kv_c, k_pe = random_kv(rng, 64, dtype=np.float32)
    fmt = formats.get(name)
    dec = np.asarray(fmt.decode(fmt.encode(jnp.asarray(kv_c), jnp.asarray(k_pe))))
    assert dec.shape == (64, 576) and dec.dtype == np.float32
    err = np.abs(dec[:, :512] - kv_c)
    bound = _roundtrip_bound(name, kv_c)
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    assert np.array_equal(dec[:, 512:], np.asarray(k_pe).astype(np.float32))
    if name != "bf16":     # and the bound is not vacuous: the error is a real fraction of it
        assert np.max(err / np.maximum(bound, 1e-30)) > 0.25


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_oracle_on_arbitrary_bytes(name):
    fmt = formats.get(name)
    records = np.random.default_rng(5).integers(0, 256, (40, fmt.record_bytes), dtype=np.uint8)
    got = np.asarray(fmt.decode(jnp.asarray(records)))
    want = oracle.decode(name, records)
    if FLUSHES_SUBNORMALS and name == "fp8_ds_mla":   # XLA:CPU flushes subnormal q * scale
        nope = want[:, :512]                           # (the RoPE bf16 -> f32 widening is exact)
        want[:, :512] = np.where(np.abs(nope) < np.finfo(np.float32).tiny, np.copysign(0, nope), nope)
    np.testing.assert_array_equal(got, want)   # NaN positions must agree too


@pytest.mark.parametrize("bad, err, match", [
    (lambda kv, pe: (kv.astype(jnp.int32), pe), TypeError, r"kv_c: expected bfloat16 or float16 or float32\[T, 512\], got int32"),
    (lambda kv, pe: (kv[0], pe), ValueError, r"kv_c: expected rank 2"),
    (lambda kv, pe: (kv[:, :256], pe), ValueError, r"kv_c: expected \[T, 512\]"),
    (lambda kv, pe: (kv, pe.astype(jnp.float32)), TypeError, r"k_pe: expected bfloat16\[T, 64\], got float32"),
    (lambda kv, pe: (kv, pe[:3]), ValueError, r"k_pe: expected the same T as kv_c \(4\)"),
    (lambda kv, pe: (kv.tolist(), pe), TypeError, r"kv_c: expected an array, got list"),
])
def test_encode_rejects_bad_input(bad, err, match):
    kv, pe = random_kv(np.random.default_rng(0), 4)
    with pytest.raises(err, match=match):
        formats.get("fp8_ds_mla").encode(*bad(jnp.asarray(kv), jnp.asarray(pe)))


def test_decode_rejects_wrong_record_size():
    with pytest.raises(ValueError, match=r"records: expected uint8\[T, 432\] for format nvfp4_ds_mla, got uint8\[2, 656\]"):
        formats.get("nvfp4_ds_mla").decode(jnp.zeros((2, 656), jnp.uint8))


def test_e4m3_conversion_is_exact_including_ties_and_subnormals():
    """The integer float32 -> e4m3fn rounding against ml_dtypes: every e4m3 value, every
    midpoint between neighbours (ties to even), saturation, NaN, random magnitudes."""
    from pallas_kernels.float_codes import e4m3_bytes, e4m3_values
    rng = np.random.default_rng(4)
    finite = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.sort(finite[np.isfinite(finite)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    special = np.array([448, 449, 463.99, 464, 465, 1e9, np.inf, -np.inf, -448.5, -0.0, np.nan, 1e-45],
                       np.float32)
    noise = (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-5, 3, 100_000)).astype(np.float32)
    x = np.concatenate([finite, mids, np.nextafter(mids, np.float32(np.inf)), special, noise])
    with np.errstate(invalid="ignore"):
        want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    want = np.where(np.isnan(x), 0x7F, want)
    assert_bytes_equal(jax.jit(e4m3_bytes)(x), want, "e4m3 bytes")
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    back = np.asarray(jax.jit(e4m3_values)(codes))
    np.testing.assert_array_equal(back.view(np.uint32),
                                  codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).view(np.uint32))


def test_e2m1_conversion_is_exact_including_ties():
    """The bit-level float32 -> e2m1 rounding against ml_dtypes: every e2m1 value and midpoint
    and their float32 neighbours (ties to even, the switch between the half-step and the bit
    rounding at 1.0), saturation, signed zeros, Inf, NaN, subnormals and random bit patterns."""
    from pallas_kernels.float_codes import e2m1_nibbles
    rng = np.random.default_rng(5)
    grid = np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    points = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, [1.0, 5.0, 6.0, 7.0, 8.0]]).astype(np.float32)
    near = np.concatenate([points, np.nextafter(points, np.float32(np.inf)),
                           np.nextafter(points, np.float32(0))])
    special = np.array([np.inf, -np.inf, np.nan, -np.nan, -0.0, 1e-45, -1e-40, 3.4e38], np.float32)
    noise = rng.integers(0, 2 ** 32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([near, -near, special, noise])
    with np.errstate(invalid="ignore"):
        want = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    want = np.where(np.isnan(x), 0x7, want | (np.signbit(x) << 3).astype(np.uint8))
    assert_bytes_equal(jax.jit(e2m1_nibbles)(x), want, "e2m1 codes")
    # the compiled writer's variant: the same codes for every input but a NaN with its sign bit
    # set, which a GPU product never is (it returns the positive canonical NaN)
    from pallas_kernels.float_codes import e2m1_sign_magnitude_codes
    keep = ~(np.isnan(x) & np.signbit(x))
    assert_bytes_equal(np.asarray(jax.jit(e2m1_sign_magnitude_codes)(x[keep])).astype(np.uint8), want[keep],
                       "e2m1 codes (GPU variant)")
    assert int(jax.jit(e2m1_sign_magnitude_codes)(np.float32(-np.nan))) == 0xF    # what the GPU never sees


def test_nvfp4_pair_decode_is_exact_for_every_code_and_scale():
    """The dequantizing gather's nvfp4 path (integer-assembled e2m1 values, bf16 by truncating the
    float32 bits) against ml_dtypes' e2m1 x e4m3 product rounded to bf16, for every code and
    scale byte at both parities; and the f32 decode against the oracle."""
    from pallas_kernels.float_codes import exact_bf16_pair_words
    from pallas_kernels.record_codec import decode_nvfp4_pairs
    fmt = formats.get("nvfp4_ds_mla")
    records = nvfp4_every_code_and_scale()
    words = jax.jit(lambda p, s: exact_bf16_pair_words(*decode_nvfp4_pairs(fmt.layout, p, s)))(
        records[:, :256], records[:, 256:288])
    want = oracle.decode("nvfp4_ds_mla", records)[:, :512]
    assert np.isnan(want).sum() == 4 * 16 and (want == 0).any() and (np.abs(want) == 2688).any()
    with np.errstate(invalid="ignore"):              # NaN scales: NaN values, cast on purpose
        want_bf16 = want.astype(ml_dtypes.bfloat16)
    assert_bf16_bits_equal(np.asarray(words).view(ml_dtypes.bfloat16), want_bf16, "nvfp4 pairs")
    np.testing.assert_array_equal(np.asarray(fmt.decode(jnp.asarray(records)))[:, :512], want)
