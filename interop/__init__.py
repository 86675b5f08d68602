"""Torch interop: a zero-copy DLPack bridge and `TorchCkvAdapter` for torch engines (vLLM-style).

Needs torch (`pip install 'ckv-jax[torch]'`); the core library never imports it.
"""
try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError("interop needs torch: pip install 'ckv-jax[torch]'", name="torch") from e
from interop.adapter import TorchCkvAdapter
from interop.attention import sparse_mla_attention
from interop.attention_layout import attention_layout, compact_attention_output
from interop.bridge import (ALIGNMENT, ALLOWED_DTYPES, CudaGraphCaptureError, check_not_capturing, int32_indices,
                            join_stream, to_jax, to_torch)
from interop.memory import configure_jax_memory, planned_pool_bytes

__all__ = ["ALIGNMENT", "ALLOWED_DTYPES", "CudaGraphCaptureError", "TorchCkvAdapter", "attention_layout",
           "check_not_capturing", "compact_attention_output", "configure_jax_memory", "int32_indices",
           "join_stream", "planned_pool_bytes", "sparse_mla_attention", "to_jax", "to_torch"]
