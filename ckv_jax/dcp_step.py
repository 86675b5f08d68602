"""One DCP step, defined once: its device arrays, its host checks, and its three operations.

Every runner (the one-call API in `full_ckv`, the per-layer `prefetch.PrefetchOrchestrator`,
the in-program `pipelined_prefill.prefill_layers`) builds a step the same way:

    arrays = step_arrays(plan, block_table, mesh)      # StepArrays, placed once per step
    workspace = gather_workspace_in_shard_map(cache, arrays, out=slot)   # pack + all-gather
    cache = write_chunk(cache, kv_c, k_pe, arrays)     # the chunk into this rank's paged cache
    workspace = patch_chunk(workspace, kv_c, k_pe, arrays.chunk_rows)    # a prefetched workspace

The three operations are functions usable inside a `shard_map` over the DCP axis;
`gather_program`, `write_program` and `patch_program` are the same operations as jitted
programs over a mesh, for callers outside one.  The kernels themselves come from
`pallas_kernels` through these functions only.

The gathered workspace is rank-major: rank o's shard of request r at rows
`o * P + rank_req_starts[o, r] + local`, rows past a rank's total up to P zero.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ckv_jax import formats, placement, validation
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.placement import DCP_AXIS
from ckv_jax.step_plan import StepPlan, bucket_up
from pallas_kernels import cache_writer, paged_gather
from pallas_kernels.record_layout import RecordLayout


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["block_table", "local_cu", "slots", "chunk_rows", "req_id", "causal_len",
                                "rank_lens"],
                   meta_fields=["num_rows", "layout"])
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """The device-side arrays of one step, identical on every rank (a registered pytree; a
    shard_map takes it whole with spec P()).

      block_table i32[R', W']         shared by all ranks
      local_cu    i32[D, R' + 1]      each rank's cumulative local lengths, leading 0
      slots       i32[D, T']          each rank's cache slot of every chunk token, -1 where another
                                      rank owns the token (and in padding rows, below)
      chunk_rows  i32[T']             the gathered-workspace row of every chunk token (-1: padding)
      req_id      i32[T']             the request of every query row (0 in padding rows)
      causal_len  i32[T']             global causal length of every query row (its position + 1;
                                      0 in padding rows: they attend nothing)
      rank_lens   i32[D, R']          local lengths per rank
    Static: num_rows (P, the workspace rows per rank) and the DcpLayout.
    R' >= R and W' >= the caller's table width are the plan's bucketed shapes (`bucket_up` with
    its `shape_buckets`): padding requests have length 0 on every rank and table rows of block
    0, padding columns block 0; none is read.  T' is T, or the chunk capacity the caller asked
    for (`host_step_arrays`).
    """
    block_table: jax.Array
    local_cu: jax.Array
    slots: jax.Array
    chunk_rows: jax.Array
    req_id: jax.Array
    causal_len: jax.Array
    rank_lens: jax.Array
    num_rows: int
    layout: DcpLayout


def step_arrays(plan: StepPlan, block_table, mesh: jax.sharding.Mesh | None = None, *,
                chunk_capacity: int | None = None) -> StepArrays:
    """The step's arrays from its plan and block table (`host_step_arrays`), replicated on `mesh`
    (None: on the default device), in one transfer."""
    host = host_step_arrays(plan, block_table, chunk_capacity=chunk_capacity)
    return jax.device_put(host, None if mesh is None else NamedSharding(mesh, P()))


def host_step_arrays(plan: StepPlan, block_table, *, chunk_capacity: int | None = None) -> StepArrays:
    """The step's arrays as numpy int32 arrays, from its plan and block table.  Check the block
    table first (`check_block_table`).

    chunk_capacity: the rows of the latent buffers the chunk will be patched from, when they hold
    more than the step's T tokens (a persistent buffer sized once): `chunk_rows` is then padded
    to that length with -1, which the patch skips, and so is `slots` (which the cache write
    skips), so the buffers pass whole and the programs' shapes stay the same from step to step
    (`req_id` and `causal_len` are padded with 0).  The requests and the table's columns are
    padded to the plan's bucketed shapes (`StepArrays`).
    """
    table = np.asarray(block_table)
    pos = plan.positions()
    rows, slots = _chunk_rows(plan, pos), plan.layout.slot_mapping(pos, plan.req_id_per_token, table, None)
    req_id, causal_len = plan.req_id_per_token, pos + 1
    if chunk_capacity is not None:
        if isinstance(chunk_capacity, bool) or not isinstance(chunk_capacity, (int, np.integer)) \
                or chunk_capacity < plan.num_tokens:
            raise ValueError(f"chunk_capacity: expected an int >= the step's {plan.num_tokens} query tokens, "
                             f"got {chunk_capacity!r}")
        rows, req_id, causal_len = (_padded(a, (int(chunk_capacity),), fill)
                                    for a, fill in ((rows, -1), (req_id, 0), (causal_len, 0)))
        slots = _padded(slots, (slots.shape[0], int(chunk_capacity)), -1)
    reqs = bucket_up(plan.num_reqs, plan.shape_buckets)
    local_cu = plan.local_cu_seq_lens
    if reqs > plan.num_reqs:        # padding requests of length 0: their cumulative lengths repeat the last
        local_cu = np.concatenate([local_cu, np.repeat(local_cu[:, -1:], reqs - plan.num_reqs, axis=1)], axis=1)
    table = _padded(table, (reqs, bucket_up(table.shape[1], plan.shape_buckets)), 0)
    return StepArrays(block_table=table, local_cu=local_cu, slots=slots, chunk_rows=rows, req_id=req_id,
                      causal_len=causal_len, rank_lens=_padded(plan.rank_req_lens, (plan.layout.world_size, reqs), 0),
                      num_rows=plan.padded_tokens, layout=plan.layout)


def _padded(a: np.ndarray, shape: tuple, fill: int) -> np.ndarray:
    """int32 `a` in the leading corner of an array of `shape`, the rest `fill` (`a` itself, as
    int32, where it has that shape)."""
    if a.shape == shape:
        return a.astype(np.int32, copy=False)
    out = np.full(shape, fill, np.int32)
    out[tuple(slice(n) for n in a.shape)] = a
    return out


def workspace_rows(plan: StepPlan, req, pos):
    """Row of global position `pos` of request `req` in the gathered workspace (numpy or jax)."""
    layout = plan.layout
    owner, local = layout.owner(pos), layout.local_index(pos)
    starts = plan.rank_req_starts
    if not isinstance(pos, np.ndarray) and not np.isscalar(pos):
        starts = jnp.asarray(starts)
    return owner * plan.padded_tokens + starts[owner, req] + local


def chunk_rows(plan: StepPlan) -> np.ndarray:
    """i32[T]: the workspace row of every current-chunk token (all owners, all requests)."""
    return _chunk_rows(plan, plan.positions())


def dcp_slot_mapping(plan: StepPlan, block_table) -> np.ndarray:
    """i32[D, T]: each rank's slot for every current-chunk token (-1 where another rank owns it)."""
    return plan.layout.slot_mapping(plan.positions(), plan.req_id_per_token, np.asarray(block_table), None)


def _chunk_rows(plan: StepPlan, pos: np.ndarray) -> np.ndarray:
    return workspace_rows(plan, plan.req_id_per_token, pos.astype(np.int64)).astype(np.int32)


# -- host checks: each written once ----------------------------------------------------------------
def check_block_table(plan: StepPlan, block_table, num_blocks: int | None = None, validate: bool | None = None):
    """int32[R, max_blocks] with room for every rank's local length; with validation on, every
    block id a rank will read lies in [0, num_blocks)."""
    validation.check_array("block_table", block_table, (jnp.int32,), f"[{plan.num_reqs}, max_blocks]", 2)
    if block_table.shape[0] != plan.num_reqs:
        raise ValueError(f"block_table: expected int32[{plan.num_reqs}, max_blocks] (one row per request), "
                         f"got {validation.describe(block_table)}")
    need = plan.layout.blocks_needed(plan.rank_req_lens.max(axis=0, initial=0))       # [R]
    if plan.num_reqs and need.max() > block_table.shape[1]:
        r = int(np.argmax(need))
        raise ValueError(f"seq_lens: request {r} needs {int(need[r])} blocks per rank but block_table has "
                         f"{block_table.shape[1]} columns (seq_len {int(plan.seq_lens[r])})")
    if num_blocks is not None and validation.validation_enabled(validate):
        table = validation.concrete("block_table", block_table)
        for r in range(plan.num_reqs):
            ids = table[r, :need[r]]
            bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
            if bad.size:
                raise ValueError(f"block_table: request {r} block {int(bad[0])} is {int(ids[bad[0]])}, "
                                 f"expected a block id in [0, {num_blocks})")


def check_caches(fmt: formats.RecordFormat, caches, plan: StepPlan) -> int:
    """u8[D * num_blocks, block_size, R] of `fmt` with the plan's block size; returns num_blocks
    (per rank)."""
    validation.check_cache(fmt, caches)
    d = plan.world_size
    if caches.shape[0] % d:
        raise ValueError(f"caches: expected D * num_blocks rows on axis 0 (D={d}), got {validation.describe(caches)}")
    if caches.shape[1] != plan.layout.block_size:
        raise ValueError(f"caches: expected block_size {plan.layout.block_size} on axis 1, "
                         f"got {validation.describe(caches)}")
    return caches.shape[0] // d


def check_chunk(fmt: formats.RecordFormat, kv_c, k_pe, plan: StepPlan, rows: int | None = None):
    """kv_c [T, nope_dim] and k_pe bf16[T, rope_dim] with T the plan's query tokens (or `rows`,
    the length of a padded `StepArrays.chunk_rows`)."""
    want = plan.num_tokens if rows is None else rows
    if validation.check_values(fmt, kv_c, k_pe) != want:
        what = "the step's query tokens" if rows is None else "the chunk buffers' rows"
        raise ValueError(f"kv_c: expected [{want}, {fmt.nope_dim}] ({what}), got {validation.describe(kv_c)}")


# The bounded pack's candidate tiles (records, warps) and the records its whole grid should hold
# in flight: the persistent sweep's fastest tile at 66 programs (128 by 16) and at 33 (256 by 32)
# both hold about 8K records (5.4 MB of fp8 records) over the grid.
PACK_TILES = ((128, 16), (256, 32))
PACK_RECORDS_IN_FLIGHT = 8192


def bounded_pack_tiles(programs: int) -> paged_gather.GatherTiles:
    """The pack's tiles with a bounded SM footprint: `programs` persistent programs, each moving
    one tile at a time.  A full grid keeps every SM busy until the gather ends, so kernels another
    stream launches meanwhile wait for it; a bounded grid leaves the other SMs to them.

    A program's rate is about its tile per memory latency, so fewer programs need larger tiles:
    the tile of `PACK_TILES` whose grid holds nearer `PACK_RECORDS_IN_FLIGHT` records (128 records
    by 16 warps from 46 programs up, 256 by 32 below).  `python tools/tune.py --ops
    gather_records_persistent --persistent-programs 33,66` (H100, 1M fp8 records, device
    timeline): at 66 programs 553 us (256 by 32: 630), at 33 programs 638 us (128 by 16: 721)."""
    if isinstance(programs, bool) or not isinstance(programs, int) or programs <= 0:
        raise ValueError(f"programs: expected a positive number of persistent programs, got {programs!r}")
    rows, warps = min(PACK_TILES, key=lambda tile: abs(math.log2(programs * tile[0] / PACK_RECORDS_IN_FLIGHT)))
    return paged_gather.GatherTiles(rows_per_tile=rows, num_warps=warps, programs=programs)


def default_prefetch_programs(device: jax.Device) -> int:
    """A prefetch's persistent programs when its caller names none: half the SMs of a GPU (0, the
    full grid, elsewhere).  Measured on an H100 (BENCHMARKS.md, "The prefetch's pack on half the
    SMs"): beside compute that leaves SMs idle the half-grid pack hides 89-98% of the gather where
    the full grid hides 13-27%, and beside matmuls that fill every SM it hides about as much as the
    full grid (the rows' spread is wider than their difference)."""
    cores = getattr(device, "core_count", 0) or 0
    return max(1, cores // 2) if device.platform == "gpu" and cores else 0


def prefetch_pack_tiles(programs: int | None, device: jax.Device) -> paged_gather.GatherTiles | None:
    """The tiles of a prefetch's pack: `programs` None picks `default_prefetch_programs(device)`,
    0 is the full grid of a synchronous gather (None tiles), n > 0 is n persistent programs."""
    if programs is None:
        programs = default_prefetch_programs(device)
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
        raise ValueError(f"prefetch_programs: expected None, 0 (the full grid) or a positive number of "
                         f"persistent programs, got {programs!r}")
    return bounded_pack_tiles(programs) if programs else None


def static_implementation(implementation):
    """`implementation` as a hashable static argument for jit (a sequence becomes a tuple)."""
    if implementation is None or isinstance(implementation, str):
        return implementation
    return tuple(implementation)


def owned_topk_slots(topk, arrays: StepArrays, rank, block_size: int):
    """The stock DCP path's rows of one rank: of the global top-k i32[T, K] (positions per
    request, -1 = none), the entries this rank's cache holds, as its cache slots, first and in
    their order, then -1; and their number per token.  The attention stops after counts[t]
    columns, so a rank walks its own ~K / D entries, not all K.

    Entries outside [0, causal length) are dropped, as are positions past the rank's local length.
    rank: a Python int or `lax.axis_index` inside the shard_map.  Returns (i32[T, K], i32[T])."""
    layout, table, req_id = arrays.layout, arrays.block_table, arrays.req_id
    local = layout.local_index(topk)
    block = jnp.clip(local // block_size, 0, table.shape[1] - 1)
    mine = ((topk >= 0) & (topk < arrays.causal_len[:, None]) & (layout.owner(topk) == rank)
            & (local < arrays.rank_lens[rank, req_id][:, None]))
    slots = jnp.where(mine, table[req_id[:, None], block] * block_size + local % block_size, -1)
    order = jnp.argsort(~mine, axis=1, stable=True)
    return jnp.take_along_axis(slots, order, axis=1), jnp.sum(mine, axis=1, dtype=jnp.int32)


# -- the three operations, usable inside a shard_map over the DCP axis --------------------------------
def gather_workspace_in_shard_map(cache, arrays: StepArrays, *, out=None, axis_name: str = DCP_AXIS,
                                  implementation=None, interpret: bool = False, tiles=None, device=None):
    """This rank's cache u8[num_blocks, block_size, R] -> the rank-major workspace u8[D * P, R].

    Each rank packs its local history of all requests (zero-padded to P rows) and one all-gather
    over `axis_name` concatenates the packs.  out: optional u8[M >= D * P, R] (a ring slot,
    donated by the caller) that receives the workspace in its rows [0, D * P).  With D = 1 the
    pack writes straight into it.  With D > 1 the all-gather's result is copied into it once:
    XLA's all-gather writes a buffer of its own and cannot target a slice of another one.
    tiles: the Pallas Triton pack's tile config (None: the measured one); device: where the
    kernels run, for their selection (None: the default device).
    """
    world_size = arrays.local_cu.shape[0]
    num_rows = arrays.num_rows
    if num_rows == 0:        # no history on any rank: XLA rejects a zero-size all-gather
        return jnp.zeros((0, cache.shape[2]), cache.dtype) if out is None else out
    rank = lax.axis_index(axis_name)
    pack = functools.partial(paged_gather.gather_records, cache, arrays.block_table, arrays.local_cu[rank],
                             num_rows=num_rows, implementation=implementation, interpret=interpret, config=tiles,
                             device=device)
    if world_size == 1:      # the all-gather of one rank is the identity: no collective, no copy
        return pack(out=out)
    workspace = lax.all_gather(pack(), axis_name, axis=0, tiled=True)
    return workspace if out is None else lax.dynamic_update_slice(out, workspace, (0, 0))


def write_chunk(cache, kv_c, k_pe, arrays: StepArrays, *, layout: RecordLayout, axis_name: str = DCP_AXIS,
                implementation=None, interpret: bool = False, device=None, skip_words=None, skip_index: int = 0):
    """The chunk tokens this rank owns, encoded into its cache u8[num_blocks, block_size, R]
    (every rank holds all T tokens of kv_c [T, nope_dim] and k_pe bf16[T, rope_dim]).
    skip_words: i32[n]; where skip_words[skip_index] is not 0 nothing is written."""
    return cache_writer.write_records_to_all(
        (cache,), kv_c, k_pe, (arrays.slots[lax.axis_index(axis_name)],), layout=layout,
        implementation=implementation, interpret=interpret, device=device, skip_words=skip_words,
        skip_index=skip_index)[0]


def patch_chunk(workspace, kv_c, k_pe, rows, *, layout: RecordLayout, implementation=None, interpret: bool = False,
                device=None):
    """The chunk's records written into a gathered workspace u8[N, R] at `rows` i32[T] (its
    `chunk_rows`), in place; other rows untouched.

    A prefetched workspace was gathered before its layer wrote the current chunk into the paged
    cache, so the chunk's rows hold stale bytes.  Every rank holds the chunk's latents of all T
    tokens, so it re-encodes them with the cache writer (bit-identical records), treating the
    workspace as a cache of N blocks of one record.
    """
    n, record_bytes = workspace.shape
    out = cache_writer.write_records(workspace.reshape(n, 1, record_bytes), kv_c, k_pe, rows, layout=layout,
                                     implementation=implementation, interpret=interpret, device=device)
    return out.reshape(n, record_bytes)


def write_and_patch_chunk(cache, workspace, kv_c, k_pe, arrays: StepArrays, *, layout: RecordLayout,
                          axis_name: str = DCP_AXIS, implementation=None, interpret: bool = False, device=None,
                          skip_words=None, skip_index: int = 0):
    """`write_chunk` and `patch_chunk` (at `arrays.chunk_rows`) in one writer call: each chunk
    record is encoded once and stored into this rank's cache and the workspace.  Returns (cache,
    workspace), both updated in place.  skip_words, skip_index: as for `write_chunk`."""
    n, record_bytes = workspace.shape
    cache, rows = cache_writer.write_records_to_all(
        (cache, workspace.reshape(n, 1, record_bytes)), kv_c, k_pe,
        (arrays.slots[lax.axis_index(axis_name)], arrays.chunk_rows), layout=layout,
        implementation=implementation, interpret=interpret, device=device, skip_words=skip_words,
        skip_index=skip_index)
    return cache, rows.reshape(n, record_bytes)


# -- the same operations as programs over a mesh ----------------------------------------------------
def _gather_over_mesh(caches, arrays: StepArrays, out, *, mesh, axis_name, implementation, interpret, tiles):
    body = functools.partial(gather_workspace_in_shard_map, axis_name=axis_name, implementation=implementation,
                             interpret=interpret, tiles=tiles, device=placement.mesh_device(mesh))
    if out is None:
        return jax.shard_map(lambda c, a: body(c, a), mesh=mesh, in_specs=(P(axis_name), P()), out_specs=P(),
                             check_vma=False)(caches, arrays)
    return jax.shard_map(lambda c, a, o: body(c, a, out=o), mesh=mesh, in_specs=(P(axis_name), P(), P()),
                         out_specs=P(), check_vma=False)(caches, arrays, out)


def _write_over_mesh(caches, kv_c, k_pe, arrays: StepArrays, workspace=None, *, mesh, layout, axis_name,
                     implementation, interpret, skip_words=None, skip_index: int = 0):
    """`write_chunk` on every rank, or with `workspace` (replicated) `write_and_patch_chunk`,
    returning (caches, workspace); skip_words (replicated), skip_index: as for `write_chunk`."""
    kw = dict(layout=layout, axis_name=axis_name, implementation=implementation, interpret=interpret,
              device=placement.mesh_device(mesh), skip_index=skip_index)
    if workspace is None:
        write, operands, out_specs = write_chunk, (caches, kv_c, k_pe, arrays), P(axis_name)
    else:
        write, operands, out_specs = write_and_patch_chunk, (caches, workspace, kv_c, k_pe, arrays), (P(axis_name), P())
    skip = () if skip_words is None else (skip_words,)

    def body(*args):            # the operands, then the skip words where given
        return write(*args[:len(operands)], skip_words=args[len(operands)] if skip else None, **kw)
    # the caches split over the ranks, everything else whole on each
    in_specs = (P(axis_name),) + (P(),) * (len(operands) - 1 + len(skip))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*operands, *skip)


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "implementation", "interpret", "tiles"),
                   donate_argnames=("out",), keep_unused=True)
def gather_program(caches, arrays: StepArrays, out=None, after=None, *, mesh, axis_name: str = DCP_AXIS,
                   implementation=None, interpret: bool = False, tiles=None):
    """The gathered workspace u8[D * P, R] (replicated) from the sharded u8[D * num_blocks,
    block_size, R] caches; written into `out` (donated) when given.  after: an array the program
    takes as an unused input, so that it runs only once `after` is ready."""
    return _gather_over_mesh(caches, arrays, out, mesh=mesh, axis_name=axis_name, implementation=implementation,
                             interpret=interpret, tiles=tiles)


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "layout", "implementation", "interpret"),
                   donate_argnums=(0,))
def write_program(caches, kv_c, k_pe, arrays: StepArrays, *, mesh, layout: RecordLayout,
                  axis_name: str = DCP_AXIS, implementation=None, interpret: bool = False):
    """`write_chunk` on every rank: the sharded caches (donated) with the chunk written."""
    return _write_over_mesh(caches, kv_c, k_pe, arrays, mesh=mesh, layout=layout, axis_name=axis_name,
                            implementation=implementation, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layout", "implementation", "interpret", "device"),
                   donate_argnums=(0,), keep_unused=True)
def patch_program(workspace, kv_c, k_pe, rows, after=None, *, layout: RecordLayout, implementation=None,
                  interpret: bool = False, device=None):
    """`patch_chunk` as a program over the workspace's devices (donated, updated in place).
    after: an array the program takes as an unused input (see `gather_program`)."""
    return patch_chunk(workspace, kv_c, k_pe, rows, layout=layout, implementation=implementation,
                       interpret=interpret, device=device)


def signal_when_ready(arrays: tuple, signal, *, platform: str) -> tuple:
    """`arrays`, unchanged, after `signal` ran at the point where they are ready.

    signal: a callable, called as `signal(stream)` from a host callback, `stream` being the
    handle (an int) of the GPU stream the program runs on (None on other platforms); or an
    object with a method `in_program(arrays, platform=)` that emits its own operation with the
    same contract (a native custom call: no Python call per dispatch) and returns the arrays.
    On a GPU either runs on the host thread that dispatches the program, while its kernels are
    being enqueued, after the kernels that produce `arrays` and before every kernel that reads
    what it returns: what it enqueues on `stream` (an event record, a wait) lands exactly there.

    The arrays go through the call as aliased operands: a true data dependency, which XLA's
    scheduler keeps (it drops an optimization barrier's order).  A buffer the program owns (its
    own result, a donated parameter) passes without a copy; any other parameter is copied first,
    so pass only small ones of that kind.  The program must use what returns, or XLA removes the
    call (marked as a side effect instead, it would cost every call jax's slow Python dispatch
    path).
    """
    in_program = getattr(signal, "in_program", None)
    if in_program is not None:
        return tuple(in_program(tuple(arrays), platform=platform))
    from jax.experimental.buffer_callback import buffer_callback     # jax's semi-private GPU stream access

    def call(ctx, outs, *args):
        signal(int(ctx.stream) if platform == "gpu" else None)

    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    return tuple(buffer_callback(call, shapes, input_output_aliases={i: i for i in range(len(arrays))})(*arrays))


# layer_program's static arguments that a caller fixes (`bound_layer_program`) and those it
# passes per call, and its donated arguments: one definition for both jitted forms
_LAYER_PROGRAM_FIXED = ("mesh", "axis_name", "layout", "implementation", "interpret", "tiles", "prefetch_tiles")
_LAYER_PROGRAM_PER_CALL = ("signal", "gather_written")
_LAYER_PROGRAM_DONATED = ("slot", "prefetch_slots", "write_cache")


@functools.partial(jax.jit, static_argnames=_LAYER_PROGRAM_FIXED + _LAYER_PROGRAM_PER_CALL,
                   donate_argnames=_LAYER_PROGRAM_DONATED)
def layer_program(slot, cache, kv_c, k_pe, arrays: StepArrays, prefetch_caches=(), prefetch_slots=(),
                  write_cache=None, *, mesh, layout: RecordLayout, axis_name: str = DCP_AXIS, implementation=None,
                  interpret: bool = False, tiles=None, prefetch_tiles=None, signal=None, gather_written: bool = False):
    """One layer's JAX work as one program (one dispatch):

      0. `write_cache` (optional, donated; the layer's sharded cache u8[D * num_blocks,
         block_size, R]): the chunk (kv_c, k_pe) written into it first (`write_chunk`), so
         that an engine's cache write and the layer's JAX work are one dispatch;
      1. its own workspace in `slot` (donated): `cache` None patches the chunk (kv_c, k_pe at
         `arrays.chunk_rows`) into a slot prefetched earlier; otherwise gathers `cache` into it
         (with `tiles`); `gather_written` (with `cache` None) gathers the cache step 0 wrote.
         `slot` None: no workspace of its own (the first prefetches of a step);
      2. `signal` (optional, static, hashable): called through `signal_when_ready` once the
         workspace (and the written cache) is ready, once per device, so a consumer on another
         stream can wait for it alone;
      3. the gathers of later layers: prefetch_caches[i] into prefetch_slots[i] (donated), with
         `prefetch_tiles`; every kernel of theirs comes after the signal.

    Returns (workspace or None, tuple of prefetched workspaces, written cache or None).  The
    step arrays it does not read are dropped from the executable's inputs (each input costs the
    dispatch time)."""
    device = placement.mesh_device(mesh)
    gather = functools.partial(_gather_over_mesh, arrays=arrays, mesh=mesh, axis_name=axis_name,
                               implementation=implementation, interpret=interpret)
    if gather_written and (write_cache is None or cache is not None):
        raise ValueError("gather_written: gathers the cache this program writes; pass write_cache and cache=None")
    written = workspace = None
    write = functools.partial(_write_over_mesh, mesh=mesh, layout=layout, axis_name=axis_name,
                              implementation=implementation, interpret=interpret)
    if write_cache is not None and slot is not None and cache is None and not gather_written:
        # the cache write and the patch as one kernel: each record encoded once, stored twice
        written, workspace = write(write_cache, kv_c, k_pe, arrays, slot)
    elif write_cache is not None:
        written = write(write_cache, kv_c, k_pe, arrays)
    if slot is not None and workspace is None:
        if gather_written:
            workspace = gather(written, out=slot, tiles=tiles)
        elif cache is None:
            workspace = patch_chunk(slot, kv_c, k_pe, arrays.chunk_rows, layout=layout,
                                    implementation=implementation, interpret=interpret, device=device)
        else:
            workspace = gather(cache, out=slot, tiles=tiles)
    prefetch_slots = tuple(prefetch_slots)
    if signal is not None:
        if workspace is None:
            raise ValueError("signal: marks the layer's own workspace, but slot is None (no workspace)")
        # The workspace passes through the signal (so the callback follows the layer's own work),
        # and so does the written cache (donated: no copy), so a reader of the cache on the
        # consumer's stream is ordered too; the prefetches' inputs pass as well (so every
        # prefetch kernel follows it): with one rank the slots they write, which are donated (no
        # copy); with several, local_cu, which every pack reads (its pack writes a buffer of its
        # own before the all-gather).  In a shard_map: XLA's partitioner needs the callback
        # placed, and each device's program then calls it once.
        signalled = functools.partial(signal_when_ready, signal=signal, platform=device.platform)
        one_rank = arrays.local_cu.shape[0] == 1
        following = prefetch_slots if one_rank else (arrays.local_cu,)
        # the cache passes as rows u8[D * num_blocks * block_size, R]: XLA copies a 3-D buffer
        # through the aliased call, not a 2-D one
        passing = (workspace,) + (() if written is None else (written.reshape(-1, written.shape[2]),)) \
            + tuple(following)
        specs = (P(),) + (() if written is None else (P(axis_name),)) + (P(),) * len(following)
        outs = jax.shard_map(lambda *a: signalled(a), mesh=mesh, in_specs=specs, out_specs=specs,
                             check_vma=False)(*passing)
        workspace, outs = outs[0], outs[1:]
        if written is not None:
            written, outs = outs[0].reshape(written.shape), outs[1:]
        if one_rank:
            prefetch_slots = tuple(outs)
        else:
            gather = functools.partial(gather, arrays=dataclasses.replace(arrays, local_cu=outs[0]))
    prefetched = tuple(gather(c, out=o, tiles=prefetch_tiles) for c, o in zip(prefetch_caches, prefetch_slots))
    return workspace, prefetched, written


def bound_layer_program(*, mesh, layout: RecordLayout, axis_name: str = DCP_AXIS, implementation=None,
                        interpret: bool = False, tiles=None, prefetch_tiles=None):
    """`layer_program` with these static arguments fixed: a jitted program of its own (one per
    distinct set, shared) that takes only `signal` and `gather_written` as static keywords.  A
    caller that dispatches it per layer (`prefetch.PrefetchOrchestrator`) saves jit's hashing
    and matching of the fixed arguments on every call."""
    return _bound_layer_program(mesh, layout, axis_name, implementation, interpret, tiles, prefetch_tiles)


@functools.cache
def _bound_layer_program(mesh, layout, axis_name, implementation, interpret, tiles, prefetch_tiles):
    program = functools.partial(layer_program.__wrapped__, mesh=mesh, layout=layout, axis_name=axis_name,
                                implementation=implementation, interpret=interpret, tiles=tiles,
                                prefetch_tiles=prefetch_tiles)
    return jax.jit(program, static_argnames=_LAYER_PROGRAM_PER_CALL, donate_argnames=_LAYER_PROGRAM_DONATED)


def _through_hook(hook, layer: int, ring: list, cache=None, small=(), *, mesh, axis_name, platform):
    """The ring slots (replicated), one layer's sharded cache if given, and `small` replicated
    arrays through `hook(layer, arrays, platform=)` on every device, aliased (no copy of a buffer
    the program owns or was donated; any other parameter among `small` is copied first).
    Returns (the slots, the cache or None, the small arrays)."""
    small = tuple(small)
    passing, specs = list(ring) + list(small), [P()] * (len(ring) + len(small))
    if cache is not None:       # as rows: a 3-D buffer would be copied through the call
        passing.append(cache.reshape(-1, cache.shape[2]))
        specs.append(P(axis_name))
    specs = tuple(specs)
    outs = jax.shard_map(lambda *a: hook(layer, a, platform=platform), mesh=mesh, in_specs=specs,
                         out_specs=specs, check_vma=False)(*passing)
    slots, small = list(outs[:len(ring)]), tuple(outs[len(ring):len(ring) + len(small)])
    return slots, None if cache is None else outs[-1].reshape(cache.shape), small


# The most gathers queued ahead at one point of a step, before a layer's write or patch.  JAX
# runs a device's work on one stream in order, so every gather queued ahead of a layer's write
# delays that layer: queueing the whole lookahead at once (depth gathers before layer 0) puts
# depth - 1 unneeded gathers in front of layer 0's write (1M history, 1 ms a layer, depth 3:
# three at once hid 86-88%, two hide 93-95%; BENCHMARKS.md, forty-ninth and fiftieth
# sections).  Two at a point fill the lookahead one layer a point (one to keep pace, one to
# gain), so a write waits for at most two gathers.
PREFETCHES_AT_ONCE = 2


def prefetch_points(num_layers: int, depth: int) -> list[list[int]]:
    """The layers a step of lookahead `depth` gathers ahead, point by point: [0] before layer 0's
    wait, [l + 1] after layer l's signal.  A point gathers the layers up to l + depth that are
    not gathered yet, at most `PREFETCHES_AT_ONCE` of them, in order; so with depth > 0 layer l
    is gathered at point l or before, and the slot it overwrites held layer l - depth - 1 at the
    latest.  Depth 0 gathers nothing ahead."""
    if depth == 0:
        return [[] for _ in range(num_layers + 1)]
    points, gathered = [], 0
    for point in range(num_layers + 1):
        end = min(point + depth, num_layers, gathered + PREFETCHES_AT_ONCE)
        points.append(list(range(gathered, end)))
        gathered = max(gathered, end)
    return points


@functools.partial(jax.jit, static_argnames=("depth", "mesh", "axis_name", "layout", "implementation", "interpret",
                                             "tiles", "prefetch_tiles", "hooks"),
                   donate_argnames=("ring", "caches", "flags"))
def step_program(ring, caches, flags, kv_c, k_pe, arrays: StepArrays, *, depth: int, mesh, layout: RecordLayout,
                 hooks, axis_name: str = DCP_AXIS, implementation=None, interpret: bool = False, tiles=None,
                 prefetch_tiles=None):
    """A whole step's JAX work for L layers as one program, queued ahead of the consumer that
    produces each layer's chunk: an engine whose per-layer hand-off is a flag it writes, not a
    dispatch.

      ring:   depth + 1 slots u8[D * C, R] (replicated, donated, updated in place)
      caches: L sharded caches u8[D * num_blocks, block_size, R] (donated, written in place)
      flags:  i32[L + 1] (replicated, donated): the hooks' words, [L] the abandon word, read
              after each wait (on a GPU `StepFlags.words` itself)
      kv_c, k_pe: tuples of [C', nope_dim] and bf16[C', rope_dim] chunk buffers (C' =
              `arrays.chunk_rows` rows): one pair, which holds each layer's latents when that
              layer's wait is released (the consumer rewrites it between layers), or L pairs;
              or both None: the consumer writes the chunk itself (below)

    The program first gathers layers 0..min(depth, 2)-1 into their slots; then for layer l:

      1. `hooks.wait(l, arrays, platform=)` -> arrays, the ring slots and then `flags`: the rest
         waits there until the consumer released layer l (its latents are in the chunk buffers,
         its reads of slot (l - 1) % (depth + 1) are done); the writer reads the abandon word
         `flags[L]` from the wait's result, and where it is not 0 this layer writes nothing into
         its cache or its slot's chunk rows (a step released without its latents);
      2. the chunk written into caches[l] and, with depth > 0, patched into slot l % (depth + 1)
         by one writer call (depth 0: the slot gathered from the written cache);
      3. `hooks.signal(l, arrays, platform=)` -> arrays: layer l's workspace is ready;
      4. the gathers of the layers up to l + depth not gathered yet (their pre-step caches),
         layer t into slot t % (depth + 1), at most two (`prefetch_points`): the lookahead fills
         over the first layers, and no layer's write waits behind more than two gathers.

    Both hooks take and return all ring slots (the signal also the layer's written cache, as
    rows), aliased, and the writer takes the word read after the wait, so the steps of one layer
    and the layers follow each other in that order on the program's stream (no schedule can
    hoist a later layer's work over a wait, or a prefetch over a signal).

    With kv_c and k_pe None the consumer writes each layer's chunk into its cache before
    releasing the layer and, with depth > 0, patches it into the layer's slot after the layer's
    signal; the program writes no cache and only gathers, so at depth > 0 nothing of the
    program lies between a layer's release and its workspace:

      0. the gathers of layers 0..depth-1 into slots 0..depth-1, each followed by its signal;
      1. the wait of layer l (the consumer's cache write of layer l is done, and its reads of
         slot (l - 1) % (depth + 1));
      2. depth 0: the gather of layer l into slot 0, then its signal; depth > 0: the gather of
         layer l + depth (its cache before this step's chunk, whose rows the consumer's patch
         overwrites) into slot (l + depth) % (depth + 1), then the signal of layer l + depth.

    The signal of layer t says "slot t % (depth + 1) holds layer t's gather".  hooks: static,
    hashable; on a GPU `interop.stream_handoff.StepFlags` (native flag waits and event records),
    whose docstring names the hazard of a program that waits for the host.
    Returns (the ring slots, the caches, flags)."""
    num_layers = len(caches)
    if len(ring) != depth + 1:
        raise ValueError(f"ring: expected depth + 1 = {depth + 1} slots, got {len(ring)}")
    if (kv_c is None) != (k_pe is None):
        raise ValueError(f"kv_c, k_pe: expected both chunk buffers or both None (the consumer writes the chunk), "
                         f"got {'None' if kv_c is None else 'buffers'} and {'None' if k_pe is None else 'buffers'}")
    if kv_c is not None and (len(kv_c) != len(k_pe) or len(kv_c) not in (1, num_layers)):
        raise ValueError(f"kv_c, k_pe: expected one chunk buffer pair or one per layer ({num_layers}), "
                         f"got {len(kv_c)} and {len(k_pe)}")
    if flags.shape != (num_layers + 1,) or flags.dtype != jnp.int32:
        raise ValueError(f"flags: expected int32[{num_layers + 1}] (a word a layer and the abandon word), "
                         f"got {flags.dtype}{list(flags.shape)}")
    platform = placement.mesh_device(mesh).platform
    gather = functools.partial(_gather_over_mesh, arrays=arrays, mesh=mesh, axis_name=axis_name,
                               implementation=implementation, interpret=interpret)
    write = functools.partial(_write_over_mesh, mesh=mesh, layout=layout, axis_name=axis_name,
                              implementation=implementation, interpret=interpret)
    through = functools.partial(_through_hook, mesh=mesh, axis_name=axis_name, platform=platform)
    ring, caches, slots = list(ring), list(caches), depth + 1
    one_rank = arrays.local_cu.shape[0] == 1
    if kv_c is None:
        ring, flags = _gather_only_step(ring, caches, flags, arrays, depth=depth, hooks=hooks, gather=gather,
                                        through=through, one_rank=one_rank, tiles=tiles,
                                        prefetch_tiles=prefetch_tiles)
        return tuple(ring), tuple(caches), flags
    points = prefetch_points(num_layers, depth)
    for t in points[0]:
        ring[t] = gather(caches[t], out=ring[t], tiles=prefetch_tiles)
    for l in range(num_layers):
        own = l % slots
        # the wait passes the slots and flags only (the cache, a parameter, would be copied
        # through it); the writer follows it through the flags, whose abandon word it reads
        ring, _, (flags,) = through(hooks.wait, l, ring, small=(flags,))
        # a released step writes nothing more: its chunk buffers hold no latents of this layer.
        # The writer reads the abandon word itself: a select of the slots would be a kernel of
        # its own between the wait and the write, on the path the consumer waits for
        chunk = (kv_c[l % len(kv_c)], k_pe[l % len(k_pe)])
        if depth:
            caches[l], ring[own] = write(caches[l], *chunk, arrays, ring[own], skip_words=flags,
                                         skip_index=num_layers)
        else:
            caches[l] = write(caches[l], *chunk, arrays, skip_words=flags, skip_index=num_layers)
            ring[own] = gather(caches[l], out=ring[own], tiles=tiles)
        # with several ranks a prefetch's pack writes a buffer of its own: local_cu, which it
        # reads, passes through the signal too, so the pack follows it
        following = () if one_rank else (arrays.local_cu,)
        ring, caches[l], following = through(hooks.signal, l, ring, caches[l], following)
        if points[l + 1]:
            after_signal = arrays if one_rank else dataclasses.replace(arrays, local_cu=following[0])
            for t in points[l + 1]:
                ring[t % slots] = gather(caches[t], arrays=after_signal, out=ring[t % slots], tiles=prefetch_tiles)
    return tuple(ring), tuple(caches), flags


def _gather_only_step(ring: list, caches: list, flags, arrays: StepArrays, *, depth, hooks, gather, through,
                      one_rank, tiles, prefetch_tiles):
    """`step_program`'s layers where the consumer writes the chunk (its steps 0-2).  Each gather
    follows the last wait through the slot it writes and, with several ranks, through
    `local_cu`, which its pack reads: the pack writes a buffer of its own and could otherwise
    run ahead of the wait, before the consumer's cache write (depth 0)."""
    num_layers, slots = len(caches), depth + 1
    following = () if one_rank else (arrays.local_cu,)

    def gather_and_signal(t, ring, following, tiles):
        after_wait = arrays if one_rank else dataclasses.replace(arrays, local_cu=following[0])
        ring[t % slots] = gather(caches[t], arrays=after_wait, out=ring[t % slots], tiles=tiles)
        ring, _, following = through(hooks.signal, t, ring, small=following)
        return ring, following

    for t in range(min(depth, num_layers)):
        ring, following = gather_and_signal(t, ring, following, prefetch_tiles)
    for l in range(num_layers):
        ring, _, (*following, flags) = through(hooks.wait, l, ring, small=(*following, flags))
        if depth == 0:
            ring, following = gather_and_signal(l, ring, tuple(following), tiles)
        elif l + depth < num_layers:
            ring, following = gather_and_signal(l + depth, ring, tuple(following), prefetch_tiles)
    return ring, flags
