"""Paged CKV gather benchmark: the local pack (raw records) and the dequantizing gather.

  python -m ckv_jax.benchmarks.gather [--tokens 131072,524288] [--formats fp8_ds_mla,nvfp4_ds_mla]

One rank's shard of `tokens` records in 64-token pages scattered over a cache twice that size
(one request, a random block table per call).  Raw: bytes = 2 * tokens * R; dequant: bytes =
tokens * (R + 1152).  The Pallas kernels run with the tuned config for the size
(`pallas_kernels.tuning`).  Baselines in the same run: the XLA reference of the same pack, XLA
`jnp.take` of whole pages, torch `index_select` of the same pages (CUDA events), and the faster
of an XLA and a torch contiguous copy of the same byte count (`ckv_jax.benchmarks.tune` sweeps
every config beside the same baselines).  Each JAX variant is checked
against the XLA reference before it is timed.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.benchmarks import report
from ckv_jax.benchmarks.timing import (fastest, measure_copy, measure_pure, result_fields, torch_copy_timing,
                                       torch_index_select_timing)
from pallas_kernels import paged_gather

BLOCK = 64


def run(tokens_list, names, repeats=7, log=print, interpret=False):
    """interpret: off a GPU, run the Pallas gathers in interpret mode (rows marked
    mode="interpret", without a % of copy) instead of skipping them."""
    results = []
    device = jax.devices()[0]
    for tokens in tokens_list:
        npages = tokens // BLOCK
        for name in names:
            fmt = formats.get(name)
            rb = fmt.record_bytes
            nb = 2 * npages
            rng = np.random.default_rng(tokens)
            cache_np = rng.integers(0, 256, (nb, BLOCK, rb), dtype=np.uint8)
            if fmt.quantized:          # finite scales so the dequant check compares numbers
                kv = rng.standard_normal((BLOCK * 8, 512)).astype(jnp.bfloat16)
                pe = rng.standard_normal((BLOCK * 8, 64)).astype(jnp.bfloat16)
                good = np.asarray(fmt.encode(jnp.asarray(kv), jnp.asarray(pe))).reshape(8, BLOCK, rb)
                cache_np = np.tile(good, (nb // 8 + 1, 1, 1))[:nb]
            cache = jax.device_put(cache_np, device)
            pages = [rng.permutation(nb)[:npages].astype(np.int32) for _ in range(repeats)]
            inputs = [(cache, jnp.asarray(p[None, :]), jnp.asarray([0, tokens], jnp.int32)) for p in pages]
            raw_bytes = 2 * tokens * rb
            deq_bytes = tokens * (rb + 2 * fmt.value_dim)
            ceiling_raw = fastest([measure_copy(raw_bytes // 2, repeats), torch_copy_timing(raw_bytes // 2)])
            ceiling_deq = fastest([measure_copy(deq_bytes // 2, repeats), torch_copy_timing(deq_bytes // 2)])
            ref_raw = np.asarray(paged_gather.gather_records_reference(*inputs[0], num_rows=tokens))
            ref_deq = np.asarray(paged_gather.gather_dequant_reference(*inputs[0], num_rows=tokens,
                                                                        layout=fmt.layout)).view(np.uint16)
            mode = report.run_mode(paged_gather.GATHER_RECORDS, "pallas_triton", device, cache.size, interpret, log)
            interp = mode == "interpret"
            variants = [
                ("raw", "pallas_triton", lambda c, b, u: paged_gather.gather_records(
                    c, b, u, num_rows=tokens, implementation="pallas_triton", interpret=interp), ref_raw),
                ("raw", "xla_reference", lambda c, b, u: paged_gather.gather_records_reference(c, b, u, num_rows=tokens), ref_raw),
                ("raw", "xla_take_pages", lambda c, b, u: jnp.take(c, b[0], axis=0).reshape(tokens, rb), ref_raw),
                ("dequant", "pallas_triton", lambda c, b, u: paged_gather.gather_dequant(
                    c, b, u, num_rows=tokens, layout=fmt.layout, implementation="pallas_triton",
                    interpret=interp), ref_deq),
                ("dequant", "xla_reference", lambda c, b, u: paged_gather.gather_dequant_reference(
                    c, b, u, num_rows=tokens, layout=fmt.layout), ref_deq),
            ]
            if mode is None:
                variants = [v for v in variants if v[1] != "pallas_triton"]
            for kind, impl, fn, ref in variants:
                got = np.asarray(jax.jit(fn)(*inputs[0]))
                exact = bool(np.array_equal(got.view(ref.dtype), ref))
                nbytes, ceiling = (raw_bytes, ceiling_raw) if kind == "raw" else (deq_bytes, ceiling_deq)
                row = dict(op=f"gather_{kind}", format=name, tokens=tokens, implementation=impl,
                           bytes_moved=nbytes, exact=exact,
                           **result_fields(measure_pure(fn, inputs), nbytes, ceiling, interp and impl == "pallas_triton"))
                results.append(row)
                log(f"  {name:<13} T={tokens:>7} {kind:<8} {impl:<15} {report.timing_text(row)} exact={exact}")
            t = torch_index_select_timing(cache_np.reshape(cache_np.shape[0], -1), pages)
            if t:
                row = dict(op="gather_raw", format=name, tokens=tokens, implementation="torch_index_select",
                           bytes_moved=raw_bytes, exact=True, **result_fields(t, raw_bytes, ceiling_raw))
                results.append(row)
                log(f"  {name:<13} T={tokens:>7} raw      torch_index_sel {report.timing_text(row)}")
            del cache, inputs
    return results


def main(argv=None) -> int:
    from ckv_jax.benchmarks import suite
    ap = suite.sweep_parser("gather", __doc__.splitlines()[0], tokens="131072,524288",
                            formats_default="fp8_ds_mla,nvfp4_ds_mla", repeats=7)
    args = ap.parse_args(argv)
    print(f"gather benchmark on {jax.devices()[0].device_kind} (jax {jax.__version__})", flush=True)
    results = run([t - t % BLOCK or BLOCK for t in args.tokens], args.formats, args.repeats,
                  log=lambda *a: print(*a, flush=True), interpret=args.interpret)
    return report.finish(results, [("op", "op", 14), ("format", "format", 13), ("tokens", "tokens", 7)], args.out)


if __name__ == "__main__":
    sys.exit(main())
