"""Zero-copy torch <-> JAX over DLPack, with the host checks a kernel library owes its callers.

`to_jax` refuses what DLPack would silently copy or what the kernels cannot take: a tensor on
another device, a non-compact view (an error in JAX anyway), a pointer not 32-byte aligned
(Pallas Triton marks every pointer `tt.divisibility=32`; on the CPU, JAX would copy it), a dtype
outside the allow-list, int64 (JAX would truncate it to a new int32 buffer: convert explicitly with
`int32_indices`), tensors that require grad.  After the import it checks that JAX's buffer is
torch's memory, so a version that starts copying fails loudly instead of racing.

Ordering (CUDA).  DLPack orders an import after the work on torch's *current* stream at that
moment, and an export (`to_torch`) makes torch's current stream wait for the JAX array.  So:
a JAX computation is ordered after torch's writes when one of its inputs was imported after
them, and torch's later writes are ordered after the JAX reads when torch
first imports an output of that computation.  Writes made on another torch stream must be joined
into the current stream first (`join_stream`).

Under `torch.cuda` graph capture every entry raises `CudaGraphCaptureError` (JAX launches on its
own streams cannot be captured), so an engine can fall back to its stock path.
"""
from __future__ import annotations

import functools

import jax
import torch


# dtypes that cross as themselves; fp4 never crosses (torch packs two per byte): move records as uint8
ALLOWED_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.bfloat16, torch.float16, torch.float32,
                  torch.float8_e4m3fn)
ALIGNMENT = 32
CPU_ALIGNMENT = 64       # JAX's CPU backend imports a less aligned buffer as a copy (XLA CPU's minimum)


class CudaGraphCaptureError(RuntimeError):
    """Raised by every bridge entry while torch captures a CUDA graph on the current stream."""


def dtype_names(dtypes) -> list[str]:
    """torch dtypes as error messages name them ("bfloat16", not "torch.bfloat16")."""
    return [str(d).replace("torch.", "") for d in dtypes]


def check_not_capturing(what: str, cuda_initialized: bool = False):
    """Raise if torch's current stream is capturing a CUDA graph.  cuda_initialized: the caller
    holds CUDA objects (so CUDA is initialized) and the check asks only the capture state."""
    # a capture needs CUDA initialized; is_initialized is the cheap test (is_available asks NVML)
    if (cuda_initialized or torch.cuda.is_initialized()) and torch.cuda.is_current_stream_capturing():
        raise CudaGraphCaptureError(f"{what}: ckv-jax runs JAX work on JAX's own streams, which a torch CUDA "
                                    "graph cannot capture; run this step eagerly or take the stock path")


def jax_device_of(tensor: torch.Tensor):
    """The JAX device holding `tensor`'s memory (for the bridge's device check)."""
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        return _jax_gpu(index)
    if tensor.device.type == "cpu":
        return jax.local_devices(backend="cpu")[0]
    raise ValueError(f"tensor on {tensor.device}: expected a CUDA or CPU tensor")


@functools.lru_cache(maxsize=None)
def _jax_gpu(index: int):
    """JAX's local GPU of CUDA ordinal `index` (looked up once: the torch adapter asks per layer)."""
    devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    for d in devices:
        if d.local_hardware_id == index:
            return d
    raise ValueError(f"tensor on cuda:{index}, but JAX has no local GPU with that id "
                     f"(JAX GPUs: {[d.local_hardware_id for d in devices]})")


def check_tensor(name: str, tensor, device=None):
    """Host checks of `tensor` before an import (no sync).  `device`: the JAX device it must be on."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.int64:
        raise TypeError(f"{name}: int64 would be truncated to int32 by JAX (with a copy); pass int32, "
                        f"e.g. interop.int32_indices({name})")
    if tensor.dtype not in ALLOWED_DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} does not cross zero-copy; expected one of "
                        f"{dtype_names(ALLOWED_DTYPES)} (move fp4 records as uint8)")
    if tensor.requires_grad:
        raise ValueError(f"{name}: requires grad; pass tensor.detach()")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: a non-compact view (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
                         "ckv-jax does not copy: pass a contiguous tensor")
    if tensor.numel() and tensor.data_ptr() % ALIGNMENT:
        raise ValueError(f"{name}: data pointer 0x{tensor.data_ptr():x} is not {ALIGNMENT}-byte aligned "
                         f"(offset {tensor.data_ptr() % ALIGNMENT}); the kernels assume {ALIGNMENT}-byte alignment")
    if tensor.numel() and tensor.device.type == "cpu" and tensor.data_ptr() % CPU_ALIGNMENT:
        raise ValueError(f"{name}: data pointer 0x{tensor.data_ptr():x} is not {CPU_ALIGNMENT}-byte aligned "
                         f"(offset {tensor.data_ptr() % CPU_ALIGNMENT}); JAX's CPU backend would import a copy "
                         "(torch's own CPU allocations are aligned; numpy's need not be)")
    if device is not None and jax_device_of(tensor) != device:
        raise ValueError(f"{name}: on {tensor.device}, expected the device of JAX's {device}")


def to_jax(tensor: torch.Tensor, *, name: str = "tensor", device=None) -> jax.Array:
    """The same memory as a single-device jax.Array (checked: no copy).  Not a value: JAX must
    never cache it on the host; pass it only as a jit argument."""
    check_not_capturing(name)
    check_tensor(name, tensor, device)
    array = jax.dlpack.from_dlpack(tensor)
    if tensor.numel() and array.unsafe_buffer_pointer() != tensor.data_ptr():
        raise RuntimeError(f"{name}: JAX imported a copy of the tensor instead of its memory; this torch/jax "
                           "pair does not share it zero-copy")
    return array


def to_torch(array: jax.Array, *, name: str = "array") -> torch.Tensor:
    """A torch view of a single-device jax.Array (checked: no copy).  On CUDA, torch's current
    stream waits for the array, which orders torch's later work after the JAX computation."""
    check_not_capturing(name)
    if len(array.devices()) != 1:
        raise ValueError(f"{name}: expected a single-device array, got one on {len(array.devices())} devices "
                         "(pass array.addressable_shards[i].data)")
    tensor = torch.from_dlpack(array)
    if array.size and tensor.data_ptr() != array.unsafe_buffer_pointer():
        raise RuntimeError(f"{name}: torch imported a copy of the JAX array")
    return tensor


def int32_indices(tensor: torch.Tensor, *, name: str = "indices") -> torch.Tensor:
    """An explicit int32 copy of an int64 index tensor (vLLM's slot_mapping, positions), after
    checking every value fits; any other dtype but int32 is rejected.  This one is a copy, by
    request: it runs on torch's stream (and syncs once for the range check)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.int32:
        return tensor
    if tensor.dtype != torch.int64:
        raise TypeError(f"{name}: expected int32 or int64 indices, got {tensor.dtype}")
    if tensor.numel():
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo < -2 ** 31 or hi >= 2 ** 31:
            raise ValueError(f"{name}: values in [{lo}, {hi}] do not fit int32")
    return tensor.to(torch.int32).contiguous()


def join_stream(device: torch.device, after: torch.cuda.Event | torch.cuda.Stream | None):
    """Make torch's current stream of `device` wait for `after` (an event or stream of writes made
    elsewhere), so the next import orders JAX's work after them too."""
    if after is None:
        return
    if device.type != "cuda":
        raise ValueError("after: an event or stream only applies to CUDA tensors")
    stream = torch.cuda.current_stream(device)
    if isinstance(after, torch.cuda.Event):
        stream.wait_event(after)
    elif isinstance(after, torch.cuda.Stream):
        stream.wait_stream(after)
    else:
        raise TypeError(f"after: expected a torch.cuda.Event or torch.cuda.Stream, got {type(after).__name__}")
