"""A step's arrays (`dcp_step.StepArrays`) in torch memory that stays where it is from step to
step: one int32 buffer on the GPU, its views imported into JAX once, refreshed each step by one
copy from pinned memory on torch's current stream.

Two things follow from the memory staying put.  XLA replays a program it recorded as a CUDA
graph only while every buffer the program reads is where it was (the step program's other
inputs, the caches, ring slots, chunk buffers and flags, already are), and the host's part of a
step is one pinned copy instead of a transfer per array (`jax.device_put`).  The price is an
ordering rule: the copy overwrites what the last step's programs read, so torch's stream must
already wait for them (the adapter's `begin_step` drains JAX's stream first), and the step's
programs must wait for torch's stream after the copy.
"""
from __future__ import annotations

import jax
import numpy as np
import torch

from ckv_jax import dcp_step, placement
from interop import bridge

# each array starts on a 256-byte boundary of the buffer (bridge.to_jax asks for 32; CUDA
# allocations give 256)
_ALIGN_WORDS = 64


class ResidentStepArrays:
    """`refresh(host)` copies a step's host arrays into the buffer kept for their shapes and
    returns them as JAX arrays replicated on `mesh`: the same memory every step of those shapes.
    A buffer is kept for each of the last `shapes_kept` sets of shapes (steps of a few shape
    buckets take turns without moving), the oldest dropped for a new one."""

    def __init__(self, mesh: jax.sharding.Mesh, jax_device, torch_device: torch.device, *, shapes_kept: int = 8):
        self.mesh, self._jax_device, self._torch_device = mesh, jax_device, torch_device
        self.shapes_kept = shapes_kept
        # shapes -> (int32[words] buffer on the device, each array's first word, the JAX views)
        self._buffers: dict[tuple, tuple[torch.Tensor, list[int], list[jax.Array]]] = {}

    def refresh(self, host: dcp_step.StepArrays) -> dcp_step.StepArrays:
        """host: the step's numpy arrays (`dcp_step.host_step_arrays`).  The copy runs on torch's
        current stream, which must be past every program that read the last step's arrays.  The
        arrays returned are views of the buffer, for programs to read: a host read of one (e.g.
        np.asarray) would keep the values it saw, which the next refresh overwrites."""
        leaves, treedef = jax.tree_util.tree_flatten(host)
        for leaf in leaves:
            if not (isinstance(leaf, np.ndarray) and leaf.dtype == np.int32):
                raise TypeError(f"host: expected numpy int32 arrays (dcp_step.host_step_arrays), got "
                                f"{type(leaf).__name__} {getattr(leaf, 'dtype', '')}")
        shapes = tuple(leaf.shape for leaf in leaves)
        held = self._buffers.pop(shapes, None) or self._allocate(shapes)
        self._buffers[shapes] = held                      # (the most recent last)
        while len(self._buffers) > self.shapes_kept:
            del self._buffers[next(iter(self._buffers))]
        buffer, offsets, views = held
        # pinned, so the copy does not wait for the host; torch's host allocator keeps the block
        # until the copy has run, so the next step's fill never overwrites one still queued
        staging = torch.empty(buffer.shape, dtype=torch.int32, pin_memory=self._torch_device.type == "cuda")
        words = staging.numpy()
        for leaf, offset in zip(leaves, offsets):
            words[offset:offset + leaf.size] = leaf.ravel()
        buffer.copy_(staging, non_blocking=True)
        return jax.tree_util.tree_unflatten(treedef, views)

    def _allocate(self, shapes):
        offsets, words = [], 0
        for shape in shapes:
            offsets.append(words)
            words += -(-max(int(np.prod(shape)), 1) // _ALIGN_WORDS) * _ALIGN_WORDS
        buffer = torch.zeros(words, dtype=torch.int32, device=self._torch_device)
        views = [placement.assemble_replicated(self.mesh, [bridge.to_jax(
            buffer[offset:offset + int(np.prod(shape))].view(shape), name="step arrays", device=self._jax_device)])
            for offset, shape in zip(offsets, shapes)]
        return buffer, offsets, views
