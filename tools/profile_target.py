"""Single calls of kernel ops (and of the torch ops doing the same movement), for `ncu` to capture.

  ncu --kernel-name regex:'ckv_|indexSelect|gather_kernel' --section SpeedOfLight --section LaunchStats \\
      python tools/profile_target.py gather_records:32768:8:4 torch_pages:32768 \\
      gather_slots:2048:16:8 torch_rows:2048

Each run is `op:tokens[:rows_per_tile:num_warps]`: ops gather_records, gather_dequant,
gather_slots (Pallas Triton, the given config), gather_records_mosaic (Mosaic GPU),
torch_pages (`index_select` of the same whole pages), torch_rows (`index_select` of the same
rows), write_records (the Pallas Triton writer, `tokens` tokens to random slots of a cache
four times that size; the config is tokens_per_block:num_warps), and attention_triton /
attention_mosaic (the sparse-MLA attention kernels, `tokens` query tokens of --heads heads with
their own --top-k rows of a table of --rows records, the default configs; the Mosaic GPU kernel
reads fp8_ds_mla and nvfp4_ds_mla).  Every op runs once on inputs
built on the host, so the only kernels launched are the profiled ones; the paged ops pack one
request of `tokens` records in 64-token pages picked at random from a cache twice that size.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import formats
from pallas_kernels import cache_writer, compat, paged_gather
from pallas_kernels.cache_writer import WriterTiles
from pallas_kernels.paged_gather import GatherTiles

BLOCK = 64
OPS = ("gather_records", "gather_records_mosaic", "gather_dequant", "gather_slots", "torch_pages", "torch_rows",
       "write_records", "attention_triton", "attention_mosaic")


def parse_run(text: str) -> tuple[str, int, GatherTiles | WriterTiles | None]:
    parts = text.split(":")
    if parts[0] not in OPS or len(parts) not in (2, 4) or (parts[0].startswith("attention") and len(parts) != 2):
        raise argparse.ArgumentTypeError(f"expected op:tokens[:rows:warps] with op in {OPS} (attention ops: "
                                         f"op:tokens), got {text!r}")
    config_type = WriterTiles if parts[0] == "write_records" else GatherTiles
    config = config_type(int(parts[2]), int(parts[3])) if len(parts) == 4 else None
    return parts[0], int(parts[1]), config


def write_once(tokens: int, config: WriterTiles | None, fmt: formats.RecordFormat, rng) -> None:
    num_blocks = -(-4 * tokens // BLOCK)
    cache = jnp.zeros((num_blocks, BLOCK, fmt.record_bytes), jnp.uint8)
    kv_c = jnp.asarray((rng.standard_normal((tokens, fmt.nope_dim), np.float32) * 3)).astype(jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((tokens, fmt.rope_dim), np.float32)).astype(jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(num_blocks * BLOCK)[:tokens].astype(np.int32))
    jax.block_until_ready((cache, kv_c, k_pe, slots))
    out = cache_writer.write_records_triton(cache, kv_c, k_pe, slots, layout=fmt.layout,
                                            config=config or WriterTiles())
    jax.block_until_ready(out)


def attend_once(op: str, tokens: int, fmt: formats.RecordFormat, heads: int, top_k: int, rows: int) -> None:
    from ckv_jax.benchmarks import attention
    from pallas_kernels import sparse_mla_attention
    records = attention.record_table(fmt, rows, seed=1)
    q, indices, counts = attention.query_sets(tokens, heads, top_k, rows, seed=heads)[0]
    jax.block_until_ready((records, q, indices, counts))
    implementation = "pallas_triton" if op == "attention_triton" else "pallas_mosaic_gpu"
    out = sparse_mla_attention.sparse_mla_attention(q, records, indices, counts, 576 ** -0.5, layout=fmt.layout,
                                                    implementation=implementation)
    jax.block_until_ready(out)


def run_once(op: str, tokens: int, config, fmt: formats.RecordFormat, rng, attention_shape=None) -> None:
    if op == "write_records":
        return write_once(tokens, config, fmt, rng)
    if op.startswith("attention"):
        return attend_once(op, tokens, fmt, *attention_shape)
    npages = -(-tokens // BLOCK)
    cache_np = rng.integers(0, 256, (2 * npages, BLOCK, fmt.record_bytes), dtype=np.uint8)
    pages = rng.permutation(2 * npages)[:npages].astype(np.int32)
    slots = rng.integers(0, 2 * npages * BLOCK, tokens).astype(np.int32)
    if op.startswith("torch"):
        import torch
        if op == "torch_pages":
            src, index = cache_np.reshape(2 * npages, -1), pages
        else:
            src, index = cache_np.reshape(2 * npages * BLOCK, -1), slots
        out = torch.from_numpy(src).cuda().index_select(0, torch.from_numpy(index.astype(np.int64)).cuda())
        torch.cuda.synchronize()
        del out
        return
    cache = jnp.asarray(cache_np)
    table = jnp.asarray(pages[None, :])
    cu = jnp.asarray([0, tokens], jnp.int32)
    kw = {} if config is None else {"config": config}
    if op == "gather_records":
        out = paged_gather.gather_records_triton(cache, table, cu, num_rows=tokens, **kw)
    elif op == "gather_records_mosaic":
        out = paged_gather.gather_records(cache, table, cu, num_rows=tokens, implementation="pallas_mosaic_gpu")
    elif op == "gather_dequant":
        out = paged_gather.gather_dequant_triton(cache, table, cu, num_rows=tokens, layout=fmt.layout, **kw)
    else:
        out = paged_gather.gather_slots_triton(cache, jnp.asarray(slots), **kw)
    jax.block_until_ready(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/profile_target.py", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=parse_run, help="op:tokens[:rows_per_tile:num_warps]")
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument("--heads", type=int, default=64, help="attention ops: query heads (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=2048, help="attention ops: rows per token (default %(default)s)")
    ap.add_argument("--rows", type=int, default=262144, help="attention ops: records (default %(default)s)")
    args = ap.parse_args(argv)
    compat.silence_triton_deprecation()
    fmt = formats.get(args.format)
    rng = np.random.default_rng(0)
    for op, tokens, config in args.runs:
        run_once(op, tokens, config, fmt, rng, (args.heads, args.top_k, args.rows))
        print(f"{op} {args.format} tokens={tokens} {config or ''}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
