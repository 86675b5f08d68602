"""One call of main's writer (the copy in ab_old) for ncu: format, tokens, tokens_per_block, warps."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "ab_old")
import pallas_kernels_old.cache_writer as old_cw  # noqa: E402
from ckv_jax import formats  # noqa: E402

fmt, tokens, tpb, warps = formats.get(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
nb = -(-4 * tokens // 64)
cache = jnp.zeros((nb, 64, fmt.record_bytes), jnp.uint8)
kv_c = jnp.asarray(rng.standard_normal((tokens, fmt.nope_dim), np.float32) * 3).astype(jnp.bfloat16)
k_pe = jnp.asarray(rng.standard_normal((tokens, fmt.rope_dim), np.float32)).astype(jnp.bfloat16)
slots = jnp.asarray(rng.permutation(nb * 64)[:tokens].astype(np.int32))
jax.block_until_ready(old_cw.write_records_triton(cache, kv_c, k_pe, slots, layout=fmt.layout,
                                                  config=old_cw.WriterConfig(tpb, warps)))
print("done")
