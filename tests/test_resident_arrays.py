"""`interop.resident_arrays`: a step's arrays refreshed into memory that stays put, on CPU
tensors here (the adapter's GPU steps in test_interop_gpu.py)."""
import jax
import numpy as np
import pytest
import torch

from ckv_jax import dcp_step, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan
from interop.resident_arrays import ResidentStepArrays


def _host(seq, query, table, capacity):
    plan = build_step_plan(DcpLayout(2, 1, 8), np.array(seq), np.array(query), max_num_seqs=3, min_tokens=1)
    return dcp_step.host_step_arrays(plan, table, chunk_capacity=capacity)


def _pointers(arrays):
    return [leaf.addressable_data(0).unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(arrays)]


def test_each_refresh_holds_the_steps_values_in_the_same_memory_while_the_shapes_stay():
    device = jax.devices("cpu")[0]
    mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=[device])
    resident = ResidentStepArrays(mesh, device, torch.device("cpu"))
    rng = np.random.default_rng(3)
    table = rng.permutation(3 * 9).astype(np.int32).reshape(3, 9)
    steps = [_host([40, 9, 71], [17, 3, 12], table, 64),
             _host([41, 30, 60], [17, 3, 12], table[::-1].copy(), 64),    # same shapes, other values
             _host([41, 30], [9, 23], table[:2], 64),                        # fewer requests
             _host([40, 9, 71], [17, 3, 12], table, 64)]                     # the first shapes again
    seen = []
    for host in steps:
        arrays = resident.refresh(host)
        assert (arrays.num_rows, arrays.layout) == (host.num_rows, host.layout)
        for name in ("block_table", "local_cu", "slots", "chunk_rows", "req_id", "causal_len", "rank_lens"):
            got = getattr(arrays, name)
            assert got.sharding.is_fully_replicated and got.dtype == np.int32, name
            np.testing.assert_array_equal(np.asarray(got), getattr(host, name), err_msg=name)
        pointers = _pointers(arrays)
        assert all((p - pointers[0]) % 256 == 0 for p in pointers)        # each array 256-byte aligned in one buffer
        seen.append(pointers)
    assert seen[1] == seen[0] and seen[3] == seen[0] and seen[2] != seen[0]


def test_the_oldest_shapes_buffer_is_dropped_beyond_the_kept_number():
    device = jax.devices("cpu")[0]
    mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=[device])
    resident = ResidentStepArrays(mesh, device, torch.device("cpu"), shapes_kept=2)
    table = np.random.default_rng(5).permutation(27).astype(np.int32).reshape(3, 9)
    a, b, c = (_host([40, 9, 71], [17, 3, 12], table, 64), _host([41, 30], [9, 23], table[:2], 64),
               _host([40, 9, 71], [17, 3, 12], table, 128))
    first = _pointers(resident.refresh(a))
    resident.refresh(b)
    assert _pointers(resident.refresh(a)) == first          # two sets kept: a's buffer still there
    resident.refresh(c)                                      # a third set drops the oldest, b's
    assert len(resident._buffers) == 2
    got = resident.refresh(b)                                # b again: a new buffer, then a's is the oldest
    np.testing.assert_array_equal(np.asarray(got.slots), b.slots)
    assert set(resident._buffers) == {tuple(x.shape for x in jax.tree_util.tree_leaves(h)) for h in (c, b)}


def test_a_refresh_takes_only_the_host_arrays_of_a_step():
    device = jax.devices("cpu")[0]
    mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=[device])
    resident = ResidentStepArrays(mesh, device, torch.device("cpu"))
    table = np.arange(27, dtype=np.int32).reshape(3, 9)
    host = _host([40, 9, 71], [17, 3, 12], table, None)
    with pytest.raises(TypeError, match="host: expected numpy int32 arrays"):
        resident.refresh(jax.device_put(host))
