"""The native forms of the in-program stream hooks (`native/stream_signal.cc`): a layer program's
signal (an event recorded where its workspace is ready), and a step program's signal and flag
wait (a program queued ahead waits for a word torch writes), which XLA may record into a CUDA
graph and replay.  XLA FFI handlers, built on first use with the host's C++ compiler against the
installed jaxlib's FFI headers (`jax.ffi.include_dir()`, so they always match the running XLA),
cached on disk, and registered with JAX.  The handlers run in native
code where the Python `buffer_callback` costs each layer's dispatch a Python call
(BENCHMARKS.md, ninth session: 19-27 us traced, 44 us alone).

`load()` returns the `Library` or None with the reason (no compiler, a failed build or
registration); the caller then keeps the Python callback and logs why.  Nothing here needs CUDA
at build time: the handlers take the driver's functions as addresses.

The cache directory is `$CKV_JAX_CACHE_DIR` or `~/.cache/ckv_jax`; one library per source,
FFI headers and compiler, built into a temporary file and renamed, so concurrent processes
(one per GPU) never load a half-written one.
"""
from __future__ import annotations

import array
import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import numpy as np

SOURCE = Path(__file__).with_name("native") / "stream_signal.cc"
GPU_TARGET, HOST_TARGET = "ckv_stream_signal", "ckv_host_signal"
GPU_WAIT_TARGET, HOST_WAIT_TARGET = "ckv_stream_wait_flag", "ckv_host_wait_flag"
GPU_STEP_SIGNAL, HOST_STEP_SIGNAL = "ckv_stream_step_signal", "ckv_host_step_signal"
# a step hook's stream word (its `state[1]`) where it ran under a capture (XLA recording the program)
CAPTURING = 1
# cuStreamWaitValue32 / cuStreamWriteValue32(stream, device address, value, flags) as a ctypes
# function type, to call `flag_functions`' addresses from Python
STREAM_VALUE_OP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)


@dataclasses.dataclass(frozen=True)
class Library:
    path: Path
    handle: ctypes.CDLL


@dataclasses.dataclass(frozen=True)
class Loaded:
    library: Library | None
    why: str                   # why it is missing ("" when loaded)


def cache_dir() -> Path:
    return Path(os.environ.get("CKV_JAX_CACHE_DIR") or Path.home() / ".cache" / "ckv_jax")


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


@functools.cache
def load() -> Loaded:
    """The library, built if needed and registered for CUDA and the CPU, once per process."""
    cxx = compiler()
    if cxx is None:
        return Loaded(None, "no C++ compiler ($CXX, c++ or g++) to build the native stream signal")
    include = jax.ffi.include_dir()
    headers = b"".join((Path(include) / "xla" / "ffi" / "api" / name).read_bytes()
                       for name in ("c_api.h", "api.h", "ffi.h"))
    key = hashlib.sha256(SOURCE.read_bytes() + headers + cxx.encode()).hexdigest()[:16]
    path = cache_dir() / "native" / key / "libckv_stream_signal.so"
    try:
        if not path.exists():
            _build(cxx, include, path)
        handle = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(GPU_TARGET, jax.ffi.pycapsule(handle.CkvStreamSignal), platform="CUDA")
        jax.ffi.register_ffi_target(HOST_TARGET, jax.ffi.pycapsule(handle.CkvHostSignal), platform="cpu")
        jax.ffi.register_ffi_target(GPU_WAIT_TARGET, jax.ffi.pycapsule(handle.CkvStreamWaitFlag), platform="CUDA")
        jax.ffi.register_ffi_target(HOST_WAIT_TARGET, jax.ffi.pycapsule(handle.CkvHostWaitFlag), platform="cpu")
        jax.ffi.register_ffi_target(GPU_STEP_SIGNAL, jax.ffi.pycapsule(handle.CkvStreamStepSignal), platform="CUDA")
        jax.ffi.register_ffi_target(HOST_STEP_SIGNAL, jax.ffi.pycapsule(handle.CkvHostStepSignal), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError, ValueError, RuntimeError) as e:
        detail = getattr(e, "stderr", "") or ""
        return Loaded(None, f"native stream signal unavailable: {type(e).__name__}: {e} {detail[-2000:]}".rstrip())
    return Loaded(Library(path, handle), "")


def _build(cxx: str, include: str, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so.tmp", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        # -isystem: the FFI headers' own warnings are not ours
        subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-isystem", include, str(SOURCE), "-o",
                        str(partial)], check=True, capture_output=True, text=True)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def new_state() -> array.array:
    """The host words a signal's handler updates: (calls, last stream handle), uint64 each."""
    return array.array("Q", [0, 0])


def _check_state(state):
    if not isinstance(state, array.array) or state.typecode != "Q" or len(state) != 2:
        raise TypeError(f"state: expected new_state() (array.array('Q') of 2 words), got {state!r}")


def _aliased_call(target: str, arrays: tuple, attrs: dict) -> tuple:
    """`arrays` through the custom call `target` with `attrs` (u64 each), every operand aliased to
    its result."""
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    return tuple(jax.ffi.ffi_call(target, shapes, input_output_aliases={i: i for i in range(len(arrays))})(
        *arrays, **{k: np.uint64(v) for k, v in attrs.items()}))


def call(arrays: tuple, *, platform: str, record_fn: int, wait_fn: int, ready_event: int, then_wait: int,
         state: array.array) -> tuple:
    """`arrays`, unchanged, through the layer program's native signal (see the comment atop the
    C++ file): on a GPU it records `ready_event` on the program's stream there, then (when
    `then_wait` is not 0) makes the stream wait on that event; elsewhere it only counts.  state:
    `new_state()`, which the handler updates; it must outlive every program that calls it (and
    never be resized).
    The operands are aliased to the results (no copy of a buffer the program owns)."""
    _check_state(state)
    return _aliased_call(GPU_TARGET if platform == "gpu" else HOST_TARGET, arrays,
                         dict(record_fn=record_fn, wait_fn=wait_fn, ready_event=ready_event, then_wait=then_wait,
                              state=state.buffer_info()[0]))


def step_signal(arrays: tuple, *, platform: str, record_fn: int, capturing_fn: int, ready_event: int,
                state: array.array) -> tuple:
    """`arrays`, unchanged, through a step program's signal (see the C++ file): on a GPU it
    records `ready_event` on the program's stream, as an external event node where XLA records
    the program into a command buffer; elsewhere it only counts.  record_fn, capturing_fn:
    cuEventRecordWithFlags and cuStreamIsCapturing (`capture_functions`).  state: as for `call`;
    it counts executions and recordings, not replays, and its stream word is `CAPTURING` for a
    recording."""
    _check_state(state)
    return _aliased_call(GPU_STEP_SIGNAL if platform == "gpu" else HOST_STEP_SIGNAL, arrays,
                         dict(record_fn=record_fn, capturing_fn=capturing_fn, ready_event=ready_event,
                              state=state.buffer_info()[0]))


def wait_flag(arrays: tuple, *, platform: str, wait_fn: int, capturing_fn: int, flag: int,
              state: array.array) -> tuple:
    """`arrays`, unchanged, through a step program's flag wait (see the C++ file): on a GPU the
    program's stream waits until the u32 at device address `flag` is 1 (and leaves it at 1: the
    caller zeroes the flags before the next step); elsewhere it only counts.  Nothing is read
    from the host while the program is enqueued, so a command buffer recorded once replays it.
    wait_fn: `flag_functions`' first; capturing_fn: as for `step_signal`.  state: as for
    `step_signal`.  The operands are aliased to the results."""
    _check_state(state)
    return _aliased_call(GPU_WAIT_TARGET if platform == "gpu" else HOST_WAIT_TARGET, arrays,
                         dict(wait_fn=wait_fn, capturing_fn=capturing_fn, flag=flag,
                              state=state.buffer_info()[0]))


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver, libcuda.so.1: the one driver every CUDA runtime in the process uses."""
    return ctypes.CDLL("libcuda.so.1")


def _driver_function(name: str, argtypes: tuple, *, v2: bool = False):
    """The driver's function `name` (with `v2`, its _v2 form where the driver exports one) as a
    ctypes function of `argtypes` returning its CUresult."""
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(_driver_addresses((name,), v2=v2)[0])


def _driver_addresses(names: tuple, *, v2: bool = False) -> tuple:
    """The addresses of the CUDA driver's functions `names`; with `v2`, each in its _v2 form
    where the driver exports one."""
    cuda = driver()
    found = []
    for name in names:
        fn = (v2 and getattr(cuda, name + "_v2", None)) or getattr(cuda, name, None)
        if fn is None:
            raise RuntimeError(f"libcuda exports neither {name}_v2 nor {name}" if v2 else f"libcuda exports no {name}")
        found.append(ctypes.cast(fn, ctypes.c_void_p).value)
    return tuple(found)


def flag_functions() -> tuple[int, int]:
    """The addresses of the CUDA driver's cuStreamWaitValue32 and cuStreamWriteValue32, in their
    _v2 forms where the driver exports them (the stream memory operations' v1 entry points may
    be disabled)."""
    return _driver_addresses(("cuStreamWaitValue32", "cuStreamWriteValue32"), v2=True)


def memset_d32():
    """The CUDA driver's cuMemsetD32Async(device address, value, count, stream) as a ctypes function."""
    return _driver_function("cuMemsetD32Async", (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p))


def check_result(rc: int, what: str):
    """Raise where a driver call `what` returned a CUresult other than CUDA_SUCCESS."""
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def memcpy_dtod():
    """The CUDA driver's cuMemcpyDtoDAsync(destination, source, bytes, stream) (its _v2 form, of
    64-bit device addresses) as a ctypes function."""
    return _driver_function("cuMemcpyDtoDAsync", (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p),
                            v2=True)


def event_functions():
    """The CUDA driver's cuEventRecord(event, stream) and cuStreamWaitEvent(stream, event, flags)
    as ctypes functions, for calls from Python on raw handles (the runtime's)."""
    return (_driver_function("cuEventRecord", (ctypes.c_void_p, ctypes.c_void_p)),
            _driver_function("cuStreamWaitEvent", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)))


def driver_functions() -> tuple[int, int]:
    """The addresses of the CUDA driver's cuEventRecord and cuStreamWaitEvent (their event and
    stream handles are the runtime's)."""
    return _driver_addresses(("cuEventRecord", "cuStreamWaitEvent"))


def capture_functions() -> tuple[int, int]:
    """The addresses of the CUDA driver's cuEventRecordWithFlags and cuStreamIsCapturing (the
    step hooks')."""
    return _driver_addresses(("cuEventRecordWithFlags", "cuStreamIsCapturing"))


def module_loading_mode() -> str:
    """How the CUDA driver of this process loads kernels: "eager" (each module's kernels when the
    module is loaded) or "lazy" (a kernel at its first launch, which synchronizes the device:
    `CUDA_MODULE_LOADING`, read once when the driver initializes)."""
    mode = ctypes.c_int()
    check_result(_driver_function("cuModuleGetLoadingMode", (ctypes.POINTER(ctypes.c_int),))(ctypes.byref(mode)),
                 "cuModuleGetLoadingMode")
    return {1: "eager", 2: "lazy"}.get(mode.value, f"unknown ({mode.value})")


def make_context_current(index: int):
    """Make GPU `index`'s primary context (torch's and JAX's) current on this thread: a thread
    that made no CUDA call has none, and the driver's calls fail there (CUDA_ERROR_INVALID_CONTEXT)."""
    cuda = driver()
    current = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    # each call only after the one before succeeded: a failed lookup leaves its output unset
    for what, call in (("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), index)),
                       ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)),
                       ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(context))):
        check_result(call(), what)
