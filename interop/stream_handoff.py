"""Ordering torch and JAX on one CUDA GPU with events, through the semi-private entry points that
allow it.  This module is the only place that uses them; each is checked when it is first needed,
and a missing or changed one makes `probe` return None with the reason (the adapter then takes
the DLPack path and logs why), never a silently different order.

JAX runs every computation of a device on one compute stream (the PJRT GPU client), but has no
public handle of it: `Device.get_stream_for_external_ready_events()` is another stream, which
does not order JAX's kernels.  `jax.experimental.buffer_callback` hands its callback an
`ExecutionContext` whose `stream` is the compute stream the program runs on.  `probe` runs two
small programs with such a callback and accepts the handle only if

  * the jax version is one this module was checked against,
  * both programs report the same non-null stream (one compute stream per device), and
  * the callback ran on the dispatching thread, i.e. a program's kernels are enqueued before
    its dispatch returns, so an event recorded on the stream right after a dispatch follows the
    whole program (XLA joins its side streams back into the compute stream at the end).

With the handle, the per-layer ordering costs a few event records and waits (`StreamEvents`);
the event torch waits on is recorded from inside the layer's program (`StreamSignal`), so the
layer's work and its prefetches stay one dispatch.  The in-program signal is native code
(`interop.native_signal`, built on first use) where a C++ compiler is found, else the Python
callback (logged).
`storage_use_count` (torch) counts the views of a tensor's memory, so the adapter can refuse to
overwrite a ring slot that a caller still holds.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading

import jax
import jax.numpy as jnp
import torch

from interop import native_signal

log = logging.getLogger("ckv_jax.interop")

# the jax release line whose buffer_callback context and dispatch were checked on a GPU (0.11.2;
# the GPU tests pin both properties)
CHECKED_JAX = (0, 11)


def _version(text: str) -> tuple[int, ...]:
    """(major, minor, micro) from a version string; a suffix such as "rc1" is ignored."""
    return tuple(int(re.match(r"\d*", piece).group() or 0) for piece in text.split(".")[:3])


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    stream: int | None        # cudaStream_t of JAX's compute stream, None when unusable
    why: str                  # the reason it is unusable ("" otherwise)


_PROBED: dict = {}


def probe(device: jax.Device) -> ProbeResult:
    """JAX's compute stream of `device` (a GPU), found once per device and cached."""
    if device in _PROBED:
        return _PROBED[device]
    result = _probe(device)
    _PROBED[device] = result
    return result


def _probe(device: jax.Device) -> ProbeResult:
    if device.platform != "gpu":
        return ProbeResult(None, f"device {device} is not a GPU")
    if _version(jax.__version__)[:2] != CHECKED_JAX:
        return ProbeResult(None, f"jax {jax.__version__} is not of the release line whose compute-stream hand-off "
                                 f"was checked ({'.'.join(map(str, CHECKED_JAX))}.*)")
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as e:
        return ProbeResult(None, f"jax.experimental.buffer_callback unavailable: {e}")
    seen = []

    def record(ctx, out, x):
        seen.append((int(ctx.stream), threading.get_ident()))

    try:
        callback = buffer_callback(record, jax.ShapeDtypeStruct((1,), jnp.int32), input_output_aliases={0: 0})
        x = jax.device_put(jnp.zeros((1,), jnp.int32), device)
        jax.block_until_ready(jax.jit(lambda v: callback(v) + 1)(x))
        jax.block_until_ready(jax.jit(lambda v: callback(v * 2)[0])(x))
    except Exception as e:          # any failure of a semi-private API means: do not use it
        return ProbeResult(None, f"buffer_callback probe failed: {type(e).__name__}: {e}")
    streams = {s for s, _ in seen}
    if len(seen) != 2 or len(streams) != 1 or 0 in streams:
        return ProbeResult(None, f"buffer_callback reported streams {sorted(streams)} in {len(seen)} calls; "
                                 "expected one non-null compute stream")
    if any(thread != threading.get_ident() for _, thread in seen):
        return ProbeResult(None, "JAX enqueued a program on another thread (asynchronous dispatch): an event "
                                 "recorded after a dispatch would not follow the program")
    return ProbeResult(streams.pop(), "")


class StreamEvents:
    """Event ordering between torch's current stream and JAX's compute stream of one GPU.

    Three torch events: `_torch_done` (torch's stream at the last hand-off to JAX: cache writes,
    the chunk copy, reads of the slots a prefetch overwrites), `_latents_ready` (torch's stream
    when the engine declared the chunk's latents final, `mark_latents`) and `_jax_done`; and the
    in-program `signal`.  They are created (recorded once) here: the native signal bakes their
    handles into the layer program."""

    name = "cuda-events"

    def __init__(self, device: torch.device, jax_stream: int, *, native: bool = True):
        self.device = device
        self._index = device.index            # an int: torch looks it up faster than a device
        self.jax_stream = torch.cuda.ExternalStream(jax_stream, device=device)
        self._streams: dict = {}              # torch's current stream objects, by what identifies them
        self._read_stream = current_stream_reader(self._index)
        self._torch_done = torch.cuda.Event()
        self._latents_ready = torch.cuda.Event()
        self._jax_done = torch.cuda.Event()
        for event in (self._torch_done, self._latents_ready, self._jax_done):
            event.record(self.torch_stream())
        loaded = native_signal.load() if native else None
        if loaded is not None and loaded.library is not None:
            self._signal = NativeStreamSignal(self.jax_stream, jax_stream, then_wait=self._torch_done)
        else:
            if loaded is not None:
                log.warning("the layer program signals torch through a Python callback (about 20-40 us more host "
                            "time per layer): %s", loaded.why)
            self._signal = StreamSignal(self.jax_stream, jax_stream, then_wait=self._torch_done)

    def torch_stream(self) -> torch.cuda.Stream:
        """torch's current stream on this GPU.  `torch.cuda.current_stream` builds a new Stream
        object on every call; where `current_stream_reader` found torch's reader of the stream's
        identity, this keeps one object per stream instead (under cProfile 5 against 39 us a
        layer, which asks twice)."""
        if self._read_stream is None:
            return torch.cuda.current_stream(self._index)
        key = self._read_stream()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def mark_latents(self, torch_stream: torch.cuda.Stream):
        """The chunk's latents are final at this point of `torch_stream` (see `jax_after_torch`)."""
        self._latents_ready.record(torch_stream)

    def jax_after_torch(self, torch_stream: torch.cuda.Stream, *, latents_only: bool = False):
        """JAX work dispatched from now on runs after the work queued on `torch_stream` so far;
        with `latents_only`, only after the point `mark_latents` recorded.  That is for a program
        whose own work reads nothing but the latents (the patch of a prefetched slot), so it runs
        beside torch's cache write; what the program does after the signal (the prefetches, which
        overwrite slots torch may still be reading) waits for the full point inside the program
        (the signal's `then_wait`)."""
        self._torch_done.record(torch_stream)
        (self._latents_ready if latents_only else self._torch_done).wait(self.jax_stream)

    def torch_after_jax(self, torch_stream: torch.cuda.Stream):
        """Work queued on `torch_stream` from now on runs after the JAX work dispatched so far."""
        self._jax_done.record(self.jax_stream)
        self._jax_done.wait(torch_stream)

    @property
    def signal(self) -> "StreamSignal":
        """The in-program hook (`dcp_step.signal_when_ready`) whose event `torch_after_signal` waits on."""
        return self._signal

    def torch_after_signal(self, torch_stream: torch.cuda.Stream):
        """Work queued on `torch_stream` from now on runs after the point where the program
        dispatched last called `signal`; raises if it did not call it during its dispatch."""
        self._signal.take()
        self._signal.event.wait(torch_stream)


class StreamSignal:
    """Records its event on JAX's compute stream when a program calls it (through
    `dcp_step.signal_when_ready`, on the dispatching thread) and, called from a program, then
    makes that stream wait on `then_wait`.  Hashable by identity: a static argument of the layer
    program, one compiled program per adapter.  `take` checks that exactly one call happened
    since the last `take`, on the probed stream; anything else (an asynchronous dispatch,
    another stream) raises instead of letting torch wait on a stale event.

    This class is the Python form, which runs as a `buffer_callback`; `NativeStreamSignal` does
    the same in native code.  Both count in `state` (calls, last stream handle, host uint64[2])."""

    native = False

    def __init__(self, jax_stream: torch.cuda.ExternalStream, handle: int, *, then_wait: torch.cuda.Event):
        self.event = torch.cuda.Event()
        self.event.record(jax_stream)             # created now (its handle goes into programs)
        self._stream, self._handle = jax_stream, handle
        self._then_wait = then_wait
        self.state = native_signal.new_state()

    def __call__(self, stream):
        """From a program: `stream` is its stream.  From the host right after a dispatch (a call
        without prefetches): None, and the event marks the end of what JAX's stream holds."""
        if stream is not None and stream != self._handle:
            self.state[1] = stream
            return
        self.event.record(self._stream)
        if stream is not None:
            self._stream.wait_event(self._then_wait)
        self.state[0] += 1

    def take(self):
        calls, stream = self.state
        self.state[0] = self.state[1] = 0
        if stream not in (0, self._handle):
            raise RuntimeError(f"the layer program ran on stream {stream!r}, not on JAX's compute stream "
                               f"0x{self._handle:x} that the adapter orders against")
        if calls != 1:
            raise RuntimeError(f"the layer program signalled {calls} times during its dispatch, expected once: "
                               "JAX no longer enqueues a program on the dispatching thread")


class NativeStreamSignal(StreamSignal):
    """`StreamSignal` whose in-program form is `interop.native_signal`'s custom call: the event
    record and the wait run in native code while XLA enqueues the program (no Python call)."""

    native = True

    def __init__(self, jax_stream: torch.cuda.ExternalStream, handle: int, *, then_wait: torch.cuda.Event):
        super().__init__(jax_stream, handle, then_wait=then_wait)
        self._record_fn, self._wait_fn = native_signal.driver_functions()

    def in_program(self, arrays: tuple, *, platform: str) -> tuple:
        """`dcp_step.signal_when_ready`'s hook: `arrays` through the native signal."""
        return native_signal.call(arrays, platform=platform, record_fn=self._record_fn, wait_fn=self._wait_fn,
                                  ready_event=self.event.cuda_event, then_wait=self._then_wait.cuda_event,
                                  state=self.state)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """References to `storage` (a tensor's `untyped_storage()`) held by tensors and storage
    objects: every view of the memory counts one, and so does `storage` itself."""
    return torch._C._storage_Use_Count(storage._cdata)


def current_stream_reader(index: int):
    """A reader of torch's current stream on GPU `index` as (stream id, device index, device
    type), what `torch.cuda.current_stream` reads before it builds its Stream object (torch's
    private `_cuda_getCurrentStream`); None, with a debug log, when it is missing or disagrees
    with `torch.cuda.current_stream` (the caller then uses that)."""
    read = getattr(torch._C, "_cuda_getCurrentStream", None)
    try:
        key = None if read is None else tuple(read(index))
    except (RuntimeError, TypeError) as e:
        key = f"{type(e).__name__}: {e}"
    public = torch.cuda.current_stream(index)
    if key != (public.stream_id, public.device_index, public.device_type):
        log.debug("torch's current stream is read through torch.cuda.current_stream: the private reader gave %r "
                  "for %s", key, public)
        return None
    return functools.partial(read, index)


class StepFlags:
    """The hooks of a step program queued ahead (`dcp_step.step_program`) on a GPU, and torch's
    side of them: per layer torch writes one 32-bit flag and waits on one event, where the
    per-layer protocol (`StreamEvents`) costs a program dispatch.

    `words` (torch int32[layers + 1] on the GPU): [l] layer l's flag, which torch's stream sets
    to 1 when the layer's latents are in the chunk buffers (or, where the engine writes the
    chunk, its cache write) and its reads of the slot the layer's prefetch overwrites are
    queued (`release`); [layers] the abandon word.  The program takes `words` itself, imported
    into JAX and donated (its `flags`), and passes it through every wait: layer l's wait holds
    JAX's stream until its flag is 1 (native `cuStreamWaitValue32`,
    `interop.native_signal.wait_flag`), and the program reads the abandon word from it after
    the wait.  Layer l's signal records `events[l]`, which torch's stream waits on before
    reading the workspace (`torch_after`).
    Nothing the hooks touch depends on the step or lives in XLA's scratch memory, so XLA records
    the program into a CUDA graph at its second execution and can replay it from the third, at a
    fraction of the per-thunk dispatch, as long as the program's other buffers keep their
    addresses too (BENCHMARKS.md).  The waits leave their flags at 1 (a write back to 0 cost
    every layer's hand-off 1.5 us): `next_step` zeroes every word on torch's stream, after
    torch's stream waited for the last step's program, and the next program must be dispatched
    after JAX's stream waited for torch's (`StreamEvents.jax_after_torch`), so no flag of the
    last step, nor one an abandonment set, releases a layer of the next step early.  A step left
    half-way must be released (`abandon`), or JAX's stream waits forever: the abandon word set
    first makes the rest of the program write nothing into the caches.
    With `release_aside` torch's stream records an event where the flag is due, and a stream of
    the flags' own waits on it and writes the flag: the write's memory barrier then holds that
    stream instead of torch's, whose next kernels start at once.  That pays where torch's next
    work does not wait for the program (an engine that writes its own caches: on an H100 its
    layer boundary took 14.1 us instead of 22.0 on a side stream, the same on the default
    stream); where it waits for the program's write after the flag, the extra hop lies on that
    path (BENCHMARKS.md, forty-third section).
    Hashable by identity: the static `hooks` argument of the program.

    The hazard of a program queued ahead: while a step is not fully released, any device-wide
    synchronization on the host (torch.cuda.synchronize, cudaFree when torch's allocator frees
    its cache, CUDA's lazy loading of a kernel at its first launch) waits for JAX's stream,
    which waits for a flag only the blocked host would write: a deadlock, unless another
    thread abandons the step (`interop.step_runner`'s watchdog does).  Run such steps with
    CUDA_MODULE_LOADING=EAGER and no device synchronization between `next_step` and the last
    `release`."""

    name = "cuda-flags"

    def __init__(self, device: torch.device, jax_stream: torch.cuda.ExternalStream, handle: int, *, layers: int,
                 release_aside: bool = False):
        loaded = native_signal.load()
        if loaded.library is None:
            raise RuntimeError(f"step flags need the native stream hooks: {loaded.why}")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
            raise ValueError(f"layers: expected a positive number of layers, got {layers!r}")
        self.layers, self._handle = layers, handle
        self.words = torch.zeros(layers + 1, dtype=torch.int32, device=device)
        self._words_at = self.words.data_ptr()
        self.events = [torch.cuda.Event() for _ in range(layers)]
        for event in self.events:
            event.record(jax_stream)                # created now: their handles go into the program
        self._wait_fn, write_fn = native_signal.flag_functions()
        self._record_fn, self._capturing_fn = native_signal.capture_functions()
        self._write = native_signal.STREAM_VALUE_OP(write_fn)
        self._memset = native_signal.memset_d32()
        self.wait_state, self.signal_state = native_signal.new_state(), native_signal.new_state()
        self.released = layers                      # layers of the current step released so far
        # the driver's calls on the events' and streams' handles: a few us a layer less than torch's
        self._event_record, self._stream_wait_event = native_signal.event_functions()
        self._ready = [event.cuda_event for event in self.events]
        self.release_aside = release_aside
        if release_aside:
            self._release_stream = torch.cuda.Stream(device=device)
            self._release_handle = self._release_stream.cuda_stream
            self._release_events = [torch.cuda.Event() for _ in range(layers)]
            for event in self._release_events:
                event.record(self._release_stream)      # created now; the objects own the handles
            self._released_at = [event.cuda_event for event in self._release_events]

    # -- the program's hooks -----------------------------------------------------------------------
    def wait(self, layer: int, arrays: tuple, *, platform: str):
        return native_signal.wait_flag(arrays, platform=platform, wait_fn=self._wait_fn,
                                       capturing_fn=self._capturing_fn, flag=self._words_at + 4 * layer,
                                       state=self.wait_state)

    def signal(self, layer: int, arrays: tuple, *, platform: str):
        return native_signal.step_signal(arrays, platform=platform, record_fn=self._record_fn,
                                         capturing_fn=self._capturing_fn, ready_event=self.events[layer].cuda_event,
                                         state=self.signal_state)

    # -- torch's side --------------------------------------------------------------------------------
    def next_step(self, torch_stream: torch.cuda.Stream):
        """Before a step program is dispatched, after torch's stream waited for the last one: every
        flag and the abandon word are zeroed, on torch's stream."""
        if self.released != self.layers:
            raise RuntimeError(f"step flags: the last step released {self.released} of {self.layers} layers; "
                               "abandon it first")
        if self.release_aside:      # no late write of the last step may land after the zeroing
            torch_stream.wait_stream(self._release_stream)
        native_signal.check_result(self._memset(self._words_at, 0, self.layers + 1, torch_stream.cuda_stream),
                                   "cuMemsetD32Async")
        self.released = 0

    def dispatched(self) -> int:
        """After the dispatch: how many of the program's hooks ran on the host.  2 * layers where
        XLA executed the program thunk by thunk (every wait and signal enqueued on JAX's stream)
        or recorded it into its command buffer (on a capture stream); 0 where it replayed the
        recorded graph; between, where it recorded anew only the hooks whose buffers moved (a
        caller that passes new buffers for the ring, the caches or `flags`)."""
        counts = []
        for what, state in (("wait", self.wait_state), ("signal", self.signal_state)):
            calls, stream = state
            state[0] = state[1] = 0
            executed = stream == self._handle and calls == self.layers
            recorded = stream == native_signal.CAPTURING and calls <= self.layers
            if calls and not (executed or recorded):
                raise RuntimeError(f"the step program enqueued {calls} flag {what}s on stream {stream:#x}; expected "
                                   f"{self.layers} on JAX's compute stream {self._handle:#x}, or at most "
                                   f"{self.layers} recorded under a capture")
            counts.append(calls)
        return sum(counts)

    def release(self, torch_stream: torch.cuda.Stream, layer: int):
        """Layer `layer`'s part of the program runs once torch's stream reaches this point."""
        if layer != self.released:
            raise ValueError(f"layer: expected {self.released} (layers are released in order), got {layer}")
        if self.release_aside:
            event = self._released_at[layer]
            native_signal.check_result(self._event_record(event, torch_stream.cuda_stream), "cuEventRecord")
            native_signal.check_result(self._stream_wait_event(self._release_handle, event, 0), "cuStreamWaitEvent")
            self._write_word(self._release_handle, layer, 1)
        else:
            self._write_word(torch_stream.cuda_stream, layer, 1)
        self.released += 1

    def torch_after(self, torch_stream: torch.cuda.Stream, layer: int):
        """Work queued on `torch_stream` from now on runs after layer `layer`'s workspace is ready."""
        native_signal.check_result(self._stream_wait_event(torch_stream.cuda_stream, self._ready[layer], 0),
                                   "cuStreamWaitEvent")

    def abandon(self, torch_stream: torch.cuda.Stream):
        """Release the layers not yet released, after setting the abandon word: their part of the
        program runs at once and writes no cache.  Callable from any thread (a watchdog's, while
        the host is blocked in a device synchronization: see the class docstring)."""
        if self.released == self.layers:
            return
        native_signal.make_context_current(self.words.device.index)
        self._write_word(torch_stream.cuda_stream, self.layers, 1)
        for layer in range(self.released, self.layers):
            self._write_word(torch_stream.cuda_stream, layer, 1)
        self.released = self.layers

    def _write_word(self, stream: int, index: int, value: int):
        native_signal.check_result(self._write(stream, self._words_at + 4 * index, value, 0), "cuStreamWriteValue32")
