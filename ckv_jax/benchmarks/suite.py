"""`ckv-jax bench`: the kernel sweeps and the pipelined prefill, one JSON file.

  ckv-jax bench [--ops writer,gather,patch,prefill,attention] [--tokens 65536,262144] [--formats fp8_ds_mla]
                [--depths 0,1,2,3] [--context 1048576] [--prefill-chunk 8192] [--prefill-heads 64]
                [--heads 16,32,64,128] [--top-k 2048] [--out results.json]

Without a GPU the defaults are CPU-sized (small sizes, XLA only; `--interpret` adds the Pallas
kernels in interpret mode, whose rows are marked and get no % of copy).

Every kernel figure is validated against its reference before it is timed and sits beside its
baselines from the same run (see writer.py and gather.py); `patch` times the current-chunk patch
(a scatter of `--chunk` re-encoded tokens into a gathered workspace of 4 * `tokens` rows);
`prefill` times one step of `prefill_layers` per depth on the local devices (host clock around a
jitted call of several milliseconds, median of 3, after a warm-up call; on a GPU by default a
GLM-5-shaped step: 64 heads, top-k 2,048, an 8,192-token chunk on a 1M-token context) and the
gathers' share of it (see prefill.py); `attention` times the
sparse-MLA attention over native records per implementation and head count against the bf16
matmul rate (see attention.py).  `ckv-jax plot` renders
the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import dcp_step, formats, sparse_mla
from ckv_jax.benchmarks import attention, gather, prefill, report, writer
from ckv_jax.benchmarks.timing import fastest, measure_copy, measure_in_place, result_fields, torch_copy_timing
from pallas_kernels import cache_writer


OPS = ("writer", "gather", "patch", "prefill", "attention")
PATTERNS = ("sequential", "random")
# (GPU default, CPU default) of the options whose sizes only make sense on a GPU
DEFAULTS = dict(tokens=("65536,262144,1048576", "4096"), chunk=(8192, 512), prefill_chunk=(8192, 128),
                depths=("0,1,2,3", "0,1"), layers=(8, 2), context=(1048576, 2048), repeats=(5, 3),
                prefill_heads=(64, None),
                heads=("16,32,64,128", "16"), attention_tokens=(4096, 16), attention_rows=(262144, 1024),
                top_k=(2048, 64))


def positive_ints(text):
    """An argparse type: comma-separated positive ints."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text):
    """An argparse type: one positive int."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def depth_list(text):
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated depths >= 0, got {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected depths >= 0, got {text!r}")
    return values


def key_list(text):
    """An argparse type: comma-separated `keys` of the attention (`sparse_mla.KEYS`)."""
    values = str(text).split(",")
    bad = [v for v in values if v not in sparse_mla.KEYS]
    if bad or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct keys among {', '.join(sparse_mla.KEYS)}, got {text!r}")
    return values


def format_names(text):
    """An argparse type: comma-separated record format names or aliases -> canonical names."""
    names = []
    for name in str(text).split(","):
        try:
            names.append(formats.get(name).name)
        except (ValueError, KeyError) as e:
            raise argparse.ArgumentTypeError(str(e).strip("'\"")) from None
    return names


def one_of(allowed):
    """An argparse type: comma-separated values, each among `allowed`."""
    def parse(text):
        values = str(text).split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; expected among {', '.join(allowed)}")
        return values
    return parse


slot_patterns = one_of(PATTERNS)
op_names = one_of(OPS)


def sweep_parser(module: str, description: str, *, tokens: str, formats_default: str,
                 repeats: int) -> argparse.ArgumentParser:
    """The options the standalone sweeps (`python -m ckv_jax.benchmarks.<module>`) share with
    `ckv-jax bench`: --tokens, --formats, --repeats, --interpret and --out."""
    ap = argparse.ArgumentParser(prog=f"python -m ckv_jax.benchmarks.{module}", description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", type=positive_ints, default=tokens, help="tokens per call")
    ap.add_argument("--formats", type=format_names, default=formats_default, help="record formats (names or aliases)")
    ap.add_argument("--repeats", type=positive_int, default=repeats, help="timed calls per case")
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode off a GPU")
    ap.add_argument("--out", help="write the results here as JSON")
    return ap


def patch_results(tokens_list, names, chunk, repeats, log, interpret=False):
    """The patch: `chunk` tokens re-encoded and scattered into a workspace of 4 * tokens rows."""
    results = []
    device = jax.devices()[0]
    for tokens in tokens_list:
        for name in names:
            fmt = formats.get(name)
            rows = 4 * tokens
            moved = chunk * (2 * fmt.nope_dim + 2 * fmt.rope_dim + 4 + fmt.record_bytes)
            ceiling = fastest([measure_copy(moved // 2, repeats), torch_copy_timing(moved // 2)])
            key = jax.random.key(tokens)
            inputs = []
            for i in range(repeats):
                k1, k2, k3, key = jax.random.split(key, 4)
                inputs.append(((jax.random.normal(k1, (chunk, fmt.nope_dim)) * 3).astype(jnp.bfloat16),
                               jax.random.normal(k2, (chunk, fmt.rope_dim)).astype(jnp.bfloat16),
                               jax.random.permutation(k3, rows)[:chunk].astype(jnp.int32)))
            reference = None
            for impl in cache_writer.DEFAULT_ORDER:
                mode = report.run_mode(cache_writer.WRITE_RECORDS, impl, device, rows * fmt.record_bytes, interpret,
                                       log)
                if mode is None:
                    continue
                interpreted = mode == "interpret"

                def op(ws, kv_c, k_pe, dest, impl=impl, interpreted=interpreted):
                    return dcp_step.patch_chunk(ws, kv_c, k_pe, dest, layout=fmt.layout, implementation=impl,
                                                interpret=interpreted)

                ws = jnp.zeros((rows, fmt.record_bytes), jnp.uint8)
                got = np.asarray(jax.jit(op)(ws, *inputs[0]))
                if reference is None:
                    reference = np.asarray(cache_writer.write_records_reference(
                        jnp.zeros((rows, 1, fmt.record_bytes), jnp.uint8), *inputs[0], layout=fmt.layout)
                    ).reshape(rows, fmt.record_bytes)
                timing, _ = measure_in_place(op, ws, inputs)
                row = dict(op="patch", format=name, tokens=tokens, chunk=chunk, implementation=impl,
                           bytes_moved=moved, exact=bool(np.array_equal(got, reference)),
                           **result_fields(timing, moved, ceiling, interpreted))
                results.append(row)
                log(f"  patch {name} rows={rows} chunk={chunk} {impl}: {report.timing_text(row)}")
    return results


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    default = {k: v[0 if on_gpu else 1] for k, v in DEFAULTS.items()}
    ap = argparse.ArgumentParser(prog="ckv-jax bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog=f"Defaults shown are this machine's ({'GPU' if on_gpu else 'CPU'}-sized).")
    ap.add_argument("--ops", type=op_names, default=",".join(OPS), help="what to run: " + ", ".join(OPS))
    ap.add_argument("--tokens", type=positive_ints, default=default["tokens"],
                    help="[writer, gather, patch] tokens per call (per rank shard for gathers; patch: a "
                         "workspace of 4 x tokens rows)")
    ap.add_argument("--formats", type=format_names, default="fp8_ds_mla,nvfp4_ds_mla",
                    help="[all] record formats, names or aliases (prefill: the first)")
    ap.add_argument("--patterns", type=slot_patterns, default="sequential,random",
                    help="[writer] slot patterns: " + ", ".join(PATTERNS))
    ap.add_argument("--chunk", type=positive_int, default=default["chunk"],
                    help="[patch] current-chunk tokens re-encoded into the workspace")
    ap.add_argument("--prefill-chunk", type=positive_int, default=default["prefill_chunk"],
                    help="[prefill] query tokens of the step")
    ap.add_argument("--prefill-heads", type=positive_int, default=default["prefill_heads"],
                    help="[prefill] query heads of the model, split over the devices (default off a GPU: 8 a device)")
    ap.add_argument("--prefill-attention", choices=("auto",) + sparse_mla.IMPLEMENTATIONS, default="auto",
                    help="[prefill] the step's attention: auto (the library's choice: a kernel on a GPU, XLA "
                         "elsewhere) or an implementation")
    ap.add_argument("--keys", type=key_list, default="exact",
                    help="[attention, prefill] how fp8 and nvfp4 values reach the products: exact (dequantized "
                         "in the kernel), bf16 (the table dequantized to bf16 records first), or both "
                         "(exact,bf16); prefill: the first")
    ap.add_argument("--depths", type=depth_list, default=default["depths"], help="[prefill] prefetch depths")
    ap.add_argument("--layers", type=positive_int, default=default["layers"], help="[prefill] layers")
    ap.add_argument("--context", type=positive_int, default=default["context"],
                    help="[prefill] context tokens of the request")
    ap.add_argument("--heads", type=positive_ints, default=default["heads"], help="[attention] query heads")
    ap.add_argument("--attention-tokens", type=positive_int, default=default["attention_tokens"],
                    help="[attention] query tokens, each with its own top-k")
    ap.add_argument("--attention-rows", type=positive_int, default=default["attention_rows"],
                    help="[attention] records the top-k rows are drawn from (a workspace or a flat paged cache)")
    ap.add_argument("--top-k", type=positive_int, default=default["top_k"],
                    help="[attention, prefill] rows per query token")
    ap.add_argument("--repeats", type=positive_int, default=default["repeats"],
                    help="[writer, gather, patch] timed calls per case")
    ap.add_argument("--interpret", action="store_true",
                    help="[writer, gather, patch] off a GPU, also run the Pallas kernels in interpret mode "
                         "(marked rows, no %% of copy)")
    ap.add_argument("--out", default="results.json", help="the JSON results file")
    args = ap.parse_args(argv)
    if "gather" in args.ops and any(t < 64 for t in args.tokens):
        ap.error("--tokens: the gathers move whole 64-record pages; expected at least 64")
    if "prefill" in args.ops and args.prefill_heads and args.prefill_heads % len(jax.devices()):
        ap.error(f"--prefill-heads {args.prefill_heads}: expected a multiple of the {len(jax.devices())} devices")
    names = args.formats
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                command="ckv-jax bench " + " ".join(argv if argv is not None else sys.argv[2:]))
    results = []

    def log(line):                                       # each case as it finishes
        print(line, flush=True)

    units = [(op, t, n) for op in args.ops if op not in ("prefill", "attention") for t in args.tokens for n in names]
    units += [("prefill", args.context, names[0])] if "prefill" in args.ops else []
    units += [("attention", args.attention_tokens, n) for n in names] if "attention" in args.ops else []
    progress = report.Progress(len(units))
    for op, tokens, name in units:
        if op == "writer":
            results += writer.run([tokens], [name], args.patterns, args.repeats, log=log, interpret=args.interpret)
        elif op == "gather":
            results += gather.run([tokens - tokens % 64], [name], args.repeats, log=log, interpret=args.interpret)
        elif op == "patch":
            results += patch_results([tokens], [name], args.chunk, args.repeats, log, args.interpret)
        elif op == "attention":
            results += attention.run(args.heads, [name], tokens, args.top_k, args.attention_rows, log, args.interpret,
                                     keys_list=args.keys)
        else:
            results += prefill.run(args.depths, name, args.layers, args.context,
                                   min(args.prefill_chunk, args.context), log, heads=args.prefill_heads,
                                   top_k=args.top_k, keys=args.keys[0],
                                   attention=None if args.prefill_attention == "auto" else args.prefill_attention)
        progress.step(f"{op} {name} {tokens} tokens")
        with open(args.out, "w") as f:                   # after every unit, so a cut-off sweep keeps its figures
            json.dump(dict(meta, results=results), f, indent=1)
    for r in results:
        times = report.timing_text(r) if "gbps" in r else f"{r['us']:.1f} us"
        if r["op"] == "attention":
            times += f" {r['tflops']:.3g} TFLOP/s, H={r['heads']}, {r['keys']} keys" + (
                " (interpret mode)" if r.get("mode") else "")
        if r["op"] == "prefill_step":
            times += f", attention {r['attention']} ({r['keys']} keys) {r['attention_tflops']:.3g} TFLOP/s" + (
                "" if r["gather_share_pct"] is None else f", gathers exposed {r['gather_share_pct']:.1f}%")
        print(f"{r['op']:<14} {r['format']:<13} {r['tokens']:>8} {r.get('depth', r.get('pattern', '')):<10} "
              f"{r['implementation']:<19} {times} exact={r['exact']}")
    print(f"wrote {len(results)} results to {args.out}")
    return 0 if all(r["exact"] for r in results) else 1
