"""`ckv-jax bench`: the kernel sweeps and the pipelined prefill, one JSON file.

  ckv-jax bench [--ops writer,gather,patch,prefill] [--tokens 65536,262144] [--formats fp8_ds_mla]
                [--depths 0,1,2,3] [--context 32768] [--prefill-chunk 1024] [--out results.json]

Every kernel figure is validated against its reference before it is timed and sits beside its
baselines from the same run (see writer.py and gather.py); `patch` times the current-chunk patch
(a scatter of `--chunk` re-encoded tokens into a gathered workspace of 4 * `tokens` rows);
`prefill` times one step of `prefill_layers` per depth on the local devices (host clock around a
jitted call of several milliseconds, median of 3, after a warm-up call).  `ckv-jax plot` renders
the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.benchmarks import gather, report, writer
from ckv_jax.benchmarks.timing import fastest, measure_copy, measure_in_place, result_fields, torch_copy_timing
from pallas_kernels import cache_writer


def _progress(done, total, what):
    width = 24
    filled = int(width * done / max(total, 1))
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<60}", end="", file=sys.stderr, flush=True)


def patch_results(tokens_list, names, chunk, repeats, log):
    """The patch: `chunk` tokens re-encoded and scattered into a workspace of 4 * tokens rows."""
    results = []
    device = jax.devices()[0]
    for tokens in tokens_list:
        for name in names:
            fmt = formats.get(name)
            rows = 4 * tokens
            moved = chunk * (2 * fmt.nope_dim + 2 * fmt.rope_dim + 4 + fmt.record_bytes)
            ceiling = fastest([measure_copy(moved // 2, repeats), torch_copy_timing(moved // 2)])
            key = jax.random.key(tokens)
            inputs = []
            for i in range(repeats):
                k1, k2, k3, key = jax.random.split(key, 4)
                inputs.append(((jax.random.normal(k1, (chunk, fmt.nope_dim)) * 3).astype(jnp.bfloat16),
                               jax.random.normal(k2, (chunk, fmt.rope_dim)).astype(jnp.bfloat16),
                               jax.random.permutation(k3, rows)[:chunk].astype(jnp.int32)))
            reference = None
            for impl in cache_writer.DEFAULT_ORDER:
                entry = cache_writer.IMPLEMENTATIONS[impl]
                if not entry.supported_on(device, rows * fmt.record_bytes)[0]:
                    continue

                def op(ws, kv_c, k_pe, dest, run=entry.run):
                    return run(ws, kv_c, k_pe, dest, layout=fmt.layout)

                ws = jnp.zeros((rows, 1, fmt.record_bytes), jnp.uint8)
                got = np.asarray(jax.jit(op)(ws, *inputs[0]))
                if reference is None:
                    reference = np.asarray(cache_writer.write_records_reference(jnp.zeros_like(ws), *inputs[0],
                                                                                layout=fmt.layout))
                timing, _ = measure_in_place(op, ws, inputs)
                row = dict(op="patch", format=name, tokens=tokens, chunk=chunk, implementation=impl,
                           bytes_moved=moved, exact=bool(np.array_equal(got, reference)),
                           **result_fields(timing, moved, ceiling))
                results.append(row)
                log(f"  patch {name} rows={rows} chunk={chunk} {impl}: {report.timing_text(row)}")
    return results


def prefill_results(depths, fmt_name, layers, context, chunk, log):
    """Step time of `prefill_layers` per depth on the local devices (one request)."""
    from ckv_jax import full_ckv
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.demo import make_model, mla_layer
    from ckv_jax.pipelined_prefill import collective_schedule, prefill_layers
    from ckv_jax.step_plan import build_step_plan

    fmt = formats.get(fmt_name)
    devices = jax.devices()
    dcp = len(devices)
    heads = 8 * dcp
    mesh = jax.make_mesh((dcp,), (full_ckv.DCP_AXIS,), devices=devices)
    layout = DcpLayout(dcp, 1, 64)
    rng = np.random.default_rng(0)
    model = make_model(layers, heads, 256, rng)
    layer = mla_layer(model, fmt, dcp, full_ckv.DCP_AXIS)
    plan = build_step_plan(layout, np.array([context]), np.array([chunk]), max_tokens=context)
    blocks = -(-(-(-context // dcp)) // 64)
    table = np.arange(blocks, dtype=np.int32)[None, :]
    topk = np.minimum(rng.integers(0, 1 << 30, (plan.num_tokens, 2048)) % (plan.positions()[:, None] + 1),
                      plan.positions()[:, None]).astype(np.int32)
    idx, cnt = full_ckv.remap_topk(jnp.asarray(topk), plan)
    idx, cnt = jnp.stack([idx] * layers), jnp.stack([cnt] * layers)
    x = jnp.asarray(rng.standard_normal((plan.num_tokens, 256)), jnp.float32)
    host_caches = [np.asarray(rng.integers(0, 256, (blocks, 64, fmt.record_bytes), dtype=np.uint8))] * dcp
    results, outputs = [], {}
    for depth in depths:
        caches = [full_ckv.place_caches(host_caches, mesh) for _ in range(layers)]
        schedule = collective_schedule(prefill_layers(x, caches, model.params, table, plan, idx, cnt, layer=layer,
                                                      depth=depth, mesh=mesh, format=fmt, compiled_text=True))
        del caches
        times = []
        for trial in range(4):
            caches = [full_ckv.place_caches(host_caches, mesh) for _ in range(layers)]
            jax.block_until_ready(caches)
            start = time.perf_counter()
            out, _ = prefill_layers(x, caches, model.params, table, plan, idx, cnt, layer=layer, depth=depth,
                                    mesh=mesh, format=fmt)
            out = jax.block_until_ready(out)
            if trial:
                times.append(time.perf_counter() - start)
        outputs[depth] = np.asarray(out)
        seconds = statistics.median(times)
        results.append(dict(op="prefill_step", format=fmt_name, tokens=context, chunk=chunk, layers=layers,
                            dcp=dcp, depth=depth, implementation="prefill_layers", us=seconds * 1e6,
                            exact=bool(np.array_equal(outputs[depth], outputs[depths[0]])), **schedule))
        log(f"  prefill depth {depth}: {seconds * 1e3:.2f} ms per step ({layers} layers, context {context}, "
            f"chunk {chunk}, D={dcp}); all-gathers async {schedule['async_all_gathers']}, "
            f"sync {schedule['sync_all_gathers']}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ckv-jax bench", description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="writer,gather,patch,prefill")
    ap.add_argument("--tokens", default="65536,262144,1048576", help="tokens per op (per rank shard for gathers)")
    ap.add_argument("--formats", default="fp8_ds_mla,nvfp4_ds_mla")
    ap.add_argument("--patterns", default="sequential,random", help="writer slot patterns")
    ap.add_argument("--chunk", type=int, default=8192, help="current-chunk tokens of the patch")
    ap.add_argument("--prefill-chunk", type=int, default=1024,
                    help="query tokens of the prefill step (its reference attention materializes "
                         "[chunk, 2048, 576] float32 per layer)")
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768, help="prefill context tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results.json")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    unknown = set(ops) - {"writer", "gather", "patch", "prefill"}
    if unknown:
        ap.error(f"--ops: unknown {sorted(unknown)}; expected writer, gather, patch, prefill")
    tokens = [int(t) for t in args.tokens.split(",")]
    names = args.formats.split(",")
    for name in names:
        formats.get(name)
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                command="ckv-jax bench " + " ".join(argv if argv is not None else sys.argv[2:]))
    results = []
    def log(line):                                       # each case as it finishes
        print("\r" + line, flush=True)

    for i, op in enumerate(ops):
        _progress(i, len(ops), f"{op} ...")
        if op == "writer":
            results += writer.run(tokens, names, args.patterns.split(","), args.repeats, log=log)
        elif op == "gather":
            results += gather.run([t - t % 64 or 64 for t in tokens], names, args.repeats, log=log)
        elif op == "patch":
            results += patch_results(tokens, names, args.chunk, args.repeats, log)
        else:
            results += prefill_results([int(d) for d in args.depths.split(",")], names[0], args.layers,
                                       args.context, min(args.prefill_chunk, args.context), log)
        with open(args.out, "w") as f:                   # after every op, so a cut-off sweep keeps its figures
            json.dump(dict(meta, results=results), f, indent=1)
    _progress(len(ops), len(ops), "done")
    print(file=sys.stderr)
    for r in results:
        times = report.timing_text(r) if "gbps" in r else f"{r['us']:.1f} us"
        print(f"{r['op']:<14} {r['format']:<13} {r['tokens']:>8} {r.get('depth', r.get('pattern', '')):<10} "
              f"{r['implementation']:<19} {times} exact={r['exact']}")
    print(f"wrote {len(results)} results to {args.out}")
    return 0 if all(r["exact"] for r in results) else 1
