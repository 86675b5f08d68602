"""Adversarial inputs, determinism and faults across the whole pipeline (writer -> paged caches
-> pack -> all-gather -> attention).  Outcomes are exact results or the documented error."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dcp_scenario
from ckv_jax import full_ckv, placement, sparse_mla
from helpers import run_workers
from helpers import mesh_of


@st.composite
def steps(draw):
    d = draw(st.integers(1, 4))
    interleave = draw(st.sampled_from([1, 2]))
    block = draw(st.sampled_from([4, 8, 16]))
    edge = [0, 1, block - 1, block, block + 1, d * interleave * block]
    lens = draw(st.lists(st.one_of(st.sampled_from(edge), st.integers(0, 90)), min_size=1, max_size=3))
    queries = [draw(st.integers(0, n)) for n in lens]
    fmt = draw(st.sampled_from(["fp8_ds_mla", "nvfp4_ds_mla", "bf16"]))
    special = draw(st.sampled_from([(), ("subnormal",), ("nan",), ("inf",), ("nan", "inf", "subnormal")]))
    return d, interleave, block, lens, queries, fmt, special, draw(st.integers(0, 2 ** 16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_gathered_bytes_are_exact_or_the_documented_error(case):
    d, interleave, block, lens, queries, fmt, special, seed = case
    sc = dcp_scenario.build(d, interleave, fmt, lens, queries, block_size=block, seed=seed, special=special)
    mesh = mesh_of(d)
    caches = placement.place_caches(sc.caches, mesh)
    table = jnp.asarray(sc.block_table)          # stale ids (-1, num_blocks + 7, 2**31 - 1) past each prefix
    got = np.asarray(full_ckv.all_gather_ckv(caches, table, sc.plan, mesh=mesh, format=fmt, implementation="xla",
                                             validate=False))
    np.testing.assert_array_equal(got, dcp_scenario.expected_workspace(sc))
    # validation: an Inf in a quantized tile makes its scale non-finite, which the opt-in check names
    # (nvfp4 saturates its scale to 448 instead; bf16 has no scales)
    if "inf" in special and fmt == "fp8_ds_mla" and sum(lens):
        with pytest.raises(ValueError, match="non-finite tile_scales_f32 scale"):
            full_ckv.all_gather_ckv(caches, table, sc.plan, mesh=mesh, format=fmt, implementation="xla",
                                    validate=True)
    else:
        full_ckv.all_gather_ckv(caches, table, sc.plan, mesh=mesh, format=fmt, implementation="xla", validate=True)


@pytest.mark.parametrize("bad", [-1, "num_blocks", 2 ** 31 - 1])
def test_adversarial_block_ids_inside_a_prefix_are_masked_or_rejected(bad):
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", [40, 33], [8, 5], block_size=8, seed=11)
    table = sc.block_table.copy()
    num_blocks = sc.caches[0].shape[0]
    table[1, 1] = num_blocks if bad == "num_blocks" else bad
    mesh = mesh_of(2)
    caches = placement.place_caches(sc.caches, mesh)
    with pytest.raises(ValueError, match=rf"block_table: request 1 block 1 is {table[1, 1]}, expected a block id in "
                                         rf"\[0, {num_blocks}\)"):
        full_ckv.all_gather_ckv(caches, jnp.asarray(table), sc.plan, mesh=mesh, format="fp8_ds_mla", validate=True)
    for impl in ("xla", "pallas_triton"):
        got = np.asarray(full_ckv.all_gather_ckv(caches, jnp.asarray(table), sc.plan, mesh=mesh, format="fp8_ds_mla",
                                                 implementation=impl, interpret=True, validate=False))
        want = dcp_scenario.expected_workspace(sc)
        hit = np.zeros(len(want), bool)              # rows of request 1's local positions 8..15, per rank
        for owner in range(2):
            start = owner * sc.plan.padded_tokens + sc.plan.rank_req_starts[owner, 1]
            hit[start + 8:start + min(16, sc.plan.rank_req_lens[owner, 1])] = True
        np.testing.assert_array_equal(got[~hit], want[~hit])
        assert not got[hit].any(), "rows of an out-of-range block must be zero, never another block's bytes"


def test_a_nan_scale_in_a_cache_is_copied_raw_and_named_by_validation():
    sc = dcp_scenario.build(2, 1, "fp8_ds_mla", [30], [6], block_size=8, seed=5)
    caches = [c.copy() for c in sc.caches]
    block = sc.block_table[0, 0]
    caches[1][block, 2, 512:516] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    mesh = mesh_of(2)
    placed = placement.place_caches(caches, mesh)
    got = np.asarray(full_ckv.all_gather_ckv(placed, jnp.asarray(sc.block_table), sc.plan, mesh=mesh,
                                             format="fp8_ds_mla"))
    row = sc.plan.padded_tokens + 2                  # rank 1, local record 2
    np.testing.assert_array_equal(got[row], caches[1][block, 2])
    with pytest.raises(ValueError, match=rf"rank 1 local record 2 \(workspace row {row}\) has a non-finite"):
        full_ckv.all_gather_ckv(placed, jnp.asarray(sc.block_table), sc.plan, mesh=mesh, format="fp8_ds_mla",
                                validate=True)


def test_repeated_runs_are_bit_identical():
    sc = dcp_scenario.build(4, 2, "nvfp4_ds_mla", [70, 41, 9], [20, 41, 3], block_size=8, seed=3)
    mesh = mesh_of(4)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((sc.plan.num_tokens, 4, 576)), jnp.bfloat16)
    topk = np.minimum(rng.integers(0, 100, (sc.plan.num_tokens, 16)), sc.plan.positions()[:, None]).astype(np.int32)
    runs = []
    for _ in range(3):
        ws = full_ckv.all_gather_ckv(placement.place_caches([c.copy() for c in sc.caches], mesh),
                                     jnp.asarray(sc.block_table), sc.plan, mesh=mesh, format="nvfp4_ds_mla")
        idx, cnt = full_ckv.remap_topk(jnp.asarray(topk), sc.plan)
        out, lse = sparse_mla.sparse_mla_reference(q, ws, idx, cnt, 0.04, format="nvfp4_ds_mla")
        runs.append((np.asarray(ws), np.asarray(out), np.asarray(lse)))
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_dead_process_makes_the_other_fail_in_bounded_time(tmp_path):
    procs, logs = run_workers("mp_gather_worker.py",
                              lambda pid: [str(tmp_path / f"ws{pid}.npy")] + (["--die"] if pid == 1 else []),
                              timeout=150, wait_for=[0])
    survivor = logs[0]
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0, survivor[-2000:]
    assert "stopped sending heartbeats" in survivor, survivor[-2000:]     # says which task died
    assert not (tmp_path / "ws0.npy").exists()
