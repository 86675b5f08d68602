"""The attention output before the output projection: the two dense layouts an MLA attention
kernel may leave, compacted to the token-major matrix the projection multiplies.

Upstream's bug fix: a kernel wrote its output head-major into a capacity-sized buffer while the
projection assumed a compact token-major one, and read other tokens' heads.  Accepted here:

  token-major  out[t, h, :] at t * pitch_t + h * Dv        pitch_t >= H * Dv (compact: ==)
  head-major   out[t, h, :] at h * pitch_h + t * Dv        pitch_h >= T * Dv (compact: ==)

as a [T, H, Dv] tensor with unit stride on the last axis; anything else (overlapping heads,
strided values) is an error, never a silent misread.
"""
from __future__ import annotations

import torch


def attention_layout(out: torch.Tensor, num_tokens: int, num_heads: int, head_dim: int) -> str:
    """'token-major' or 'head-major' for an accepted [T, H, Dv] view; ValueError otherwise."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    want = (num_tokens, num_heads, head_dim)
    if tuple(out.shape) != want:
        raise ValueError(f"out: expected shape [T, H, Dv] = {list(want)}, got {list(out.shape)}")
    s_t, s_h, s_d = out.stride()
    if s_d == 1 and s_h == head_dim and s_t >= num_heads * head_dim:
        return "token-major"
    if s_d == 1 and s_t == head_dim and s_h >= num_tokens * head_dim:
        return "head-major"
    raise ValueError(f"out: strides {out.stride()} are neither token-major (Dv, >= H * Dv = {num_heads * head_dim}) "
                     f"nor head-major (>= T * Dv = {num_tokens * head_dim}, Dv) with Dv = {head_dim}")


def compact_attention_output(out: torch.Tensor, num_tokens: int, num_heads: int, head_dim: int) -> torch.Tensor:
    """[T, H * Dv] token-major and compact: a view when `out` already is, else one copy."""
    attention_layout(out, num_tokens, num_heads, head_dim)
    if out.is_contiguous():
        return out.view(num_tokens, num_heads * head_dim)
    return out.contiguous().view(num_tokens, num_heads * head_dim)
