"""The step's static shapes: P, the requests and the block table's columns rounded up to a few
values per doubling (`step_plan.bucket_up`), so a prefill that grows its history step by step
compiles a few programs per doubling instead of one a step, and gathers the same bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dcp_scenario
from ckv_jax import dcp_step, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch import PrefetchOrchestrator
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import DEFAULT_SHAPE_BUCKETS, bucket_up, build_step_plan
from helpers import mesh_of


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 1 << 22), per_doubling=st.sampled_from([0, 1, 2, 8, 16]),
       align=st.sampled_from([1, 8, 64]))
def test_a_bucket_holds_its_size_and_pads_it_by_less_than_one_bucket(n, per_doubling, align):
    shape, exact = bucket_up(n, per_doubling, align), -(-n // align) * align
    assert shape % align == 0 and shape >= exact
    if per_doubling == 0 or exact <= per_doubling * align:
        assert shape == exact
    else:
        assert (shape - exact) * per_doubling < exact, (n, shape)
    assert bucket_up(shape, per_doubling, align) == shape          # a shape is its own bucket
    assert bucket_up(n + 1, per_doubling, align) >= shape         # growing sizes never shrink it


@pytest.mark.parametrize("per_doubling", [1, 4, 8, 16])
def test_each_doubling_holds_per_doubling_shapes(per_doubling):
    for k in range(6):
        low = per_doubling * 64 << k
        shapes = {bucket_up(n, per_doubling, 64) for n in range(low + 1, 2 * low + 1)}
        assert len(shapes) == per_doubling and max(shapes) == 2 * low, (k, sorted(shapes))


def test_the_plan_rounds_p_to_its_buckets_within_the_capacity():
    layout = DcpLayout(2, 1, 64)
    exact = build_step_plan(layout, [9000, 700], [300, 100], shape_buckets=0)
    assert exact.padded_tokens == 4864                          # ceil64 of rank 0's 4850 local tokens
    plan = build_step_plan(layout, [9000, 700], [300, 100])
    assert plan.shape_buckets == DEFAULT_SHAPE_BUCKETS == 8
    assert plan.padded_tokens == bucket_up(4850, 8, 64) == 5120
    # at the top, the capacity is the shape: C = ceil64(4900 / 2 + 2) = 2496 rows
    full = build_step_plan(layout, [4900], [300], max_tokens=4900, max_num_seqs=2)
    assert full.capacity == 2496 and full.padded_tokens == 2496 and full.eligible
    over = build_step_plan(layout, [5200], [300], max_tokens=4900, max_num_seqs=2)
    assert not over.eligible and "P=2624 exceed capacity C=2496" in over.why


@pytest.mark.parametrize("bad", [3, -1, 1.0, True, "8"])
def test_a_bad_bucket_count_is_rejected(bad):
    with pytest.raises(ValueError, match="shape_buckets: expected 0 .* or a power of two"):
        build_step_plan(DcpLayout(2), [900], [300], shape_buckets=bad)


def test_padded_arrays_pad_requests_and_columns_with_nothing_to_read():
    layout = DcpLayout(2, 1, 8)
    plan = build_step_plan(layout, [90, 40, 70], [30, 20, 10], shape_buckets=1)
    table = np.random.default_rng(0).integers(0, 50, (3, 6), dtype=np.int32)
    arrays = dcp_step.host_step_arrays(plan, table, chunk_capacity=64)
    assert arrays.block_table.shape == (4, 8) and arrays.local_cu.shape == (2, 5) and arrays.rank_lens.shape == (2, 4)
    np.testing.assert_array_equal(arrays.block_table[:3, :6], table)
    assert not arrays.block_table[3].any() and not arrays.block_table[:, 6:].any()
    np.testing.assert_array_equal(arrays.local_cu[:, :4], plan.local_cu_seq_lens)
    np.testing.assert_array_equal(arrays.local_cu[:, 4], plan.local_cu_seq_lens[:, 3])    # a padding request is empty
    assert not arrays.rank_lens[:, 3].any()
    assert arrays.chunk_rows.shape == arrays.req_id.shape == arrays.causal_len.shape == (64,)
    assert (arrays.chunk_rows[60:] == -1).all() and not arrays.req_id[60:].any() and not arrays.causal_len[60:].any()
    assert (arrays.slots[:, 60:] == -1).all()
    exact = dcp_step.host_step_arrays(build_step_plan(layout, [90, 40, 70], [30, 20, 10], shape_buckets=0), table)
    assert exact.block_table.shape == (3, 6) and exact.chunk_rows.shape == (60,)


@pytest.mark.parametrize("pack", ["xla", "pallas_triton:interpret", "pallas_triton:interpret:3",
                                  pytest.param("pallas_triton:compiled", marks=pytest.mark.gpu),
                                  pytest.param("pallas_triton:compiled:3", marks=pytest.mark.gpu)])
def test_a_padded_step_gathers_the_same_workspace(pack):
    """Padding requests and columns (shape_buckets=1: powers of two) read nothing: the pack's
    rows (the full grid, or 3 persistent programs as a prefetch packs) are the naive workspace,
    zero past each rank's total up to the bucketed P.  Two ranks, or compiled on one GPU, one."""
    implementation, _, rest = pack.partition(":")
    mode, _, programs = rest.partition(":")
    d = 1 if mode == "compiled" and len(jax.devices()) < 2 else 2
    sc = dcp_scenario.build(d, 1, "fp8_ds_mla", [150, 0, 131], [20, 0, 31], seed=5)
    mesh = mesh_of(d)
    plan = build_step_plan(sc.layout, sc.seq_lens, sc.query_lens, max_num_seqs=8, min_tokens=1, shape_buckets=1)
    # 141 rows on rank 0 of two, 281 on one
    assert (plan.padded_tokens, sc.plan.padded_tokens) == {2: (256, 192), 1: (512, 320)}[d]
    arrays = dcp_step.step_arrays(plan, sc.block_table, mesh)
    assert arrays.block_table.shape[0] == 4 and arrays.block_table.shape[1] > sc.block_table.shape[1]
    caches = placement.place_caches(sc.caches, mesh)
    tiles = dcp_step.bounded_pack_tiles(int(programs)) if programs else None
    ws = dcp_step.gather_program(caches, arrays, mesh=mesh, implementation=implementation,
                                 interpret=mode == "interpret", tiles=tiles)
    np.testing.assert_array_equal(np.asarray(ws), dcp_scenario.expected_workspace(sc, plan=plan))


def test_a_growing_prefill_compiles_a_few_programs_per_doubling():
    """A request's prefill past an 8,192-token prefix in 40 chunks of 64 tokens, with the
    engine's table cut to the blocks it needs (its width grows every step): the exact P would
    take 20 values, the default buckets 3, and the orchestrator's layer program compiles once
    per distinct set of the step's shapes; every gather checked is exact."""
    d, prefix, chunk, steps = 2, 8192, 64, 40
    final = prefix + chunk * steps
    sc = dcp_scenario.build(d, 1, "fp8_ds_mla", [final], [final], seed=9)
    mesh = mesh_of(d)
    orch = PrefetchOrchestrator(mesh, sc.layout, "fp8_ds_mla", max_num_seqs=1, implementation="xla",
                                config=GatherConfig(enabled=True, depth=0, workspace_mib=0, max_tokens=2 * final))
    cache = placement.place_caches(sc.caches, mesh)
    before = orch._layer_program._cache_size()
    signatures, exact_rows = set(), set()
    for s in range(1, steps + 1):
        seq, query = np.array([prefix + s * chunk]), np.array([chunk])
        plan = build_step_plan(sc.layout, seq, query, max_num_seqs=1, max_tokens=2 * final, min_tokens=1)
        exact_rows.add(build_step_plan(sc.layout, seq, query, max_num_seqs=1, max_tokens=2 * final, min_tokens=1,
                                       shape_buckets=0).padded_tokens)
        width = int(sc.layout.blocks_needed(sc.layout.local_seq_lens(seq).max()))
        orch.begin_step(plan, sc.block_table[:, :width])
        arrays = orch.step_arrays
        signatures.add((arrays.num_rows,) + tuple(a.shape for a in (arrays.block_table, arrays.local_cu,
                                                                    arrays.slots, arrays.req_id)))
        done = int(seq[0])
        kv, pe = (jnp.asarray(x[done - chunk:done]) for x in (sc.kv_c[0], sc.k_pe[0]))
        ws = orch.gather(0, cache, kv, pe)
        if s % 8 == 0:
            want = dcp_scenario.expected_workspace(sc, seq_lens=seq, plan=plan)
            np.testing.assert_array_equal(np.asarray(ws)[:len(want)], want, err_msg=f"step {s}")
    compiled = orch._layer_program._cache_size() - before
    assert len(exact_rows) == steps // 2
    assert compiled <= len(signatures) <= 3, (compiled, sorted(signatures))
