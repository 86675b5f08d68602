"""What the torch side of the engine-writes step program costs by itself, on the GPU's clock.

`interop.bench`'s workload (one request of H history tokens plus a 4,096-token chunk,
fp8_ds_mla, D = 1, `torch.cuda._sleep` compute of X ms a layer, the engine's cache write, a
one-row consumer) with no JAX program at all: each layer adds, cumulatively, the calls an
engine-writes step makes on torch's stream at depth > 0 (`StepRunner.release`):

  alone      compute, the engine's cache write, the consumer
  +wait      `StepFlags.torch_after`: torch's stream waits on the layer's ready event, which is
             long complete (the prefetched slot)
  +patch     `adapter.patch_chunk`: the chunk's records into the workspace's chunk rows, one copy
  +release   `StepFlags.release`: on torch's stream (`--release torch`) or aside (`aside`: an
             event, the release stream's wait on it and its flag write), no program waiting

Printed per stream kind: the step (CUDA events around the layer loop, median over trials) and
what each level adds per layer over the compute alone.  Before the table, `torch.cuda._sleep`
alone and beside four device copies of a layer's cache on another stream: the compute counts SM
cycles, so a clock that dropped under the copies' memory traffic would stretch it.

    python tools/handoff_floor.py [--history 262144] [--layers 8] [--compute-ms 1]
                                  [--streams side,default] [--trials 9] [--release aside,torch]
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from interop import adapter as adapter_module, bench, stream_handoff  # noqa: E402

WARMUP = 2          # trials left out


def _timed(fn, stream, beside=None) -> float:
    """us between CUDA events on `stream` around fn(); beside(), queued by the host after fn on
    another stream, runs beside fn's kernels."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    if beside is not None:
        beside()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def sleep_stretch(work: bench.Workload, compute, trials: int) -> dict:
    """us of one compute call alone and beside four device copies of a layer's cache."""
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    cache = work.caches[0]
    copy = torch.empty_like(cache)

    def copies():
        with torch.cuda.stream(other):
            for _ in range(4):
                copy.copy_(cache)
    out = {}
    for name, beside in (("alone", None), ("beside 4 device copies", copies)):
        times = [_timed(compute, side, beside) for _ in range(trials)]
        out[name] = statistics.median(times[WARMUP:])
    return out


def run(history: int, layers: int, compute_ms: float, streams, trials: int, releases):
    work = bench.Workload(history, 4096, layers)
    compute = bench.compute_kernels(compute_ms)["sleep"]
    chunk = work.records.shape[0]
    rows = work.caches[0].shape[0] * work.caches[0].shape[1]
    workspace = torch.empty((rows, work.records.shape[1]), dtype=torch.uint8, device="cuda")
    runs = [(0, chunk, rows - chunk)]               # the chunk's rows end the workspace
    stand_in_jax = torch.cuda.Stream()              # the events' stream: they are recorded once, complete
    flags = {kind: stream_handoff.StepFlags(torch.device("cuda", torch.cuda.current_device()), stand_in_jax,
                                            stand_in_jax.cuda_stream, layers=layers,
                                            release_aside=kind == "aside")
             for kind in releases}
    levels = [("alone", 0, None), ("+wait", 1, None), ("+patch", 2, None)]
    levels += [(f"+release {kind}", 3, flags[kind]) for kind in releases]
    print(f"history {history}, {layers} layers, sleep {compute_ms} ms a layer; medians of trials "
          f"{WARMUP + 1}..{trials} (us)")
    stretch = sleep_stretch(work, compute, trials)
    print("one layer's compute: " + ", ".join(f"{name} {us:.1f}" for name, us in stretch.items()), flush=True)
    for kind in streams:
        stream = bench.torch_stream(kind)
        base = None
        for name, level, flag in levels:
            def step():
                step_flags = flag or flags[releases[0]]
                if level >= 3:
                    step_flags.next_step(stream)
                for layer in range(layers):
                    compute()
                    work.write(layer)
                    if level >= 1:
                        step_flags.torch_after(stream, layer)
                    if level >= 2:
                        adapter_module.patch_chunk(workspace, work.records, runs=runs)
                    if level >= 3:
                        flag.release(stream, layer)
                    workspace[:1].sum()
            times = [_timed(step, stream) for _ in range(trials)][WARMUP:]
            us = statistics.median(times)
            base = us if base is None else base
            print(f"{kind:>7} {name:>16}: step {us:8.1f} (spread {max(times) - min(times):5.1f}), "
                  f"added a layer {(us - base) / layers:5.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=262144)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=1.0)
    ap.add_argument("--streams", type=lambda t: t.split(","), default=["side", "default"])
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--release", type=lambda t: t.split(","), default=["aside", "torch"],
                    help="where the release's flag write goes: aside (a stream of its own) and/or torch")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("handoff_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    bad = [r for r in args.release if r not in ("aside", "torch")]
    if bad:
        ap.error(f"--release: expected aside and/or torch, got {bad}")
    run(args.history, args.layers, args.compute_ms, args.streams, args.trials, args.release)
    return 0


if __name__ == "__main__":
    sys.exit(main())
