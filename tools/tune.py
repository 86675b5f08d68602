"""Tuning sweep: every implementation and candidate config of the kernel ops, side by side.

  python tools/tune.py [--ops gather_records,gather_dequant,gather_slots,write_records]
                         [--formats fp8_ds_mla,nvfp4_ds_mla] [--tokens N,...] [--requests N]
                         [--out tune.json] [--table-out pallas_kernels/tuned]
  python tools/tune.py --ops gather_records_persistent [--persistent-programs N,...]

Per op, format and size, in one process: the copy ceiling of the same bytes (the faster of an XLA
and a torch contiguous copy), the XLA implementation, the torch op doing the same movement where
torch has one (`index_select` of whole pages for the pack, of rows for the gather by slot), XLA
`jnp.take` of whole pages on a uint32 view, and the Pallas Triton kernel at every candidate
config.  Each result is checked byte for byte against the reference before it is timed; caches
span at least 512 MB so the 60 MB L2 cannot hold them.  Every time is taken twice
(`ckv_jax.benchmarks.timing`): on the host clock, (t_R - t_1) / (R - 1), and on the device's
timeline (the profiler's kernel span / R; torch: a replayed CUDA graph), each with its own copy
ceiling.  The launch floor (one tiny kernel in a program of many) is measured too, for the small
sizes' "bytes / bandwidth + one launch" floor.  Prints the winners, ranked by device time where
every candidate has one, as the table `pallas_kernels.tuning` reads (`--table-out DIR` writes it
as DIR/<device kind>.json); `--table-from a.json b.json ...` makes the table from earlier sweeps
instead, each config's time averaged over the sweeps that ran it.

`gather_records_persistent` is the prefetch's pack with a bounded SM footprint
(`ckv_jax.dcp_step.bounded_pack_tiles`): every candidate tile at every program count, beside the
synchronous gather as `gather_records` selects it (a full grid; a baseline row).  The footprint
is `prefetch_programs` (half the SMs unless the caller names another), so these rows inform the
bounded pack's tiles and add nothing to the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ckv_jax import formats
from ckv_jax.benchmarks.timing import (Timing, fastest, measure_copy, measure_in_place, measure_pure, repeats_for,
                                       result_fields, torch_copy_timing, torch_index_select_timing)
from pallas_kernels import cache_writer, compat, paged_gather, sparse_mla_attention, tuning
from pallas_kernels.cache_writer import WriterTiles
from pallas_kernels.paged_gather import GatherTiles
from pallas_kernels.sparse_mla_attention import AttentionTiles, MosaicAttentionTiles, pallas_mosaic_gpu
from pallas_kernels.sparse_mla_attention.api import reading

BLOCK = 64
MIN_CACHE_BYTES = 512 * 2 ** 20

# candidates: smaller tiles win at every large size on the H200 (BENCHMARKS.md, kernel notes), so
# the smallest are here
GATHER_CONFIGS = [GatherTiles(t, w) for t, w in [(4, 2), (4, 4), (8, 2), (8, 4), (16, 4)]]
DEQUANT_CONFIGS = [GatherTiles(t, w) for t, w in [(4, 4), (8, 2), (8, 4), (16, 8)]]
SLOT_CONFIGS = [GatherTiles(t, w) for t, w in [(4, 2), (8, 2), (8, 4), (16, 8), (32, 8)]]
WRITER_CONFIGS = [WriterTiles(t, w) for t, w in [(4, 2), (4, 4), (8, 2), (8, 4)]]
# the persistent pack's candidates (records per tile, warps), by the bytes one program holds in
# flight: a program waits for each tile's loads before its stores and the next loads, so its rate
# is about its tile per memory latency (64 fp8 records, 42 KB: about 40 GB/s a program on the
# H200, BENCHMARKS.md "the bounded pack's price"); larger tiles with more warps hold more
PERSISTENT_OP = "gather_records_persistent"
PERSISTENT_CANDIDATES = [(32, 4), (64, 8), (128, 8), (128, 16), (256, 16), (256, 32)]


def persistent_configs(programs: int) -> list[GatherTiles]:
    """Every persistent candidate at `programs` programs."""
    return [GatherTiles(rows, warps, programs=programs) for rows, warps in PERSISTENT_CANDIDATES]


# tokens per op: from a 21 MB pack, a 64K-token shard and decode-sized slot lists up to working
# sets far above the 60 MB L2 (524,288 fp8 records are the 344 MB pack of the goals; 131,072
# written tokens are the patch of `ckv-jax bench`)
SIZES = {"gather_records": (32768, 131072, 524288, 1048576), "gather_dequant": (65536, 1048576),
         "gather_slots": (2048, 131072, 1048576), "write_records": (8192, 131072, 262144, 1048576),
         PERSISTENT_OP: (262144, 1048576)}       # the torch adapter bench's two histories


def launch_timing() -> Timing:
    """Per-kernel cost of a trivial Pallas Triton kernel inside one program: launch + minimal work."""
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    kernel = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
                            compiler_params=compat.triton_compiler_params(1))
    inputs = [(jnp.full((16,), i, jnp.int32),) for i in range(21)]
    return measure_pure(kernel, inputs)


def copy_ceiling(moved: int) -> Timing:
    """The copy ceiling of `moved` bytes (read + written): the faster of an XLA and a torch copy."""
    return fastest([measure_copy(moved // 2, repeats_for(moved // 2, hi=16)), torch_copy_timing(moved // 2)])


def _record_cache(fmt, num_blocks, rng):
    """u8[num_blocks, BLOCK, R] of real records (finite scales), tiled from 8 encoded blocks."""
    kv = rng.standard_normal((BLOCK * 8, fmt.nope_dim)).astype(jnp.bfloat16)
    pe = rng.standard_normal((BLOCK * 8, fmt.rope_dim)).astype(jnp.bfloat16)
    good = np.asarray(fmt.encode(jnp.asarray(kv), jnp.asarray(pe))).reshape(8, BLOCK, fmt.record_bytes)
    cache = np.tile(good, (num_blocks // 8 + 1, 1, 1))[:num_blocks]
    cache[:, :, -1] = rng.integers(0, 256, (num_blocks, BLOCK), dtype=np.uint8)   # every record distinct
    return cache


def _row(op, fmt, size, impl, config, timing: Timing, moved, ceiling: Timing, exact, **extra):
    return dict(op=op, format=fmt.name, size=size, implementation=impl,
                config=None if config is None else dict(
                    (f, getattr(config, f)) for f in config.__dataclass_fields__),
                bytes_moved=moved, exact=exact, **result_fields(timing, moved, ceiling), **extra)


def _timed(log, results, row):
    results.append(row)
    cfg = "" if row["config"] is None else " ".join(f"{k}={v}" for k, v in row["config"].items())
    device = (f" | device {row['device_us']:9.1f} us {row['device_pct_of_copy']:5.1f}%" if "device_us" in row
              else "")
    log(f"  {row['op']:<15} {row['format']:<13} {row['size']:>8} {row['implementation']:<16} {cfg:<44} "
        f"{row['us']:9.1f} us {row['gbps']:6.3g} GB/s {row['pct_of_copy']:5.1f}%{device} exact={row['exact']}")


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    """Bit for bit equal, except that in bf16 outputs any NaN matches any NaN: the sweep's records
    end in a random byte (the top of their last RoPE element), and XLA on CPU quiets a signaling
    NaN when it copies bf16, so the references do not keep NaN payloads everywhere."""
    got = got.view(ref.dtype)
    if ref.dtype != jnp.bfloat16:
        return bool(np.array_equal(got, ref))
    nan = np.isnan(ref)
    return bool(np.array_equal(nan, np.isnan(got))
                and np.array_equal(got[~nan].view(np.uint16), ref[~nan].view(np.uint16)))


def _time_variants(op, fmt, size, variants, inputs, ref, moved, ceiling, log, results):
    """Check each (implementation, config, fn) against `ref` on the first inputs, then time it."""
    for impl, cfg, fn in variants:
        got = np.asarray(jax.jit(fn)(*inputs[0]))
        exact = same_bits(got, ref)
        _timed(log, results, _row(op, fmt, size, impl, cfg, measure_pure(fn, inputs), moved, ceiling, exact))


def _time_torch(op, fmt, size, name, source_np, index_lists, moved, ceiling, log, results):
    """torch `index_select` of the same rows as a baseline, where torch with CUDA is installed."""
    timing = torch_index_select_timing(source_np, index_lists)
    if timing:
        _timed(log, results, _row(op, fmt, size, name, None, timing, moved, ceiling, True, baseline=True))


def request_tables(rng, num_blocks, tokens, num_requests):
    """A step of `num_requests` requests sharing `tokens` rows (equal lengths, the last one 17
    rows short so its last page is partial) on distinct random pages: (i32[num_requests,
    max_blocks] block table, i32[num_requests + 1] cu_lens, i32[pages] every page in order)."""
    lens = np.full(num_requests, tokens // num_requests)
    lens[-1] = tokens - lens[:-1].sum() - 17
    need = -(-lens // BLOCK)
    pages = rng.permutation(num_blocks)[:need.sum()].astype(np.int32)
    table = np.zeros((num_requests, need.max()), np.int32)
    for r, (lo, n) in enumerate(zip(np.cumsum(need) - need, need)):
        table[r, :n] = pages[lo:lo + n]
    return table, np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), pages


def sweep_paged(op, names, log, results, num_requests=1, persistent_programs=()):
    """gather_records, gather_dequant, or the persistent pack (PERSISTENT_OP) at each of
    `persistent_programs`."""
    device = jax.devices()[0]
    if op == PERSISTENT_OP:                    # every candidate tile at every program count
        configs = [c for p in persistent_programs for c in persistent_configs(p)]
    else:
        configs = DEQUANT_CONFIGS if op == "gather_dequant" else GATHER_CONFIGS
    records = op != "gather_dequant"           # raw records out (both gathers of records)
    for tokens in SIZES[op]:
        for name in names:
            fmt = formats.get(name)
            rb = fmt.record_bytes
            npages = tokens // BLOCK + num_requests
            nb = max(2 * npages, MIN_CACHE_BYTES // (BLOCK * rb))
            rng = np.random.default_rng(tokens)
            cache_np = _record_cache(fmt, nb, rng)
            cache = jax.device_put(cache_np, device)
            out_bytes = tokens * (rb if records else 2 * fmt.value_dim)
            steps = [request_tables(rng, nb, tokens, num_requests) for _ in range(repeats_for(out_bytes))]
            inputs = [(cache, jnp.asarray(table), jnp.asarray(cu)) for table, cu, _ in steps]
            pages = [p for _, _, p in steps]
            if records:
                moved = 2 * tokens * rb
                ref = np.asarray(paged_gather.gather_records_reference(*inputs[0], num_rows=tokens))
                variants = [] if op == PERSISTENT_OP else [("xla", None, lambda c, b, u: (
                    paged_gather.gather_records_reference(c, b, u, num_rows=tokens)))]
                variants += [("pallas_triton", cfg, lambda c, b, u, cfg=cfg: paged_gather.gather_records_triton(
                    c, b, u, num_rows=tokens, config=cfg)) for cfg in configs]
                if op == "gather_records" and paged_gather.GATHER_RECORDS.implementation(
                        "pallas_mosaic_gpu").supported_on(device, cache.size, False)[0]:
                    variants.append(("pallas_mosaic_gpu", None, lambda c, b, u: paged_gather.gather_records(
                        c, b, u, num_rows=tokens, implementation="pallas_mosaic_gpu")))
            else:
                moved = tokens * (rb + 2 * fmt.value_dim)
                ref = np.asarray(paged_gather.gather_dequant_reference(*inputs[0], num_rows=tokens,
                                                                       layout=fmt.layout))
                variants = [("xla", None, lambda c, b, u: paged_gather.gather_dequant_reference(
                    c, b, u, num_rows=tokens, layout=fmt.layout))]
                variants += [("pallas_triton", cfg, lambda c, b, u, cfg=cfg: paged_gather.gather_dequant_triton(
                    c, b, u, num_rows=tokens, layout=fmt.layout, config=cfg)) for cfg in configs]
            copy = copy_ceiling(moved)
            _time_variants(op, fmt, tokens, variants, inputs, ref, moved, copy, log, results)
            if op == PERSISTENT_OP:            # baseline: the synchronous gather as selected (a full grid)
                sync = lambda c, b, u: paged_gather.gather_records(c, b, u, num_rows=tokens)   # noqa: E731
                exact = same_bits(np.asarray(jax.jit(sync)(*inputs[0])), ref)
                _timed(log, results, _row(op, fmt, tokens, "selected", None, measure_pure(sync, inputs), moved,
                                          copy, exact, baseline=True))
            elif records:                    # baselines: the same pages whole, no masking or padding
                words = jax.device_put(cache_np.reshape(nb, -1).view(np.uint32), device)
                take_inputs = [(words, jnp.asarray(p)) for p in pages]
                take = lambda w, p: jnp.take(w, p, axis=0)                       # noqa: E731
                got = np.asarray(jax.jit(take)(*take_inputs[0])).view(np.uint8)
                exact = bool(np.array_equal(got, cache_np[pages[0]].reshape(len(pages[0]), -1)))
                page_moved = 2 * len(pages[0]) * BLOCK * rb             # = moved for one request
                _timed(log, results, _row(op, fmt, tokens, "xla_take_pages_u32", None,
                                          measure_pure(take, take_inputs), page_moved, copy, exact, baseline=True))
                del words, take_inputs
                _time_torch(op, fmt, tokens, "torch_index_select_pages", cache_np.reshape(nb, -1), pages,
                            page_moved, copy, log, results)
            del cache, inputs


def sweep_slots(names, log, results):
    device = jax.devices()[0]
    for n in SIZES["gather_slots"]:
        for name in names:
            fmt = formats.get(name)
            rb = fmt.record_bytes
            nb = max(-(-2 * n // BLOCK), MIN_CACHE_BYTES // (BLOCK * rb))
            rng = np.random.default_rng(n)
            cache_np = _record_cache(fmt, nb, rng)
            cache = jax.device_put(cache_np, device)
            slot_lists = [rng.integers(0, nb * BLOCK, n).astype(np.int32) for _ in range(repeats_for(n * rb))]
            inputs = [(cache, jnp.asarray(s)) for s in slot_lists]
            moved = 2 * n * rb
            copy = copy_ceiling(moved)
            ref = np.asarray(paged_gather.gather_slots_reference(*inputs[0]))
            variants = [("xla", None, paged_gather.gather_slots_reference)]
            variants += [("pallas_triton", cfg, lambda c, s, cfg=cfg: paged_gather.gather_slots_triton(c, s, config=cfg))
                         for cfg in SLOT_CONFIGS]
            _time_variants("gather_slots", fmt, n, variants, inputs, ref, moved, copy, log, results)
            _time_torch("gather_slots", fmt, n, "torch_index_select_rows", cache_np.reshape(nb * BLOCK, rb),
                        slot_lists, moved, copy, log, results)
            del cache, inputs


def sweep_writer(names, log, results):
    device = jax.devices()[0]
    for tokens in SIZES["write_records"]:
        for name in names:
            fmt = formats.get(name)
            moved = cache_writer.work_bytes(tokens, fmt.layout)
            copy = copy_ceiling(moved)
            # slots spread over up to 4x the tokens, as a patch; the cache stays below 2 GiB, where
            # every implementation runs (`selection.triton_supported`)
            nb = min(4 * -(-tokens // BLOCK), (2 ** 31 - 1) // (BLOCK * fmt.record_bytes))
            key = jax.random.key(tokens)
            inputs = []
            for _ in range(repeats_for(tokens * (2 * fmt.nope_dim + 2 * fmt.rope_dim), hi=32)):
                k1, k2, k3, key = jax.random.split(key, 4)
                inputs.append(((jax.random.normal(k1, (tokens, fmt.nope_dim)) * 3).astype(jnp.bfloat16),
                               jax.random.normal(k2, (tokens, fmt.rope_dim)).astype(jnp.bfloat16),
                               jax.random.permutation(k3, nb * BLOCK)[:tokens].astype(jnp.int32)))
            empty = lambda: jnp.zeros((nb, BLOCK, fmt.record_bytes), jnp.uint8)      # noqa: E731
            ref = np.asarray(cache_writer.write_records_reference(empty(), *inputs[0], layout=fmt.layout))
            variants = [("xla", None)] + [("pallas_triton", cfg) for cfg in WRITER_CONFIGS]
            for impl, cfg in variants:
                implementation = cache_writer.WRITE_RECORDS.implementation(impl)
                if not implementation.supported_on(device, nb * BLOCK * fmt.record_bytes, False)[0]:
                    continue
                run = implementation.run

                def op(cache, kv_c, k_pe, slots, run=run, cfg=cfg):
                    return run(cache, kv_c, k_pe, slots, layout=fmt.layout, config=cfg)

                exact = bool(np.array_equal(np.asarray(jax.jit(op)(empty(), *inputs[0])), ref))
                timing, _ = measure_in_place(op, empty(), inputs)
                _timed(log, results, _row("write_records", fmt, tokens, impl, cfg, timing, moved, copy, exact))


ATTENTION_CONFIGS = [AttentionTiles(h, k, w, st) for h, k, w, st in
                     [(16, 32, 4, 1), (32, 32, 8, 1), (32, 64, 8, 1), (64, 32, 8, 1), (64, 64, 8, 1), (32, 32, 4, 2)]]
MOSAIC_ATTENTION_CONFIGS = [MosaicAttentionTiles(copy_issuers=w, split_scores=split)
                            for w, split in ((4, False), (4, True), (128, False), (128, True))] + [
    MosaicAttentionTiles(copy_issuers=w, split_scores=split, k_slots=2) for w in (4, 128) for split in (False, True)] + [
    MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=r) for r in (216, 208, 200)] + [  # two K tiles
    # fp8 and nvfp4 converted by two memory warpgroups (twice the warps, each thread half the rows
    # and 256 - compute_registers registers)
    MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=r, memory_warpgroups=2) for r in (216, 208, 200)]
SWEPT_ATTENTION = {"pallas_triton": ATTENTION_CONFIGS, "pallas_mosaic_gpu": MOSAIC_ATTENTION_CONFIGS}


def parse_counts(option: str, text: str, ap: argparse.ArgumentParser) -> tuple[int, ...]:
    """Comma-separated positive integers, or the parser's error naming `option`."""
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n <= 0 for n in counts):
        ap.error(f"{option}: expected comma-separated positive integers, got {text!r}")
    return counts


def parse_mosaic_configs(text: str) -> list[MosaicAttentionTiles]:
    """`--mosaic-configs`: configs separated by ';', each 'field=value,...' of MosaicAttentionTiles
    (integers; true / false for its flags), e.g. 'copy_issuers=128,k_slots=2,compute_registers=208'."""
    fields = [f.name for f in dataclasses.fields(MosaicAttentionTiles)]
    configs = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        kwargs = {}
        for item in spec.split(","):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not sep or name not in fields:
                raise ValueError(f"--mosaic-configs: expected field=value with a field of {', '.join(fields)}, "
                                 f"got {item!r}")
            if value.lower() in ("true", "false"):
                kwargs[name] = value.lower() == "true"
            else:
                try:
                    kwargs[name] = int(value)
                except ValueError:
                    raise ValueError(f"--mosaic-configs: {name}: expected an integer, true or false, "
                                     f"got {value!r}") from None
        configs.append(MosaicAttentionTiles(**kwargs))
    if not configs:
        raise ValueError(f"--mosaic-configs: expected at least one config, got {text!r}")
    return configs


# the prefill shape of the attention goals: T query tokens with their own top-k over a gathered
# fp8 workspace far above L2, at the head counts of TP 8 (16), TP 2 (64) and one GPU (128)
ATTENTION_SHAPE = dict(tokens=4096, top_k=2048, rows=262144)
ATTENTION_HEADS = (16, 64, 128)


def sweep_attention(names, log, results, heads_list=ATTENTION_HEADS, implementations=None, swept=SWEPT_ATTENTION):
    """Every tile config of the Pallas attention (swept: implementation -> configs; of
    `implementations`, None: all), each checked against the XLA implementation on the first
    inputs (`ckv_jax.benchmarks.attention`); the work of a row is its FLOPs."""
    from ckv_jax.benchmarks import attention as bench
    t, k, rows = ATTENTION_SHAPE["tokens"], ATTENTION_SHAPE["top_k"], ATTENTION_SHAPE["rows"]
    for name in names:
        fmt = formats.get(name)
        records = bench.record_table(fmt, rows, seed=1)
        for heads in heads_list:
            inputs = bench.query_sets(t, heads, k, rows, seed=heads)
            work = sparse_mla_attention.flops(t, heads, k, fmt.layout)
            reference = sparse_mla_attention.attention_blocked(inputs[0][0], records, *inputs[0][1:], 576 ** -0.5,
                                                               layout=fmt.layout)
            attention_op = sparse_mla_attention.SPARSE_MLA_ATTENTION
            variants = [(impl, cfg) for impl, configs in swept.items() for cfg in configs
                        if (implementations is None or impl in implementations) and impl in reading(fmt.layout)
                        and (getattr(cfg, "k_slots", 1) == 1 or pallas_mosaic_gpu.fills_k_tiles(fmt.layout, cfg))
                        and attention_op.implementation(impl).supported_on(jax.devices()[0], records.size, False)[0]]
            calls = [(q, records, indices, counts) for q, indices, counts in inputs]   # the table as an argument
            for impl, cfg in variants:
                def op(q, records, indices, counts, impl=impl, cfg=cfg):
                    return sparse_mla_attention.sparse_mla_attention(q, records, indices, counts, 576 ** -0.5,
                                                                     layout=fmt.layout, implementation=impl,
                                                                     config=cfg)
                exact = bench.agrees(jax.jit(op)(*calls[0]), reference)
                timing = measure_pure(op, calls)
                row = dict(op="sparse_mla_attention", format=name, size=work, implementation=impl,
                           config=dataclasses.asdict(cfg), bytes_moved=work, exact=exact, us=timing.seconds * 1e6,
                           heads=heads, tflops=work / timing.seconds / 1e12)
                if timing.device_seconds is not None:
                    row.update(device_us=timing.device_seconds * 1e6,
                               device_tflops=work / timing.device_seconds / 1e12)
                results.append(row)
                log(f"  sparse_mla_attention {name:<13} H={heads:<4} {cfg} {row['us']:9.1f} us "
                    f"{row.get('device_tflops', row['tflops']):6.1f} TFLOP/s exact={exact}")
            del inputs, reference


def table_rows(results):
    """Per op and size: implementations by their best time summed over formats, and the winning
    config of each; row boundaries halfway (geometrically) between the measured sizes.  The time
    is the device time where every candidate of the size has one, else the host-clock time.
    Paged gathers count with one request (the size's bytes as one pack)."""
    rows = {}
    # a sweep of several requests adds no rows, nor does the persistent pack (its footprint is
    # `prefetch_programs`, not a size's winner)
    results = [r for r in results if r.get("requests", 1) == 1 and r["op"] != PERSISTENT_OP]
    for op in sorted({r["op"] for r in results}):
        sizes = sorted({r["size"] for r in results if r["op"] == op})
        moved = {s: min(r["bytes_moved"] for r in results if r["op"] == op and r["size"] == s) for s in sizes}
        out = []
        for i, size in enumerate(sizes):
            cands = [r for r in results if r["op"] == op and r["size"] == size and r["exact"]
                     and not r.get("baseline")]
            metric = "device_us" if all("device_us" in r for r in cands) else "us"
            by_key = {}
            for r in cands:
                key = (r["implementation"], json.dumps(r["config"], sort_keys=True))
                by_key.setdefault(key, {})[r["format"]] = r[metric]
            nfmt = max(len(v) for v in by_key.values())
            total = {k: sum(v.values()) for k, v in by_key.items() if len(v) == nfmt}
            best_per_impl = {}
            for (impl, cfg), t in sorted(total.items(), key=lambda kv: kv[1]):
                best_per_impl.setdefault(impl, (t, json.loads(cfg)))
            order = tuple(sorted(best_per_impl, key=lambda k: best_per_impl[k][0]))
            configs = {k: v[1] for k, v in best_per_impl.items() if v[1]}
            lo = 0 if i == 0 else int(math.sqrt(moved[sizes[i - 1]] * moved[size]))
            out.append((lo, order, configs))
        rows[op] = out
    return rows


def merge_results(paths) -> list[dict]:
    """The results of several sweeps' JSON files, one row per (op, format, size, requests,
    implementation, config) with its times averaged over the sweeps that ran it (the device time
    over those that measured one; exact only if exact in all)."""
    runs = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["results"]:
                key = (row["op"], row["format"], row["size"], row.get("requests", 1), row["implementation"],
                       json.dumps(row["config"], sort_keys=True))
                runs.setdefault(key, []).append(row)
    merged = []
    for rows in runs.values():
        row = dict(rows[-1], us=sum(r["us"] for r in rows) / len(rows), exact=all(r["exact"] for r in rows))
        row["gbps"] = row["bytes_moved"] / row["us"] / 1e3
        device = [r["device_us"] for r in rows if "device_us" in r]
        if device:
            row["device_us"] = sum(device) / len(device)
            row["device_gbps"] = row["bytes_moved"] / row["device_us"] / 1e3
        merged.append(row)
    return merged


def table_document(results, kind) -> dict:
    """The tuned table of `kind` as `pallas_kernels.tuning` reads it."""
    ops = {op: [dict(min_work_bytes=lo, order=list(order), configs=configs) for lo, order, configs in rows]
           for op, rows in table_rows(results).items()}
    return dict(device_kind=kind, measured_by="python tools/tune.py: every implementation and tile config timed on "
                "the device timeline, each checked against its reference first", ops=ops)


def write_table(results, kind, table_dir) -> None:
    """Print the table of `kind`, and write it to table_dir/<kind>.json when table_dir is given;
    an existing file keeps the entries of the ops this sweep did not measure."""
    doc = table_document(results, kind)
    path = pathlib.Path(table_dir) / tuning.table_path(kind).name if table_dir else None
    if path is not None and path.is_file():
        old = json.loads(path.read_text())
        doc["ops"] = dict(old.get("ops", {}), **doc["ops"])
    text = json.dumps(doc, indent=1) + "\n"
    print(f"\n# tuned table ({kind})\n{text}", end="")
    if path is not None:
        path.write_text(text)
        print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/tune.py", description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="gather_records,gather_dequant,gather_slots,write_records",
                    help=f"ops to sweep (default %(default)s; also sparse_mla_attention and {PERSISTENT_OP})")
    ap.add_argument("--formats", default="fp8_ds_mla,nvfp4_ds_mla")
    ap.add_argument("--tokens", default=None, help="comma-separated sizes for every op (default: SIZES)")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests sharing the tokens of a paged gather (the table is built from one)")
    ap.add_argument("--attention-heads", default=",".join(map(str, ATTENTION_HEADS)),
                    help="sparse_mla_attention: query heads of the sweep (default %(default)s)")
    ap.add_argument("--implementations", default=None,
                    help="sparse_mla_attention: the implementations swept, comma-separated (default: all)")
    ap.add_argument("--mosaic-configs", default=None, metavar="SPECS",
                    help="sparse_mla_attention: sweep these Mosaic GPU configs instead of the built-in list, "
                         "';'-separated 'field=value,...' (e.g. 'copy_issuers=128,k_slots=2,compute_registers=208')")
    ap.add_argument("--persistent-programs", default=None, metavar="N,...",
                    help=f"{PERSISTENT_OP}: the program counts swept (default: an eighth, a quarter and half "
                         "of the GPU's SMs)")
    ap.add_argument("--out", default="tune.json", help="the JSON results file")
    ap.add_argument("--table-from", nargs="+", metavar="JSON", default=None,
                    help="measure nothing: make the table from earlier sweeps' JSON files (times averaged)")
    ap.add_argument("--table-out", metavar="DIR", default=None,
                    help="also write the table to DIR/<device kind>.json (pallas_kernels/tuned to ship it)")
    ap.add_argument("--device-kind", default="NVIDIA H200", help="with --table-from: the device kind of the rows")
    args = ap.parse_args(argv)
    if args.table_from:
        write_table(merge_results(args.table_from), args.device_kind, args.table_out)
        return 0
    if args.tokens:
        sizes = parse_counts("--tokens", args.tokens, ap)
        SIZES.update((op, sizes) for op in SIZES)
    if args.requests < 1:
        ap.error(f"--requests: expected at least 1, got {args.requests}")
    if args.implementations and not set(args.implementations.split(",")) <= set(SWEPT_ATTENTION):
        ap.error(f"--implementations: expected names of {', '.join(SWEPT_ATTENTION)}, got {args.implementations!r}")
    swept = SWEPT_ATTENTION
    if args.mosaic_configs is not None:
        try:
            swept = dict(SWEPT_ATTENTION, pallas_mosaic_gpu=parse_mosaic_configs(args.mosaic_configs))
        except (ValueError, TypeError) as e:
            ap.error(str(e))
    programs = None
    if args.persistent_programs is not None:
        programs = parse_counts("--persistent-programs", args.persistent_programs, ap)
    if jax.default_backend() != "gpu":
        print("the tuning sweep times compiled kernels: it needs a GPU", file=sys.stderr)
        return 2
    compat.silence_triton_deprecation()
    names = args.formats.split(",")
    log = lambda line: print(line, flush=True)          # noqa: E731
    device = jax.devices()[0]
    launch = launch_timing()
    meta = dict(device=device.device_kind, jax=jax.__version__, launch_us=launch.seconds * 1e6,
                launch_device_us=None if launch.device_seconds is None else launch.device_seconds * 1e6,
                command="python tools/tune.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    device_launch = "-" if meta["launch_device_us"] is None else f"{meta['launch_device_us']:.2f}"
    log(f"tuning on {meta['device']} (jax {meta['jax']}); one trivial kernel in a program: {meta['launch_us']:.1f} us"
        f" (device timeline: {device_launch} us)")
    if programs is None:
        cores = getattr(device, "core_count", 0) or 0
        programs = tuple(sorted({n for n in (cores // 8, cores // 4, cores // 2) if n > 0}))
        if not programs and PERSISTENT_OP in args.ops.split(","):
            ap.error(f"--persistent-programs: {device.device_kind} reports no SM count; give the program counts")
    results = []
    for op in args.ops.split(","):
        if op in ("gather_records", "gather_dequant", PERSISTENT_OP):
            start = len(results)
            sweep_paged(op, names, log, results, args.requests, programs)
            for row in results[start:]:
                row["requests"] = args.requests
        elif op == "gather_slots":
            sweep_slots(names, log, results)
        elif op == "write_records":
            sweep_writer(names, log, results)
        elif op == "sparse_mla_attention":
            sweep_attention(names, log, results, tuple(int(h) for h in args.attention_heads.split(",")),
                            None if args.implementations is None else args.implementations.split(","), swept)
        else:
            ap.error(f"--ops: unknown {op!r}")
        with open(args.out, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)
    write_table(results, device.device_kind, args.table_out)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
