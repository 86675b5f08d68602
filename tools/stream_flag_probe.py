"""What ordering torch and JAX by 32-bit flags in memory would cost and whether it orders: the
CUDA driver's stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32) on torch's
current stream and on JAX's compute stream, against torch's event record and wait.

Unlike an event, a flag can be waited on before its producer has queued the write: a consumer
stream that waits for `flag >= n` holds everything queued behind the wait until some stream (or
the host, for flags in pinned host memory) writes n.  So JAX's work of a whole step could be
queued ahead, each layer's part behind its own flag, and torch would pay one write and one
event wait a layer instead of a dispatch.  This probe measures the commands' host cost and
checks, each against a control that races:

  torch -> JAX      JAX's stream waits for the flag, then a jitted copy reads a buffer torch
                    fills behind 50 ms of queued sleep before it writes the flag;
  queued ahead      the same with the wait and the copy dispatched before torch queues its
                    sleep, fill and write;
  host release      a wait on a flag in pinned host memory that no stream writes is released
                    by the host writing it (the way out of a step abandoned half-way).

    python tools/stream_flag_probe.py [--calls N]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from interop import bench, bridge, native_signal, stream_handoff  # noqa: E402
from interop.native_signal import check_result  # noqa: E402

WAIT_GEQ = 0x0                 # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0x0            # CU_STREAM_WRITE_VALUE_DEFAULT (a memory barrier before the write)


def median_us(fn, calls: int, rounds: int = 5) -> float:
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    torch.cuda.synchronize()
    return statistics.median(medians) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/stream_flag_probe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000, help="calls per timed round (default %(default)s)")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("stream_flag_probe needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    device = jax.devices()[0]
    found = stream_handoff.probe(device)
    if found.stream is None:
        print(f"JAX's compute stream was not found: {found.why}", file=sys.stderr)
        return 2
    wait_fn, write_fn = native_signal.flag_functions()
    write_value, wait_value = native_signal.STREAM_VALUE_OP(write_fn), native_signal.STREAM_VALUE_OP(wait_fn)
    jax_stream = ctypes.c_void_p(found.stream)
    torch_stream = torch.cuda.current_stream()
    torch_handle = ctypes.c_void_p(torch_stream.cuda_stream)
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    host_flags = torch.zeros(64, dtype=torch.int32, pin_memory=True)

    # host cost of each command, a satisfied wait (flag 0 >= 0) so nothing blocks
    event = torch.cuda.Event()
    rows = [
        ("torch Event.record(torch stream)", median_us(lambda: event.record(torch_stream), args.calls)),
        ("torch Event.wait(torch stream)", median_us(lambda: event.wait(torch_stream), args.calls)),
        ("cuStreamWriteValue32(torch stream, device flag)", median_us(
            lambda: write_value(torch_handle, flags.data_ptr(), 0, WRITE_DEFAULT), args.calls)),
        ("cuStreamWaitValue32(JAX stream, device flag)", median_us(
            lambda: wait_value(jax_stream, flags.data_ptr(), 0, WAIT_GEQ), args.calls)),
        ("cuStreamWaitValue32(JAX stream, pinned host flag)", median_us(
            lambda: wait_value(jax_stream, host_flags.data_ptr(), 0, WAIT_GEQ), args.calls)),
    ]
    for name, us in rows:
        print(f"{name:<52} {us:6.2f} us (host, median of 5 rounds of {args.calls})")

    sleep = bench.compute_kernels(50.0)["sleep"]
    filled = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    filled_jax = bridge.to_jax(filled, name="filled", device=device)
    read = jax.jit(lambda x: x + 0)
    jax.block_until_ready(read(filled_jax))              # compiled before any timing
    torch.cuda.synchronize()

    def torch_fills(value: int, flag: int | None):
        sleep()
        filled.fill_(value)
        if flag is not None:
            check_result(write_value(torch_handle, flags.data_ptr() + 4 * flag, value, WRITE_DEFAULT), "write")

    def jax_reads(flag: int | None, value: int):
        if flag is not None:
            check_result(wait_value(jax_stream, flags.data_ptr() + 4 * flag, value, WAIT_GEQ), "wait")
        return read(filled_jax)

    cases = []
    for n, (name, ordered, ahead) in enumerate([("torch -> JAX", True, False), ("  control, no wait", False, False),
                                                ("queued ahead", True, True), ("  control, no wait", False, True)]):
        value, flag = 10 + n, n if ordered else None
        if ahead:
            out = jax_reads(flag, value)
            torch_fills(value, flag)
        else:
            torch_fills(value, flag)
            out = jax_reads(flag, value)
        seen = np.asarray(out)
        torch.cuda.synchronize()
        exact = bool((seen == value).all())
        cases.append((name, ordered, exact))
        print(f"{name:<20} JAX read {'the fill' if exact else 'stale rows'} "
              f"({int((seen == value).sum())} of {seen.size} rows)")

    # the way out of an abandoned step: the host writes a flag no stream will write
    check_result(wait_value(jax_stream, host_flags.data_ptr() + 4, 5, WAIT_GEQ), "host-flag wait")
    held = read(filled_jax)
    time.sleep(0.05)
    blocked = not held.is_ready()
    host_flags[1] = 5
    start = time.perf_counter()
    jax.block_until_ready(held)
    released_ms = (time.perf_counter() - start) * 1e3
    print(f"host release         JAX's stream {'held' if blocked else 'did not hold'} behind the pinned flag for "
          f"50 ms; released {released_ms:.2f} ms after the host wrote it")
    ok = all(exact for _, ordered, exact in cases if ordered) and blocked
    raced = [name.strip() for name, ordered, exact in cases if not ordered and not exact]
    print(f"ordered cases exact and the host release held: {ok}; controls that raced: {len(raced)} of 2")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
