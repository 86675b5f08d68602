"""Paged gathers (raw and dequantizing): kernels against the references and a numpy model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckv_jax import dcp_step, formats
from helpers import FLUSHES_SUBNORMALS, assert_bf16_bits_equal, nvfp4_every_code_and_scale, random_kv
from pallas_kernels import paged_gather
from pallas_kernels.paged_gather import pallas_triton

NAMES = ["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]


@pytest.fixture(params=["xla", "pallas_triton:interpret", "pallas_mosaic_gpu:interpret",
                        pytest.param("pallas_triton:compiled", marks=pytest.mark.gpu),
                        pytest.param("pallas_mosaic_gpu:compiled", marks=pytest.mark.gpu)])
def records_implementation(request):
    """The implementations of the raw paged gather (Mosaic GPU has only this op)."""
    name, _, mode = request.param.partition(":")
    return dict(implementation=name, interpret=mode == "interpret")


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
def test_gather_records_matches_numpy_model(name, records_implementation):
    fmt, cache, table, cu, rows = _case(name)
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                      num_rows=rows, **records_implementation)
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


@pytest.mark.parametrize("name", ["fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("rows", [192, 96, 97, 0])
def test_dequantize_records_decodes_every_row(name, rows, implementation):
    """A flat table: pages of 64 (192 rows), of 32 (96), of one record (97, odd), none; every row
    against the numpy oracle's decode rounded once to bf16."""
    import oracle
    fmt = formats.get(name)
    kv_c, k_pe = random_kv(np.random.default_rng(rows), max(rows, 1))
    records = np.asarray(fmt.encode(jnp.asarray(kv_c), jnp.asarray(k_pe)))[:rows]
    got = paged_gather.dequantize_records(jnp.asarray(records), layout=fmt.layout, **implementation)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 576)
    want = oracle.decode(name, records)
    if FLUSHES_SUBNORMALS:
        nope = want[:, :512]
        want[:, :512] = np.where(np.abs(nope) < np.finfo(np.float32).tiny, np.copysign(0, nope), nope)
    assert_bf16_bits_equal(np.asarray(got), want.astype(jnp.bfloat16), f"{name}, {rows} rows")


def test_triton_is_left_out_where_any_buffer_has_wrapping_offsets():
    """Pallas Triton's int32 element offsets wrap in buffers of [2**31, 2**32] elements: the
    automatic choice looks at the largest of the cache and the output (a ring slot written in
    place, the bf16 values of a dequantization), not at the cache alone."""
    from helpers import FakeDevice
    gpu, fp8 = FakeDevice(), formats.get("fp8_ds_mla")
    small, rows = 2 ** 30, 2 ** 20
    assert paged_gather.select_records(None, gpu, small, rows, fp8.record_bytes).name == "pallas_triton"
    assert paged_gather.select_records(None, gpu, small, rows, fp8.record_bytes, out_rows=4 * rows).name == "xla"
    assert paged_gather.select_records(None, gpu, 3 * 2 ** 30, rows, fp8.record_bytes).name == "xla"
    assert paged_gather.select_dequant(None, gpu, small, rows, fp8.record_bytes, fp8.layout).name == "pallas_triton"
    # 4M rows of 576 bf16 values: 2.4e9 elements, from a cache below 2**31 bytes
    assert paged_gather.select_dequant(None, gpu, small, 4 * rows, fp8.record_bytes, fp8.layout).name == "xla"


def test_gather_with_more_rows_than_tiles_and_empty_requests(records_implementation):
    fmt, cache, table, cu, _ = _case("fp8_ds_mla", seed=2)
    cu_empty = np.zeros_like(cu)
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu_empty),
                                      num_rows=64, **records_implementation)
    assert np.asarray(got).shape == (64, 656) and np.asarray(got).max() == 0


@pytest.mark.parametrize("num_reqs", [1, 2, 7, 33])
def test_gather_many_requests_straddling_tiles(num_reqs, records_implementation):
    """Requests of random lengths (empty ones included) start anywhere inside a tile and a page,
    so tiles span several requests; the rows past the last request are padding."""
    rng = np.random.default_rng(100 + num_reqs)
    block_size, num_blocks = 8, 40
    cache = rng.integers(0, 256, (num_blocks, block_size, 656), dtype=np.uint8)
    lens = rng.integers(0, 3 * block_size, num_reqs)
    lens[rng.random(num_reqs) < 0.2] = 0
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    max_blocks = max(1, -(-int(lens.max()) // block_size))
    table = rng.integers(0, num_blocks, (num_reqs, max_blocks)).astype(np.int32)
    rows = int(cu[-1]) + 13
    got = np.asarray(paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                                 num_rows=rows, **records_implementation))
    np.testing.assert_array_equal(got, _numpy_model(cache, table, cu, rows))
    assert got[cu[-1]:].max() == 0 and got[:cu[-1]].any(axis=1).all()


@pytest.mark.parametrize("num_reqs", [3, 33])
def test_gather_dequant_many_requests(num_reqs, implementation):
    rng = np.random.default_rng(200 + num_reqs)
    fmt = formats.get("nvfp4_ds_mla")
    kv_c, k_pe = random_kv(rng, 16 * 8)
    cache = np.asarray(fmt.encode(jnp.asarray(kv_c), jnp.asarray(k_pe))).reshape(16, 8, -1)
    lens = rng.integers(0, 20, num_reqs)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = rng.integers(0, 16, (num_reqs, 3)).astype(np.int32)
    args = (jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu))
    rows = int(cu[-1]) + 5
    got = paged_gather.gather_dequant(*args, num_rows=rows, layout=fmt.layout, **implementation)
    want = paged_gather.gather_dequant_reference(*args, num_rows=rows, layout=fmt.layout)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_gather_dequant_nvfp4_every_code_and_scale(kernel_mode):
    """The kernel's nvfp4 pair path on records holding every (e2m1 code, e4m3 scale byte) pair,
    NaN scales included, in two requests over shuffled pages, against the numpy oracle."""
    import oracle
    records = nvfp4_every_code_and_scale()
    cache = records.reshape(4, 4, 432)                 # 4 pages of 4 records
    table = np.array([[2, 0], [3, 1]], np.int32)
    cu = np.array([0, 8, 16], np.int32)
    got = pallas_triton.gather_dequant_triton(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                              num_rows=19, layout=formats.get("nvfp4_ds_mla").layout,
                                              interpret=kernel_mode == "interpret")
    order = np.concatenate([np.arange(8, 12), np.arange(0, 4), np.arange(12, 16), np.arange(4, 8)])
    with np.errstate(invalid="ignore"):              # NaN scales: NaN rows, cast on purpose
        want = oracle.decode("nvfp4_ds_mla", records[order]).astype(jnp.bfloat16)
    assert_bf16_bits_equal(np.asarray(got)[:16], want, "dequantized rows")
    assert not np.asarray(got)[16:].view(np.uint16).any(), "padding rows are zero"


# tiles smaller than, equal to and larger than the block (a tile spanning 4 pages), narrow pieces
CONFIGS = [pallas_triton.GatherTiles(4, 1, 16), pallas_triton.GatherTiles(8, 4, 512),
           pallas_triton.GatherTiles(32, 8, 128, evict_first=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"tile{c.rows_per_tile}_w{c.num_warps}_p{c.max_piece_bytes}_e{int(c.evict_first)}")
@pytest.mark.parametrize("name", NAMES)
def test_gather_configs_match_numpy_model(name, config, kernel_mode):
    fmt, cache, table, cu, rows = _case(name, seed=3)
    args = (jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu))
    interpret = kernel_mode == "interpret"
    got = pallas_triton.gather_records_triton(*args, num_rows=rows, config=config, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got), _numpy_model(cache, table, cu, rows))
    deq = pallas_triton.gather_dequant_triton(*args, num_rows=rows, layout=fmt.layout, config=config,
                                              interpret=interpret)
    ref = paged_gather.gather_dequant_reference(*args, num_rows=rows, layout=fmt.layout)
    np.testing.assert_array_equal(np.asarray(deq).view(np.uint16), np.asarray(ref).view(np.uint16))


# the persistent pack (`programs` > 0, the prefetch's bounded footprint): several tiles per
# program with the last round past the end, tiles over fewer programs than tiles, one tile larger
# than every row with programs that get none (the sweep's largest candidate), the prefetch's tiles
# as one program (both of `dcp_step.bounded_pack_tiles`' tiles)
PERSISTENT_CONFIGS = [pallas_triton.GatherTiles(8, 2, 512, programs=2), pallas_triton.GatherTiles(16, 4, 128, programs=3),
                      pallas_triton.GatherTiles(256, 16, 512, programs=3), pallas_triton.GatherTiles(128, 16, programs=1),
                      pallas_triton.GatherTiles(256, 32, programs=1)]


@pytest.mark.parametrize("config", PERSISTENT_CONFIGS, ids=lambda c: f"tile{c.rows_per_tile}_w{c.num_warps}_programs{c.programs}")
@pytest.mark.parametrize("name", NAMES)
def test_persistent_gather_configs_match_numpy_model(name, config, kernel_mode):
    fmt, cache, table, cu, rows = _case(name, seed=5)
    # poisoned, with rows past num_rows (a ring slot larger than the step): rows [0, num_rows)
    # must all be written and no other
    out = np.full((rows + 9, cache.shape[2]), 0xA5, np.uint8)
    got = np.asarray(pallas_triton.gather_records_triton(
        jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu), num_rows=rows, config=config, out=jnp.asarray(out),
        interpret=kernel_mode == "interpret"))
    np.testing.assert_array_equal(got[:rows], _numpy_model(cache, table, cu, rows))
    assert (got[rows:] == 0xA5).all(), "rows past num_rows were written"


@pytest.mark.parametrize("name", NAMES)
def test_gather_slots_matches_numpy_model(name, implementation):
    """Random slots over the whole cache with repeats, -1, num_slots and INT32_MAX sentinels, and a
    length that is not a multiple of any tile."""
    rng = np.random.default_rng(4)
    fmt, cache, _, _, _ = _case(name, seed=4)
    num_slots = cache.shape[0] * cache.shape[1]
    slots = rng.integers(0, num_slots, 77).astype(np.int32)
    slots[[3, 10, 40, 76]] = [-1, num_slots, 2 ** 31 - 1, -(2 ** 31)]
    slots[20] = slots[21]
    got = np.asarray(paged_gather.gather_slots(jnp.asarray(cache), jnp.asarray(slots), **implementation))
    flat = cache.reshape(num_slots, -1)
    want = np.where(((slots >= 0) & (slots < num_slots))[:, None], flat[np.clip(slots, 0, num_slots - 1)], 0)
    np.testing.assert_array_equal(got, want)
    assert got[[3, 10, 40, 76]].max() == 0 and got[:3].any(axis=1).all()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"tile{c.rows_per_tile}_w{c.num_warps}_p{c.max_piece_bytes}_e{int(c.evict_first)}")
def test_gather_slots_configs(config, kernel_mode):
    rng = np.random.default_rng(5)
    _, cache, _, _, _ = _case("fp8_ds_mla", seed=5)
    slots = rng.integers(-3, cache.shape[0] * cache.shape[1] + 3, 45).astype(np.int32)
    got = pallas_triton.gather_slots_triton(jnp.asarray(cache), jnp.asarray(slots), config=config,
                                            interpret=kernel_mode == "interpret")
    want = paged_gather.gather_slots_reference(jnp.asarray(cache), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gather_without_requests_is_all_padding(records_implementation):
    fmt, cache, _, _, _ = _case("nvfp4_ds_mla")
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.zeros((0, 4), jnp.int32), jnp.zeros((1,), jnp.int32),
                                      num_rows=24, **records_implementation)
    assert got.shape == (24, 432) and np.asarray(got).max() == 0


def test_gather_slots_empty_list(implementation):
    _, cache, _, _, _ = _case("bf16")
    got = paged_gather.gather_slots(jnp.asarray(cache), jnp.zeros((0,), jnp.int32), **implementation)
    assert got.shape == (0, 1152)


@pytest.mark.parametrize("record_bytes,max_piece,want", [
    (656, 512, ((0, 512), (512, 128), (640, 16))),
    (432, 512, ((0, 256), (256, 128), (384, 32), (416, 16))),
    (1152, 512, ((0, 512), (512, 512), (1024, 128))),
    (584, 256, ((0, 256), (256, 256), (512, 64), (576, 8))),
])
def test_record_pieces_cover_the_record(record_bytes, max_piece, want):
    assert pallas_triton.record_pieces(record_bytes, max_piece) == want


@pytest.mark.parametrize("num_reqs", [1, 8])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("config", [pallas_triton.GatherTiles(), pallas_triton.GatherTiles(16, 8, 256, True)])
def test_gathers_lower_for_cuda(name, config, num_reqs):
    layout = formats.get(name).layout
    sds = jax.ShapeDtypeStruct
    args = (sds((5000, 64, layout.record_bytes), jnp.uint8), sds((num_reqs, 600), jnp.int32),
            sds((num_reqs + 1,), jnp.int32))
    for f in (lambda c, b, u: pallas_triton.gather_records_triton(c, b, u, num_rows=32768, config=config),
              lambda c, b, u: pallas_triton.gather_dequant_triton(c, b, u, num_rows=32768, layout=layout,
                                                                  config=config),
              lambda c, b, u: pallas_triton.gather_slots_triton(c, u, config=config)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call") == 1 and "ckv_gather_" in text


@pytest.mark.parametrize("num_reqs", [1, 8])
@pytest.mark.parametrize("programs", [33, 66])
def test_the_persistent_pack_lowers_for_cuda(programs, num_reqs):
    """The prefetch's pack as it runs: persistent programs writing into a donated slot, with
    each of `bounded_pack_tiles`' tiles."""
    config = dcp_step.bounded_pack_tiles(programs)
    sds = jax.ShapeDtypeStruct
    args = (sds((5000, 64, 656), jnp.uint8), sds((num_reqs, 600), jnp.int32), sds((num_reqs + 1,), jnp.int32),
            sds((40000, 656), jnp.uint8))
    pack = jax.jit(lambda c, b, u, o: pallas_triton.gather_records_triton(c, b, u, o, num_rows=32768, config=config),
                   donate_argnums=3)
    text = pack.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and "ckv_gather_records_r656" in text


@pytest.mark.parametrize("field", ["rows_per_tile", "num_warps", "max_piece_bytes"])
def test_gather_config_rejects_non_powers_of_two(field):
    with pytest.raises(ValueError, match=field):
        pallas_triton.GatherTiles(**{field: 48})


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_mosaic_gather_pages_partial_pages_and_padding(block_size, kernel_mode):
    """Every row count 0..block_size of a page (each binary digit of the store), a request ending
    mid-page followed by padding in the same page, and a table with an out-of-range id."""
    rng = np.random.default_rng(block_size)
    fmt = formats.get("fp8_ds_mla")
    num_blocks = 40
    cache = rng.integers(0, 256, (num_blocks, block_size, fmt.record_bytes), dtype=np.uint8)
    lens = np.arange(block_size + 1, dtype=np.int32)[::-1].copy()
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = rng.integers(0, num_blocks, (len(lens), 2)).astype(np.int32)
    table[1, 0] = -5
    rows = int(cu[-1]) + block_size + 3
    if kernel_mode == "interpret":
        args = dict(implementation="pallas_mosaic_gpu", interpret=True)
    else:
        args = dict(implementation="pallas_mosaic_gpu")
    got = paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu), num_rows=rows, **args)
    np.testing.assert_array_equal(np.asarray(got), _numpy_model(cache, table, cu, rows))


def test_mosaic_gather_lowers_for_cuda_with_bulk_copies():
    sds = jax.ShapeDtypeStruct
    from pallas_kernels.paged_gather import pallas_mosaic_gpu
    for record_bytes in (656, 432, 1152):
        f = lambda c, b, u: pallas_mosaic_gpu.gather_records_mosaic(c, b, u, num_rows=32768)   # noqa: E731
        text = jax.jit(f).trace(sds((5000, 64, record_bytes), jnp.uint8), sds((8, 600), jnp.int32),
                                sds((9,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call") == 1 and "ckv_gather_records_mgpu" in text
        assert "cp.async.bulk.tensor" not in text, "pages go by plain bulk copies, not tensor maps"


@pytest.mark.parametrize("name", NAMES)
def test_gather_into_a_buffer_writes_its_head_and_keeps_the_rest(name, implementation):
    """`out=`: rows [0, num_rows) replaced by the gather, every later row of the poisoned
    destination left as it was (a ring slot holds more rows than a step gathers)."""
    fmt, cache, table, cu, rows = _case(name, seed=3)
    poison = np.random.default_rng(9).integers(0, 256, (rows + 37, fmt.record_bytes), dtype=np.uint8)
    got = np.asarray(paged_gather.gather_records(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu),
                                                 num_rows=rows, out=jnp.asarray(poison), **implementation))
    np.testing.assert_array_equal(got[:rows], _numpy_model(cache, table, cu, rows))
    np.testing.assert_array_equal(got[rows:], poison[rows:])


def test_gather_into_a_buffer_rejects_a_wrong_destination():
    fmt, cache, table, cu, rows = _case("fp8_ds_mla")
    args = (jnp.asarray(cache), jnp.asarray(table), jnp.asarray(cu))
    for bad in (jnp.zeros((rows - 1, 656), jnp.uint8), jnp.zeros((rows, 432), jnp.uint8),
                jnp.zeros((rows, 656), jnp.int8)):
        with pytest.raises(ValueError, match=rf"out: expected uint8\[>= {rows}, 656\]"):
            paged_gather.gather_records(*args, num_rows=rows, out=bad, implementation="xla")
    with pytest.raises(ValueError, match="out: the pallas_mosaic_gpu gather writes a fresh output only"):
        paged_gather.gather_records(*args, num_rows=rows, out=jnp.zeros((rows, 656), jnp.uint8),
                                    implementation="pallas_mosaic_gpu", interpret=True)


def test_gather_into_a_buffer_lowers_for_cuda_aliased():
    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda c, b, u, o: pallas_triton.gather_records_triton(c, b, u, o, num_rows=32768), donate_argnums=3)
    text = f.trace(sds((5000, 64, 656), jnp.uint8), sds((1, 600), jnp.int32), sds((2,), jnp.int32),
                   sds((40000, 656), jnp.uint8)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and "ckv_gather_records" in text
    assert "output_operand_aliases" in text, "the destination must be aliased in place"
