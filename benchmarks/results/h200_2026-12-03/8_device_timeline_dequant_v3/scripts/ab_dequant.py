"""A/B of the nvfp4 dequantizing gather: main's kernel ("old", loaded from a copy) against the
branch's ("new"), both checked exact against the reference, timed as in tune.  With --once:
one call of each (old first) at 1M tokens 8/4, for ncu."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "ab_old")
import pallas_kernels_old.paged_gather as old_pg  # noqa: E402

from ckv_jax import formats  # noqa: E402
from ckv_jax.benchmarks import tune  # noqa: E402
from ckv_jax.benchmarks.timing import measure_pure, repeats_for  # noqa: E402
from pallas_kernels import paged_gather as new_pg  # noqa: E402
from pallas_kernels._pallas_compat import silence_triton_deprecation  # noqa: E402

silence_triton_deprecation()
fmt_names = sys.argv[2:] if len(sys.argv) > 2 else ["nvfp4_ds_mla"]
once = sys.argv[1] == "once"
sizes = [1048576] if once else [65536, 262144, 1048576]
configs = [(8, 4)] if once else [(4, 4), (8, 4), (16, 8)]
for name in fmt_names:
    fmt = formats.get(name)
    for tokens in sizes:
        rb = fmt.record_bytes
        nb = max(2 * (tokens // 64 + 1), tune.MIN_CACHE_BYTES // (64 * rb))
        rng = np.random.default_rng(tokens)
        cache = jax.device_put(tune._record_cache(fmt, nb, rng))
        moved = tokens * (rb + 2 * fmt.value_dim)
        steps = [tune.request_tables(rng, nb, tokens, 1) for _ in range(2 if once else repeats_for(2 * fmt.value_dim * tokens))]
        inputs = [(cache, jnp.asarray(t), jnp.asarray(c)) for t, c, _ in steps]
        ref = np.asarray(new_pg.gather_dequant_reference(*inputs[0], num_rows=tokens, layout=fmt.layout))
        ceiling = None if once else tune.copy_ceiling(moved)
        for rows, warps in configs:
            for tag, mod in (("old", old_pg), ("new", new_pg)):
                cfg = mod.GatherConfig(rows, warps)
                fn = lambda c, b, u, mod=mod, cfg=cfg: mod.gather_dequant_triton(  # noqa: E731
                    c, b, u, num_rows=tokens, layout=fmt.layout, config=cfg)
                got = np.asarray(jax.block_until_ready(jax.jit(fn)(*inputs[0])))
                exact = tune.same_bits(got, ref)
                if once:
                    print(f"ONCE {tag} {name} {tokens} ({rows}, {warps}) exact={exact}", flush=True)
                    continue
                t = measure_pure(fn, inputs)
                print(f"AB {name:<13} {tokens:>8} {tag} ({rows}, {warps}) {t.seconds * 1e6:8.1f} us "
                      f"{moved / t.seconds / 1e9:6.0f} GB/s {100 * ceiling.seconds / t.seconds:5.1f}% of copy | device "
                      f"{t.device_seconds * 1e6:8.1f} us {100 * ceiling.device_seconds / t.device_seconds:5.1f}% "
                      f"exact={exact}", flush=True)
        del cache, inputs
