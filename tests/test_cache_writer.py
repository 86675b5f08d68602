"""Paged-cache writer: every implementation against the numpy oracle, in place, masked."""
import re

import jax
import jax.numpy as jnp
from jax import lax
import ml_dtypes
import numpy as np
import pytest

import ckv_jax
from ckv_jax import formats
from helpers import ON_GPU, assert_bytes_equal, copies_of_at_least, edge_case_kv, oracle_records, random_kv
from pallas_kernels import cache_writer
from pallas_kernels.cache_writer import pallas_triton

NAMES = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]


def _triton(kernel_mode):
    return dict(implementation="pallas_triton", interpret=kernel_mode == "interpret")


def _expected_cache(poison, slots, records):
    num_slots = poison.shape[0] * poison.shape[1]
    want = poison.reshape(num_slots, -1).copy()
    for t, s in enumerate(slots):
        if 0 <= s < num_slots:
            want[s] = records[t]
    return want.reshape(poison.shape)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, kv_dtype", [(37, ml_dtypes.bfloat16), (1, ml_dtypes.bfloat16),
                                              (16, np.float32), (21, np.float16)])
def test_writer_matches_oracle(implementation, name, tokens, kv_dtype):
    fmt = formats.get(name)
    rng = np.random.default_rng(tokens * 7 + len(name))
    num_blocks, block_size = 5, 16
    num_slots = num_blocks * block_size
    kv_c, k_pe = random_kv(rng, tokens, dtype=kv_dtype)
    slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
    if tokens > 4:          # skipped tokens and out-of-range slots are masked, never written
        slots[1::5] = -1
        slots[2] = num_slots
        slots[3] = np.iinfo(np.int32).max
        slots[4] = -7
    poison = rng.integers(0, 256, (num_blocks, block_size, fmt.record_bytes), dtype=np.uint8)
    out = ckv_jax.write_records(jnp.asarray(poison), jnp.asarray(kv_c), jnp.asarray(k_pe),
                                jnp.asarray(slots), name, **implementation)
    assert out.shape == poison.shape and out.dtype == jnp.uint8
    assert_bytes_equal(out, _expected_cache(poison, slots, oracle_records(name, kv_c, k_pe)), "cache")


@pytest.mark.parametrize("name", ["fp8_ds_mla", "nvfp4_ds_mla"])
def test_writing_to_several_caches_stores_each_record_at_each_caches_slot(implementation, name):
    """`write_records_to_all`: one call writes the tokens into a paged cache and into a workspace
    of one-record blocks (the adapter's cache write and patch), each at its own slots (some
    skipped, some out of range, different per destination); every other row keeps its poison,
    and the caches are updated in place."""
    fmt = formats.get(name)
    rng = np.random.default_rng(len(name))
    tokens = 45
    kv_c, k_pe = random_kv(rng, tokens)
    records = oracle_records(name, kv_c, k_pe)
    poisons = [rng.integers(0, 256, (6, 16, fmt.record_bytes), dtype=np.uint8),
               rng.integers(0, 256, (130, 1, fmt.record_bytes), dtype=np.uint8)]
    slots = [rng.permutation(96)[:tokens].astype(np.int32), rng.permutation(130)[:tokens].astype(np.int32)]
    slots[0][1::4] = -1
    slots[0][2] = 96
    slots[1][3::5] = -1
    slots[1][4] = np.iinfo(np.int32).max
    caches = tuple(jnp.asarray(p) for p in poisons)
    outs = jax.jit(lambda c, a, b, s: cache_writer.write_records_to_all(c, a, b, s, layout=fmt.layout, **implementation),
                   donate_argnums=0)(caches, jnp.asarray(kv_c), jnp.asarray(k_pe), tuple(jnp.asarray(x) for x in slots))
    assert all(c.is_deleted() for c in caches)
    for k, (out, poison, s) in enumerate(zip(outs, poisons, slots)):
        assert_bytes_equal(out, _expected_cache(poison, s, records), f"cache {k}")
    with pytest.raises(ValueError, match=r"slot_mappings: expected one per cache \(2\), got 1"):
        cache_writer.write_records_to_all(outs, jnp.asarray(kv_c), jnp.asarray(k_pe), (jnp.asarray(slots[0]),),
                                          layout=fmt.layout)


@pytest.mark.parametrize("word", [0, 1, -7])
def test_a_skip_word_read_on_the_device_turns_every_store_off(implementation, word):
    """`write_records_to_all(skip_words=, skip_index=)`: the word at skip_index (the other words
    differ) decides on the device whether the call writes; not 0, every row keeps its poison."""
    fmt = formats.get("fp8_ds_mla")
    rng = np.random.default_rng(word + 10)
    tokens = 29
    kv_c, k_pe = random_kv(rng, tokens)
    poisons = [rng.integers(0, 256, (4, 16, fmt.record_bytes), dtype=np.uint8),
               rng.integers(0, 256, (70, 1, fmt.record_bytes), dtype=np.uint8)]
    slots = [rng.permutation(64)[:tokens].astype(np.int32), rng.permutation(70)[:tokens].astype(np.int32)]
    slots[1][5] = -1
    words = np.array([1 - abs(word), word, 3], np.int32)     # the word read is [1]
    caches = tuple(jnp.asarray(p) for p in poisons)
    outs = jax.jit(lambda c, a, b, s, w: cache_writer.write_records_to_all(
        c, a, b, s, layout=fmt.layout, skip_words=w, skip_index=1, **implementation), donate_argnums=0)(
        caches, jnp.asarray(kv_c), jnp.asarray(k_pe), tuple(jnp.asarray(x) for x in slots), jnp.asarray(words))
    records = oracle_records("fp8_ds_mla", kv_c, k_pe)
    for k, (out, poison, s) in enumerate(zip(outs, poisons, slots)):
        assert_bytes_equal(out, poison if word else _expected_cache(poison, s, records), f"cache {k}")
    with pytest.raises(ValueError, match=r"skip_words, skip_index: expected int32\[n\] and an index in \[0, n\), "
                                         r"got int32\[3\] and 3"):
        cache_writer.write_records_to_all(outs, jnp.asarray(kv_c), jnp.asarray(k_pe),
                                          tuple(jnp.asarray(x) for x in slots), layout=fmt.layout,
                                          skip_words=jnp.asarray(words), skip_index=3)


def test_the_writer_with_a_skip_word_lowers_for_cuda_as_one_kernel():
    """The word is the kernel's operand: no select of the slots runs before it."""
    fmt = formats.get("nvfp4_ds_mla")
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda c, w, a, b, s, r: pallas_triton.write_records_to_all_triton(
        (c, w), a, b, (s, r), jnp.zeros((9,), jnp.int32) + r[0], layout=fmt.layout, skip_index=8))
    lowered = f.trace(sds((512, 64, fmt.record_bytes), jnp.uint8), sds((9000, 1, fmt.record_bytes), jnp.uint8),
                      sds((300, 512), jnp.bfloat16), sds((300, 64), jnp.bfloat16), sds((300,), jnp.int32),
                      sds((300,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("stablehlo.custom_call") == 1 and "stablehlo.select" not in lowered
    assert "ckv_write_records_nvfp4_groups_r432_to_2" in lowered


@pytest.mark.parametrize("name", NAMES)
def test_writer_edge_values_match_oracle(name, kernel_mode):
    """NaN/Inf/subnormal/extreme latents through the Pallas kernel, as in test_formats."""
    kv_c, k_pe = edge_case_kv()
    fmt = formats.get(name)
    poison = np.random.default_rng(1).integers(0, 256, (2, 8, fmt.record_bytes), dtype=np.uint8)
    slots = np.arange(15, 3, -1, dtype=np.int32)
    out = ckv_jax.write_records(jnp.asarray(poison), jnp.asarray(kv_c), jnp.asarray(k_pe),
                                jnp.asarray(slots), name, **_triton(kernel_mode))
    assert_bytes_equal(out, _expected_cache(poison, slots, oracle_records(name, kv_c, k_pe)), "cache")


def test_writer_with_zero_tokens_returns_cache_unchanged(implementation):
    fmt = formats.get("fp8_ds_mla")
    poison = np.random.default_rng(2).integers(0, 256, (2, 4, fmt.record_bytes), dtype=np.uint8)
    out = ckv_jax.write_records(jnp.asarray(poison), jnp.zeros((0, 512), jnp.bfloat16),
                                jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0,), jnp.int32),
                                fmt, **implementation)
    assert_bytes_equal(out, poison)


@pytest.mark.parametrize("name", NAMES)
def test_writer_updates_in_place(implementation, name):
    fmt = formats.get(name)
    cache = jnp.zeros((64, 16, fmt.record_bytes), jnp.uint8)
    kv_c, k_pe = random_kv(np.random.default_rng(0), 40)
    slots = jnp.arange(40, dtype=jnp.int32) * 3
    run = cache_writer.select(implementation["implementation"], jax.devices()[0], cache.size, 40, fmt.layout,
                              interpret=implementation["interpret"])

    def write(c, a, b, s):
        return run(c, a, b, s, layout=fmt.layout, interpret=implementation["interpret"])

    compiled = jax.jit(write, donate_argnums=0).lower(cache, kv_c, k_pe, slots).compile()
    hlo = compiled.as_text()
    assert copies_of_at_least(hlo, cache.size) == []
    assert re.search(r"u8\[\d+(,\d+)*\]", hlo), "the check above must see the uint8 buffers"
    # and the donated input buffer is really consumed
    out = compiled(cache, kv_c, k_pe, slots)
    assert cache.is_deleted() and out.shape == (64, 16, fmt.record_bytes)


def test_full_cache_copy_detector_sees_copies():
    """The in-place check must be able to fail: without donation XLA copies the cache."""
    cache = jnp.zeros((64, 16, 656), jnp.uint8)
    hlo = jax.jit(lambda c: c.at[3].set(1)).lower(cache).compile().as_text()
    assert copies_of_at_least(hlo, cache.size)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("config, kv_dtype", [(pallas_triton.WriterTiles(), jnp.bfloat16),
                                              (pallas_triton.WriterTiles(32, 8), jnp.bfloat16),
                                              (pallas_triton.WriterTiles(4, 1), jnp.bfloat16),
                                              (pallas_triton.WriterTiles(), jnp.float16),
                                              (pallas_triton.WriterTiles(), jnp.float32)])
def test_writer_lowers_for_cuda(name, config, kv_dtype):
    fmt = formats.get(name)
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda c, a, b, s: pallas_triton.write_records_triton(c, a, b, s, layout=fmt.layout, config=config))
    text = f.trace(sds((4096, 64, fmt.record_bytes), jnp.uint8), sds((3000, 512), kv_dtype),
                   sds((3000, 64), jnp.bfloat16), sds((3000,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1
    assert f"ckv_write_records_{fmt.layout.kind}" in text
    assert "output_operand_aliases" in text, "the cache must be aliased in place"


def test_automatic_choice():
    dev = jax.devices()[0]
    layout = formats.get("fp8_ds_mla").layout

    def choose(implementation, nbytes=10_000):
        return cache_writer.select(implementation, dev, nbytes, 8, layout)

    auto = choose(None)
    assert auto.name == ("pallas_triton" if ON_GPU else "xla")
    assert choose(["pallas_triton", "xla"]).name == auto.name
    assert choose("xla").name == "xla"
    if not ON_GPU:
        with pytest.raises(ValueError, match="pallas_triton: needs a GPU"):
            choose("pallas_triton")
    with pytest.raises(ValueError, match=r"implementation: expected one of \['pallas_triton', 'xla'\]"):
        choose("cuda")


@pytest.mark.gpu
def test_triton_is_not_chosen_where_its_int32_offsets_wrap():
    from pallas_kernels import selection
    dev = jax.devices()[0]
    for nbytes, ok in [(2 ** 31 - 1, True), (2 ** 31, False), (3 * 2 ** 30, False), (2 ** 32, False),
                       (2 ** 32 + 1, True)]:
        assert selection.triton_supported(dev, nbytes, False)[0] == ok, nbytes
    assert cache_writer.select(None, dev, 3 * 2 ** 30, 8, formats.get("fp8_ds_mla").layout).name == "xla"


@pytest.mark.gpu
def test_compiled_fp8_division_matches_long_division():
    """The compiled writer's per-tile division (one reciprocal, Markstein's correction) gives the
    e4m3 bytes of the correctly rounded quotient, and the quotient itself wherever it could
    matter (|x / scale| >= 2**-11), on quotients within 3 ulps of every e4m3 value and midpoint."""
    from jax.experimental import pallas as pl

    from helpers import fp8_division_tiles
    from pallas_kernels import compat, float_codes
    from pallas_kernels.cache_writer import gpu_arithmetic

    x, scale = fp8_division_tiles(np.random.default_rng(11))

    def kernel(x_ref, scale_ref, q_ref, byte_ref):
        q = gpu_arithmetic.triton_divide_by_scale(x_ref[...], scale_ref[...])
        q_ref[...] = q
        byte_ref[...] = gpu_arithmetic.triton_e4m3_bytes(q)

    rows = 8
    q, byts = pl.pallas_call(
        kernel, grid=(x.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, 128), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))],
        out_specs=[pl.BlockSpec((rows, 128), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape, jnp.uint8)],
        compiler_params=compat.triton_compiler_params(4))(jnp.asarray(x), jnp.asarray(scale))
    want = np.asarray(float_codes.xla_ieee_divide(x, scale[:, None]))
    assert_bytes_equal(byts, np.asarray(float_codes.e4m3_bytes(jnp.asarray(want))), "e4m3 bytes")
    matters = np.abs(want) >= 2.0 ** -11
    assert_bytes_equal(np.asarray(q).view(np.uint32)[matters], want.view(np.uint32)[matters], "quotients")


@pytest.mark.gpu
def test_compiled_e2m1_codes_match_for_every_float32():
    """The compiled writer's e2m1 codes (Veltkamp's split, in PTX) against the portable bit-level
    rounding, both run on the GPU, for all 2**32 float32 bit patterns: each program builds 65,536
    consecutive patterns and counts its mismatches per row."""
    from jax.experimental import pallas as pl

    from pallas_kernels import compat, float_codes
    from pallas_kernels.cache_writer import gpu_arithmetic

    rows, cols = 16, 4096

    def kernel(count_ref):
        first = pl.program_id(0).astype(jnp.uint32) * jnp.uint32(rows * cols)
        bits = (first + lax.broadcasted_iota(jnp.uint32, (rows, cols), 0) * jnp.uint32(cols)
                + lax.broadcasted_iota(jnp.uint32, (rows, cols), 1))
        y = lax.bitcast_convert_type(bits, jnp.float32)
        got = gpu_arithmetic.triton_e2m1_codes(y).astype(jnp.uint32)
        want = float_codes.e2m1_sign_magnitude_codes(y)
        count_ref[...] = jnp.sum((got != want).astype(jnp.int32), axis=1)

    programs = 2 ** 32 // (rows * cols)
    counts = pl.pallas_call(kernel, grid=(programs,), out_specs=pl.BlockSpec((rows,), lambda i: (i,)),
                            out_shape=jax.ShapeDtypeStruct((programs * rows,), jnp.int32),
                            compiler_params=compat.triton_compiler_params(4))()
    counts = np.asarray(counts)
    assert counts.sum() == 0, f"{counts.sum()} codes differ, first in rows {np.nonzero(counts)[0][:4] * cols}"


@pytest.mark.parametrize("field, value", [("tokens_per_block", 12), ("num_warps", 0)])
def test_writer_config_rejects_non_powers_of_two(field, value):
    with pytest.raises(ValueError, match=field):
        pallas_triton.WriterTiles(**{field: value})


@pytest.mark.parametrize("field, value", [("tokens_per_block", 8.0), ("num_warps", True)])
def test_writer_config_rejects_non_ints(field, value):
    with pytest.raises(TypeError, match=field):
        pallas_triton.WriterTiles(**{field: value})


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def _good(tokens=4):
    kv_c, k_pe = random_kv(np.random.default_rng(0), tokens)
    return dict(cache=jnp.zeros((2, 4, 656), jnp.uint8), kv_c=jnp.asarray(kv_c), k_pe=jnp.asarray(k_pe),
                slot_mapping=jnp.arange(tokens, dtype=jnp.int32), format="fp8_ds_mla")


@pytest.mark.parametrize("change, err, match", [
    (dict(cache=jnp.zeros((2, 4, 656), jnp.int8)), TypeError, r"cache: expected uint8\[num_blocks, block_size, 656\], got int8"),
    (dict(cache=jnp.zeros((8, 656), jnp.uint8)), ValueError, r"cache: expected rank 3"),
    (dict(cache=jnp.zeros((2, 4, 432), jnp.uint8)), ValueError, r"cache: expected uint8\[num_blocks, block_size, 656\] for format fp8_ds_mla \(656-byte records\), got uint8\[2, 4, 432\]"),
    (dict(kv_c=jnp.zeros((4, 512), jnp.int8)), TypeError, r"kv_c: expected"),
    (dict(kv_c=jnp.zeros((5, 512), jnp.bfloat16)), ValueError, r"k_pe: expected the same T as kv_c \(5\)"),
    (dict(slot_mapping=jnp.arange(3, dtype=jnp.int32)), ValueError, r"slot_mapping: expected int32\[4\]"),
    (dict(slot_mapping=np.arange(4, dtype=np.int64)), TypeError, r"slot_mapping: expected int32\[4\], got int64\[4\]"),
    (dict(slot_mapping=jnp.arange(4, dtype=jnp.float32)), TypeError, r"slot_mapping: expected int32"),
    (dict(format="fp4"), ValueError, r"format: unknown record format 'fp4'"),
])
def test_writer_rejects_bad_input(change, err, match):
    args = {**_good(), **change}
    with pytest.raises(err, match=match):
        ckv_jax.write_records(**args)


@pytest.mark.parametrize("slots, match", [
    ([0, 1, 8, 2], r"slot_mapping: entry 2 is 8, expected -1 or a slot in \[0, 8\)"),
    ([0, -2, 1, 2], r"slot_mapping: entry 1 is -2"),
    ([0, 5, 1, 5], r"slot_mapping: slot 5 appears at entries \[1, 3\]"),
])
def test_validation_mode_reports_bad_slots(slots, match, monkeypatch):
    args = {**_good(), "slot_mapping": jnp.asarray(slots, jnp.int32)}
    with pytest.raises(ValueError, match=match):
        ckv_jax.write_records(**args, validate=True)
    monkeypatch.setenv("CKV_JAX_VALIDATE", "1")
    with pytest.raises(ValueError, match=match):
        ckv_jax.write_records(**{**args, "cache": jnp.zeros((2, 4, 656), jnp.uint8)})


def test_validation_off_masks_out_of_range_slots(monkeypatch):
    monkeypatch.delenv("CKV_JAX_VALIDATE", raising=False)
    args = {**_good(), "slot_mapping": jnp.asarray([0, 8, 1000, 3], jnp.int32)}
    out = np.asarray(ckv_jax.write_records(**args))
    assert out.reshape(8, 656)[[1, 2, 4, 5, 6, 7]].max() == 0
    assert out.reshape(8, 656)[[0, 3]].max() > 0


def test_validation_mode_needs_concrete_slots():
    args = _good()

    @jax.jit
    def inside(cache, kv_c, k_pe, slot_mapping):
        return ckv_jax.write_records(cache, kv_c, k_pe, slot_mapping, "fp8_ds_mla", validate=True)

    with pytest.raises(ValueError, match="validation mode reads values back to the host"):
        inside(args["cache"], args["kv_c"], args["k_pe"], args["slot_mapping"])


def test_validation_env_value_must_be_boolean(monkeypatch):
    monkeypatch.setenv("CKV_JAX_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match="CKV_JAX_VALIDATE: expected 0/1/true/false, got 'sometimes'"):
        ckv_jax.write_records(**_good())


def test_empty_cache_and_read_records_round_trip():
    cache = ckv_jax.empty_cache(3, 4, "nvfp4_ds_mla")
    assert cache.shape == (3, 4, 432) and cache.dtype == jnp.uint8 and int(cache.max()) == 0
    kv_c, k_pe = random_kv(np.random.default_rng(4), 5)
    slots = np.array([11, 0, -1, 6, 3], np.int32)
    cache = ckv_jax.write_records(cache, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots), "nvfp4_ds_mla")
    got = np.asarray(ckv_jax.read_records(cache, jnp.asarray([6, -1, 11, 12, 3], jnp.int32)))
    want = oracle_records("nvfp4_ds_mla", kv_c, k_pe)
    assert_bytes_equal(got[[0, 2, 4]], want[[3, 0, 4]])
    assert got[[1, 3]].max() == 0, "slot -1 and slots past the cache read as zeros"
    with pytest.raises(ValueError, match="num_blocks, block_size: expected positive sizes"):
        ckv_jax.empty_cache(0, 4, "bf16")
