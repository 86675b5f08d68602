"""A Flax NNX MLA layer stack (GLM-5 / DeepSeek-V3.2 shape) prefilling through ckv-jax.

    pip install -e '.[flax]' && python examples/flax_mla.py [--dcp 4] [--depth 2] [--steps 3]

The model is ordinary Flax NNX: low-rank query (q_a -> RMSNorm -> q_b, 128 nope + 64 RoPE dims per
head), low-rank KV (kv_a -> 512-wide latent + 64 RoPE dims), absorbed attention (q_nope @ W_UK
gives a 576-wide query against the latent; the 512-wide attention output goes through W_UV and
the output projection) and a stand-in for the indexer (attention sinks plus the most recent
positions, as global token positions).  Its paged CKV caches are not module state: they are
passed into `prefill_layers` and returned from it, one per layer, sharded by token over the
`dcp` mesh axis.  Each step prefills a chunk of every request on top of its cached history with
depth-N cross-layer prefetch; every step is checked against a single-device computation of the
same modules over the records in global token order (no DCP, no gather).

Without an accelerator it runs on `--dcp` virtual CPU devices.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

ROPE, LATENT, QK_NOPE, V_HEAD = 64, 512, 128, 128


def _configure_devices(dcp: int):
    import jax
    try:                        # before any backend starts: a virtual CPU mesh when there is no GPU
        jax.config.update("jax_num_cpu_devices", dcp)
    except RuntimeError:        # already running (imported by a test that set up its devices)
        pass


def build_model(layers: int, d_model: int, heads: int, q_rank: int, seed: int):
    import jax.numpy as jnp
    from flax import nnx

    class MlaBlock(nnx.Module):
        """One MLA layer; `project` and `output` are all the model code the DCP path needs."""

        def __init__(self, rngs: nnx.Rngs):
            linear = dict(use_bias=False, rngs=rngs)          # LeCun-normal init: activations stay O(1)
            self.norm = nnx.RMSNorm(d_model, rngs=rngs)
            self.q_a = nnx.Linear(d_model, q_rank, **linear)
            self.q_norm = nnx.RMSNorm(q_rank, rngs=rngs)
            self.q_b = nnx.Linear(q_rank, heads * (QK_NOPE + ROPE), **linear)
            self.kv_a = nnx.Linear(d_model, LATENT + ROPE, **linear)
            self.kv_norm = nnx.RMSNorm(LATENT, rngs=rngs)
            self.w_uk = nnx.Param(nnx.initializers.normal(QK_NOPE ** -0.5)(rngs.params(), (heads, QK_NOPE, LATENT)))
            self.w_uv = nnx.Param(nnx.initializers.normal(LATENT ** -0.5)(rngs.params(), (heads, LATENT, V_HEAD)))
            self.o = nnx.Linear(heads * V_HEAD, d_model, **linear)

        def project(self, x, cos, sin):
            """x f32[T, d_model], cos/sin f32[T, 32] -> q bf16[T, H, 576], kv_c bf16[T, 512], k_pe bf16[T, 64]."""
            h = self.norm(x)
            q = self.q_b(self.q_norm(self.q_a(h))).reshape(x.shape[0], heads, QK_NOPE + ROPE)
            q_latent = jnp.einsum("thd,hdc->thc", q[..., :QK_NOPE], self.w_uk[...])
            q = jnp.concatenate([q_latent, rope(q[..., QK_NOPE:], cos[:, None], sin[:, None])], axis=-1)
            kv = self.kv_a(h)
            kv_c = self.kv_norm(kv[:, :LATENT])
            k_pe = rope(kv[:, LATENT:], cos, sin)
            return q.astype(jnp.bfloat16), kv_c.astype(jnp.bfloat16), k_pe.astype(jnp.bfloat16)

        def output(self, x, latent_out):
            """latent_out [T, H, 512] (all heads) -> the next residual stream f32[T, d_model]."""
            v = jnp.einsum("thc,hcd->thd", latent_out.astype(jnp.float32), self.w_uv[...])
            return x + self.o(v.reshape(x.shape[0], heads * V_HEAD))

    class MlaStack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([MlaBlock(rngs) for _ in range(layers)])

    return MlaStack(nnx.Rngs(seed))


def rope(x, cos, sin):
    """Rotary embedding over the last dim (halves rotated), x [..., 64]."""
    import jax.numpy as jnp
    a, b = x[..., :ROPE // 2], x[..., ROPE // 2:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rope_tables(positions):
    inv = 1.0 / (10000.0 ** (np.arange(0, ROPE, 2) / ROPE))
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def indexer_stand_in(positions, topk: int, sinks: int = 4):
    """Global top-k per query token: the first `sinks` positions and the most recent ones, causal.
    i32[T, topk], -1 where a token has fewer than `topk` positions to attend."""
    out = np.full((len(positions), topk), -1, np.int32)
    for t, p in enumerate(positions):
        n = min(topk, p + 1)
        head = np.arange(min(sinks, n))
        tail = np.arange(p + 1 - (n - len(head)), p + 1)
        out[t, :n] = np.concatenate([head, tail])
    return out


def dcp_layer(graphdef, heads: int, dcp: int, sm_scale: float, fmt, axis: str):
    """The model as one DCP rank runs it inside `prefill_layers`: its own heads only."""
    import jax.numpy as jnp
    from flax import nnx
    from jax import lax

    from ckv_jax import sparse_mla
    from ckv_jax.pipelined_prefill import MlaLayer
    local = heads // dcp

    def project(params, x):
        state, cos, sin = params
        q, kv_c, k_pe = nnx.merge(graphdef, state).project(x, cos, sin)
        return lax.dynamic_slice_in_dim(q, lax.axis_index(axis) * local, local, axis=1), kv_c, k_pe

    def attend(q, workspace, indices, counts):           # the implementation `attend` selects
        out, _ = sparse_mla.attend(q, workspace, indices, counts, sm_scale, fmt.layout, out_dtype=jnp.bfloat16)
        return out

    def finish(params, x, out):
        state, _, _ = params
        return nnx.merge(graphdef, state).output(x, lax.all_gather(out, axis, axis=1, tiled=True))

    return MlaLayer(project, attend, finish)


def reference_step(model, fmt, x, history, plan, topk, sm_scale):
    """One device, no DCP: every layer attends over its requests' records in global token order.
    history: per layer, per request u8[len, R]; the chunk's records are appended here."""
    import jax.numpy as jnp

    from ckv_jax import sparse_mla
    pos = plan.positions()
    cos, sin = rope_tables(pos)
    starts = plan.query_start_loc
    for l, block in enumerate(model.blocks):
        q, kv_c, k_pe = block.project(x, jnp.asarray(cos), jnp.asarray(sin))
        chunk = np.asarray(fmt.encode(kv_c, k_pe))
        for r in range(plan.num_reqs):
            history[l][r] = np.concatenate([history[l][r], chunk[starts[r]:starts[r + 1]]])
        offsets = np.concatenate([[0], np.cumsum([len(h) for h in history[l]])])
        rows = np.where(topk >= 0, offsets[plan.req_id_per_token][:, None] + topk, -1).astype(np.int32)
        out, _ = sparse_mla.sparse_mla_reference(q, jnp.asarray(np.concatenate(history[l])), jnp.asarray(rows),
                                                 jnp.asarray((topk >= 0).sum(1).astype(np.int32)), sm_scale,
                                                 format=fmt.name)
        x = block.output(x, out)
    return x


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ckv_jax import formats, full_ckv, placement
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.pipelined_prefill import prefill_layers
    from ckv_jax.step_plan import build_step_plan

    devices = jax.devices()
    if args.dcp > len(devices):
        print(f"--dcp {args.dcp}: only {len(devices)} device(s)", file=sys.stderr)
        return 2
    fmt = formats.get(args.format)
    mesh = jax.make_mesh((args.dcp,), (placement.DCP_AXIS,), devices=devices[:args.dcp])
    layout = DcpLayout(args.dcp, 1, args.block_size)
    model = build_model(args.layers, args.d_model, args.heads, args.q_rank, args.seed)
    graphdef, _ = nnx.split(model.blocks[0])
    states = [nnx.state(block) for block in model.blocks]
    sm_scale = (QK_NOPE + ROPE) ** -0.5
    layer = dcp_layer(graphdef, args.heads, args.dcp, sm_scale, fmt, placement.DCP_AXIS)
    rng = np.random.default_rng(args.seed)

    reqs, chunk = args.requests, args.chunk
    total = args.prefix + args.steps * chunk
    blocks_per_req = -(-(-(-total // args.dcp)) // args.block_size)
    num_blocks = reqs * blocks_per_req
    table = rng.permutation(num_blocks).reshape(reqs, blocks_per_req).astype(np.int32)
    empty = np.zeros((num_blocks, args.block_size, fmt.record_bytes), np.uint8)
    caches = [placement.place_caches([empty] * args.dcp, mesh) for _ in range(args.layers)]
    history = [[np.zeros((0, fmt.record_bytes), np.uint8)] * reqs for _ in range(args.layers)]

    done, ok = 0, True
    for step in range(args.steps + (args.prefix > 0)):
        q_len = args.prefix if step == 0 and args.prefix else chunk
        plan = build_step_plan(layout, np.full(reqs, done + q_len), np.full(reqs, q_len), max_num_seqs=reqs,
                               max_tokens=reqs * total)
        pos = plan.positions()
        cos, sin = rope_tables(pos)
        topk = indexer_stand_in(pos, args.topk)
        idx, cnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
        idx, cnt = jnp.stack([idx] * args.layers), jnp.stack([cnt] * args.layers)
        x = jnp.asarray(rng.standard_normal((plan.num_tokens, args.d_model)), jnp.float32)
        params = [(s, jnp.asarray(cos), jnp.asarray(sin)) for s in states]
        out, caches = prefill_layers(x, caches, params, table, plan, idx, cnt, layer=layer, depth=args.depth,
                                     mesh=mesh, format=fmt)
        ref = reference_step(model, fmt, x, history, plan, topk, sm_scale)
        err = float(jnp.max(jnp.abs(out - ref)))
        scale = float(jnp.max(jnp.abs(ref - x)))
        good = err <= 0.02 * scale + 1e-6
        ok &= good
        print(f"step {step}: {q_len} tokens x {reqs} requests at position {done}, D={args.dcp}, depth {args.depth}: "
              f"max |DCP - single device| = {err:.2e} (layer update scale {scale:.2e}) "
              f"{'match' if good else 'MISMATCH'}", flush=True)
        done += q_len
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcp", type=int, default=4, help="DCP ranks (virtual CPU devices without an accelerator)")
    ap.add_argument("--depth", type=int, default=2, help="layers gathered ahead")
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--q-rank", type=int, default=96)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=96, help="history tokens per request, prefilled first")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per request per later step")
    ap.add_argument("--steps", type=int, default=2, help="chunks after the prefix")
    ap.add_argument("--topk", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("dcp", "layers", "heads", "d_model", "q_rank", "requests", "chunk", "steps", "topk", "block_size"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.depth < 0 or args.prefix < 0:
        ap.error("--depth and --prefix must be >= 0")
    if args.heads % args.dcp:
        ap.error(f"--heads {args.heads} must be divisible by --dcp {args.dcp}")
    _configure_devices(args.dcp)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
