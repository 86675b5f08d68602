"""Paged-cache writer benchmark: effective bandwidth next to a device copy of the same bytes.

  python -m ckv_jax.benchmarks.writer [--tokens 65536,262144,1048576] [--formats ...] [--out out.json]

Bytes counted per token: kv_c and k_pe read (bf16), the int32 slot read, the record written.
The ceiling is the faster of two contiguous device-to-device copies of that many bytes (read +
written) in the same run: XLA (timed like the kernels) and torch `copy_` (CUDA events), when
torch with CUDA is installed.  Each implementation's cache is checked byte for byte against
the XLA reference before it is timed.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from ckv_jax.benchmarks import report
from ckv_jax.benchmarks.timing import fastest, measure_copy, measure_in_place, result_fields, torch_copy_timing
from pallas_kernels import cache_writer

BLOCK_SIZE = 64


def make_inputs(fmt, tokens, repeats, pattern, key):
    num_slots = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE
    out = []
    for i in range(repeats):
        k1, k2, k3, key = jax.random.split(key, 4)
        kv_c = (jax.random.normal(k1, (tokens, fmt.nope_dim), jnp.float32) * 3).astype(jnp.bfloat16)
        k_pe = jax.random.normal(k2, (tokens, fmt.rope_dim), jnp.float32).astype(jnp.bfloat16)
        if pattern == "random":
            slots = jax.random.permutation(k3, num_slots)[:tokens].astype(jnp.int32)
        else:
            slots = ((jnp.arange(tokens, dtype=jnp.int32) + i * BLOCK_SIZE) % num_slots)
        out.append((kv_c, k_pe, slots))
    return num_slots // BLOCK_SIZE, out


def run(tokens_list, names, patterns, repeats=5, log=print, interpret=False):
    """interpret: run the Pallas implementations in interpret mode where they need a GPU
    (rows marked mode="interpret", without a % of copy)."""
    device = jax.devices()[0]
    results = []
    for tokens in tokens_list:
        for name in names:
            fmt = formats.get(name)
            moved = tokens * (2 * fmt.nope_dim + 2 * fmt.rope_dim + 4 + fmt.record_bytes)
            xla_copy = measure_copy(moved // 2, max(repeats, min(21, int(4e9 // moved))))
            torch_copy = torch_copy_timing(moved // 2)
            ceiling = fastest([xla_copy, torch_copy])
            log(f"  copy of {moved / 1e6:.0f} MB (read + write): XLA {moved / xla_copy.seconds / 1e9:.0f} GB/s"
                + (f", torch {moved / torch_copy.seconds / 1e9:.0f} GB/s" if torch_copy else ""))
            for pattern in patterns:
                num_blocks, inputs = make_inputs(fmt, tokens, repeats, pattern, jax.random.key(tokens))
                reference = None
                for impl in cache_writer.DEFAULT_ORDER:
                    mode = report.run_mode(cache_writer.WRITE_RECORDS, impl, device,
                                           num_blocks * BLOCK_SIZE * fmt.record_bytes, interpret, log)
                    if mode is None:
                        continue
                    interpreted = mode == "interpret"
                    run_impl = cache_writer.WRITE_RECORDS.implementation(impl).run

                    def op(cache, kv_c, k_pe, slots, run_impl=run_impl, interpreted=interpreted):
                        return run_impl(cache, kv_c, k_pe, slots, layout=fmt.layout, interpret=interpreted)

                    cache = jnp.zeros((num_blocks, BLOCK_SIZE, fmt.record_bytes), jnp.uint8)
                    checked = np.asarray(jax.jit(op)(cache, *inputs[0]))
                    if reference is None:
                        reference = np.asarray(cache_writer.write_records_reference(
                            jnp.zeros_like(cache), *inputs[0], layout=fmt.layout))
                    exact = bool(np.array_equal(checked, reference))
                    timing, _ = measure_in_place(op, cache, inputs)
                    row = dict(op="write_records", format=name, tokens=tokens, pattern=pattern,
                               implementation=impl, bytes_moved=moved, exact=exact,
                               xla_copy_gbps=moved / xla_copy.seconds / 1e9,
                               torch_copy_gbps=moved / torch_copy.seconds / 1e9 if torch_copy else None,
                               **result_fields(timing, moved, ceiling, interpreted))
                    results.append(row)
                    log(f"  {name:<13} T={tokens:>8} {pattern:<10} {impl:<14} {report.timing_text(row)}  exact={exact}")
    return results


def main(argv=None) -> int:
    from ckv_jax.benchmarks import suite
    ap = suite.sweep_parser("writer", __doc__.splitlines()[0], tokens="65536,262144,1048576",
                            formats_default="fp8_ds_mla,nvfp4_ds_mla,bf16", repeats=5)
    ap.add_argument("--patterns", type=suite.slot_patterns, default="sequential,random", help="slot patterns")
    args = ap.parse_args(argv)
    print(f"writer benchmark on {jax.devices()[0].device_kind} (jax {jax.__version__})", flush=True)
    results = run(args.tokens, args.formats, args.patterns, args.repeats, log=lambda *a: print(*a, flush=True),
                  interpret=args.interpret)
    return report.finish(results, [("format", "format", 13), ("tokens", "tokens", 8), ("slots", "pattern", 10)], args.out)


if __name__ == "__main__":
    sys.exit(main())
