"""`ckv-jax demo`: a GLM-5-shaped sparse-MLA prefill through the full-CKV DCP path.

A small stack of MLA layers (512-wide latent + 64 RoPE, `--format` records, random weights)
prefills requests chunk by chunk on top of a cached prefix.  Each step writes the chunk into
every layer's DCP-sharded paged cache, all-gathers the CKV with depth-N cross-layer prefetch,
remaps a global top-k (a seeded stand-in for the indexer) and runs each rank's own heads over
the gathered workspace.  Every step is run at depth 0 and at `--depth`, and checked: both must
give bit-identical outputs, and match a single-device reference that attends over the records in
global token order without DCP.  With no accelerator the demo builds a virtual mesh of `--dcp`
CPU devices itself; on GPUs it uses them.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


KERNELS = ("pallas_triton", "pallas_mosaic_gpu")


def _configure_devices(dcp: int):
    import jax
    try:                       # before any backend starts: a virtual CPU mesh when there is no GPU
        jax.config.update("jax_num_cpu_devices", max(dcp, 1))
    except RuntimeError:       # backends already running (called from a live session): run() reports
        pass                   # a --dcp larger than the devices that exist


def _blocks_per_rank(context: int, dcp: int, block_size: int) -> int:
    """Blocks of one request on one rank: its ceil(context / D) tokens, plus one block for the
    interleave's uneven split."""
    return -(-(-(-context // dcp)) // block_size) + 1


def reference_step(model, fmt, x, records, plan, topks, implementation="xla", interpret=False):
    """One device, no DCP: every layer attends all heads over its records in global token order,
    with the attention implementation the DCP path runs (a different one would differ by a bf16
    step in places, which this small random model amplifies through its layers).

    records: per layer, per request u8[len, R] (history); the chunk's records are appended here.
    """
    import jax.numpy as jnp

    from ckv_jax import sparse_mla
    pos = plan.positions()
    for l, p in enumerate(model.params):
        q = (x @ p["w_q"]).reshape(x.shape[0], model.heads, 576).astype(jnp.bfloat16)
        kv = x @ p["w_kv"]
        chunk = np.asarray(fmt.encode(kv[:, :512].astype(jnp.bfloat16), kv[:, 512:].astype(jnp.bfloat16)))
        starts = plan.query_start_loc
        for r in range(plan.num_reqs):
            records[l][r] = np.concatenate([records[l][r], chunk[starts[r]:starts[r + 1]]])
        offsets = np.concatenate([[0], np.cumsum([len(rr) for rr in records[l]])])
        flat = np.concatenate(records[l])
        topk = topks[l]
        keep = (topk >= 0) & (topk <= pos[:, None])
        rows = np.where(keep, offsets[plan.req_id_per_token][:, None] + topk, -1)
        order = np.argsort(~keep, axis=1, kind="stable")           # kept entries first, in order
        rows = np.take_along_axis(rows, order, axis=1).astype(np.int32)
        out, _ = sparse_mla.sparse_mla_attention(q, jnp.asarray(flat), jnp.asarray(rows),
                                                 jnp.asarray(keep.sum(1).astype(np.int32)), model.sm_scale,
                                                 format=fmt.name, implementation=implementation, interpret=interpret)
        x = x + out.reshape(x.shape[0], -1).astype(jnp.float32) @ p["w_o"]
    return x


def run(args) -> int:
    import jax
    import jax.numpy as jnp

    from ckv_jax import formats, full_ckv, placement, sparse_mla
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.mla_model import make_model, mla_layer
    from ckv_jax.pipelined_prefill import prefill_layers
    from ckv_jax.prefetch_config import GatherConfig, memory_plan
    from ckv_jax.step_plan import build_step_plan

    fmt = formats.get(args.format)
    devices = jax.devices() if jax.default_backend() != "cpu" else jax.devices("cpu")
    dcp = args.dcp or len(devices)
    if dcp > len(devices):
        print(f"--dcp {dcp}: only {len(devices)} {devices[0].platform} device(s)", file=sys.stderr)
        return 2
    if args.heads % dcp:
        print(f"--heads {args.heads} must be divisible by --dcp {dcp}", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((dcp,), (placement.DCP_AXIS,), devices=devices[:dcp])
    layout = DcpLayout(dcp, args.interleave, args.block_size)
    rng = np.random.default_rng(args.seed)
    model = make_model(args.layers, args.heads, args.d_model, rng)
    interpret = args.attention in KERNELS and jax.default_backend() != "gpu"
    # resolved once, so that both sides of the check run the same implementation
    chosen = sparse_mla.attention_implementation(fmt, devices[0], args.requests * args.context, args.chunk,
                                                 args.heads // dcp, args.topk, interpret=interpret,
                                                 implementation=None if args.attention == "auto" else args.attention)
    layer = mla_layer(model, fmt, dcp, placement.DCP_AXIS, implementation=chosen, interpret=interpret)

    reqs = args.requests
    prefix = args.context // 4
    blocks_per_rank = _blocks_per_rank(args.context, dcp, args.block_size)
    num_blocks = reqs * blocks_per_rank
    table = rng.permutation(num_blocks).reshape(reqs, blocks_per_rank).astype(np.int32)
    cfg = GatherConfig(enabled=True, depth=args.depth, workspace_mib=0, max_tokens=args.context * reqs)
    mem = memory_plan(layout, fmt, max_num_seqs=reqs, config=cfg)
    caches = [placement.place_caches([np.zeros((num_blocks, args.block_size, fmt.record_bytes), np.uint8)] * dcp, mesh)
              for _ in range(args.layers)]
    records = [[np.zeros((0, fmt.record_bytes), np.uint8) for _ in range(reqs)] for _ in range(args.layers)]

    # the cached prefix: every layer's records of positions [0, prefix), written through the DCP writer
    plan0 = build_step_plan(layout, np.full(reqs, prefix), np.full(reqs, prefix), max_num_seqs=reqs)
    for l in range(args.layers):
        kv = (rng.standard_normal((plan0.num_tokens, 512)) * 2).astype(jnp.bfloat16)
        pe = rng.standard_normal((plan0.num_tokens, 64)).astype(jnp.bfloat16)
        caches[l] = full_ckv.write_records_dcp(caches[l], jnp.asarray(kv), jnp.asarray(pe), plan0, table,
                                               mesh=mesh, format=fmt)
        enc = np.asarray(fmt.encode(jnp.asarray(kv), jnp.asarray(pe)))
        for r in range(reqs):
            records[l][r] = enc[plan0.query_start_loc[r]:plan0.query_start_loc[r + 1]]

    print(f"ckv-jax demo: {args.layers} layers, {reqs} request(s) x {args.context} tokens ({prefix} cached, "
          f"chunks of {args.chunk}), {fmt.name}, DCP {dcp} on {devices[0].platform}, depth {args.depth}, "
          f"attention {chosen}{' (interpret mode)' if interpret else ''}", flush=True)
    rows, ok_all, done = [], True, prefix
    num_steps = -(-(args.context - prefix) // args.chunk)
    while done < args.context:
        q_len = min(args.chunk, args.context - done)
        plan = build_step_plan(layout, np.full(reqs, done + q_len), np.full(reqs, q_len), max_num_seqs=reqs,
                               max_tokens=cfg.max_tokens)
        pos = plan.positions()
        topks = []
        for _ in range(args.layers):
            k = np.full((plan.num_tokens, args.topk), -1, np.int32)
            for t, p in enumerate(pos):
                n = min(args.topk, p + 1)
                k[t, :n] = rng.choice(p + 1, size=n, replace=False)
            topks.append(k)
        remapped = [full_ckv.remap_topk(jnp.asarray(k), plan) for k in topks]
        idx = jnp.stack([i for i, _ in remapped])
        cnt = jnp.stack([c for _, c in remapped])
        x = jnp.asarray(rng.standard_normal((plan.num_tokens, args.d_model)), jnp.float32)
        outs = {}
        for depth in sorted({0, args.depth}):
            trial = [jnp.array(c) for c in caches]       # each depth starts from the same caches
            trial = [jax.device_put(c, cc.sharding) for c, cc in zip(trial, caches)]
            start = time.perf_counter()
            x_out, new_caches = prefill_layers(x, trial, model.params, table, plan, idx, cnt, layer=layer,
                                               depth=depth, mesh=mesh, format=fmt)
            x_out = np.asarray(jax.block_until_ready(x_out))
            outs[depth] = (x_out, new_caches, time.perf_counter() - start)
        caches = outs[args.depth][1]
        ref = np.asarray(reference_step(model, fmt, x, records, plan, topks, chosen, interpret))
        same = np.array_equal(outs[0][0], outs[args.depth][0])
        scale = np.abs(ref - np.asarray(x)).max()
        err = np.abs(outs[args.depth][0] - ref).max()
        close = err <= 0.02 * scale + 1e-6
        ok = same and close
        ok_all &= ok
        gathered = args.layers * dcp * plan.padded_tokens * fmt.record_bytes
        rows.append((done, q_len, plan.padded_tokens, gathered, outs[args.depth][2], same, err / max(scale, 1e-30), ok))
        print(f"  step {len(rows)}/{num_steps} at {done:>6} tokens: depth {args.depth} == depth 0: {same}; "
              f"vs single device: max err {err:.2e} of {scale:.2e}", flush=True)
        done += q_len

    print(f"\n{'context':>8} {'chunk':>6} {'D':>3} {'depth':>5} {'P':>6} {'gathered MB':>11} {'ring MiB':>9} "
          f"{'wall s*':>7} {'rel err':>8}  result")
    for done_, q_len, pad, gathered, secs, same, rel, ok in rows:
        print(f"{done_ + q_len:>8} {q_len:>6} {dcp:>3} {args.depth:>5} {pad:>6} {gathered / 1e6:>11.2f} "
              f"{mem.lane_bytes / 2**20:>9.1f} {secs:>7.2f} {rel:>8.1e}  {'match' if ok else 'MISMATCH'}")
    print("* wall time of the step at --depth, compilation included (every step has new shapes)")
    print(f"\n{args.layers} layers x {len(rows)} steps: " + ("all steps match" if ok_all else "MISMATCH"))
    return 0 if ok_all else 1


def _format(text):
    from ckv_jax import formats
    try:
        return formats.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_estimate(args, dcp: int) -> int:
    """Bytes the demo holds at its peak: every layer's paged caches of all ranks (host copy,
    device copy and the two depths' trial copies), the single-device reference's records, and
    the reference attention's gathered keys of one step ([chunk tokens, top-k, 576] float32)."""
    from ckv_jax import formats
    record = formats.get(args.format).record_bytes
    blocks_per_rank = _blocks_per_rank(args.context, dcp, args.block_size)
    caches = args.layers * args.requests * dcp * blocks_per_rank * args.block_size * record
    reference = args.layers * args.requests * args.context * record
    attention = 2 * args.requests * args.chunk * args.topk * 576 * 4
    return 4 * caches + 2 * reference + attention


def available_memory() -> int | None:
    """Bytes of memory available on this machine (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ckv-jax demo", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--format", type=_format, default="fp8_ds_mla",
                    help="record format of the paged caches: fp8_ds_mla, nvfp4_ds_mla, bf16 or an alias (fp8, auto, ...)")
    ap.add_argument("--dcp", type=int, default=None,
                    help="DCP ranks (default: 4 virtual CPU devices without an accelerator, else every GPU)")
    ap.add_argument("--interleave", type=int, default=1, help="tokens per rank before the next rank (DCP interleave)")
    ap.add_argument("--depth", type=int, default=2,
                    help="layers gathered ahead, at most --layers - 1 (checked against depth 0)")
    ap.add_argument("--layers", type=int, default=4, help="MLA layers")
    ap.add_argument("--context", type=int, default=768, help="tokens per request at the end of the prefill")
    ap.add_argument("--chunk", type=int, default=192, help="tokens per prefill step (after a 1/4 cached prefix)")
    ap.add_argument("--requests", type=int, default=2, help="requests prefilled together")
    ap.add_argument("--heads", type=int, default=8, help="query heads (divisible by --dcp)")
    ap.add_argument("--d-model", type=int, default=64, help="model width")
    ap.add_argument("--topk", type=int, default=64, help="indexer top-k per query token")
    ap.add_argument("--attention", choices=("auto", "xla") + KERNELS, default="auto",
                    help="sparse-MLA attention of both paths: auto (ckv-jax's choice: a kernel on a GPU, XLA "
                         "elsewhere) or an implementation (pallas_triton runs in interpret mode without a GPU; "
                         "pallas_mosaic_gpu needs an SM90+ GPU)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per paged-cache block")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and top-k")
    args = ap.parse_args(argv)
    if args.depth < 0:
        ap.error("--depth must be >= 0")
    for name in ("layers", "context", "chunk", "requests", "heads", "d_model", "topk", "block_size", "interleave"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.dcp is not None and args.dcp <= 0:
        ap.error("--dcp must be positive")
    if args.depth >= args.layers:
        ap.error(f"--depth {args.depth}: at most --layers - 1 = {args.layers - 1} (a layer is gathered ahead of "
                 "the layers before it)")
    need, have = memory_estimate(args, args.dcp or 4), available_memory()
    if have is not None and need > 0.8 * have:
        ap.error(f"--context {args.context} (x {args.requests} requests, {args.layers} layers, top-k {args.topk}) "
                 f"needs about {need / 2**30:.1f} GiB; this machine has {have / 2**30:.1f} GiB available")
    _configure_devices(args.dcp or 4)
    if args.attention == "pallas_mosaic_gpu":
        import jax
        if jax.default_backend() != "gpu":   # its interpreter is for one-device unit tests (it hung on several)
            ap.error("--attention pallas_mosaic_gpu needs a GPU")
    return run(args)
