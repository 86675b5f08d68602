"""`ckv-jax demo`: write CKV records into a paged cache on every local device and read them back.

For each device and format: random kv_c/k_pe, a random slot mapping with skipped (-1) tokens,
a cache filled with random bytes (so stray writes show), the automatic writer implementation;
then every written record must equal the XLA reference encoding byte for byte, every other row
must be unchanged, and the decoded values must be within the format's rounding bound.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats, paged_cache
from pallas_kernels import cache_writer


def roundtrip_error_bound(fmt: formats.RecordFormat, kv_c: np.ndarray) -> np.ndarray:
    """Per-element bound on |decode(encode(x)) - x| for the NoPE part (f32[T, nope_dim])."""
    x = np.abs(kv_c.astype(np.float32))
    if not fmt.quantized:
        return x * 2.0 ** -8
    block = fmt.layout.quant_block
    amax = np.repeat(x.reshape(x.shape[0], -1, block).max(-1), block, axis=1)
    if fmt.layout.kind == "fp8_tiles":     # half an e4m3 ulp, or half the smallest subnormal step
        return np.maximum(x * 2.0 ** -4, amax / 448.0 * 2.0 ** -10) * 1.0001
    # nvfp4: the e4m3 group scale is amax/6 within 1/16 (2**-10 absolute when subnormal); the top
    # e2m1 step spans two scale units; saturation at 6 loses at most 6 * 2**-10
    return amax / 6.0 * 1.0625 + 6.0 * 2.0 ** -10


def check_one(device: jax.Device, fmt: formats.RecordFormat, tokens: int, block_size: int,
              rng: np.random.Generator) -> dict:
    num_blocks = -(-int(tokens * 1.25) // block_size)
    num_slots = num_blocks * block_size
    kv_c = (rng.standard_normal((tokens, fmt.nope_dim)) * rng.uniform(0.05, 20.0, (tokens, 1))).astype(jnp.bfloat16)
    k_pe = rng.standard_normal((tokens, fmt.rope_dim)).astype(jnp.bfloat16)
    slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
    slots[rng.random(tokens) < 1 / 16] = -1
    poison = rng.integers(0, 256, (num_blocks, block_size, fmt.record_bytes), dtype=np.uint8)

    put = lambda x: jax.device_put(x, device)
    impl = cache_writer.choose(None, device, poison.size).name
    expected = np.asarray(fmt.encode(put(kv_c), put(k_pe)))
    start = time.perf_counter()
    cache = paged_cache.write_records(put(poison), put(kv_c), put(k_pe), put(slots), fmt)
    cache.block_until_ready()
    seconds = time.perf_counter() - start

    written = slots >= 0
    got = np.asarray(paged_cache.read_records(cache, put(slots)))
    bytes_ok = bool(np.array_equal(got[written], expected[written]))
    untouched = np.ones(num_slots, bool)
    untouched[slots[written]] = False
    rest_ok = bool(np.array_equal(np.asarray(cache).reshape(num_slots, -1)[untouched],
                                  poison.reshape(num_slots, -1)[untouched]))
    decoded = np.asarray(fmt.decode(put(got[written])))
    err = np.abs(decoded[:, :fmt.nope_dim] - kv_c[written].astype(np.float32))
    err_ok = bool((err <= roundtrip_error_bound(fmt, kv_c[written])).all())
    rope_ok = bool(np.array_equal(decoded[:, fmt.nope_dim:], k_pe[written].astype(np.float32)))
    return dict(device=f"{device.platform}:{device.id}", format=fmt.name, record_bytes=fmt.record_bytes,
                written=int(written.sum()), skipped=int((~written).sum()), implementation=impl,
                seconds=seconds, ok=bytes_ok and rest_ok and err_ok and rope_ok,
                detail=f"bytes={'ok' if bytes_ok else 'DIFF'} rest={'ok' if rest_ok else 'DIFF'} "
                       f"roundtrip={'ok' if err_ok and rope_ok else 'OUT OF BOUND'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ckv-jax demo", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens written per device and format")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per cache page")
    ap.add_argument("--format", action="append", choices=formats.names(),
                    help="record format (repeatable; default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.block_size <= 0:
        ap.error("--tokens and --block-size must be positive")
    rng = np.random.default_rng(args.seed)
    rows = []
    devices = jax.local_devices()
    print(f"ckv-jax demo: {args.tokens} tokens per format on {len(devices)} device(s) "
          f"({jax.default_backend()}), {args.block_size}-token pages", flush=True)
    for device in devices:
        for name in args.format or formats.names():
            row = check_one(device, formats.get(name), args.tokens, args.block_size, rng)
            rows.append(row)
            print(f"  {row['device']:<8} {row['format']:<13} {row['detail']}", flush=True)
    print(f"\n{'device':<8} {'format':<13} {'B/rec':>6} {'written':>8} {'skipped':>8} "
          f"{'implementation':<15} {'write s':>8}  result")
    for r in rows:
        print(f"{r['device']:<8} {r['format']:<13} {r['record_bytes']:>6} {r['written']:>8} {r['skipped']:>8} "
              f"{r['implementation']:<15} {r['seconds']:>8.3f}  {'match' if r['ok'] else 'MISMATCH'}")
    bad = [r for r in rows if not r["ok"]]
    print("\nall records match" if not bad else f"\n{len(bad)} MISMATCH(ES)")
    return 1 if bad else 0
