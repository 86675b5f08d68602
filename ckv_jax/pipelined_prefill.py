"""Depth-N cross-layer prefetch inside one JAX program.

The all-gather of a layer's CKV depends only on that layer's history, not on its queries, so
iteration l issues the gather of layer l + depth from the pre-step cache, into ring slot
`(l + depth) % (depth + 1)`, before layer l computes; layer l then writes its current chunk into
its own paged cache, consumes slot `l % (depth + 1)` after patching the chunk into it, and runs
its attention.  Depth 0 gathers each layer synchronously after its write.  Every depth gives the
same bytes and the same outputs; data dependencies replace upstream's events, and XLA is free to
run the gathers of later layers (async collectives) under earlier layers' compute.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ckv_jax import dcp_step, formats, placement
from ckv_jax.placement import DCP_AXIS
from ckv_jax.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class MlaLayer:
    """How one layer computes, as seen from one DCP rank (inside the shard_map).

    project(params, x) -> (q bf16[T, H_local, 576] (this rank's heads), kv_c bf16[T, 512], k_pe bf16[T, 64])
    attend(q, workspace u8[D * P, R], indices i32[T, K], counts i32[T]) -> out [T, H_local, 512]
    finish(params, x, out) -> next x (may use collectives over the DCP axis, e.g. to gather heads)
    """
    project: Callable
    attend: Callable
    finish: Callable


def prefill_layers(x, caches: Sequence[jax.Array], params: Sequence[Any], block_table, plan: StepPlan,
                   topk_indices, topk_counts, *, layer: MlaLayer, depth: int, mesh: jax.sharding.Mesh,
                   format: str | formats.RecordFormat, axis_name: str = DCP_AXIS, implementation=None,
                   interpret: bool = False, return_workspaces: bool = False, compiled_text: bool = False):
    """Run L layers of one pure-prefill step with depth-N prefetch of the full-CKV gathers.

    Args:
      x: [T, ...] layer input, replicated (every rank holds all T tokens).
      caches: L arrays u8[D * num_blocks, block_size, R] sharded over `axis_name` (`place_caches`);
        they hold each layer's history; the current chunk is written here.
      params: L per-layer parameter pytrees (replicated), passed to `layer`.
      block_table: i32[R, max_blocks]; plan: the step plan.
      topk_indices, topk_counts: i32[L, T, K], i32[L, T] per-layer top-k already remapped to
        workspace rows (`remap_topk`).
      depth: layers gathered ahead (0 = synchronous).
      compiled_text: return the optimized HLO of the step's program instead of running it.
    Returns:
      (x after the last layer, the L updated caches[, u8[L, D * P, R] workspaces each layer used]).
    """
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
    fmt = formats.get(format)
    num_layers = len(caches)
    if len(params) != num_layers:
        raise ValueError(f"params: expected one entry per layer ({num_layers}), got {len(params)}")
    for cache in caches:
        dcp_step.check_caches(fmt, cache, plan)
    placement.mesh_axis_size(mesh, axis_name, plan.world_size)
    dcp_step.check_block_table(plan, block_table)
    arrays = dcp_step.step_arrays(plan, block_table, mesh)
    x, indices, counts = placement.replicated(mesh, x, topk_indices, topk_counts)
    params = jax.tree.map(lambda a: placement.replicated(mesh, a)[0], list(params))
    fn = _compiled_loop(mesh, axis_name, num_layers, layer, depth, fmt.layout,
                        dcp_step.static_implementation(implementation), interpret, return_workspaces)
    args = (x, list(caches), params, arrays, indices, counts)
    if compiled_text:
        return fn.lower(*args).compile().as_text()
    return fn(*args)


@functools.lru_cache(maxsize=64)
def _compiled_loop(mesh, axis_name, num_layers, layer, depth, layout, implementation, interpret,
                   return_workspaces):
    """One jitted program per static configuration, so repeated steps do not retrace."""
    body = functools.partial(
        _loop, layer=layer, depth=depth, layout=layout, axis_name=axis_name, implementation=implementation,
        interpret=interpret, device=placement.mesh_device(mesh), return_workspaces=return_workspaces)
    rep = P()
    in_specs = (rep, [P(axis_name)] * num_layers, rep, rep, rep, rep)
    out_specs = (rep, [P(axis_name)] * num_layers) + ((rep,) if return_workspaces else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
                   donate_argnums=(1,))


def _loop(x, caches, params, arrays, indices, counts, *, layer, depth, layout, axis_name, implementation,
          interpret, device, return_workspaces):
    num_layers = len(caches)
    caches = list(caches)
    ring_slots = depth + 1
    kernels = dict(implementation=implementation, interpret=interpret, device=device)

    def gather(cache):
        return dcp_step.gather_workspace_in_shard_map(cache, arrays, axis_name=axis_name, **kernels)

    # the ring is the gathered workspaces themselves: each gather writes a buffer of its own and
    # the patch updates it in place, so no workspace is ever copied into a stacked ring
    ring = [None] * ring_slots
    for target in range(min(depth, num_layers)):                 # the first N layers, before any compute
        ring[target % ring_slots] = gather(caches[target])
    used = []
    for l in range(num_layers):
        if depth and l + depth < num_layers:                     # issued ahead of layer l's compute
            ring[(l + depth) % ring_slots] = gather(caches[l + depth])
        q, kv_c, k_pe = layer.project(params[l], x)
        caches[l] = dcp_step.write_chunk(caches[l], kv_c, k_pe, arrays, layout=layout, axis_name=axis_name, **kernels)
        if depth:
            prefetched, ring[l % ring_slots] = ring[l % ring_slots], None
            workspace = dcp_step.patch_chunk(prefetched, kv_c, k_pe, arrays.chunk_rows, layout=layout, **kernels)
        else:
            workspace = gather(caches[l])                        # synchronous: after this layer's write
        if return_workspaces:
            used.append(workspace)
        x = layer.finish(params[l], x, layer.attend(q, workspace, indices[l], counts[l]))
    outputs = (x, caches)
    return outputs + ((jnp.stack(used),) if return_workspaces else ())
