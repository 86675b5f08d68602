"""The full-CKV DCP path as one call per operation: gather, patch, write, and the top-k remap.

Every rank packs its local CKV records of all requests out of its paged cache, zero-pads them to
P rows, and one all-gather over the mesh axis builds the same u8[D * P, R] workspace on every
rank: rank o's shard of request r at rows `o * P + rank_req_starts[o, r] + local`.  The global
top-k is remapped to those rows (`remap_topk`) instead of reordering the workspace.  Each call
checks its inputs on the host, places the step's arrays (`dcp_step.step_arrays`) and runs the
step's operation (`dcp_step`); a caller that runs many operations per step (a layer loop) uses
`dcp_step` or `prefetch.PrefetchOrchestrator` to place and check once.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax import dcp_step, formats, placement, validation
from ckv_jax.placement import DCP_AXIS
from ckv_jax.step_plan import StepPlan
from pallas_kernels import selection


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
    placement.mesh_axis_size(mesh, axis_name, plan.world_size)
    num_blocks = dcp_step.check_caches(fmt, caches, plan)
    dcp_step.check_block_table(plan, block_table, num_blocks, validate)
    workspace = dcp_step.gather_program(caches, dcp_step.step_arrays(plan, block_table, mesh), mesh=mesh,
                                        axis_name=axis_name,
                                        implementation=dcp_step.static_implementation(implementation),
                                        interpret=interpret)
    if validation.validation_enabled(validate):
        validation.check_finite_scales(fmt, workspace, plan)
    return workspace


def patch_current_chunk(workspace, kv_c, k_pe, plan: StepPlan, format: str | formats.RecordFormat, *,
                        implementation: str | Sequence[str] | None = None, interpret: bool = False, after=None):
    """Write the step's current-chunk records into a gathered workspace, in place (`dcp_step.patch_chunk`).

    Args:
      workspace: u8[N, R] with N >= D * P, e.g. a ring slot of D * C rows (donated; the result
        reuses its buffer; rows past D * P are not touched).
      kv_c: bf16|f16|f32[T, nope_dim]; k_pe: bf16[T, rope_dim], T = plan.num_tokens.
      after: optional array the patch waits for (an unused input; see `PrefetchOrchestrator.gather`).
    Returns:
      u8[N, R].
    """
    fmt = formats.get(format)
    validation.check_records(fmt, workspace, name="workspace", rows="N")
    if workspace.shape[0] < plan.world_size * plan.padded_tokens:
        raise ValueError(f"workspace: expected uint8[>= {plan.world_size * plan.padded_tokens}, {fmt.record_bytes}] "
                         f"(at least D * P rows), got {validation.describe(workspace)}")
    dcp_step.check_chunk(fmt, kv_c, k_pe, plan)
    return dcp_step.patch_program(workspace, kv_c, k_pe, jnp.asarray(dcp_step.chunk_rows(plan)), after,
                                  layout=fmt.layout, implementation=dcp_step.static_implementation(implementation),
                                  interpret=interpret, device=selection.device_of(workspace))


def write_records_dcp(caches, kv_c, k_pe, plan: StepPlan, block_table, *, mesh: jax.sharding.Mesh,
                      format: str | formats.RecordFormat, axis_name: str = DCP_AXIS,
                      implementation: str | Sequence[str] | None = None, interpret: bool = False):
    """The DCP cache write of one layer: every rank writes the chunk tokens it owns into its cache.

    caches: u8[D * num_blocks, block_size, R] sharded over `axis_name` (donated, updated in place);
    kv_c: [T, nope_dim], k_pe: bf16[T, rope_dim], T = plan.num_tokens (every rank holds all T).
    """
    fmt = formats.get(format)
    placement.mesh_axis_size(mesh, axis_name, plan.world_size)
    dcp_step.check_caches(fmt, caches, plan)
    dcp_step.check_chunk(fmt, kv_c, k_pe, plan)
    dcp_step.check_block_table(plan, block_table)
    kv_c, k_pe = placement.replicated(mesh, kv_c, k_pe)
    return dcp_step.write_program(caches, kv_c, k_pe, dcp_step.step_arrays(plan, block_table, mesh), mesh=mesh,
                                  axis_name=axis_name, layout=fmt.layout,
                                  implementation=dcp_step.static_implementation(implementation), interpret=interpret)


def workspace_to_global_order(workspace, plan: StepPlan):
    """u8[D * P, R] -> u8[sum(seq_lens), R]: requests in order, each in global token order."""
    req = np.repeat(np.arange(plan.num_reqs), plan.seq_lens)
    pos = np.concatenate([np.arange(n) for n in plan.seq_lens]) if plan.num_reqs else np.zeros(0, np.int64)
    rows = dcp_step.workspace_rows(plan, req, pos.astype(np.int64)).astype(np.int32)
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
    return _remap_jit(topk, jnp.asarray(plan.req_id_per_token), jnp.asarray(plan.causal_lens()),
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
