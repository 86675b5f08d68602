"""A small GLM-5-shaped MLA model (512 latent + 64 RoPE, random weights) as one DCP rank runs it:
the model of the demo, the prefill benchmark and the torch example."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ckv_jax import sparse_mla
from ckv_jax.pipelined_prefill import MlaLayer


@dataclasses.dataclass
class Model:
    params: list
    heads: int
    d_model: int
    sm_scale: float


def make_model(layers, heads, d_model, rng):
    params = [dict(w_kv=jnp.asarray(rng.standard_normal((d_model, 576)) * 0.3, jnp.float32),
                   w_q=jnp.asarray(rng.standard_normal((d_model, heads * 576)) * 0.1, jnp.float32),
                   w_o=jnp.asarray(rng.standard_normal((heads * 512, d_model)) * 0.01, jnp.float32))
              for _ in range(layers)]
    return Model(params, heads, d_model, 576 ** -0.5)


def mla_layer(model, fmt, dcp, axis, *, implementation=None, interpret: bool = False, keys: str = "exact"):
    """The layer as one DCP rank sees it: its own heads, all-gathered before the output projection.
    implementation, interpret, keys: its attention's (`sparse_mla.attend`)."""
    local = model.heads // dcp

    def project(p, x):
        q = (x @ p["w_q"]).reshape(x.shape[0], model.heads, 576)
        q = lax.dynamic_slice_in_dim(q, lax.axis_index(axis) * local, local, axis=1)
        kv = x @ p["w_kv"]
        return q.astype(jnp.bfloat16), kv[:, :512].astype(jnp.bfloat16), kv[:, 512:].astype(jnp.bfloat16)

    def attend(q, workspace, indices, counts):
        out, _ = sparse_mla.attend(q, workspace, indices, counts, model.sm_scale, fmt.layout, out_dtype=jnp.bfloat16,
                                   implementation=implementation, interpret=interpret, keys=keys)
        return out

    def finish(p, x, out):
        heads = lax.all_gather(out, axis, axis=1, tiled=True)
        return x + heads.reshape(x.shape[0], -1).astype(jnp.float32) @ p["w_o"]

    return MlaLayer(project, attend, finish)
