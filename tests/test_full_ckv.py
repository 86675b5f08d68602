"""The full-CKV gather on a real multi-device CPU mesh: bytes, remap and attention equivalence."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dcp_scenario
from ckv_jax import dcp_step, full_ckv, placement, sparse_mla
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan
from helpers import mesh_of

# prefix history plus a current chunk per request; one request that is all chunk
SEQ_LENS, QUERY_LENS = [45, 23, 70], [12, 23, 9]
K = 24


@pytest.fixture(params=["xla", "pallas_triton:interpret"])
def impl(request):
    name, _, mode = request.param.partition(":")
    return dict(implementation=name, interpret=mode == "interpret")


@pytest.mark.parametrize("d, interleave", [(2, 1), (2, 4), (4, 1), (4, 4)])
@pytest.mark.parametrize("name", ["fp8_ds_mla", "nvfp4_ds_mla"])
def test_gathered_workspace_is_the_rank_major_layout(d, interleave, name, impl):
    sc = dcp_scenario.build(d, interleave, name, SEQ_LENS, QUERY_LENS, seed=d * 10 + interleave)
    mesh = mesh_of(d)
    ws = full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table),
                                 sc.plan, mesh=mesh, format=name, **impl)
    assert ws.shape == (d * sc.plan.padded_tokens, sc.fmt.record_bytes)
    np.testing.assert_array_equal(np.asarray(ws), dcp_scenario.expected_workspace(sc))
    np.testing.assert_array_equal(np.asarray(full_ckv.workspace_to_global_order(ws, sc.plan)),
                                  dcp_scenario.global_records(sc))


def _global_topk(sc, rng, k=K):
    """Random causal picks per query row, -1 padded, with a few future positions mixed in."""
    plan = sc.plan
    pos = plan.positions()
    topk = np.full((plan.num_tokens, k), -1, np.int32)
    for t, p in enumerate(pos):
        n = min(k - 2, p + 1)
        topk[t, :n] = rng.choice(p + 1, size=n, replace=False)
        if p + 1 < plan.seq_lens[plan.req_id_per_token[t]]:
            topk[t, n] = p + 1                       # a future token: must be dropped
    return rng.permuted(topk, axis=1)


def test_remap_topk_rows_counts_and_causality():
    sc = dcp_scenario.build(4, 2, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=3)
    rng = np.random.default_rng(0)
    topk = _global_topk(sc, rng)
    idx, counts = full_ckv.remap_topk(jnp.asarray(topk), sc.plan)
    idx, counts = np.asarray(idx), np.asarray(counts)
    pos = sc.plan.positions()
    for t in range(sc.plan.num_tokens):
        r = sc.plan.req_id_per_token[t]
        keep = [x for x in topk[t] if 0 <= x <= pos[t]]
        assert counts[t] == len(keep) <= pos[t] + 1
        want = [int(dcp_step.workspace_rows(sc.plan, r, np.int64(x))) for x in keep]
        assert idx[t, :counts[t]].tolist() == want
        assert (idx[t, counts[t]:] == -1).all()


def _attention_inputs(sc, seed):
    rng = np.random.default_rng(seed)
    topk = _global_topk(sc, rng)
    q = (rng.standard_normal((sc.plan.num_tokens, 4, 576)) * 0.5).astype(jnp.bfloat16)
    return jnp.asarray(q), jnp.asarray(topk), 576 ** -0.5


def _single_device(sc, q, topk, sm_scale):
    """Non-DCP attention: records in global order, indices = request offset + position."""
    plan = sc.plan
    cu = np.concatenate([[0], np.cumsum(plan.seq_lens)])
    pos = plan.positions()
    rows = np.full_like(np.asarray(topk), -1)
    counts = np.zeros(plan.num_tokens, np.int32)
    for t in range(plan.num_tokens):
        keep = [x for x in np.asarray(topk)[t] if 0 <= x <= pos[t]]
        rows[t, :len(keep)] = cu[plan.req_id_per_token[t]] + np.asarray(keep, np.int64)
        counts[t] = len(keep)
    return sparse_mla.sparse_mla_reference(q, jnp.asarray(dcp_scenario.global_records(sc)), jnp.asarray(rows),
                                           jnp.asarray(counts), sm_scale, format=sc.fmt.name)


@pytest.mark.parametrize("d, interleave", [(2, 1), (4, 2)])
def test_each_rank_walks_only_its_own_topk_entries(d, interleave):
    """The stock path's rows of a rank (`owned_topk_slots`): the entries its cache holds, as slots
    the layout's slot mapping gives, first and in the top-k's order, then -1; their number is the
    count.  Holes, future positions and other ranks' entries are dropped."""
    sc = dcp_scenario.build(d, interleave, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=5)
    plan, table = sc.plan, sc.block_table
    topk = _global_topk(sc, np.random.default_rng(d))
    arrays = dcp_step.step_arrays(plan, table, mesh_of(d))
    pos = plan.positions()
    for rank in range(d):
        slots, counts = dcp_step.owned_topk_slots(jnp.asarray(topk), arrays, rank, plan.layout.block_size)
        slots, counts = np.asarray(slots), np.asarray(counts)
        for t in range(plan.num_tokens):
            r = plan.req_id_per_token[t]
            causal = [p for p in topk[t] if 0 <= p <= pos[t]]
            mapped = [int(plan.layout.slot_mapping(np.array([p]), np.array([r]), table, rank)[0]) for p in causal]
            want = [s for s in mapped if s >= 0]
            assert counts[t] == len(want), (rank, t)
            assert slots[t].tolist() == want + [-1] * (topk.shape[1] - len(want)), (rank, t)
    assert 0 < counts.sum() < (topk >= 0).sum()


def _close(a, b, what):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max(), err_msg=what)


@pytest.mark.parametrize("d, interleave", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("name", ["fp8_ds_mla", "bf16", "nvfp4_ds_mla"])
def test_full_ckv_equals_stock_dcp_equals_single_device(d, interleave, name):
    sc = dcp_scenario.build(d, interleave, name, SEQ_LENS, QUERY_LENS, seed=7 + d)
    mesh = mesh_of(d)
    caches = placement.place_caches(sc.caches, mesh)
    q, topk, sm_scale = _attention_inputs(sc, seed=d)
    ws = full_ckv.all_gather_ckv(caches, jnp.asarray(sc.block_table), sc.plan, mesh=mesh, format=name)
    idx, counts = full_ckv.remap_topk(topk, sc.plan)
    out_full, lse_full = sparse_mla.full_ckv_attention(q, ws, idx, counts, sm_scale, format=name, mesh=mesh)
    out_stock, lse_stock = sparse_mla.stock_dcp_attention(q, caches, sc.block_table, topk, sc.plan, sm_scale,
                                                          format=name, mesh=mesh)
    out_one, lse_one = _single_device(sc, q, topk, sm_scale)
    # same records and keys in the same order; only the float32 reduction shapes differ (H/D heads)
    np.testing.assert_allclose(np.asarray(out_full, np.float32), np.asarray(out_one, np.float32),
                               rtol=8e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(lse_full), np.asarray(lse_one), rtol=1e-5, atol=1e-5)
    # the stock path sums per-rank partials: equal within bf16 rounding
    _close(out_stock, out_one, "stock DCP output")
    np.testing.assert_allclose(np.asarray(lse_stock), np.asarray(lse_one), rtol=1e-5, atol=1e-4)
    assert np.abs(np.asarray(out_one, np.float32)).max() > 0.05


def test_union_of_local_topks_is_not_global_topk_attention():
    """Each rank picking its own top-k over its shard (then merging) attends to other keys than the
    global top-k: the outputs differ well beyond rounding."""
    d, name = 4, "fp8_ds_mla"
    sc = dcp_scenario.build(d, 1, name, SEQ_LENS, QUERY_LENS, seed=21)
    mesh = mesh_of(d)
    caches = placement.place_caches(sc.caches, mesh)
    rng = np.random.default_rng(5)
    plan, k = sc.plan, 8
    pos = plan.positions()
    scores = rng.standard_normal((plan.num_tokens, int(plan.seq_lens.max())))
    q = jnp.asarray((rng.standard_normal((plan.num_tokens, 4, 576))).astype(jnp.bfloat16))
    global_topk = np.full((plan.num_tokens, k), -1, np.int32)
    local_topk = np.full((d, plan.num_tokens, k), -1, np.int32)
    for t, p in enumerate(pos):
        causal = np.arange(p + 1)
        best = causal[np.argsort(-scores[t, :p + 1])][:k]
        global_topk[t, :len(best)] = best
        for rank in range(d):
            mine = causal[(causal % d) == rank]
            pick = mine[np.argsort(-scores[t, mine])][:k]
            local_topk[rank, t, :len(pick)] = pick
    ref, _ = _single_device(sc, q, jnp.asarray(global_topk), 0.05)
    union = np.concatenate(list(local_topk), axis=1)        # every rank's picks; each rank keeps its own
    out_union, _ = sparse_mla.stock_dcp_attention(q, caches, sc.block_table, jnp.asarray(union), plan, 0.05,
                                                  format=name, mesh=mesh)
    diff = np.abs(np.asarray(out_union, np.float32) - np.asarray(ref, np.float32)).max()
    assert diff > 0.1 * np.abs(np.asarray(ref, np.float32)).max()


def test_empty_rows_give_zero_output_and_minus_inf_lse():
    sc = dcp_scenario.build(2, 1, "bf16", [20], [18], seed=1)
    q, _, sm_scale = _attention_inputs(sc, 0)
    idx = jnp.full((sc.plan.num_tokens, 4), -1, jnp.int32)
    out, lse = sparse_mla.sparse_mla_reference(q, jnp.asarray(dcp_scenario.global_records(sc)), idx,
                                               jnp.zeros(sc.plan.num_tokens, jnp.int32), sm_scale, format="bf16")
    assert np.asarray(out, np.float32).max() == 0 and np.isneginf(np.asarray(lse)).all()


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_all_gather_rejects_mesh_and_table_mismatches(monkeypatch):
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=0)
    mesh4 = mesh_of(4)
    mesh2 = mesh_of(2)
    caches = placement.place_caches(sc.caches, mesh2)
    table = jnp.asarray(sc.block_table)
    with pytest.raises(ValueError, match="mesh: axis 'dcp' has size 4, expected the plan's world_size 2"):
        full_ckv.all_gather_ckv(placement.place_caches(sc.caches * 2, mesh4), table, sc.plan, mesh=mesh4,
                                format="fp8_ds_mla")
    with pytest.raises(ValueError, match="mesh: expected an axis named 'dcp'"):
        full_ckv.all_gather_ckv(caches, table, sc.plan, format="fp8_ds_mla",
                                mesh=jax.make_mesh((2,), ("x",), devices=mesh2.devices.flatten().tolist()))
    with pytest.raises(ValueError, match="seq_lens: request 2 needs 5 blocks per rank but block_table has 2"):
        full_ckv.all_gather_ckv(caches, table[:, :2], sc.plan, mesh=mesh2, format="fp8_ds_mla")
    with pytest.raises(TypeError, match="block_table: expected int32"):
        full_ckv.all_gather_ckv(caches, table.astype(jnp.int16), sc.plan, mesh=mesh2, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"cache: expected uint8\[num_blocks, block_size, 432\]"):
        full_ckv.all_gather_ckv(caches, table, sc.plan, mesh=mesh2, format="nvfp4_ds_mla")
    bad = np.array(sc.block_table)
    bad[0, 1] = 10_000
    with pytest.raises(ValueError, match=r"block_table: request 0 block 1 is 10000, expected a block id in \[0, "):
        full_ckv.all_gather_ckv(caches, jnp.asarray(bad), sc.plan, mesh=mesh2, format="fp8_ds_mla", validate=True)
    # validation off: the bad block reads as zeros, nothing else changes
    ws = np.asarray(full_ckv.all_gather_ckv(caches, jnp.asarray(bad), sc.plan, mesh=mesh2, format="fp8_ds_mla",
                                            validate=False))
    want = dcp_scenario.expected_workspace(sc)
    differ = np.flatnonzero((ws != want).any(axis=1))
    assert differ.size and (ws[differ] == 0).all()


def test_remap_rejects_bad_topk():
    plan = build_step_plan(DcpLayout(2), [40], [20])
    with pytest.raises(TypeError, match=r"topk: expected int32\[20, K\], got int64"):
        full_ckv.remap_topk(np.zeros((20, 8), np.int64), plan)
    with pytest.raises(ValueError, match=r"topk: expected int32\[20, K\] \(one row per query token\)"):
        full_ckv.remap_topk(jnp.zeros((19, 8), jnp.int32), plan)


@pytest.mark.parametrize("d, interleave, name", [(2, 1, "fp8_ds_mla"), (4, 2, "nvfp4_ds_mla"), (4, 1, "bf16")])
def test_patch_turns_a_history_gather_into_the_synchronous_gather(d, interleave, name, impl):
    """Gather before the chunk is written (prefetch), patch the chunk: equal to the gather after
    the write, and every history row byte-unchanged by the patch."""
    kw = dict(seed=31 + d)
    before = dcp_scenario.build(d, interleave, name, SEQ_LENS, QUERY_LENS, history_only=True, **kw)
    after = dcp_scenario.build(d, interleave, name, SEQ_LENS, QUERY_LENS, **kw)
    mesh = mesh_of(d)
    table = jnp.asarray(before.block_table)
    prefetched = full_ckv.all_gather_ckv(placement.place_caches(before.caches, mesh), table, before.plan, mesh=mesh,
                                         format=name)
    prefetched_np = np.asarray(prefetched)
    kv_c, k_pe = dcp_scenario.chunk_latents(before)
    patched = np.asarray(full_ckv.patch_current_chunk(prefetched, kv_c, k_pe, before.plan, name, **impl))
    synchronous = np.asarray(full_ckv.all_gather_ckv(placement.place_caches(after.caches, mesh), table, after.plan,
                                                     mesh=mesh, format=name))
    np.testing.assert_array_equal(patched, synchronous)
    rows = dcp_step.chunk_rows(before.plan)
    history = np.setdiff1d(np.arange(patched.shape[0]), rows)
    np.testing.assert_array_equal(patched[history], prefetched_np[history])
    assert (prefetched_np[rows] != synchronous[rows]).any(), "the chunk rows were stale before the patch"


def test_patch_rejects_mismatched_inputs():
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=2)
    ws = jnp.zeros((2 * sc.plan.padded_tokens, 656), jnp.uint8)
    kv_c, k_pe = dcp_scenario.chunk_latents(sc)
    with pytest.raises(ValueError, match=r"kv_c: expected \[44, 512\] \(the step's query tokens\)"):
        full_ckv.patch_current_chunk(ws, kv_c[:10], k_pe[:10], sc.plan, "fp8_ds_mla")
    with pytest.raises(ValueError, match=r"workspace: expected uint8\[>= 256, 656\] \(at least D \* P rows\)"):
        full_ckv.patch_current_chunk(ws[:100], kv_c, k_pe, sc.plan, "fp8_ds_mla")


def test_place_caches_checks_the_rank_count_and_shapes():
    mesh = mesh_of(4)
    cache = np.zeros((4, 16, 656), np.uint8)
    for n in (3, 5):
        with pytest.raises(ValueError, match=rf"per_rank_caches: expected one cache per rank of mesh axis 'dcp' "
                                             rf"\(4\), got {n}"):
            placement.place_caches([cache] * n, mesh)
    with pytest.raises(ValueError, match=r"every rank's cache must be uint8\[4, 16, 656\] .* uint8\[5, 16, 656\] "
                                         r"for rank 2"):
        placement.place_caches([cache, cache, np.zeros((5, 16, 656), np.uint8), cache], mesh)
    with pytest.raises(ValueError, match=r"expected uint8\[num_blocks, block_size, R\] per rank, got float32"):
        placement.place_caches([cache.astype(np.float32)] * 4, mesh)
    with pytest.raises(ValueError, match=r"mesh: expected an axis named 'dcp', got axes \('x',\)"):
        placement.place_caches([cache] * 4, jax.make_mesh((4,), ("x",), devices=mesh.devices.flat))


def test_attention_entries_check_their_inputs():
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=3)
    mesh = mesh_of(2)
    q, topk, sm_scale = _attention_inputs(sc, seed=1)
    ws = full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table), sc.plan,
                                 mesh=mesh, format="fp8_ds_mla", implementation="xla")
    idx, cnt = full_ckv.remap_topk(topk, sc.plan)
    t = sc.plan.num_tokens

    def full(**kw):
        args = dict(q=q, workspace=ws, indices=idx, counts=cnt, sm_scale=sm_scale, format="fp8_ds_mla", mesh=mesh)
        args.update(kw)
        return sparse_mla.full_ckv_attention(**args)

    cases = [
        (dict(format="nvfp4_ds_mla"), ValueError, r"workspace: expected uint8\[N, 432\] for format nvfp4_ds_mla"),
        (dict(format="bf16"), ValueError, r"workspace: expected uint8\[N, 1152\] for format bf16"),
        (dict(workspace=ws.astype(jnp.float32)), TypeError, r"workspace: expected uint8\[N, 656\]"),
        (dict(q=q[..., :512]), ValueError, r"q: expected \[T, H, 576\] \(512 latent \+ 64 RoPE\)"),
        (dict(counts=cnt[:-1]), ValueError, rf"counts: expected int32\[{t}\] \(one count per query token"),
        (dict(indices=idx.astype(jnp.int16)), TypeError, rf"indices: expected int32\[{t}, K\]"),
        (dict(sm_scale=0.0), ValueError, r"sm_scale: expected a positive finite number, got 0.0"),
        (dict(sm_scale=float("nan")), ValueError, r"sm_scale: expected a positive finite number"),
        (dict(mesh=jax.make_mesh((2,), ("tp",), devices=mesh.devices.flat)), ValueError,
         r"mesh: expected an axis named 'dcp', got axes \('tp',\)"),
    ]
    for kw, err, pattern in cases:
        with pytest.raises(err, match=pattern):
            full(**kw)
    with pytest.raises(ValueError, match=r"records: expected uint8\[N, 1152\] for format bf16"):
        sparse_mla.sparse_mla_reference(q, ws, idx, cnt, sm_scale, format="bf16")
    with pytest.raises(ValueError, match=rf"topk: expected int32\[{t}, K\]"):
        sparse_mla.stock_dcp_attention(q, placement.place_caches(sc.caches, mesh), sc.block_table, topk[:-1],
                                       sc.plan, sm_scale, format="fp8_ds_mla", mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh: axis 'dcp' has size 4, expected the plan's world_size 2"):
        sparse_mla.stock_dcp_attention(q, placement.place_caches(sc.caches * 2, mesh_of(4)), sc.block_table, topk,
                                       sc.plan, sm_scale, format="fp8_ds_mla", mesh=mesh_of(4))


def test_a_nan_reaches_its_row_and_only_its_row():
    """A NaN in q[t] or in a record row t selects makes that row's output and lse NaN, on every
    path (the reference, full-CKV, and stock DCP through the LSE merge); other rows stay finite
    and an empty row stays (zeros, -inf)."""
    sc = dcp_scenario.build(2, 1, "bf16", SEQ_LENS, QUERY_LENS, seed=4)
    mesh = mesh_of(2)
    caches = placement.place_caches(sc.caches, mesh)
    q, topk, sm_scale = _attention_inputs(sc, seed=2)
    q = q.at[0, 0, 0].set(jnp.nan)
    ws = full_ckv.all_gather_ckv(caches, jnp.asarray(sc.block_table), sc.plan, mesh=mesh, format="bf16",
                                 implementation="xla")
    idx, cnt = full_ckv.remap_topk(topk, sc.plan)
    cnt = cnt.at[5].set(0)                                   # row 5: empty
    results = {"full": sparse_mla.full_ckv_attention(q, ws, idx, cnt, sm_scale, format="bf16", mesh=mesh),
               "reference": sparse_mla.sparse_mla_reference(q, ws, idx, cnt, sm_scale, format="bf16")}
    for path, (out, lse) in results.items():
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]), path
        assert np.isfinite(out[1:5]).all() and np.isfinite(lse[1:5]).all(), path
        assert (out[5] == 0).all() and np.isneginf(lse[5]).all(), path
        assert np.isfinite(out[0, 1:]).all(), f"{path}: other heads of the row are untouched"
    out, lse = sparse_mla.stock_dcp_attention(q, caches, sc.block_table, topk, sc.plan, sm_scale, format="bf16",
                                              mesh=mesh)
    assert np.isnan(np.asarray(out, np.float32)[0, 0]).all() and np.isnan(np.asarray(lse)[0, 0])
    assert np.isfinite(np.asarray(lse)[1:]).all()
    # a NaN in a selected record (a bf16 latent of the workspace row row 1 attends first)
    bad_row = int(idx[1, 0])
    poisoned = np.asarray(ws).copy()
    poisoned[bad_row, :2] = np.array([0x7FC0], np.uint16).view(np.uint8)
    out, lse = sparse_mla.sparse_mla_reference(q, jnp.asarray(poisoned), idx, cnt, sm_scale, format="bf16")
    rows_using = {t for t in range(sc.plan.num_tokens) if bad_row in np.asarray(idx)[t, :int(cnt[t])]}
    for t in range(sc.plan.num_tokens):
        assert np.isnan(np.asarray(lse)[t]).all() == (t in rows_using or t == 0), t


def test_outputs_index_like_ordinary_arrays_on_a_default_mesh():
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", SEQ_LENS, QUERY_LENS, seed=6)
    mesh = jax.make_mesh((2,), (placement.DCP_AXIS,), devices=jax.devices("cpu")[:2])   # explicit axis types
    q, topk, sm_scale = _attention_inputs(sc, seed=3)
    ws = full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table), sc.plan,
                                 mesh=mesh, format="fp8_ds_mla", implementation="xla")
    idx, cnt = full_ckv.remap_topk(topk, sc.plan)
    out, lse = sparse_mla.full_ckv_attention(q, ws, idx, cnt, sm_scale, format="fp8_ds_mla", mesh=mesh)
    assert np.isfinite(float(out[0, 0, 0])) and np.isfinite(float(lse[0, 1])) and ws[0, 0].shape == ()
    m = placement.dcp_mesh(2, jax.devices("cpu"))
    assert m.axis_names == (placement.DCP_AXIS,) and m.axis_types == (jax.sharding.AxisType.Auto,)
    with pytest.raises(ValueError, match=r"world_size: 8 ranks need as many devices, got 4 \(cpu\); on a CPU set"):
        placement.dcp_mesh(8, jax.devices("cpu"))
