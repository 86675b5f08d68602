"""Random inputs and comparisons shared by the tests."""
import jax
import ml_dtypes
import numpy as np

import oracle

ON_GPU = jax.default_backend() == "gpu"
# XLA on CPU flushes subnormal float32 results (decode's products); GPU backends keep them.
FLUSHES_SUBNORMALS = not ON_GPU


def random_kv(rng, tokens, nope=512, rope=64, dtype=ml_dtypes.bfloat16):
    """Latents with per-token magnitudes spanning 1e-3..1e3 and a bf16 RoPE key."""
    mag = 10.0 ** rng.uniform(-3, 3, (tokens, 1))
    kv_c = (rng.standard_normal((tokens, nope)) * mag).astype(dtype)
    k_pe = (rng.standard_normal((tokens, rope)) * 4).astype(ml_dtypes.bfloat16)
    return kv_c, k_pe


def oracle_records(name, kv_c, k_pe, flush=False):
    return oracle.ENCODERS[name](np.asarray(kv_c).astype(np.float32), np.asarray(k_pe), flush_subnormals=flush)


def assert_bytes_equal(got, want, what="records"):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first at {bad[:4].tolist()}: " \
        f"got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"
