"""Depth-N prefetch inside one JAX program: every depth gives the synchronous path's bytes and outputs."""
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dcp_scenario
from ckv_jax import formats, full_ckv, placement, sparse_mla
from ckv_jax.pipelined_prefill import MlaLayer, prefill_layers
from helpers import copies_of_at_least
from helpers import mesh_of

SEQ_LENS, QUERY_LENS = [45, 23, 70], [12, 23, 9]
HEADS, D_MODEL, K, LAYERS = 4, 32, 16, 4


def make_layer(fmt_name, d):
    layout = formats.get(fmt_name).layout
    heads_local = HEADS // d

    def project(p, x):
        t = x.shape[0]
        kv = x @ p["w_kv"]
        q = (x @ p["w_q"]).reshape(t, HEADS, 576)
        q = lax.dynamic_slice_in_dim(q, lax.axis_index(placement.DCP_AXIS) * heads_local, heads_local, axis=1)
        return q.astype(jnp.bfloat16), kv[:, :512].astype(jnp.bfloat16), kv[:, 512:].astype(jnp.bfloat16)

    def attend(q, workspace, indices, counts):
        out, _ = sparse_mla.attend(q, workspace, indices, counts, 576 ** -0.5, layout)
        return out.astype(jnp.bfloat16)

    def finish(p, x, out):
        heads = lax.all_gather(out, placement.DCP_AXIS, axis=1, tiled=True)        # [T, H, 512]
        return x + heads.reshape(x.shape[0], -1).astype(jnp.float32) @ p["w_o"]

    return MlaLayer(project, attend, finish)


def _step(d, interleave, fmt_name):
    scenarios = [dcp_scenario.build(d, interleave, fmt_name, SEQ_LENS, QUERY_LENS, seed=5, kv_seed=100 + l,
                                    history_only=True) for l in range(LAYERS)]
    plan = scenarios[0].plan
    rng = np.random.default_rng(8)
    params = [dict(w_kv=jnp.asarray(rng.standard_normal((D_MODEL, 576)) * 0.5, jnp.float32),
                   w_q=jnp.asarray(rng.standard_normal((D_MODEL, HEADS * 576)) * 0.2, jnp.float32),
                   w_o=jnp.asarray(rng.standard_normal((HEADS * 512, D_MODEL)) * 0.02, jnp.float32))
              for _ in range(LAYERS)]
    pos = plan.positions()
    idx, cnt = [], []
    for _ in range(LAYERS):
        topk = np.full((plan.num_tokens, K), -1, np.int32)
        for t, p in enumerate(pos):
            n = min(K, p + 1)
            topk[t, :n] = rng.choice(p + 1, size=n, replace=False)
        i, c = full_ckv.remap_topk(jnp.asarray(topk), plan)
        idx.append(i)
        cnt.append(c)
    x = jnp.asarray(rng.standard_normal((plan.num_tokens, D_MODEL)), jnp.float32)
    return scenarios, plan, params, x, jnp.stack(idx), jnp.stack(cnt)


@pytest.mark.parametrize("d, interleave, fmt_name", [(2, 1, "fp8_ds_mla"), (4, 2, "nvfp4_ds_mla")])
def test_depths_are_bit_identical_to_the_synchronous_path(d, interleave, fmt_name):
    scenarios, plan, params, x, idx, cnt = _step(d, interleave, fmt_name)
    mesh = mesh_of(d)
    layer = make_layer(fmt_name, d)
    results = {}
    for depth in (0, 1, 2, 3):
        caches = [placement.place_caches(sc.caches, mesh) for sc in scenarios]
        x_out, new_caches, used = prefill_layers(
            x, caches, params, scenarios[0].block_table, plan, idx, cnt, layer=layer, depth=depth, mesh=mesh,
            format=fmt_name, return_workspaces=True)
        results[depth] = (np.asarray(x_out), [np.asarray(c) for c in new_caches], np.asarray(used))
    x0, caches0, used0 = results[0]
    assert np.abs(x0 - np.asarray(x)).max() > 1e-3, "the layers must change x"
    for depth in (1, 2, 3):
        xd, cachesd, usedd = results[depth]
        np.testing.assert_array_equal(xd, x0)
        np.testing.assert_array_equal(usedd, used0)
        for a, b in zip(cachesd, caches0):
            np.testing.assert_array_equal(a, b)
    # the synchronous workspaces are the rank-major layout of history + the layer's own chunk
    hist = [np.asarray(sc.caches) for sc in scenarios]
    assert not all(np.array_equal(h.reshape(-1), c.reshape(-1)) for h, c in zip(hist, caches0)), "chunks were written"


def test_prefill_layers_rejects_bad_arguments():
    scenarios, plan, params, x, idx, cnt = _step(2, 1, "fp8_ds_mla")
    mesh = mesh_of(2)
    caches = [placement.place_caches(sc.caches, mesh) for sc in scenarios]
    layer = make_layer("fp8_ds_mla", 2)
    with pytest.raises(ValueError, match="depth: expected an int >= 0, got -1"):
        prefill_layers(x, caches, params, scenarios[0].block_table, plan, idx, cnt, layer=layer, depth=-1,
                       mesh=mesh, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"params: expected one entry per layer \(4\), got 3"):
        prefill_layers(x, caches, params[:3], scenarios[0].block_table, plan, idx, cnt, layer=layer, depth=1,
                       mesh=mesh, format="fp8_ds_mla")
    with pytest.raises(ValueError, match="mesh: axis 'dcp' has size 4"):
        prefill_layers(x, caches, params, scenarios[0].block_table, plan, idx, cnt, layer=layer, depth=1,
                       mesh=mesh_of(4), format="fp8_ds_mla")


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("depth", [0, 2])
def test_the_step_program_copies_no_workspace(d, depth):
    """Each gathered workspace is written once, where it lives: no ring it is copied into, and
    the patch updates it in place."""
    scenarios, plan, params, x, idx, cnt = _step(d, 1, "fp8_ds_mla")
    caches = [placement.place_caches(sc.caches, mesh_of(d)) for sc in scenarios]
    hlo = prefill_layers(x, caches, params, scenarios[0].block_table, plan, idx, cnt, layer=make_layer("fp8_ds_mla", d),
                         depth=depth, mesh=mesh_of(d), format="fp8_ds_mla", implementation="xla", compiled_text=True)
    assert copies_of_at_least(hlo, d * plan.padded_tokens * 656) == []
    assert "u8[" in hlo
