"""A torch engine using ckv-jax for the full-CKV gather, checked against the pure-JAX path.

    pip install -e '.[torch]' && python examples/torch_engine.py [--depth 2] [--layers 4] [--attention auto]
                                                                  [--cache-write engine|adapter]
                                                                  [--ordering step-program]

A small MLA-style layer stack in torch (latent 512 + RoPE 64 projections, fp8_ds_mla paged
caches, sparse attention over a global top-k) prefills one request chunk by chunk, the way an
engine does: torch writes each layer's chunk into its own paged cache, hands the cache to
`TorchCkvAdapter.gather` (JAX gathers and prefetches on its own stream) and attends over the
returned workspace with `interop.sparse_mla_attention` (ckv-jax's kernel on a GPU, its XLA
reference elsewhere; `--attention torch` attends in torch instead).  `--cache-write adapter`
leaves each layer's cache write to the adapter (`gather(..., write_cache=True)`: ckv-jax's
writer in the layer's program, on a GPU the cache write and the patch one kernel).
`--ordering step-program` (CUDA) dispatches each step's JAX work as one program at `begin_step`,
each layer released by its `gather` (the attention is torch's, since JAX work queued mid-step
would wait behind the program); with `--cache-write engine` torch writes the caches and hands
each layer's records to `gather` (`TorchCkvAdapter(cache_writes="engine")`), with `adapter` the
step's program writes them.  The same weights then run
through ckv-jax's pure-JAX `prefill_layers` with the same attention implementation; the outputs
must agree.  On a GPU it runs on CUDA (one GPU: D = 1, the full path through
`min_world_size=1`); otherwise on the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


ATTENTION = ("auto", "torch", "xla", "pallas_triton", "pallas_mosaic_gpu")


def torch_attention(q, workspace, indices, counts, sm_scale, fmt_name):
    """q f32[T, H, 576] over workspace rows `indices` i32[T, K] (first counts[t] valid) -> f32[T, H, 512]."""
    import torch

    from interop import torch_records
    kv = torch_records.decode(fmt_name, workspace)                           # f32[N, 576]
    k = indices.shape[1]
    valid = (torch.arange(k, device=q.device)[None, :] < counts[:, None]) & (indices >= 0)
    rows = kv[torch.where(valid, indices, 0).long()]                         # [T, K, 576]
    scores = torch.einsum("thd,tkd->thk", q, rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", p, rows[..., :512])


def run(args) -> int:
    import jax
    import jax.numpy as jnp
    import torch

    import interop
    from ckv_jax import formats, full_ckv, placement
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.mla_model import Model, mla_layer
    from ckv_jax.pipelined_prefill import prefill_layers
    from ckv_jax.prefetch_config import GatherConfig
    from ckv_jax.step_plan import build_step_plan
    from interop import torch_records

    device = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
    # the library's attention: None selects (the kernel on a GPU, XLA elsewhere); a named kernel
    # runs in interpret mode off a GPU
    implementation = None if args.attention in ("auto", "torch") else args.attention
    interpret = implementation is not None and implementation != "xla" and device == "cpu"
    jax.config.update("jax_default_matmul_precision", "highest")    # float32 like torch (no TF32)
    fmt = formats.get("fp8_ds_mla")
    gen = torch.Generator().manual_seed(args.seed)
    heads, d_model, block = args.heads, args.d_model, 16
    # small weights keep the residual stream O(1) over the layers, so softmax stays smooth and the
    # two paths (different matmul summation orders) stay within float noise of each other
    weights = [dict(w_kv=torch.randn(d_model, 576, generator=gen) * 0.15,
                    w_q=torch.randn(d_model, heads * 576, generator=gen) * 0.05,
                    w_o=torch.randn(heads * 512, d_model, generator=gen) * 0.005) for _ in range(args.layers)]
    sm_scale = 576 ** -0.5
    layout = DcpLayout(1, 1, block)
    # a step program that only gathers: the engine hands each layer's records to gather
    engine_records = args.ordering == "step-program" and args.cache_write == "engine"
    blocks = -(-args.context // block)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[None, :].contiguous().to(device)
    caches = [torch.zeros(blocks, block, fmt.record_bytes, dtype=torch.uint8, device=device)
              for _ in range(args.layers)]
    adapter = interop.TorchCkvAdapter(world_size=1, format=fmt.name, max_num_seqs=1, block_size=block,
                                      min_world_size=1, ordering=args.ordering,
                                      cache_writes="engine" if engine_records else "adapter",
                                      config=GatherConfig(enabled=True, depth=args.depth, workspace_mib=0,
                                                          min_tokens=1, max_tokens=args.context))
    step_caches = {}
    if adapter.ordering == "step-program":
        step_caches = dict(kv_caches=caches)
        # cuBLAS initialized before a step opens: its first use may synchronize the device, which
        # mid-step waits for the step's program while torch holds the GIL (no watchdog can run)
        (torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)).sum().item()
    print(f"torch engine on {device}: {args.layers} layers, context {args.context} in chunks of {args.chunk}, "
          f"depth {args.depth}, prefetch pool {adapter.pool_bytes / 2**20:.1f} MiB, attention {args.attention}, "
          f"caches written by the {args.cache_write}, ordering {adapter.ordering}")

    # the pure-JAX path over copies of the same caches, for the check
    mesh = adapter.mesh
    model = Model([{k: jnp.asarray(v.numpy()) for k, v in w.items()} for w in weights], heads, d_model, sm_scale)
    jax_layer = mla_layer(model, fmt, 1, placement.DCP_AXIS, implementation=implementation, interpret=interpret)
    jax_caches = [placement.place_caches([c.cpu().numpy()], mesh) for c in caches]

    ok, done = True, 0
    while done < args.context:
        q_len = min(args.chunk, args.context - done)
        seq, qlens = np.array([done + q_len]), np.array([q_len])
        plan = build_step_plan(layout, seq, qlens, max_tokens=args.context, min_tokens=1, min_world_size=1)
        pos = plan.positions()
        topk = np.full((q_len, args.topk), -1, np.int32)
        rng = np.random.default_rng(done)
        for t, p in enumerate(pos):
            n = min(args.topk, p + 1)
            topk[t, :n] = rng.choice(p + 1, size=n, replace=False)
        x0 = torch.randn(q_len, d_model, generator=gen)
        slots = layout.slot_mapping(pos, plan.req_id_per_token, table.cpu().numpy(), 0)      # host, as metadata is
        # on the device before the step: a copy from pageable memory mid-step waits for torch's stream
        topk_dev, x = torch.tensor(topk, device=device), x0.to(device)
        layer_weights = [{k: v.to(device) for k, v in w.items()} for w in weights]

        # the engine's step, in torch
        assert adapter.begin_step(seq, qlens, table, **step_caches)
        idx, cnt = adapter.remap_topk(topk_dev)
        for layer, w in enumerate(layer_weights):
            q = (x @ w["w_q"]).reshape(q_len, heads, 576).to(torch.bfloat16)
            kv = x @ w["w_kv"]
            if engine_records:
                records = torch_records.encode(fmt.name, kv[:, :512].to(torch.bfloat16), kv[:, 512:].to(torch.bfloat16))
                torch_records.write(caches[layer], records, slots)
                ws = adapter.gather(layer, caches[layer], records=records)
            else:
                kv_c, k_pe = adapter.chunk_buffers()      # the latents go where the patch reads them: no copy
                kv_c.copy_(kv[:, :512])
                k_pe.copy_(kv[:, 512:])
                adapter.set_current_chunk(kv_c, k_pe)      # before the cache write: the patch runs beside it
                if args.cache_write == "engine":
                    torch_records.write(caches[layer], torch_records.encode(fmt.name, kv_c, k_pe), slots)
                ws = adapter.gather(layer, caches[layer], write_cache=args.cache_write == "adapter")
            if args.attention == "torch":
                out = torch_attention(q.float(), ws[:adapter.rows], idx, cnt, sm_scale, fmt.name).to(torch.bfloat16)
            else:
                out, _ = interop.sparse_mla_attention(q, ws[:adapter.rows], idx, cnt, sm_scale, format=fmt,
                                                      implementation=implementation, interpret=interpret)
            del ws
            out = interop.compact_attention_output(out, q_len, heads, 512)
            x = x + out.float() @ w["w_o"]

        # the same step through ckv-jax alone
        jidx, jcnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
        jx, jax_caches = prefill_layers(jnp.asarray(x0.numpy()), jax_caches, model.params, table.cpu().numpy(), plan,
                                        jnp.stack([jidx] * args.layers), jnp.stack([jcnt] * args.layers),
                                        layer=jax_layer, depth=args.depth, mesh=mesh, format=fmt)
        ref = np.asarray(jx)
        got = x.cpu().numpy()
        scale = np.abs(ref - x0.numpy()).max()
        err = np.abs(got - ref).max()
        # Both sides write the same records from the same latents; the latents themselves come
        # from float32 matmuls whose summation order differs between torch and XLA (on a GPU
        # also cuBLAS vs XLA kernels), which flips an occasional bf16 or fp8 rounding: layer 0's
        # records must agree almost everywhere (on the CPU they agree exactly).
        a, b = caches[0].cpu().numpy(), np.asarray(jax_caches[0])
        written = np.unique(slots[slots >= 0])
        same = np.all(a.reshape(-1, a.shape[-1])[written] == b.reshape(-1, b.shape[-1])[written], axis=1).mean()
        good = err <= 0.02 * scale and (same == 1.0 if device == "cpu" else same >= 0.99)
        ok &= good
        print(f"  chunk at {done:>5}: max |torch engine - pure JAX| = {err:.2e} (update scale {scale:.2e}), "
              f"layer-0 records identical: {100 * same:.2f}% -> {'match' if good else 'MISMATCH'}", flush=True)
        done += q_len
    adapter.close()
    print("all chunks match" if ok else "MISMATCH")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--topk", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", choices=ATTENTION, default="auto",
                    help="auto: ckv-jax's attention as it selects (the kernel on a GPU, XLA elsewhere); torch: "
                         "attend in torch; or a ckv-jax implementation (a kernel runs interpreted off a GPU)")
    ap.add_argument("--cache-write", choices=("engine", "adapter"), default="engine",
                    help="who writes each layer's cache: torch (the engine) or the adapter's gather "
                         "(default %(default)s)")
    ap.add_argument("--ordering", choices=("step-program",), default=None,
                    help="the adapter's ordering (default: its own choice); step-program needs CUDA and "
                         "--attention torch")
    args = ap.parse_args(argv)
    if args.ordering == "step-program":
        if args.attention != "torch":
            ap.error("--ordering step-program: JAX work queued mid-step would wait behind the step's program; "
                     "pass --attention torch")
        # read when CUDA initializes (nothing has yet): the adapter refuses lazy kernel loading
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    for name in ("layers", "heads", "d_model", "context", "chunk", "topk"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.depth < 0:
        ap.error("--depth must be >= 0")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
