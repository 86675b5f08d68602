"""`ckv-jax bench --ops attention`: sparse-MLA attention over native records, TFLOP/s per
implementation against the bf16 matmul rate of the same run.

T query tokens, each with its own top-k of `top_k` distinct random rows of a table of `rows`
real records (a gathered workspace, or a paged cache viewed flat), all rows valid; FLOPs counted
as FlashMLA counts them, 2 T H K (576 + 512).  Each implementation's output is checked first
against the XLA implementation with the same keys on the first input (`reference`, `agrees`;
`exact` in the row).  With keys="bf16" (fp8 and nvfp4 records) each implementation also runs over
the table dequantized to bf16 records first, the dequantization inside the timed call (`keys` in
the row).  Timed with `timing.measure_pure` (host clock and device timeline) over R calls on R
different query and index sets.  The ceiling: a bf16 [8192, 8192] x [8192, 8192] matmul timed the
same way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.benchmarks import report
from ckv_jax.benchmarks.timing import measure_pure
from pallas_kernels.sparse_mla_attention import SPARSE_MLA_ATTENTION, flops, sparse_mla_attention
from pallas_kernels.sparse_mla_attention.api import bf16_records, keys_layout, reading

REPEATS = 3


def matmul_rate(n: int = 8192) -> dict:
    """bf16 matmul TFLOP/s on the host clock and the device timeline."""
    keys = jax.random.split(jax.random.key(0), 2 * REPEATS)
    inputs = [(jax.random.normal(keys[2 * i], (n, n), jnp.bfloat16), jax.random.normal(keys[2 * i + 1], (n, n),
                                                                                     jnp.bfloat16))
              for i in range(REPEATS)]
    timing = measure_pure(lambda a, b: a @ b, inputs)
    work = 2 * n ** 3
    return dict(tflops=work / timing.seconds / 1e12,
                device_tflops=None if timing.device_seconds is None else work / timing.device_seconds / 1e12)


def record_table(fmt, rows: int, seed: int) -> jax.Array:
    """u8[rows, R] of real records (finite scales): random latents encoded in pieces and tiled."""
    piece = min(rows, 65536)
    key1, key2 = jax.random.split(jax.random.key(seed))
    kv = (jax.random.normal(key1, (piece, fmt.nope_dim)) * 2).astype(jnp.bfloat16)
    pe = jax.random.normal(key2, (piece, fmt.rope_dim)).astype(jnp.bfloat16)
    records = fmt.encode(kv, pe)
    return jnp.tile(records, (-(-rows // piece), 1))[:rows]


def query_sets(tokens: int, heads: int, top_k: int, rows: int, seed: int) -> list[tuple]:
    """REPEATS inputs (q bf16[T, H, 576], indices i32[T, K], counts i32[T] all K) of `rows` records."""
    out = []
    for i in range(REPEATS):
        kq, ki = jax.random.split(jax.random.key(seed * 100 + i))
        q = (jax.random.normal(kq, (tokens, heads, 576)) * 0.5).astype(jnp.bfloat16)
        # rows start + 7919 j modulo `rows`: distinct while top_k <= rows and the prime 7919 does
        # not divide `rows`
        start = jax.random.randint(ki, (tokens, 1), 0, rows)
        indices = ((start + jnp.arange(top_k)[None, :] * 7919) % rows).astype(jnp.int32)
        out.append((q, indices, jnp.full((tokens,), top_k, jnp.int32)))
    return out


def reference(q, records, indices, counts, layout, keys: str):
    """The XLA implementation with `keys`; with "bf16" over the table dequantized by XLA too, so
    that the check does not share the kernels' dequantizing gather."""
    read_layout = keys_layout(layout, keys)
    if read_layout != layout:
        records = bf16_records(records, layout=layout, implementation="xla")
    return sparse_mla_attention(q, records, indices, counts, 576 ** -0.5, layout=read_layout, implementation="xla")


def agrees(got, want) -> bool:
    """(out, lse) against the reference's: out within 1e-2 of its largest |value|, lse within 1e-2
    (relative above 1)."""
    out, lse = (np.asarray(a, np.float32) for a in got)
    ref_out, ref_lse = (np.asarray(a, np.float32) for a in want)
    scale = np.abs(ref_out).max() + 1e-30
    return bool(np.abs(out - ref_out).max() <= 1e-2 * scale and np.abs(lse - ref_lse).max() <= 1e-2 * max(
        1.0, np.abs(ref_lse).max()))


def run(heads_list, names, tokens: int, top_k: int, rows: int, log=print, interpret: bool = False,
        keys_list=("exact",)) -> list[dict]:
    """One row per (format, heads, implementation, keys); interpret: off a GPU, also the Pallas
    kernel in interpret mode (rows marked mode="interpret", without a % of the matmul rate);
    keys_list: the `keys` of the attention ("bf16": not for bf16 records, whose keys are bf16
    either way)."""
    device = jax.devices()[0]
    ceiling = matmul_rate(8192 if device.platform == "gpu" else 512)
    log(f"  bf16 matmul: {ceiling['tflops']:.3g} TFLOP/s"
        + (f" (device {ceiling['device_tflops']:.3g})" if ceiling["device_tflops"] else ""))
    results = []
    for name in names:
        fmt = formats.get(name)
        records = record_table(fmt, rows, seed=len(results))
        for heads in heads_list:
            inputs = query_sets(tokens, heads, top_k, rows, seed=heads)
            work = flops(tokens, heads, top_k, fmt.layout)
            references = {}         # by keys: each row is checked against XLA with the same arithmetic
            cases = [(impl, keys) for keys in keys_list for impl in SPARSE_MLA_ATTENTION.default_order
                     if impl in reading(keys_layout(fmt.layout, keys))
                     and (keys == "exact" or fmt.quantized)]
            for impl, keys in cases:
                mode = report.run_mode(SPARSE_MLA_ATTENTION, impl, device, records.size, interpret, log)
                if mode is None:
                    continue
                interpreted = mode == "interpret"

                def op(q, records, indices, counts, impl=impl, interpreted=interpreted, keys=keys):
                    return sparse_mla_attention(q, records, indices, counts, 576 ** -0.5, layout=fmt.layout,
                                                implementation=impl, interpret=interpreted, keys=keys)

                # the records go in as an argument: closed over, every compiled program carried
                # the table as a constant (688 MB at 1M rows, where one compile took 33 s, not 11)
                calls = [(q, records, indices, counts) for q, indices, counts in inputs]
                if keys not in references:
                    references[keys] = reference(*calls[0], fmt.layout, keys)
                checked = agrees(jax.jit(op)(*calls[0]), references[keys])
                timing = measure_pure(op, calls)
                row = dict(op="attention", format=name, tokens=tokens, heads=heads, top_k=top_k, rows=rows,
                           implementation=impl, keys=keys, exact=checked, us=timing.seconds * 1e6, flops=work,
                           tflops=work / timing.seconds / 1e12, matmul_tflops=ceiling["tflops"])
                if interpreted:
                    row["mode"] = "interpret"
                else:
                    row["pct_of_matmul"] = 100 * row["tflops"] / ceiling["tflops"]
                    if timing.device_seconds is not None and ceiling["device_tflops"]:
                        row.update(device_us=timing.device_seconds * 1e6,
                                   device_tflops=work / timing.device_seconds / 1e12,
                                   device_matmul_tflops=ceiling["device_tflops"])
                        row["device_pct_of_matmul"] = 100 * row["device_tflops"] / ceiling["device_tflops"]
                results.append(row)
                log(f"  attention {name} T={tokens} H={heads} K={top_k} {impl} ({keys} keys): {row['us']:.1f} us, "
                    f"{row['tflops']:.3g} TFLOP/s" + (f", device {row['device_tflops']:.3g} TFLOP/s "
                                                       f"({row['device_pct_of_matmul']:.0f}% of matmul)"
                                                       if "device_tflops" in row else "")
                    + f", checked={checked}")
            del inputs, references
    return results
