"""DCP layout formulas and the step plan against naive counting (hypothesis)."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import bucket_up, build_step_plan, capacity

layouts = st.builds(DcpLayout, world_size=st.sampled_from([1, 2, 3, 4, 8]),
                    interleave=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([4, 8, 64]))


def naive_owner_local(layout, n):
    owner = np.array([(p // layout.interleave) % layout.world_size for p in range(n)], np.int64)
    local = np.zeros(n, np.int64)
    seen = np.zeros(layout.world_size, np.int64)
    for p in range(n):
        local[p] = seen[owner[p]]
        seen[owner[p]] += 1
    return owner, local, seen


@settings(max_examples=60, deadline=None)
@given(layout=layouts, n=st.integers(0, 300))
def test_owner_local_and_inverse_match_naive_counting(layout, n):
    owner, local, seen = naive_owner_local(layout, n)
    p = np.arange(n)
    assert np.array_equal(layout.owner(p), owner)
    assert np.array_equal(layout.local_index(p), local)
    assert np.array_equal(layout.global_index(owner, local), p)
    assert np.array_equal(layout.local_seq_lens([n])[0], seen)
    for rank in range(layout.world_size):
        assert layout.local_seq_lens([n], rank)[0] == seen[rank]


@settings(max_examples=40, deadline=None)
@given(layout=layouts, lens=st.lists(st.integers(0, 200), min_size=1, max_size=4), data=st.data())
def test_slot_mapping_places_each_token_on_its_owner_at_its_local_index(layout, lens, data):
    max_blocks = max(int(layout.blocks_needed(layout.local_seq_lens([n]).max())) for n in lens) + 1
    table = np.asarray(data.draw(st.permutations(range(len(lens) * max_blocks)))).reshape(len(lens), max_blocks)
    table = table.astype(np.int32)
    for r, n in enumerate(lens):
        owner, local, _ = naive_owner_local(layout, n)
        pos = np.arange(n, dtype=np.int32)
        every = layout.slot_mapping(pos, np.full(n, r, np.int32), table, None)      # all ranks at once
        assert every.shape == (layout.world_size, n) and every.dtype == np.int32
        jax_every = layout.slot_mapping(jnp.asarray(pos), jnp.full(n, r, jnp.int32), jnp.asarray(table), None)
        assert np.array_equal(np.asarray(jax_every), every)
        for rank in range(layout.world_size):
            slots = layout.slot_mapping(pos, np.full(n, r, np.int32), table, rank)
            mine = owner == rank
            assert (slots[~mine] == -1).all()
            want = table[r, local[mine] // layout.block_size] * layout.block_size + local[mine] % layout.block_size
            assert np.array_equal(slots[mine], want)
            assert np.array_equal(every[rank], slots)


def test_local_seq_lens_examples_from_upstream():
    assert DcpLayout(2).local_seq_lens([8, 9, 10], 1).tolist() == [4, 4, 5]
    assert DcpLayout(4, 2).local_seq_lens([9]).tolist() == [[3, 2, 2, 2]]
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < 2"):
        DcpLayout(2).local_seq_lens([3], 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size: expected a positive int"),
    (dict(world_size=2, interleave=3, block_size=64), "interleave: expected a divisor of block_size=64"),
])
def test_layout_rejects_bad_geometry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DcpLayout(**kwargs)


@settings(max_examples=40, deadline=None)
@given(layout=layouts, lens=st.lists(st.integers(0, 500), min_size=1, max_size=5))
def test_step_plan_arrays(layout, lens):
    seq = np.asarray(lens)
    q = np.minimum(seq, 17)
    plan = build_step_plan(layout, seq, q, max_num_seqs=8)
    naive = np.array([[naive_owner_local(layout, n)[2][rank] for n in lens] for rank in range(layout.world_size)])
    assert np.array_equal(plan.rank_req_lens, naive)
    assert np.array_equal(plan.rank_req_starts[:, 0], np.zeros(layout.world_size))
    assert np.array_equal(plan.rank_req_starts + plan.rank_req_lens, np.cumsum(naive, axis=1))
    assert np.array_equal(plan.local_cu_seq_lens[:, 1:], np.cumsum(naive, axis=1))
    most = naive.sum(axis=1).max()
    assert plan.padded_tokens % 64 == 0 and plan.padded_tokens >= most
    assert plan.padded_tokens == min(bucket_up(most, 8, 64), plan.capacity)
    assert build_step_plan(layout, seq, q, max_num_seqs=8, shape_buckets=0).padded_tokens - most in range(64)
    assert plan.capacity == -(-(-(-131072 // layout.world_size) + 8 * layout.interleave) // 64) * 64
    positions = plan.positions()
    for t, r in enumerate(plan.req_id_per_token):
        assert positions[t] == seq[r] - q[r] + (t - plan.query_start_loc[r])


def test_eligibility_reasons():
    lay = DcpLayout(4)
    assert build_step_plan(lay, [1000, 800], [300, 200]).eligible
    assert "world_size 1 < 2" in build_step_plan(DcpLayout(1), [1000], [300]).why
    assert build_step_plan(DcpLayout(1), [1000], [300], min_world_size=1).eligible
    assert "not a pure prefill" in build_step_plan(lay, [1000, 800], [300, 1]).why
    assert "min_tokens 16" in build_step_plan(lay, [1000], [16]).why
    assert build_step_plan(lay, [1000], [17]).eligible
    tight = build_step_plan(lay, [100_000], [500], max_tokens=4096, max_num_seqs=1)
    assert not tight.eligible and "exceed capacity" in tight.why
    assert capacity(lay, 4096, 1) == 1088


@pytest.mark.parametrize("seq, q, err, match", [
    ([10, 5], [3], ValueError, r"query_lens: expected the shape of seq_lens \[2\]"),
    ([10], [11], ValueError, "query_lens: request 0 has 11 query tokens but only 10"),
    ([-1], [0], ValueError, "seq_lens: expected non-negative"),
    ([1.5], [1], TypeError, "seq_lens: expected int"),
])
def test_step_plan_rejects_bad_lengths(seq, q, err, match):
    with pytest.raises(err, match=match):
        build_step_plan(DcpLayout(2), np.asarray(seq), np.asarray(q))
