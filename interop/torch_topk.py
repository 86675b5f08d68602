"""The top-k remap of `ckv_jax.full_ckv.remap_topk` in torch, on torch's current stream.

A torch engine maps each layer's top-k without a JAX dispatch, a DLPack import or an export,
and without queueing behind JAX's stream: there a prefetch or a queued step program would hold
the remap (and the attention that reads it) until JAX's earlier work is done, and a step
program that waits for torch's next release would never get it.  The step's tables reach the
device once per step (`TopkTables`: one copy from pinned memory, no host wait); each call is
then a few element-wise kernels, no host synchronization.  The tables are torch's own memory,
read on torch's stream only, so torch's allocator reuses them safely however far the host runs
ahead (memory exported from JAX would be JAX's to reuse once released, with no wait for the
reads torch still has queued).
"""
from __future__ import annotations

import numpy as np
import torch

from ckv_jax.step_plan import StepPlan


class TopkTables:
    """One step's remap tables on `device`, from its plan:

      req_id  i32[T]     the request of every query row
      causal  i32[T]     global causal length of every query row (its position + 1)
      base    i32[D * R] the first workspace row of each (rank, request) shard: o * P + starts[o, r]
    """

    def __init__(self, plan: StepPlan, device: torch.device):
        self.layout, self.num_tokens, self.num_reqs = plan.layout, plan.num_tokens, plan.num_reqs
        d = plan.layout.world_size
        base = np.arange(d, dtype=np.int64)[:, None] * plan.padded_tokens + plan.rank_req_starts
        host = torch.from_numpy(np.concatenate([plan.req_id_per_token, plan.causal_lens(),
                                                base.ravel()]).astype(np.int32))
        if device.type == "cuda":
            # pinned, so the copy is asynchronous (torch's host allocator keeps the pinned block
            # until the copy has run)
            host = host.pin_memory().to(device, non_blocking=True)
        t = self.num_tokens
        self.req_id, self.causal, self.base = host.split([t, t, d * self.num_reqs])
        self.device = host.device


def remap_topk(topk: torch.Tensor, tables: TopkTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k i32[T, K] (positions within each query row's request, -1 = none) ->
    (indices i32[T, K], counts i32[T]): the workspace rows of the valid entries compacted to the
    front of each row in their order, -1 after; valid as `full_ckv.remap_topk` defines it
    (0 <= pos < the row's causal length, and its local index inside its owner's local length)."""
    if not isinstance(topk, torch.Tensor):
        raise TypeError(f"topk: expected a torch.Tensor, got {type(topk).__name__}")
    if topk.dtype != torch.int32 or topk.dim() != 2 or topk.shape[0] != tables.num_tokens:
        raise ValueError(f"topk: expected int32[{tables.num_tokens}, K] (one row per query token), "
                         f"got {topk.dtype}{list(topk.shape)}")
    if topk.device != tables.device:
        raise ValueError(f"topk: on {topk.device}, expected {tables.device} (the adapter's device)")
    layout, d = tables.layout, tables.layout.world_size
    # floor division and modulo: any entry, negative or past the request, maps to an owner in
    # [0, D) and so to a cell inside the tables; the mask below drops it
    if layout.interleave == 1:
        owner, local = topk % d, topk // d
    else:
        owner = topk // layout.interleave % d
        local = topk // layout.span * layout.interleave + topk % layout.interleave
    # valid needs no check of the owner's local length: pos < causal <= the request's length,
    # and a rank's local indices number the positions it owns below that length in order
    valid = (topk >= 0) & (topk < tables.causal[:, None])
    cells = tables.req_id[:, None] if d == 1 else owner * tables.num_reqs + tables.req_id[:, None]
    rows = torch.where(valid, tables.base[cells] + local, -1)
    # valid entries to the front of each row in their order, the -1s after them (a stable sort)
    order = torch.argsort(valid, dim=1, descending=True, stable=True)
    return rows.gather(1, order), valid.sum(dim=1, dtype=torch.int32)
