"""The full-CKV DCP gather: pack each rank's local history, all-gather it rank-major.

Every rank packs its local CKV records of all requests out of its paged cache
(`pallas_kernels.paged_gather`), zero-pads them to P rows, and one `lax.all_gather` over the
mesh axis builds the same u8[D * P, R] workspace on every rank: rank o's shard of request r
at rows `o * P + rank_req_starts[o, r] + local`.  The global top-k is remapped to those rows
(`remap_topk`) instead of reordering the workspace.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ckv_jax import formats, validation
from ckv_jax.step_plan import StepPlan
from pallas_kernels import _registry, cache_writer, paged_gather

DCP_AXIS = "dcp"


def replicated(mesh: jax.sharding.Mesh, *arrays):
    """Each array placed whole on every device of `mesh` (a shard_map input with spec P())."""
    sharding = NamedSharding(mesh, P())
    return [jax.device_put(jnp.asarray(a), sharding) for a in arrays]


def mesh_axis_size(mesh, axis_name: str = DCP_AXIS, world_size: int | None = None) -> int:
    """The size of `axis_name` in `mesh` (checked to equal `world_size`, the plan's, if given),
    or an error naming the mesh's axes."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh: expected an axis named {axis_name!r}, got axes {tuple(mesh.shape)}")
    size = mesh.shape[axis_name]
    if world_size is not None and size != world_size:
        raise ValueError(f"mesh: axis {axis_name!r} has size {size}, expected the plan's world_size {world_size}")
    return size


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` with every axis of type Auto (the same devices and names).  Arrays sharded over an
    Explicit axis refuse plain indexing (`out[0, 0]`); the library's outputs live on this copy so
    that a user indexes them like any array, whichever mesh they built."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def dcp_mesh(world_size: int | None = None, devices=None, axis_name: str = DCP_AXIS) -> jax.sharding.Mesh:
    """A one-axis mesh over `world_size` devices (default: all of `devices`, or of the default
    backend) named `axis_name`, with an Auto axis type."""
    devices = list(jax.devices() if devices is None else devices)
    world_size = len(devices) if world_size is None else world_size
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size <= 0:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if world_size > len(devices):
        raise ValueError(f"world_size: {world_size} ranks need as many devices, got {len(devices)} "
                         f"({devices[0].platform if devices else 'none'}); on a CPU set "
                         "jax.config.update('jax_num_cpu_devices', N) before JAX starts")
    return jax.make_mesh((world_size,), (axis_name,), devices=devices[:world_size],
                         axis_types=(jax.sharding.AxisType.Auto,))


def static_implementation(implementation):
    """`implementation` as a hashable static argument for jit (a sequence becomes a tuple)."""
    if implementation is None or isinstance(implementation, str):
        return implementation
    return tuple(implementation)


def check_block_table(plan: StepPlan, block_table, num_blocks: int | None = None, validate: bool | None = None):
    """Host checks: int32[R, max_blocks] with room for every rank's local length; with
    validation on, every block id a rank will read lies in [0, num_blocks)."""
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


def pack_local(cache, block_table, local_cu_seq_lens, *, num_rows: int, out=None,
               implementation: str | Sequence[str] | None = None, interpret: bool = False, tiles=None):
    """One rank's packed history: u8[num_rows, R] from its cache u8[num_blocks, block_size, R].

    local_cu_seq_lens: i32[R + 1] this rank's cumulative local lengths.
    out: optional u8[M >= num_rows, R] written in place (rows [0, num_rows)); see `gather_records`.
    tiles: the Pallas Triton pack's tile config (None: the tuned one).
    """
    return paged_gather.gather_records(cache, block_table, local_cu_seq_lens, num_rows=num_rows, out=out,
                                       implementation=implementation, interpret=interpret, config=tiles)


def gather_workspace_in_shard_map(cache, block_table, rank_local_cu, *, num_rows: int, out=None,
                                  axis_name: str = DCP_AXIS, implementation=None, interpret=False, tiles=None):
    """Inside a shard_map over `axis_name`: this rank's cache -> the rank-major u8[D * P, R].

    rank_local_cu: i32[D, R + 1] (the plan's local_cu_seq_lens, replicated).
    out: optional u8[M >= D * P, R] (a ring slot, donated by the caller) that receives the
    workspace in its rows [0, D * P).  With D = 1 the pack writes straight into it.  With D > 1
    the all-gather's result is copied into it once: XLA's all-gather writes a buffer of its own
    and cannot target a slice of another one.
    """
    world_size = rank_local_cu.shape[0]
    if num_rows == 0:        # no history on any rank: XLA rejects a zero-size all-gather
        empty = jnp.zeros((0, cache.shape[2]), cache.dtype)
        return empty if out is None else out
    rank = lax.axis_index(axis_name)
    pack = functools.partial(pack_local, cache, block_table, rank_local_cu[rank], num_rows=num_rows,
                             implementation=implementation, interpret=interpret, tiles=tiles)
    if world_size == 1:      # the all-gather of one rank is the identity: no collective, no copy
        return pack(out=out)
    workspace = lax.all_gather(pack(), axis_name, axis=0, tiled=True)
    return workspace if out is None else lax.dynamic_update_slice(out, workspace, (0, 0))


def all_gather_ckv(caches, block_table, plan: StepPlan, *, mesh: jax.sharding.Mesh,
                   format: str | formats.RecordFormat, axis_name: str = DCP_AXIS,
                   implementation: str | Sequence[str] | None = None, interpret: bool = False,
                   validate: bool | None = None):
    """The gathered workspace of one layer on every rank.

    Args:
      caches: u8[D * num_blocks, block_size, R]: the D per-rank caches stacked along axis 0 and
        sharded over `axis_name` (rank d holds rows [d * num_blocks, (d + 1) * num_blocks)).
      block_table: i32[R, max_blocks], shared by all ranks.
      plan: the step plan (`build_step_plan`); its world size must equal the axis size.
      validate: opt-in data checks (default `CKV_JAX_VALIDATE`): block ids of every valid
        prefix in range before the gather, finite scales in every gathered record after it.
    Returns:
      u8[D * P, R], replicated: rank o's shard of request r at rows
      `o * P + plan.rank_req_starts[o, r] + local`, zeros past each rank's total.
    """
    fmt = formats.get(format)
    d = mesh_axis_size(mesh, axis_name, plan.world_size)
    validation.check_cache(fmt, caches)
    if caches.shape[0] % d:
        raise ValueError(f"caches: expected D * num_blocks rows on axis 0 (D={d}), got {validation.describe(caches)}")
    if caches.shape[1] != plan.layout.block_size:
        raise ValueError(f"caches: expected block_size {plan.layout.block_size} on axis 1, "
                         f"got {validation.describe(caches)}")
    check_block_table(plan, block_table, caches.shape[0] // d, validate)
    table, local_cu = replicated(mesh, block_table, plan.local_cu_seq_lens)
    workspace = all_gather_placed(caches, table, local_cu, mesh=mesh, axis_name=axis_name,
                                  num_rows=plan.padded_tokens, implementation=static_implementation(implementation),
                                  interpret=interpret)
    if validation.validation_enabled(validate):
        validation.check_finite_scales(fmt, workspace, plan)
    return workspace


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "num_rows", "implementation", "interpret"))
def all_gather_placed(caches, block_table, rank_local_cu, *, mesh, axis_name, num_rows, implementation, interpret):
    """`all_gather_ckv` without its host checks, for callers that checked the step once and hold
    the replicated block table and i32[D, R + 1] local cumulative lengths on the mesh."""
    body = functools.partial(gather_workspace_in_shard_map, num_rows=num_rows, axis_name=axis_name,
                             implementation=implementation, interpret=interpret)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis_name), P(), P()), out_specs=P(),
                         check_vma=False)(caches, block_table, rank_local_cu)


def workspace_rows(plan: StepPlan, req, pos):
    """Row of global position `pos` of request `req` in the gathered workspace (numpy or jax)."""
    layout = plan.layout
    owner, local = layout.owner(pos), layout.local_index(pos)
    starts = plan.rank_req_starts
    if not isinstance(pos, np.ndarray) and not np.isscalar(pos):
        starts = jnp.asarray(starts)
    return owner * plan.padded_tokens + starts[owner, req] + local


def workspace_to_global_order(workspace, plan: StepPlan):
    """u8[D * P, R] -> u8[sum(seq_lens), R]: requests in order, each in global token order."""
    req = np.repeat(np.arange(plan.num_reqs), plan.seq_lens)
    pos = np.concatenate([np.arange(n) for n in plan.seq_lens]) if plan.num_reqs else np.zeros(0, np.int64)
    rows = workspace_rows(plan, req, pos.astype(np.int64)).astype(np.int32)
    return jnp.take(workspace, jnp.asarray(rows), axis=0)


def remap_topk(topk, plan: StepPlan):
    """Global logical top-k -> gathered-workspace rows.

    Args:
      topk: i32[T, K] positions within each query row's request, -1 padded, identical on all ranks.
      plan: the step plan (T = plan.num_tokens).
    Returns:
      (indices i32[T, K], counts i32[T]): valid rows compacted to the front of each row in
      their original order, -1 after.  An entry is valid iff 0 <= pos < the row's global causal
      length `seq_len - q_len + (t - q_start) + 1` and its local index lies inside its owner's
      local length; so counts never exceed the causal length.
    """
    validation.check_array("topk", topk, (jnp.int32,), f"[{plan.num_tokens}, K]", 2)
    if topk.shape[0] != plan.num_tokens:
        raise ValueError(f"topk: expected int32[{plan.num_tokens}, K] (one row per query token), "
                         f"got {validation.describe(topk)}")
    causal = plan.positions().astype(np.int32) + 1
    return _remap_jit(topk, jnp.asarray(plan.req_id_per_token), jnp.asarray(causal),
                      jnp.asarray(plan.rank_req_starts), jnp.asarray(plan.rank_req_lens),
                      layout=plan.layout, padded=plan.padded_tokens)


@functools.partial(jax.jit, static_argnames=("layout", "padded"))
def _remap_jit(topk, req_id, causal_len, starts, lens, *, layout, padded):
    req = req_id[:, None]
    owner, local = layout.owner(topk), layout.local_index(topk)
    owner_c = jnp.clip(owner, 0, layout.world_size - 1)
    valid = (topk >= 0) & (topk < causal_len[:, None]) & (local < lens[owner_c, req])
    rows = owner_c * padded + starts[owner_c, req] + local
    # compact: valid entries keep their order at the front of the row
    dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, topk.shape[1])
    t_idx = jnp.broadcast_to(jnp.arange(topk.shape[0])[:, None], topk.shape)
    out = jnp.full_like(topk, -1).at[t_idx, dest].set(rows, mode="drop")
    return out, valid.sum(axis=1).astype(jnp.int32)


def chunk_rows(plan: StepPlan) -> np.ndarray:
    """i32[T]: the workspace row of every current-chunk token (all owners, all requests)."""
    return workspace_rows(plan, plan.req_id_per_token, plan.positions().astype(np.int64)).astype(np.int32)


def patch_current_chunk(workspace, kv_c, k_pe, plan: StepPlan, format: str | formats.RecordFormat, *,
                        implementation: str | Sequence[str] | None = None, interpret: bool = False, after=None):
    """Write the step's current-chunk records into a gathered workspace, in place.

    A prefetched workspace was gathered before its layer wrote the current chunk into the paged
    cache, so the chunk's rows hold stale bytes.  Every rank holds the chunk's latents of all T
    tokens, so it re-encodes them with the cache writer's encoder (bit-identical records) and
    scatters them to `owner * P + rank_req_starts[owner, req] + local`.  History rows are not
    touched.

    Args:
      workspace: u8[N, R] with N >= D * P, e.g. a ring slot of D * C rows (donated; the result
        reuses its buffer; rows past D * P are not touched).
      kv_c: bf16|f16|f32[T, nope_dim]; k_pe: bf16[T, rope_dim], T = plan.num_tokens.
      after: optional array the patch waits for (an unused input; see `PrefetchOrchestrator.gather`).
    Returns:
      u8[N, R].
    """
    fmt = formats.get(format)
    validation.check_records(fmt, workspace)
    if workspace.shape[0] < plan.world_size * plan.padded_tokens:
        raise ValueError(f"workspace: expected uint8[>= {plan.world_size * plan.padded_tokens}, {fmt.record_bytes}] "
                         f"(at least D * P rows), got {validation.describe(workspace)}")
    if validation.check_values(fmt, kv_c, k_pe) != plan.num_tokens:
        raise ValueError(f"kv_c: expected [{plan.num_tokens}, {fmt.nope_dim}] (the step's query tokens), "
                         f"got {validation.describe(kv_c)}")
    run = cache_writer.select(implementation, _registry.device_of(workspace), workspace.size, plan.num_tokens,
                              fmt.layout, interpret)
    return patch_placed(workspace, kv_c, k_pe, jnp.asarray(chunk_rows(plan)), after, layout=fmt.layout,
                        run=run, interpret=interpret)


def patch_placed(workspace, kv_c, k_pe, rows, after=None, *, layout, run, interpret=False):
    """`patch_current_chunk` without its host checks, for callers that checked the step once and
    hold its i32[T] `chunk_rows` on the device and the writer backend's `run` (`cache_writer.select`)."""
    return _patch_jit(workspace, kv_c, k_pe, rows, after, layout=layout, run=run, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layout", "run", "interpret"), donate_argnums=(0,), keep_unused=True)
def _patch_jit(workspace, kv_c, k_pe, rows, after, *, layout, run, interpret):
    n, record_bytes = workspace.shape
    out = run(workspace.reshape(n, 1, record_bytes), kv_c, k_pe, rows, layout=layout, interpret=interpret)
    return out.reshape(n, record_bytes)


def dcp_slot_mapping(plan: StepPlan, block_table) -> np.ndarray:
    """i32[D, T]: each rank's slot for every current-chunk token (-1 where another rank owns it)."""
    table = np.asarray(block_table)
    pos = plan.positions()
    return np.stack([plan.layout.slot_mapping(pos, plan.req_id_per_token, table, rank)
                     for rank in range(plan.world_size)]).astype(np.int32)


def write_records_dcp(caches, kv_c, k_pe, plan: StepPlan, block_table, *, mesh: jax.sharding.Mesh,
                      format: str | formats.RecordFormat, axis_name: str = DCP_AXIS,
                      implementation: str | Sequence[str] | None = None, interpret: bool = False):
    """The DCP cache write of one layer: every rank writes the chunk tokens it owns into its cache.

    caches: u8[D * num_blocks, block_size, R] sharded over `axis_name` (donated, updated in place);
    kv_c: [T, nope_dim], k_pe: bf16[T, rope_dim], T = plan.num_tokens (every rank holds all T).
    """
    fmt = formats.get(format)
    validation.check_cache(fmt, caches)
    if validation.check_values(fmt, kv_c, k_pe) != plan.num_tokens:
        raise ValueError(f"kv_c: expected [{plan.num_tokens}, {fmt.nope_dim}] (the step's query tokens), "
                         f"got {validation.describe(kv_c)}")
    return _write_dcp_jit(caches, *replicated(mesh, kv_c, k_pe, dcp_slot_mapping(plan, block_table)),
                          mesh=mesh, axis_name=axis_name, layout=fmt.layout,
                          implementation=static_implementation(implementation), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "layout", "implementation", "interpret"),
                   donate_argnums=(0,))
def _write_dcp_jit(caches, kv_c, k_pe, slots, *, mesh, axis_name, layout, implementation, interpret):
    def body(cache, kv, pe, all_slots):
        return cache_writer.write_records(cache, kv, pe, all_slots[lax.axis_index(axis_name)], layout=layout,
                                          implementation=implementation, interpret=interpret)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis_name), P(), P(), P()), out_specs=P(axis_name),
                         check_vma=False)(caches, kv_c, k_pe, slots)


def place_caches(per_rank_caches, mesh: jax.sharding.Mesh, axis_name: str = DCP_AXIS):
    """Stack per-rank caches u8[num_blocks, block_size, R] (one per rank, host or device) into the
    sharded u8[D * num_blocks, block_size, R] that `all_gather_ckv` takes."""
    d = mesh_axis_size(mesh, axis_name)
    caches = [np.asarray(c) for c in per_rank_caches]
    if len(caches) != d:
        raise ValueError(f"per_rank_caches: expected one cache per rank of mesh axis {axis_name!r} "
                         f"({d}), got {len(caches)}")
    first = caches[0]
    if first.ndim != 3 or first.dtype != np.uint8:
        raise ValueError(f"per_rank_caches: expected uint8[num_blocks, block_size, R] per rank, got "
                         f"{first.dtype}{list(first.shape)} for rank 0")
    for rank, c in enumerate(caches):
        if c.shape != first.shape or c.dtype != first.dtype:
            raise ValueError(f"per_rank_caches: every rank's cache must be {first.dtype}{list(first.shape)} "
                             f"(rank 0's), got {c.dtype}{list(c.shape)} for rank {rank}")
    stacked = np.concatenate(caches, axis=0)
    # from a callback, so that each process of a multi-process run places only its own shards
    return jax.make_array_from_callback(stacked.shape, NamedSharding(mesh, P(axis_name)),
                                        lambda index: stacked[index])
