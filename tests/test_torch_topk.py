"""`interop.torch_topk`: the torch top-k remap against the library's (`full_ckv.remap_topk`),
on CPU tensors here (CUDA in test_interop_gpu.py, through the adapter)."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ckv_jax import full_ckv
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan
from interop import torch_topk


def _plan(d, interleave, seed):
    rng = np.random.default_rng(seed)
    query = rng.integers(1, 30, size=4)
    query[1] = 0 if d > 1 else query[1]          # a request with no query rows this step
    seq = query + rng.integers(0, 200, size=4)
    return build_step_plan(DcpLayout(d, interleave, 8), seq, query, max_num_seqs=4, min_tokens=1,
                           min_world_size=1)


def _tables(plan):
    return torch_topk.TopkTables(plan, torch.device("cpu"))


def _topk(plan, k, rng):
    """Every kind of entry: in the causal past, -1, the future, past the request, negative."""
    causal = plan.causal_lens()[:, None]
    seq = plan.seq_lens[plan.req_id_per_token][:, None]
    choice = rng.integers(0, 6, size=(plan.num_tokens, k))
    past = rng.integers(0, causal, size=(plan.num_tokens, k))
    future = causal + rng.integers(0, 8, size=(plan.num_tokens, k))
    beyond = seq + rng.integers(0, 1 << 20, size=(plan.num_tokens, k))
    out = np.select([choice < 3, choice == 3, choice == 4], [past, -1, future], beyond)
    out[choice == 5] = np.where(rng.random(np.count_nonzero(choice == 5)) < 0.5, out[choice == 5], -7)
    return out.astype(np.int32)


@pytest.mark.parametrize("d,interleave", [(1, 1), (2, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("k", [1, 16, 37])
def test_the_torch_remap_is_the_library_remap(d, interleave, k):
    rng = np.random.default_rng(100 * d + k)
    plan = _plan(d, interleave, seed=d + interleave)
    tables = _tables(plan)
    for _ in range(3):                                     # the step's tables serve every call
        topk = _topk(plan, k, rng)
        idx, cnt = torch_topk.remap_topk(torch.from_numpy(topk), tables)
        want_idx, want_cnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
        assert idx.dtype == cnt.dtype == torch.int32 and idx.is_contiguous() and cnt.is_contiguous()
        np.testing.assert_array_equal(idx.numpy(), np.asarray(want_idx))
        np.testing.assert_array_equal(cnt.numpy(), np.asarray(want_cnt))
        assert 0 < int(cnt.sum()) < topk.size               # some entries kept, some dropped


def test_an_empty_top_k_maps_to_nothing():
    plan = _plan(2, 1, seed=5)
    idx, cnt = torch_topk.remap_topk(torch.zeros((plan.num_tokens, 0), dtype=torch.int32),
                                     _tables(plan))
    assert idx.shape == (plan.num_tokens, 0) and cnt.tolist() == [0] * plan.num_tokens


def test_the_torch_remap_names_a_wrong_topk():
    plan = _plan(2, 1, seed=6)
    tables = _tables(plan)
    t = plan.num_tokens
    with pytest.raises(TypeError, match="topk: expected a torch.Tensor, got ndarray"):
        torch_topk.remap_topk(np.zeros((t, 4), np.int32), tables)
    with pytest.raises(ValueError, match=rf"topk: expected int32\[{t}, K\] .*got torch.int64\[{t}, 4\]"):
        torch_topk.remap_topk(torch.zeros((t, 4), dtype=torch.int64), tables)
    with pytest.raises(ValueError, match=rf"topk: expected int32\[{t}, K\] .*got torch.int32\[{t + 1}, 4\]"):
        torch_topk.remap_topk(torch.zeros((t + 1, 4), dtype=torch.int32), tables)
    with pytest.raises(ValueError, match="topk: on meta, expected cpu"):
        torch_topk.remap_topk(torch.zeros((t, 4), dtype=torch.int32, device="meta"), tables)
