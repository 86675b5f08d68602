"""Why the torch adapter's host time per layer moves between runs: the same layer loop in several
conditions, taking turns round after round in one process, with the CPU the dispatching thread
ran on and the host's speed beside every figure.

    python tools/adapter_host_drift.py [--history N] [--depth D] [--prefetch-programs P] [--rounds R] > out.txt

Runs `interop.bench.Workload` (one request, D = 1, fp8_ds_mla, 8 layers, the bench's layer loop).
Conditions, each for `--steps` steps per round:

  queued   1 ms of `torch.cuda._sleep` per layer on torch's default stream: the host runs far
           ahead of the GPU, as in `interop.bench`
  drained  no compute, and the host waits for the GPU after every layer: each call finds every
           queue empty (the wait is not counted)
  pinned   `queued` with the dispatching thread pinned to the CPU it ran on first
  no-gc    `queued` with Python's garbage collector off

Per round and condition: the median host time of one layer's `set_current_chunk` + `gather` and
of the layer program's jit call inside it (us), the CPUs the thread ran on, and two probes of one
trivial jitted dispatch (median us): with JAX's stream idle, and queued behind a wait for 5 ms
of torch's sleep (as the adapter's programs are).  The last lines summarize each condition over
the rounds (median, min, max of the per-round medians), then where the CPU time went while the
layer loops ran: each thread of the process by name, its time on a CPU (the kernel's schedstat)
as a share of the loops' wall time, and the whole guest's steal time (time a hypervisor gave
this machine's CPUs to others, /proc/stat) in the same share.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import torch  # noqa: E402

from interop import bench  # noqa: E402

_sched_getcpu = ctypes.CDLL(None).sched_getcpu
CONDITIONS = ("queued", "drained", "pinned", "no-gc")


class TimedLayerProgram:
    """An orchestrator's layer program (`dcp_step.bound_layer_program`) with the host time of each
    call kept (the orchestrator looks it up on itself at every dispatch, so replacing it there
    times every dispatch)."""

    def __init__(self, inner):
        self.inner = inner
        self.times: list[float] = []

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - t0)


def thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """tid -> (thread name, ns it has spent on a CPU) for every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = (name, int(f.read().split()[0]))
        except OSError:                   # a thread that ended meanwhile
            pass
    return out


def steal_ticks() -> int:
    """The guest's stolen time so far, all CPUs, in clock ticks (/proc/stat's eighth column)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


class CpuAccount:
    """Per thread name, ns on a CPU during the measured spans; the spans' wall ns; stolen ticks."""

    def __init__(self):
        self.by_name: collections.Counter = collections.Counter()
        self.wall_ns = 0
        self.steal = 0

    def span(self, fn):
        before, steal, t0 = thread_cpu_ns(), steal_ticks(), time.perf_counter_ns()
        result = fn()
        self.wall_ns += time.perf_counter_ns() - t0
        self.steal += steal_ticks() - steal
        for tid, (name, ns) in thread_cpu_ns().items():
            self.by_name[name] += ns - before.get(tid, (name, 0))[1]
        return result

    def summary(self, shown: int = 6) -> str:
        tick_ns = 1e9 / os.sysconf("SC_CLK_TCK")
        cells = [f"{name} {100 * ns / self.wall_ns:.0f}%" for name, ns in self.by_name.most_common(shown)]
        return (f"threads on a CPU: {', '.join(cells)}; steal {100 * self.steal * tick_ns / self.wall_ns:.0f}% "
                f"of one CPU ({self.wall_ns / 1e9:.2f} s of loops)")


def probe_us(adapter, queued: bool, calls: int = 50) -> float:
    """Median us of one trivial jitted dispatch (`interop.bench.host_probe_us`); with `queued`,
    JAX's stream first waits for 5 ms of torch's sleep, so every probe program waits in the queue."""
    def queue_behind_sleep():
        bench.compute_kernels(5.0)["sleep"]()
        adapter.events.jax_after_torch(adapter.events.torch_stream())
    return bench.host_probe_us(calls, before=queue_behind_sleep if queued else None)["jax"]


def run_condition(work, adapter, timed: TimedLayerProgram, condition: str, steps: int) -> dict:
    """`steps` steps of the bench's layer loop in `condition`; the host times of its layers."""
    drained = condition == "drained"
    compute = None if drained else bench.compute_kernels(1.0)["sleep"]
    host, cpus = [], set()

    def after_layer():
        cpus.add(_sched_getcpu())
        if drained:
            torch.cuda.synchronize()
    first = len(timed.times)
    pinned = None
    if condition == "pinned":
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {_sched_getcpu()})
    if condition == "no-gc":
        gc.disable()
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            if compute is not None:
                compute()
            work.begin_step(adapter)
            work.layers(adapter, compute, host, after_layer=after_layer)
            torch.cuda.synchronize()
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
        gc.enable()
    jit = timed.times[first:]
    return dict(host_us=1e6 * statistics.median(host), jit_us=1e6 * statistics.median(jit) if jit else float("nan"),
                cpus=sorted(cpus))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=262144, help="history tokens (default %(default)s)")
    ap.add_argument("--depth", type=int, default=2, help="prefetch depth (default %(default)s)")
    ap.add_argument("--prefetch-programs", type=int, default=66,
                    help="persistent programs of a prefetch's pack, 0: the full grid (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of all conditions (default %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="steps per condition and round (default %(default)s)")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("adapter_host_drift needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    work = bench.Workload(args.history, 4096, 8)
    adapter = work.adapter(args.depth, args.prefetch_programs)
    timed = adapter.orch._layer_program = TimedLayerProgram(adapter.orch._layer_program)
    print(f"history {args.history}, depth {args.depth}, prefetch programs {args.prefetch_programs}, "
          f"jax {jax.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"CPUs allowed {len(os.sched_getaffinity(0))}")
    run_condition(work, adapter, timed, "queued", 3)                # compiles, warms
    print(f"{'round':>5} {'condition':>9} {'host us/layer':>13} {'jit call us':>11} {'probe idle/queued us':>20}  cpus")
    results = {c: [] for c in CONDITIONS}
    accounts = {c: CpuAccount() for c in CONDITIONS}
    for r in range(args.rounds):
        for condition in CONDITIONS:
            idle, queued = probe_us(adapter, False), probe_us(adapter, True)
            row = accounts[condition].span(lambda: run_condition(work, adapter, timed, condition, args.steps))
            row.update(probe_idle_us=idle, probe_queued_us=queued)
            results[condition].append(row)
            print(f"{r:5d} {condition:>9} {row['host_us']:13.1f} {row['jit_us']:11.1f} {idle:9.1f}/{queued:<9.1f}  "
                  f"{row['cpus']}", flush=True)
    adapter.orch._layer_program = timed.inner
    adapter.close()
    print("\nover rounds: median [min, max] of the per-round medians")
    for condition, rows in results.items():
        cells = []
        for key in ("host_us", "jit_us", "probe_idle_us", "probe_queued_us"):
            v = [row[key] for row in rows]
            cells.append(f"{key} {statistics.median(v):6.1f} [{min(v):6.1f}, {max(v):6.1f}]")
        print(f"{condition:>9}  " + "  ".join(cells))
        print(" " * 11 + accounts[condition].summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
