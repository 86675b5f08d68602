"""How long a stream held behind a 32-bit flag takes to resume once the producer's compute ends,
on the GPU's clock, for each way of raising the flag and of waiting for it.

The step program (`dcp_step.step_program`) queues a layer's JAX work behind a flag that torch's
stream raises after the layer's compute.  On the kernel timeline JAX's stream resumed 10-12 us
after torch's compute ended where an event hand-off takes 2-4 (BENCHMARKS.md).  This probe takes
the hand-off apart.  Per trial the consumer stream (JAX's compute stream, or a torch side
stream) queues the wait first, then an optional write of the flag back to 0, then an event; the
producer (torch's default or a side stream) queues `torch.cuda._sleep` (the compute), an event,
then the release.  The figure is the time between the two events (CUDA events, the GPU's clock,
about 0.5 us resolution), median over the trials:

  release     write: cuStreamWriteValue32 (default flags: a memory barrier first);
              kernel: a one-element torch fill_ writes the flag from an SM;
              memset: cuMemsetD32Async;
              event: an event recorded on the producer and waited on by the consumer (queued
              after the producer's work: the per-layer programs' hand-off, for reference; also
              from JAX's stream to torch's, the way a workspace goes back)
  wait        eq / geq: cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_EQ / _GEQ;
              eq-flush: EQ | CU_STREAM_WAIT_VALUE_FLUSH (where the driver supports it)
  busy        the consumer runs a kernel of half the producer's compute before its wait (a
              prefetch gather before the next layer's wait), or is idle
  reset       write: the consumer writes the flag back to 0 after the wait; none: it does not (the
              step program's wait, which leaves zeroing to torch before the next step)
  memory      device (torch memory) or pinned host memory (not with the kernel release)
  graph       the consumer's wait, reset and a one-element kernel recorded as a CUDA graph and
              replayed (graph+k: XLA replays the step program as one), against the same queued
              plainly (plain+k) and against the wait queued plainly before a graph of the kernel
              (wait+g(k))

    python tools/flag_wait_latency.py [--trials N] [--compute-us 200,2000] [--out FILE.json]
"""
import argparse
import ctypes
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import torch  # noqa: E402

from interop import native_signal, stream_handoff  # noqa: E402
from interop.native_signal import check_result  # noqa: E402

WAIT_FLAGS = {"eq": 0x1, "geq": 0x0, "eq-flush": 0x1 | (1 << 30)}    # CU_STREAM_WAIT_VALUE_*
WRITE_DEFAULT = 0x0                                                   # CU_STREAM_WRITE_VALUE_DEFAULT


class Probe:
    def __init__(self, jax_stream: int):
        wait_fn, write_fn = native_signal.flag_functions()
        self.wait_value = native_signal.STREAM_VALUE_OP(wait_fn)
        self.write_value = native_signal.STREAM_VALUE_OP(write_fn)
        self.memset = native_signal.memset_d32()
        self.streams = {"jax": torch.cuda.ExternalStream(jax_stream), "side": torch.cuda.Stream(),
                        "default": torch.cuda.default_stream(), "side2": torch.cuda.Stream()}
        self.device_flag = torch.zeros(16, dtype=torch.int32, device="cuda")
        self.host_flag = torch.zeros(16, dtype=torch.int32, pin_memory=True)
        self.tick = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.cycles_per_us = self._calibrate()

    def _calibrate(self) -> float:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles // 10)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def flag(self, memory: str) -> torch.Tensor:
        return self.device_flag if memory == "device" else self.host_flag

    def release(self, how: str, stream, flag: torch.Tensor):
        handle = ctypes.c_void_p(stream.cuda_stream)
        if how == "write":
            check_result(self.write_value(handle, flag.data_ptr(), 1, WRITE_DEFAULT), "cuStreamWriteValue32")
        elif how == "kernel":
            with torch.cuda.stream(stream):
                flag[:1].fill_(1)
        elif how == "memset":
            check_result(self.memset(flag.data_ptr(), 1, 1, handle), "cuMemsetD32Async")
        else:
            raise ValueError(how)

    def wait(self, how: str, reset: str, stream, flag: torch.Tensor):
        handle = ctypes.c_void_p(stream.cuda_stream)
        check_result(self.wait_value(handle, flag.data_ptr(), 1, WAIT_FLAGS[how]), f"cuStreamWaitValue32 ({how})")
        if reset == "write":
            check_result(self.write_value(handle, flag.data_ptr(), 0, WRITE_DEFAULT), "cuStreamWriteValue32 (reset)")

    def trial(self, *, release: str, wait: str, reset: str, memory: str, producer: str, consumer: str,
              compute_us: float, busy: bool = False, graph=None) -> float:
        """One hand-off: us from the producer's compute end to the consumer's resumption."""
        flag = self.flag(memory)
        flag.zero_()
        torch.cuda.synchronize()
        prod, cons = self.streams[producer], self.streams[consumer]
        compute_end, resumed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if release == "event":
            with torch.cuda.stream(prod):
                torch.cuda._sleep(int(compute_us * self.cycles_per_us))
            compute_end.record(prod)
            cons.wait_event(compute_end)
            resumed.record(cons)
        else:
            if busy:
                with torch.cuda.stream(cons):
                    torch.cuda._sleep(int(compute_us / 2 * self.cycles_per_us))
            if graph is not None:
                with torch.cuda.stream(cons):
                    graph.replay()
            else:
                self.wait(wait, reset, cons, flag)
            resumed.record(cons)
            with torch.cuda.stream(prod):
                torch.cuda._sleep(int(compute_us * self.cycles_per_us))
            compute_end.record(prod)
            try:
                self.release(release, prod, flag)
            except RuntimeError:
                flag.fill_(1)               # never leave the consumer waiting: the next trial would hang
                torch.cuda.synchronize()
                raise
        torch.cuda.synchronize()
        return compute_end.elapsed_time(resumed) * 1e3

    def graph_of_wait(self, *, wait: str, reset: str, memory: str, consumer: str):
        """The consumer's wait, reset and a one-element kernel, recorded into a CUDA graph."""
        def queue():
            self.wait(wait, reset, torch.cuda.current_stream(), self.flag(memory))
            self.tick.add_(1)
        return self._captured(consumer, queue)

    def plain_with_tick(self, **kw):
        """The same as the graph, queued plainly: wait, reset, the one-element kernel."""
        return _TickedWait(self, **kw)

    def wait_then_graph(self, **kw):
        """The wait and reset queued plainly, then a CUDA graph of the one-element kernel (a wait
        outside the command buffers XLA records around it)."""
        return _TickedWait(self, graph=self._captured(kw["consumer"], lambda: self.tick.add_(1)), **kw)

    def _captured(self, consumer: str, queue):
        """What `queue()` queues on the current stream, recorded into a CUDA graph on `consumer`."""
        graph, stream = torch.cuda.CUDAGraph(), self.streams[consumer]
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                queue()
        return graph


class _TickedWait:
    def __init__(self, probe: Probe, *, wait: str, reset: str, memory: str, consumer: str, graph=None):
        # (consumer: the stream `trial` replays it on, current by then)
        self.probe, self.wait, self.reset, self.memory, self.graph = probe, wait, reset, memory, graph

    def replay(self):
        stream = torch.cuda.current_stream()
        self.probe.wait(self.wait, self.reset, stream, self.probe.flag(self.memory))
        if self.graph is not None:
            self.graph.replay()
        else:
            self.probe.tick.add_(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/flag_wait_latency.py", description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--compute-us", default="200,2000", help="the producer's compute per trial, us (comma list)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("flag_wait_latency needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    found = stream_handoff.probe(jax.devices()[0])
    if found.stream is None:
        print(f"JAX's compute stream was not found: {found.why}", file=sys.stderr)
        return 2
    probe = Probe(found.stream)
    computes = [float(x) for x in args.compute_us.split(",")]
    rows = []

    def measure(name: str, **kw):
        graph = kw.pop("graph", None)
        try:
            times = [probe.trial(graph=graph, **kw) for _ in range(args.trials)]
        except RuntimeError as e:
            rows.append(dict(kw, case=name, error=str(e)))
            print(f"{name:<10} {kw} refused: {e}")
            return
        row = dict(kw, case=name, median_us=statistics.median(times), min_us=min(times), max_us=max(times))
        rows.append(row)
        print(f"{name:<8} {kw['release']:>7} {kw['wait']:>8} {kw['reset']:>6} {kw['memory']:>6} "
              f"{kw['producer']:>7}->{kw['consumer']:<5} {kw['compute_us']:7.0f} us: "
              f"median {row['median_us']:6.2f} us (min {row['min_us']:6.2f}, max {row['max_us']:6.2f})")

    for compute_us in computes:
        base = dict(release="write", wait="eq", reset="write", memory="device", consumer="jax",
                    compute_us=compute_us)
        for torch_kind in ("side", "default"):      # the way back: torch waits for JAX's workspace event
            measure("event", **dict(base, release="event", producer="jax", consumer=torch_kind))
        for producer in ("side", "default"):
            measure("event", **dict(base, release="event", producer=producer))
            for release, reset, memory in itertools.product(("write", "kernel", "memset"), ("write", "none"),
                                                            ("device", "host")):
                if release == "kernel" and memory == "host":
                    continue                     # a torch fill_ of host memory runs on the host
                measure("flag", **dict(base, release=release, reset=reset, memory=memory, producer=producer))
            for wait in ("geq", "eq-flush"):
                measure("flag", **dict(base, wait=wait, producer=producer))
            for release in ("write", "kernel"):
                measure("busy", **dict(base, release=release, reset="none", producer=producer, busy=True))
            # the same hand-offs replayed from a CUDA graph on a torch side stream, against queued plainly
            for release, reset in (("write", "write"), ("write", "none"), ("kernel", "none")):
                shape = dict(wait="eq", reset=reset, memory="device", consumer="side2")
                replays = (("plain+k", probe.plain_with_tick(**shape)), ("graph+k", probe.graph_of_wait(**shape)),
                           ("wait+g(k)", probe.wait_then_graph(**shape)))
                for name, replayed in replays:
                    measure(name, **dict(shape, release=release, producer=producer, compute_us=compute_us,
                                         graph=replayed))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
                       "cycles_per_us": probe.cycles_per_us, "trials": args.trials, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
