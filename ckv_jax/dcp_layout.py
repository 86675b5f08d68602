"""Decode-context-parallel (DCP) layout of a request's tokens across ranks.

D ranks share one block table per request; token position p (0-based within its request) lives
on rank `owner(p) = (p // I) % D` at local index `local(p) = (p // (D*I)) * I + p % I`, where I is
the interleave (`cp_kv_cache_interleave_size`).  A rank stores its local positions contiguously
through the shared block table: local index l sits in block `block_table[req, l // B]`, row
`l % B`, so one virtual block covers B * D global positions.

Every method is plain integer arithmetic and works on Python ints, numpy arrays and jax arrays.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    world_size: int
    interleave: int = 1
    block_size: int = 64

    def __post_init__(self):
        for name in ("world_size", "interleave", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.block_size % self.interleave:
            raise ValueError(f"interleave: expected a divisor of block_size={self.block_size}, "
                             f"got {self.interleave}")

    @property
    def span(self) -> int:
        """Global positions per round over all ranks (D * I)."""
        return self.world_size * self.interleave

    def owner(self, pos):
        if self.interleave == 1:          # (the same, in fewer array ops)
            return pos % self.world_size
        return (pos // self.interleave) % self.world_size

    def local_index(self, pos):
        if self.interleave == 1:
            return pos // self.world_size
        return (pos // self.span) * self.interleave + pos % self.interleave

    def global_index(self, rank, local):
        return (local // self.interleave) * self.span + rank * self.interleave + local % self.interleave

    def local_seq_lens(self, seq_lens, rank: int | None = None) -> np.ndarray:
        """Local lengths: int32[R] for one rank, int32[R, D] for all ranks (rank=None)."""
        seq_lens = np.asarray(seq_lens, np.int64)
        base = (seq_lens // self.span) * self.interleave
        rem = seq_lens - base * self.world_size
        ranks = np.arange(self.world_size) if rank is None else np.int64(rank)
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {rank}")
        lens = base[..., None] + np.clip(rem[..., None] - ranks * self.interleave, 0, self.interleave)
        return (lens if rank is None else lens[..., 0]).astype(np.int32)

    def slot_mapping(self, positions, req_ids, block_table, rank):
        """Slots of tokens on `rank` (-1 where another rank owns the token): i32[T], or with
        rank=None every rank's, i32[D, T] (one block lookup for all of them).

        positions: i32[T] global positions; req_ids: i32[T] request of each token;
        block_table: i32[R, max_blocks] shared by all ranks.  Works with numpy or jax arrays.
        """
        xp = _namespace(positions, block_table)
        virtual = self.block_size * self.world_size
        block_idx = positions // virtual
        offset_in_virtual = positions % virtual
        owner = (offset_in_virtual // self.interleave) % self.world_size
        offset = (offset_in_virtual // self.span) * self.interleave + offset_in_virtual % self.interleave
        block = block_table[req_ids, xp.minimum(block_idx, block_table.shape[1] - 1)]
        slots = block * self.block_size + offset
        if rank is None:
            ranks = xp.arange(self.world_size)[:, None]
            return xp.where(owner[None, :] == ranks, slots[None, :], -1).astype(xp.int32)
        return xp.where(owner == rank, slots, -1).astype(xp.int32)

    def blocks_needed(self, local_len):
        return -(-np.asarray(local_len) // self.block_size)


def _namespace(*arrays):
    for a in arrays:
        if type(a).__module__.startswith("jax"):
            import jax.numpy as jnp
            return jnp
    return np
