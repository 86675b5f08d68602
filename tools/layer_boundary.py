"""Where a layer's boundary goes in the torch adapter's step, on the GPU's clock, without a
profiler (torch's profiler inflates stream memory operations: BENCHMARKS.md, forty-first section).

`interop.bench`'s workload (one request of H history tokens plus a 4,096-token chunk,
fp8_ds_mla, D = 1, `torch.cuda._sleep` compute of X ms a layer) with three CUDA timing events on
torch's stream per layer: at the end of the layer's compute, after the adapter's `gather`
returned (torch past its wait for the workspace; the compute alone: after the engine's cache
write) and after the consumer (a one-row read of the workspace).  Printed per variant: the step
between an event before layer 0's compute and one after the last consumer, and, as medians over
layers 1..L-1 and the trials after the warm-up, compute end -> torch past its wait, -> consumer
done, and consumer done -> the next compute's end.  The events themselves are commands on
torch's stream and shift the hand-offs by a few microseconds: compare the rows of one run, and
take the hidden share from `python -m interop.bench`.

Variants: `alone` (compute, the engine's write and the consumer, no adapter); `adapter-d<N>`
(ordering "step-program", the program writes the caches); `engine-d<N>` (ordering
"step-program", cache_writes="engine": the engine writes, `gather` takes its records);
`events-d<N>` (ordering "cuda-events", the layer program writes).

    python tools/layer_boundary.py [--history 262144] [--layers 8] [--compute-ms 1] [--depths 0,2]
                                   [--streams side,default] [--trials 8]
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")      # the step program refuses lazy loading

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from interop import bench  # noqa: E402

WARMUP = 3          # trials left out: compiles, the program's first recordings as a CUDA graph


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _step(work: bench.Workload, adapter, compute, records: bool):
    """One step's layer loop with the events; adapter None: the compute alone."""
    compute()                                   # the previous step's tail
    if adapter is not None:
        work.begin_step(adapter)
    start = _event()
    ends, waited, consumed = [], [], []
    for layer, cache in enumerate(work.caches):
        compute()
        ends.append(_event())
        if adapter is None:
            work.write(layer)
            waited.append(_event())
            work.stand_in[:1].sum()
        else:
            if records:
                work.write(layer)
                ws = adapter.gather(layer, cache, records=work.records)
            else:
                adapter.set_current_chunk(*work.latents)
                ws = adapter.gather(layer, cache, write_cache=True)
            waited.append(_event())
            ws[:1].sum()
            del ws
        consumed.append(_event())
    end = _event()
    return start, end, ends, waited, consumed


def run(history: int, layers: int, compute_ms: float, depths, streams, trials: int):
    work = bench.Workload(history, 4096, layers, cache_write="adapter")
    compute = bench.compute_kernels(compute_ms)["sleep"]
    variants = {"alone": (None, False)}
    for depth in depths:
        variants[f"adapter-d{depth}"] = (work.adapter(depth, None, "step-program"), False)
        variants[f"events-d{depth}"] = (work.adapter(depth, None, "cuda-events"), False)
    work.cache_write = "engine"             # read when an adapter is made
    for depth in depths:
        variants[f"engine-d{depth}"] = (work.adapter(depth, None, "step-program"), True)
    print(f"history {history}, {layers} layers, sleep {compute_ms} ms a layer; medians over layers 1..{layers - 1} "
          f"of trials {WARMUP + 1}..{trials} (us)")
    for kind in streams:
        with torch.cuda.stream(bench.torch_stream(kind)):
            for name, (adapter, records) in variants.items():
                steps, to_wait, to_consumer, to_next = [], [], [], []
                for trial in range(trials):
                    start, end, ends, waited, consumed = _step(work, adapter, compute, records)
                    torch.cuda.synchronize()
                    if trial < WARMUP:
                        continue
                    steps.append(start.elapsed_time(end) * 1e3)
                    for layer in range(1, layers):
                        to_wait.append(ends[layer].elapsed_time(waited[layer]) * 1e3)
                        to_consumer.append(waited[layer].elapsed_time(consumed[layer]) * 1e3)
                    to_next += [consumed[layer].elapsed_time(ends[layer + 1]) * 1e3 for layer in range(layers - 1)]
                print(f"{kind:>7} {name:>12}: step {statistics.median(steps):8.1f}; compute end -> torch past its wait "
                      f"{statistics.median(to_wait):6.1f}; -> consumer done {statistics.median(to_consumer):6.1f}; "
                      f"consumer done -> next compute end {statistics.median(to_next):7.1f}", flush=True)
    for adapter, _ in variants.values():
        if adapter is not None:
            adapter.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=262144)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=1.0)
    ap.add_argument("--depths", type=lambda t: [int(x) for x in t.split(",")], default=[0, 2])
    ap.add_argument("--streams", type=lambda t: t.split(","), default=["side", "default"])
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_boundary needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    if args.layers < 2 or args.trials <= WARMUP or args.history <= 0 or args.compute_ms <= 0:
        print(f"expected --layers >= 2, --trials > {WARMUP}, a positive --history and --compute-ms", file=sys.stderr)
        return 2
    for kind in args.streams:
        bench.torch_stream(kind)                # raises naming a wrong stream kind
    run(args.history, args.layers, args.compute_ms, args.depths, args.streams, args.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
