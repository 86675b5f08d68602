"""JAX's GPU memory inside a torch engine's process.

JAX preallocates 75% of GPU memory when its backend starts, which collides with an engine that
plans its own KV cache from the free memory.  `configure_jax_memory` must run before anything
starts a JAX backend (before the first `jax.devices()` or array); the prefetch pool the adapter
will allocate is known from the configuration alone (`planned_pool_bytes`) so the engine can
subtract it before it sizes its KV cache.
"""
from __future__ import annotations

import os

from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch_config import GatherConfig, memory_plan


def _backends_started() -> bool:
    from jax._src import xla_bridge        # no public query exists; this one is stable since jax 0.4
    return bool(xla_bridge.backends_are_initialized())


def configure_jax_memory(*, preallocate: bool = False, fraction: float | None = None) -> dict:
    """Set JAX's allocator for sharing a GPU with torch: no preallocation (default) or a fixed
    fraction.  Raises RuntimeError once a JAX backend has started (the settings would be ignored).
    Returns the environment settings it made."""
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction: expected a value in (0, 1], got {fraction}")
    if _backends_started():
        raise RuntimeError("configure_jax_memory: a JAX backend is already running; call it before the first "
                           "use of JAX in the process (before jax.devices() or any array)")
    settings = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true" if preallocate else "false"}
    if fraction is not None:
        settings["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"    # both spellings: renamed upstream
        settings["XLA_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
    os.environ.update(settings)
    return settings


def planned_pool_bytes(*, world_size: int, format: str, max_num_seqs: int, config: GatherConfig,
                       interleave: int = 1, block_size: int = 64, ubatches: int = 1,
                       speculative: bool = False) -> int:
    """Bytes of the prefetch pool `TorchCkvAdapter` will allocate on each GPU with these settings."""
    layout = DcpLayout(world_size, interleave, block_size)
    return memory_plan(layout, formats.get(format), max_num_seqs=max_num_seqs, config=config,
                       ubatches=ubatches, speculative=speculative).total_bytes
