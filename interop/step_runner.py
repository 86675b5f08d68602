"""`TorchCkvAdapter`'s "step-program" ordering: a whole step's JAX work dispatched at
`begin_step` as one program (`dcp_step.step_program`), each layer's part behind a flag torch
raises (`stream_handoff.StepFlags`).  Per layer the host writes one word after torch's stream
(on it, or on the flags' own stream after an event) and makes torch's stream wait on one event:
no JAX dispatch, import or export.  XLA executes the program thunk by thunk at its first
dispatch and records it into a CUDA graph at the second; it replays the graph only while every
buffer the program reads stays where it was.  Every input does: the caches, ring slots, chunk
buffers and flags are torch memory imported once, and the step's arrays are refreshed in place
(`interop.resident_arrays`); so a step shape's later steps replay, unless JAX allocated other
buffers between them (`hooks_run` counts the hooks run on the host per step, 0 for a replay;
BENCHMARKS.md, thirty-eighth section).

A program queued ahead makes any device-wide synchronization of the host (torch.cuda.synchronize,
cudaFree when torch's allocator releases its cache, a kernel's lazy loading) wait for JAX's
stream, which waits for a flag only the blocked host would raise.  `StepRunner` therefore
refuses a process whose driver loads kernels lazily, and a watchdog thread abandons a step that
sees no release for `timeout_s` (the rest of its program runs at once and writes no cache); the
engine's next call of the step then raises, naming what happened.  The watchdog needs the GIL:
where the host blocks inside a call that holds it (a torch op whose library initializes on first
use and synchronizes the device, e.g. cuBLAS at the process's first matmul), nothing releases the
step; such libraries must be initialized before the first step.
"""
from __future__ import annotations

import threading
import time

import jax

from ckv_jax import dcp_step, placement
from interop import bridge, native_signal, stream_handoff


class StepAbandoned(RuntimeError):
    """Raised by the call of a step that the watchdog abandoned."""


# GPUs (CUDA ordinals) with a step program waiting for a layer's release: JAX work dispatched
# there now would queue behind that wait, and torch waiting for it would never release the layer
_open_steps: set[tuple[int, int]] = set()           # (CUDA ordinal, id of the runner)
_open_lock = threading.Lock()


def check_no_open_step(what: str, device_index: int):
    """Raise if JAX work queued on GPU `device_index` now would wait for an open step program."""
    with _open_lock:
        if any(index == device_index for index, _ in _open_steps):
            raise RuntimeError(f"{what}: a ckv-jax step program is open on cuda:{device_index} (TorchCkvAdapter, "
                               "ordering 'step-program'); JAX work queued before its last layer's gather waits "
                               "behind it, and torch waiting for that work deadlocks the step: run it in torch, "
                               "or after the step's last gather")


def _mark_open(runner: "StepRunner", is_open: bool):
    with _open_lock:
        (_open_steps.add if is_open else _open_steps.discard)((runner.events.device.index, id(runner)))


class StepRunner:
    """The flags, the watchdog and the dispatch of one adapter's step programs (see the module
    docstring).  `begin` dispatches a step; `release` hands layer l to the program and orders
    torch's stream after the layer's workspace; `abandon` releases whatever is left."""

    def __init__(self, events: stream_handoff.StreamEvents, mesh: jax.sharding.Mesh, *, depth: int,
                 layout, implementation, interpret: bool, prefetch_tiles, timeout_s: float,
                 release_aside: bool = False):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"step_timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        mode = native_signal.module_loading_mode()
        if mode != "eager":
            raise RuntimeError(f"ordering: 'step-program' needs CUDA_MODULE_LOADING=EAGER in the environment before "
                               f"CUDA initializes (the driver loads kernels {mode}ly: a kernel's first launch "
                               "synchronizes the device, which waits for the queued step program, a deadlock)")
        self.events, self.mesh, self.depth = events, mesh, depth
        self._program = dict(depth=depth, mesh=mesh, layout=layout, implementation=implementation,
                             interpret=interpret, prefetch_tiles=prefetch_tiles)
        self.timeout_s = float(timeout_s)
        self.release_aside = release_aside
        self.flags: stream_handoff.StepFlags | None = None
        self._words = None                  # `flags.words` as the program's replicated argument
        self.hooks_run: list[int] = []      # per dispatch, the hooks whose handlers ran (0: a replay)
        self._lock = threading.Lock()
        self._stream = None                 # torch's stream of the step's last hand-off
        self._abandoned: str | None = None  # why the watchdog abandoned the step
        self._progress = 0.0                # time.monotonic() of the step's last dispatch or release
        self._watchdog = _Watchdog(self._stalled, self.timeout_s)

    @property
    def next_layer(self) -> int | None:
        """The layer the step releases next (None: no step is open)."""
        flags = self.flags
        return None if flags is None or flags.released == flags.layers else flags.released

    def begin(self, ring: list, caches: list, kv_c, k_pe, arrays: dcp_step.StepArrays) -> tuple[tuple, tuple]:
        """Dispatch the step's program after the work queued on torch's current stream so far.
        ring, caches, kv_c, k_pe: the adapter's JAX arrays of its torch memory (the ring and the
        caches donated: the program writes them in place); kv_c and k_pe None where the engine
        writes the chunk (`dcp_step.step_program`'s gather-only step).  Returns (ring, caches),
        the arrays that replace the donated ones."""
        stream = self.events.torch_stream()
        with self._lock:
            self._abandon_locked(stream)
            if self.flags is None or self.flags.layers != len(caches):
                self.flags = stream_handoff.StepFlags(self.events.device, self.events.jax_stream,
                                                      self.events.jax_stream.cuda_stream, layers=len(caches),
                                                      release_aside=self.release_aside)
                local = bridge.to_jax(self.flags.words, name="step flags", device=self.mesh.local_devices[0])
                self._words = placement.assemble_replicated(self.mesh, [local])
            self.events.torch_after_jax(stream)        # the last program is done with the flags
            self.flags.next_step(stream)
            self.events.jax_after_torch(stream)
            chunk = (None, None) if kv_c is None else ((kv_c,), (k_pe,))
            ring, caches, self._words = dcp_step.step_program(tuple(ring), tuple(caches), self._words, *chunk, arrays,
                                                              hooks=self.flags, **self._program)
            self.hooks_run.append(self.flags.dispatched())
            self._stream, self._abandoned, self._progress = stream, None, time.monotonic()
            _mark_open(self, True)
            self._watchdog.arm()
        return ring, caches

    def raise_if_abandoned(self):
        """Raise `StepAbandoned` where the watchdog abandoned the open step."""
        why = self._abandoned
        if why is not None:
            raise StepAbandoned(why)

    def release(self, layer: int, patch=None):
        """Hand layer `layer` to the program once torch's current stream reaches this point, and
        order what torch queues from now on after the layer's workspace.  patch: None, or a
        function of torch's current stream that queues torch's writes into the layer's workspace
        on it; the release then follows them (the program's next gather does not compete with
        them for memory bandwidth), which needs the layer's gather released before (depth > 0)."""
        stream = self.events.torch_stream()
        with self._lock:
            if self._abandoned is not None:
                raise StepAbandoned(self._abandoned)
            if patch is None:
                self.flags.release(stream, layer)
                self.flags.torch_after(stream, layer)
            else:
                self.flags.torch_after(stream, layer)
                try:
                    patch(stream)
                finally:        # a patch that raised still releases: JAX's stream must not wait for it
                    self.flags.release(stream, layer)
            self._stream, self._progress = stream, time.monotonic()
            if self.flags.released == self.flags.layers:
                self._watchdog.disarm()
                _mark_open(self, False)
            else:
                self._watchdog.arm()

    def abandon(self):
        """Release the layers of the open step not yet released (their part writes nothing)."""
        with self._lock:
            self._abandon_locked(self.events.torch_stream())

    def close(self):
        self.abandon()
        self._watchdog.stop()

    def _abandon_locked(self, stream):
        self._watchdog.disarm()
        if self.flags is not None:
            self.flags.abandon(self._stream or stream)
        _mark_open(self, False)

    def _stalled(self):
        with self._lock:
            layer = self.next_layer
            # (a release that came while the watchdog woke up re-armed it)
            if layer is None or time.monotonic() - self._progress < self.timeout_s:
                return
            self.flags.abandon(self._stream)
            _mark_open(self, False)
            self._abandoned = (
                f"the step program was abandoned at layer {layer}: no release for {self.timeout_s:g} s (the host "
                "blocked, e.g. in a device synchronization: torch.cuda.synchronize, cudaFree, a kernel loaded "
                f"lazily, while the program waited for torch); the caches of layers {layer} and later were not "
                "written this step")


class _Watchdog:
    """A daemon thread that calls `on_stall` once `timeout_s` passed since the last `arm`
    without a `disarm`; it sleeps at most `timeout_s` at a time, armed or not."""

    def __init__(self, on_stall, timeout_s: float):
        self._on_stall, self._timeout_s = on_stall, timeout_s
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def arm(self):
        # no notify: the thread went to sleep before this call for at most `timeout_s`, so it
        # wakes before the deadline anyway; woken now, it would take the GIL from the caller's
        # next calls, the step's first layer (5 us on a CPU machine; BENCHMARKS.md, forty-sixth
        # section)
        with self._cond:
            self._deadline = time.monotonic() + self._timeout_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckv-jax step watchdog", daemon=True)
                self._thread.start()

    def disarm(self):
        with self._cond:
            self._deadline = None

    def stop(self):
        with self._cond:
            thread, self._thread, self._deadline = self._thread, None, None
            self._cond.notify()
        if thread is not None:
            thread.join()

    def _run(self):
        me = threading.current_thread()
        with self._cond:
            while self._thread is me:
                if self._deadline is None:
                    self._cond.wait(self._timeout_s)
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None
                self._cond.release()      # on_stall takes the runner's lock, which `arm` callers hold
                try:
                    self._on_stall()
                finally:
                    self._cond.acquire()
