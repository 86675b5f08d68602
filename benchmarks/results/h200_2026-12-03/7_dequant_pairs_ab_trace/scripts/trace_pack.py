"""Where the in-program time of a small pack goes: the device timeline (jax.profiler trace,
CUPTI) of one program of R packs, per kernel name: count, median duration, median gap to the
next kernel on its stream; beside time_pure's figure. torch: CUDA events per call."""
import glob
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.profiler import ProfileData

from ckv_jax import formats
from ckv_jax.benchmarks import tune
from ckv_jax.benchmarks.timing import repeats_for, time_pure
from pallas_kernels import paged_gather
from pallas_kernels._pallas_compat import silence_triton_deprecation
from pallas_kernels.paged_gather import GatherConfig

silence_triton_deprecation()


def timeline(fn, inputs):
    many = jax.jit(lambda *xs: tuple(fn(*x) for x in xs))
    jax.block_until_ready(many(*inputs))
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    jax.block_until_ready(many(*inputs))
    jax.profiler.stop_trace()
    pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            ev = sorted(((e.start_ns, e.end_ns, e.name) for e in line.events), key=lambda e: e[0])
            if len(ev) < 4:
                continue
            names = {}
            for s, e, n in ev:
                names.setdefault(n[:60], []).append(e - s)
            gaps = [b[0] - a[1] for a, b in zip(ev, ev[1:])]
            span = ev[-1][1] - ev[0][0]
            out.append(f"    line {line.name[:40]!r}: {len(ev)} events, span {span / 1e3:.1f} us, "
                       f"median gap {statistics.median(gaps) / 1e3:.2f} us")
            for n, ds in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:4]:
                out.append(f"      {len(ds):4d} x {n:<60} median {statistics.median(ds) / 1e3:8.2f} us")
    return "\n".join(out)


def torch_events(source_np, index_list, iters=20):
    import torch
    src = torch.from_numpy(source_np).cuda()
    idx = [torch.from_numpy(i.astype(np.int64)).cuda() for i in index_list]
    outs = [src.index_select(0, i) for i in idx]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    ev[0].record()
    for k in range(iters):
        torch.index_select(src, 0, idx[k % len(idx)], out=outs[k % len(outs)])
        ev[k + 1].record()
    ev[-1].synchronize()
    per = [ev[k].elapsed_time(ev[k + 1]) * 1e3 for k in range(iters)]
    return statistics.median(per), (ev[0].elapsed_time(ev[-1]) * 1e3) / iters


fmt = formats.get(sys.argv[1] if len(sys.argv) > 1 else "fp8_ds_mla")
for tokens in (32768, 65536, 262144):
    rb = fmt.record_bytes
    for span_mb in (64, 512):
        nb = max(2 * (tokens // 64 + 1), span_mb * 2 ** 20 // (64 * rb))
        rng = np.random.default_rng(tokens)
        cache_np = tune._record_cache(fmt, nb, rng)
        cache = jax.device_put(cache_np)
        steps = [tune.request_tables(rng, nb, tokens, 1) for _ in range(repeats_for(tokens * rb))]
        inputs = [(cache, jnp.asarray(t), jnp.asarray(c)) for t, c, _ in steps]
        words = jax.device_put(cache_np.reshape(nb, -1).view(np.uint32))
        variants = [(f"triton {r}/{w}", lambda c, b, u, cfg=GatherConfig(r, w): paged_gather.gather_records_triton(
            c, b, u, num_rows=tokens, config=cfg), inputs) for r, w in ((4, 2), (8, 4))]
        variants.append(("xla take pages", lambda w, p: jnp.take(w, p, axis=0),
                         [(words, jnp.asarray(p)) for _, _, p in steps]))
        n = tokens * rb // 4
        src = jax.random.bits(jax.random.key(1), (n * len(steps),), jnp.uint32)
        variants.append(("xla copy", lambda s, off: lax.dynamic_slice_in_dim(s, off, n),
                         [(src, jnp.int32(i * n)) for i in range(len(steps))]))
        print(f"== {fmt.name} tokens={tokens} cache={nb * 64 * rb / 2 ** 20:.0f} MB R={len(steps)}", flush=True)
        for name, fn, ins in variants:
            print(f"  {name}: time_pure {time_pure(fn, ins) * 1e6:.1f} us/call", flush=True)
            print(timeline(fn, ins), flush=True)
        per, avg = torch_events(cache_np.reshape(nb, -1), [p for _, _, p in steps])
        print(f"  torch index_select: per-call events median {per:.1f} us, average {avg:.1f} us", flush=True)
        del cache, inputs, words, src
