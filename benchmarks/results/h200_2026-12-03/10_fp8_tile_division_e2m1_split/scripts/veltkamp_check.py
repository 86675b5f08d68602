"""Exhaustive: the Veltkamp-split e2m1 code sequence (as the PTX will run it) against
record_codec.e2m1_sign_magnitude_codes, for every float32 bit pattern (NaNs as the GPU's canonical NaN)."""
import sys
import numpy as np, jax
sys.path.insert(0, ".")
from pallas_kernels.record_codec import e2m1_sign_magnitude_codes

ref_fn = jax.jit(e2m1_sign_magnitude_codes)

def emulate(bits):
    y = bits.view(np.float32)
    a = np.abs(y)
    with np.errstate(over="ignore", invalid="ignore"):
        c = a * np.float32(4194305.0)
        d = c - a
        h = c - d
        l = a + np.float32(4194304.0)
    hb = h.view(np.uint32)
    hb = np.where(np.isnan(h), np.uint32(0x7FFFFFFF), hb)     # GPU canonical NaN
    code = np.minimum((hb >> np.uint32(22)) - np.uint32(252), np.uint32(7))
    small = a < np.float32(1.0)
    code = np.where(small, l.view(np.uint32) - np.uint32(0x4A800000), code)
    return code | ((bits >> np.uint32(28)) & np.uint32(8))

bad = 0
step = 1 << 26
for start in range(0, 1 << 32, step):
    bits = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
    y = bits.view(np.float32)
    nan = np.isnan(y)
    bits = np.where(nan, np.uint32(0x7FFFFFFF), bits)   # products reach the encoder as the canonical NaN
    got = emulate(bits)
    want = np.asarray(ref_fn(bits.view(np.float32)))
    n = int(np.sum(got != want))
    if n:
        i = np.nonzero(got != want)[0][:3]
        print(hex(start), n, [(hex(b), float(bits.view(np.float32)[j]), int(got[j]), int(want[j])) for j, b in zip(i, bits[i])])
    bad += n
print("mismatches:", bad)
