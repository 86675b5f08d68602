"""A/B of the Pallas Triton writer: main's kernel ("old", loaded from a copy) against the branch's
("new": fp8 per-tile division with one reciprocal, nvfp4 e2m1 codes by Veltkamp's split), both checked exact against the reference, timed in
place on the host clock and on the device timeline, beside the copy ceiling of the same bytes."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "ab_old")
import pallas_kernels_old.cache_writer as old_cw  # noqa: E402

from ckv_jax import formats  # noqa: E402
from ckv_jax.benchmarks import tune  # noqa: E402
from ckv_jax.benchmarks.timing import measure_in_place, repeats_for  # noqa: E402
from pallas_kernels import cache_writer as new_cw  # noqa: E402
from pallas_kernels._pallas_compat import silence_triton_deprecation  # noqa: E402

silence_triton_deprecation()
FORMATS = sys.argv[1].split(",")
TOKENS = [int(v) for v in sys.argv[2].split(",")]
CONFIGS = [tuple(int(v) for v in c.split("x")) for c in sys.argv[3].split(",")]
for name in FORMATS:
    fmt = formats.get(name)
    for tokens in TOKENS:
        moved = new_cw.work_bytes(tokens, fmt.layout)
        ceiling = tune.copy_ceiling(moved)
        nb = min(4 * -(-tokens // 64), (2 ** 31 - 1) // (64 * fmt.record_bytes))
        key = jax.random.key(tokens)
        inputs = []
        for _ in range(repeats_for(tokens * (2 * fmt.nope_dim + 2 * fmt.rope_dim), hi=32)):
            k1, k2, k3, key = jax.random.split(key, 4)
            inputs.append(((jax.random.normal(k1, (tokens, fmt.nope_dim)) * 3).astype(jnp.bfloat16),
                           jax.random.normal(k2, (tokens, fmt.rope_dim)).astype(jnp.bfloat16),
                           jax.random.permutation(k3, nb * 64)[:tokens].astype(jnp.int32)))
        empty = lambda: jnp.zeros((nb, 64, fmt.record_bytes), jnp.uint8)      # noqa: E731
        ref = np.asarray(new_cw.write_records_reference(empty(), *inputs[0], layout=fmt.layout))
        for tpb, warps in CONFIGS:
            for tag, mod in (("old", old_cw), ("new", new_cw)):
                cfg = mod.WriterConfig(tpb, warps)

                def op(cache, kv_c, k_pe, slots, mod=mod, cfg=cfg):
                    return mod.write_records_triton(cache, kv_c, k_pe, slots, layout=fmt.layout, config=cfg)

                exact = bool(np.array_equal(np.asarray(jax.jit(op)(empty(), *inputs[0])), ref))
                t, _ = measure_in_place(op, empty(), inputs)
                print(f"AB {name:<13} {tokens:>8} {tag} ({tpb}, {warps}) {t.seconds * 1e6:8.1f} us "
                      f"{100 * ceiling.seconds / t.seconds:5.1f}% of copy | device {t.device_seconds * 1e6:8.1f} us "
                      f"{100 * ceiling.device_seconds / t.device_seconds:5.1f}% exact={exact}", flush=True)
