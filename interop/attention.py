"""Sparse-MLA attention for torch engines: `ckv_jax.sparse_mla_attention` over torch tensors.

A torch engine that gathers with `TorchCkvAdapter` attends over the returned workspace (or a
paged cache viewed flat, slots as indices) without leaving torch: q, the records, indices and
counts cross to JAX through the bridge (each import checked zero-copy; on CUDA the import orders
JAX's work after torch's current stream) and out, lse come back as torch views of JAX's results
(torch's current stream waits for them).  Each imported tensor stays alive, through its DLPack
capsule, until JAX has released the buffer, so a caller may drop its references at once.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ckv_jax import formats
from ckv_jax import sparse_mla
from interop import bridge, step_runner


def sparse_mla_attention(q: torch.Tensor, records: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor,
                         sm_scale: float, *, format: str | formats.RecordFormat,
                         implementation: str | Sequence[str] | None = None,
                         interpret: bool = False, keys: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """`ckv_jax.sparse_mla_attention` for torch tensors on one device (CUDA or CPU).

    Args:
      q: bf16|f16|f32[T, H, 576]; records: u8[N, R] of `format` (e.g. `adapter.gather(...)[:adapter.rows]`);
      indices: i32[T, K] rows of `records` (-1 or any row outside [0, N): a hole); counts: i32[T];
      sm_scale: positive and finite.
      implementation, interpret, keys: as for `ckv_jax.sparse_mla_attention` (None: the kernel on
        a GPU, XLA elsewhere; keys "exact" or "bf16").
    Returns:
      out bf16[T, H, 512], lse f32[T, H]: torch tensors on the inputs' device, in JAX's memory.
    """
    bridge.check_not_capturing("sparse_mla_attention")
    if isinstance(records, torch.Tensor) and records.device.type == "cuda":
        step_runner.check_no_open_step("sparse_mla_attention", records.device.index)
    table = bridge.to_jax(records, name="records")          # every other input must be on its device
    device = bridge.jax_device_of(records)
    q, indices, counts = (bridge.to_jax(tensor, name=name, device=device)
                          for name, tensor in (("q", q), ("indices", indices), ("counts", counts)))
    out, lse = sparse_mla.sparse_mla_attention(q, table, indices, counts, sm_scale, format=format,
                                               implementation=implementation, interpret=interpret, keys=keys)
    return bridge.to_torch(out, name="out"), bridge.to_torch(lse, name="lse")
