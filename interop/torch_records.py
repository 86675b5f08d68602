"""fp8_ds_mla and bf16 records in torch, for torch engines that write their own paged caches.

The same bytes as `pallas_kernels.record_codec` (and upstream's writer) for finite inputs:
`scale_t = max(amax_t / 448, FLT_MIN)` per 128-element tile, `e4m3fn(x / scale_t)` with IEEE
division and round-to-nearest-even (torch's cast), float32 scales and bf16 RoPE bit-copied,
little-endian.  nvfp4_ds_mla is not provided in torch (write it through ckv-jax).
"""
from __future__ import annotations

import numpy as np
import torch

from ckv_jax import formats

FP8_MAX = 448.0


def _layout(format):
    fmt = formats.get(format)
    if fmt.layout.kind not in ("fp8_tiles", "bf16"):
        raise ValueError(f"format: torch records cover fp8_ds_mla and bf16, got {fmt.name}")
    return fmt


def encode(format, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """kv_c [T, 512] (bf16/f16/f32), k_pe bf16[T, 64] -> uint8[T, record_bytes]."""
    fmt = _layout(format)
    lay = fmt.layout
    t = kv_c.shape[0]
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, 2 * lay.rope_dim)
    if lay.kind == "bf16":
        nope = kv_c.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, 2 * lay.nope_dim)
        return torch.cat([nope, rope], dim=1)
    x = kv_c.float().reshape(t, lay.num_blocks, lay.quant_block)
    amax = torch.nan_to_num(x, nan=0.0).abs().amax(dim=-1)
    # a tensor divisor, not a Python number: torch on CUDA turns division by a scalar into a
    # multiplication by its reciprocal, which is off by an ulp from IEEE division
    scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=torch.finfo(torch.float32).tiny)
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    nope = q.view(torch.uint8).reshape(t, lay.nope_dim)
    return torch.cat([nope, scale.contiguous().view(torch.uint8).reshape(t, 4 * lay.num_blocks), rope], dim=1)


def write(cache: torch.Tensor, records: torch.Tensor, slot_mapping):
    """cache u8[num_blocks, block_size, R] in place: records[t] -> flat slot slot_mapping[t],
    negative slots (other ranks' tokens, padding) skipped.

    slot_mapping: host int[T] (numpy or a CPU tensor, as a step's metadata is built): the
    negative entries are dropped on the host, so the write never synchronizes with the GPU (a
    boolean mask on a device tensor would).
    """
    if isinstance(slot_mapping, torch.Tensor):
        if slot_mapping.device.type != "cpu":
            raise ValueError(f"slot_mapping: expected host slots (numpy or a CPU tensor), got a tensor on "
                             f"{slot_mapping.device}; masking it on the device would synchronize")
        slot_mapping = slot_mapping.numpy()
    slots = np.asarray(slot_mapping)
    keep = np.flatnonzero(slots >= 0)
    rows = torch.from_numpy(keep).to(records.device, non_blocking=True)
    dest = torch.from_numpy(slots[keep].astype(np.int64)).to(records.device, non_blocking=True)
    cache.view(-1, cache.shape[-1]).index_copy_(0, dest, records.index_select(0, rows))


def decode(format, records: torch.Tensor) -> torch.Tensor:
    """uint8[N, R] -> float32[N, 576] (NoPE values then RoPE)."""
    fmt = _layout(format)
    lay = fmt.layout
    n = records.shape[0]
    rope = records[:, -2 * lay.rope_dim:].contiguous().view(torch.bfloat16).float()
    if lay.kind == "bf16":
        return torch.cat([records[:, :2 * lay.nope_dim].contiguous().view(torch.bfloat16).float(), rope], dim=1)
    q = records[:, :lay.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = records[:, lay.nope_dim:lay.nope_dim + 4 * lay.num_blocks].contiguous().view(torch.float32)
    nope = (q.reshape(n, lay.num_blocks, lay.quant_block) * scale[..., None]).reshape(n, lay.nope_dim)
    return torch.cat([nope, rope], dim=1)
