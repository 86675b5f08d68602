"""Host timeline of the torch adapter's layer calls, from JAX's profiler (its host tracer sees
inside a dispatch: argument parsing, PJRT's execute, each thunk's launch, the in-program
callback, the completion callback).

    python tools/adapter_host_timeline.py [--history N] [--depth D] [--prefetch-programs P]
        [--cache-write engine|adapter] [--compute-ms X] [--python | --rounds R | --sampled STEPS] > out.txt

Runs `interop.bench.Workload` (one request, D = 1, fp8_ds_mla, 8 layers, 4 ms of
`torch.cuda._sleep` per layer on torch's default stream, so the host runs far ahead of the GPU),
three warm steps, then two steps of the bench's own layer loop under `jax.profiler.trace`, with
the adapter's `set_current_chunk` and `gather` annotated.  Prints, per name, the median over the
traced layers of the time its events take inside one `gather` (an event counts in each of its
parents of other names), then every event of two layers' `gather` with its offset, and the
longer events of one `begin_step`.  The host tracer itself adds time to every event it records:
compare pieces with each other, not with untraced timings.  With --python: cProfile of the same
layer calls instead (the Python functions by their own time per layer).  With --rounds R: R traces
of two steps each in one process, and per name its median inside one `gather` in every round,
side by side (which piece moves when the host time of a layer moves between rounds).

With --sampled STEPS: the layer loop runs STEPS steps, each drained, under py-spy (`--py-spy`,
default `py-spy` on the PATH), which samples the Python and native stacks from outside and adds
no code to the process (it pauses the process for each sample, so the loop's host times run
longer than unsampled; read the shares).  Prints the host time per layer in rounds of 25 steps
and, of the samples inside the adapter's calls (compiles left out), the share in PJRT's execute
of the layer program, in JAX's jit call around it, in torch's calls, in other JAX calls and in
ckv-jax's own Python, then the deepest ckv-jax source line of each sample by share.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import torch  # noqa: E402
from jax.profiler import ProfileData, ProfileOptions, TraceAnnotation  # noqa: E402

from interop import bench  # noqa: E402


def annotated(adapter):
    """`adapter` with its per-layer calls marked in the trace (the bench's own loop runs them)."""
    for name in ("set_current_chunk", "gather"):
        setattr(adapter, name, jax.profiler.annotate_function(getattr(adapter, name), name="layer." + name))
    return adapter


def host_events(work: bench.Workload, adapter, compute, steps: int = 2) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of the dispatching thread's events over `steps` traced steps."""
    for _ in range(3):
        work.begin_step(adapter)
        work.layers(adapter, compute)
    torch.cuda.synchronize()
    options = ProfileOptions()
    options.host_tracer_level = 3
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, profiler_options=options):
            for _ in range(steps):
                with TraceAnnotation("step.begin_step"):
                    work.begin_step(adapter)
                work.layers(adapter, compute)
            torch.cuda.synchronize()
        data = ProfileData.from_file(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0])
        threads = [[(e.start_ns, e.duration_ns, e.name) for e in line.events]
                   for plane in data.planes if plane.name == "/host:CPU" for line in plane.lines]
    # the dispatching thread is the one that recorded the annotations
    main = next(t for t in threads if any(name == "layer.gather" for _, _, name in t))
    return sorted(main)


def per_name(events) -> dict[str, list[float]]:
    """name -> the us its events take inside each traced `gather` (an event inside one of the same
    name, as jit's two nested PjitFunction, counts once), with "= layer.gather" the calls themselves."""
    per = collections.defaultdict(list)
    for start, dur, _ in (e for e in events if e[2] == "layer.gather"):
        inside = [e for e in events if e[0] >= start and e[0] + e[1] <= start + dur and e[2] != "layer.gather"]
        sums = collections.Counter()
        for e in inside:
            if not any(o is not e and o[2] == e[2] and o[0] <= e[0] and e[0] + e[1] <= o[0] + o[1] for o in inside):
                sums[e[2]] += e[1]
        for name, ns in sums.items():
            per[name].append(ns / 1e3)
        per["= layer.gather"].append(dur / 1e3)
    return per


def rounds_table(rounds: list[dict[str, list[float]]], least_us: float = 3.0) -> str:
    """Per name (median of at least `least_us` in some round), its median in each round."""
    medians = [{k: statistics.median(v) for k, v in r.items() if v} for r in rounds]
    names = sorted({k for m in medians for k, v in m.items() if v >= least_us},
                   key=lambda k: -max(m.get(k, 0.0) for m in medians))
    lines = ["us per gather (median of each round's traced layers), one column per round"]
    lines += [" ".join(f"{m.get(k, float('nan')):7.1f}" for m in medians) + f"  {k[:90]}" for k in names]
    return "\n".join(lines)


def summary(events, shown=(9, 10)) -> str:
    gathers = [e for e in events if e[2] == "layer.gather"]
    per = per_name(events)
    lines = []
    for i, (start, dur, _) in enumerate(gathers):
        if i in shown:
            inside = [e for e in events if e[0] >= start and e[0] + e[1] <= start + dur and e[2] != "layer.gather"]
            lines.append(f"-- gather of traced layer {i}: {dur / 1e3:.1f} us")
            lines += [f"   +{(e[0] - start) / 1e3:7.1f} {e[1] / 1e3:7.1f}  {e[2][:110]}" for e in inside]
    for name in ("layer.set_current_chunk", "step.begin_step"):
        per["= " + name] += [e[1] / 1e3 for e in events if e[2] == name]
    begins = [e for e in events if e[2] == "step.begin_step"]
    if begins:
        start, dur, _ = begins[-1]
        lines.append(f"-- the last traced begin_step: {dur / 1e3:.1f} us; its events of 20 us or more")
        lines += [f"   +{(e[0] - start) / 1e3:7.1f} {e[1] / 1e3:7.1f}  {e[2][:110]}" for e in events
                  if e[0] >= start and e[0] + e[1] <= start + dur and e[1] >= 20_000 and e[2] != "step.begin_step"]
    table = [f"{'us (median)':>12} {'calls':>6}  name (inside one gather, or = the annotated call itself)"]
    table += [f"{statistics.median(v):12.1f} {len(v):6d}  {k[:100]}"
              for k, v in sorted(((k, v) for k, v in per.items() if v), key=lambda kv: -statistics.median(kv[1]))]
    return "\n".join(table + lines)


def python_profile(work: bench.Workload, adapter, compute, steps: int = 6, shown: int = 28) -> str:
    """cProfile of the layer calls alone (`set_current_chunk` + `gather`, the bench's loop) over
    `steps` steps: the Python functions by their own time, per layer (cProfile's own cost is in
    every figure; compare them with each other)."""
    import cProfile
    import io
    import pstats
    for _ in range(3):
        work.begin_step(adapter)
        work.layers(adapter, compute)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    calls = {name: getattr(adapter, name) for name in ("set_current_chunk", "gather")}

    def profiled(fn):
        def call(*args, **kwargs):
            profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                profile.disable()
        return call
    for name, fn in calls.items():
        setattr(adapter, name, profiled(fn))
    for _ in range(steps):                # each step drained: JAX's cap on programs in flight never waits
        work.begin_step(adapter)
        work.layers(adapter, compute)
        torch.cuda.synchronize()
    for name, fn in calls.items():
        setattr(adapter, name, fn)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    layers = steps * len(work.caches)
    out.write(f"cProfile of set_current_chunk + gather, {layers} layers; tottime / cumtime in us per layer\n")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:shown]
    for (path, line, fn), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{os.path.basename(path)}:{line}({fn})" if line else fn
        out.write(f"{1e6 * tottime / layers:9.1f} {1e6 * cumtime / layers:9.1f} {ncalls / layers:6.2f}  {where[:100]}\n")
    return out.getvalue()


# a sample's share, by the first rule whose frame pattern any of its frames below the adapter's call matches
SAMPLE_KINDS = (
    ("PJRT execute of the program", re.compile(r"LoadedExecutable(_|::)Execute")),
    ("JAX jit call around it", re.compile(r"PjitFunction|_cpp_pjit")),
    ("torch calls", re.compile(r"\(torch/|libtorch|THCP|THPVariable|c10::")),
    ("other JAX calls", re.compile(r"\(jax/|jaxlib|libjax")),
)
ADAPTER_CALLS = re.compile(r"TorchCkvAdapter\.(gather|set_current_chunk) \(interop/adapter\.py")
OWN_LINE = re.compile(r"\((interop|ckv_jax)/[\w/]+\.py:\d+\)")


def sampled_loop(work: bench.Workload, adapter, compute, steps: int) -> list[float]:
    """The bench's layer loop for `steps` drained steps after three warm ones: each round of 25
    steps' median host time of one layer's calls (us)."""
    for _ in range(3):
        work.step(adapter, compute)
    torch.cuda.synchronize()
    rounds, host = [], []
    for step in range(steps):
        work.begin_step(adapter)
        work.layers(adapter, compute, host)
        torch.cuda.synchronize()
        if step % 25 == 24 or step == steps - 1:
            rounds.append(1e6 * statistics.median(host))
            host = []
    return rounds


def sample_shares(raw_lines) -> str:
    """The report of py-spy's raw output (`frame;frame;... count` per line) over the samples
    inside the adapter's per-layer calls; compiles (a jit cache miss) are left out."""
    kinds, lines, total = collections.Counter(), collections.Counter(), 0
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        root = next((i for i, f in enumerate(frames) if ADAPTER_CALLS.search(f)), None)
        if root is None or any("cache_miss" in f or "compile" in f for f in frames[root:]):
            continue
        n, below = int(count), frames[root:]
        total += n
        kinds[next((name for name, rule in SAMPLE_KINDS if any(rule.search(f) for f in below)),
                   "ckv-jax Python")] += n
        own = [f for f in below if OWN_LINE.search(f)]
        lines[own[-1] if own else below[0]] += n
    if not total:
        return "no samples inside the adapter's calls"
    out = [f"{total} samples inside the adapter's calls; share by kind:"]
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in kinds.most_common()]
    out.append("the deepest ckv-jax line of each sample, by share:")
    out += [f"  {100 * n / total:5.1f}%  {name[:100]}" for name, n in lines.most_common(16)]
    return "\n".join(out)


def sampled(args) -> int:
    """Runs this tool's loop (--loop-only) under py-spy, then reports.  This process only asks
    torch whether a GPU is there: JAX's GPU client, started here, would hold the child's memory."""
    if not torch.cuda.is_available():
        print("adapter_host_timeline needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    spy = shutil.which(args.py_spy)
    if spy is None:
        print(f"--sampled needs py-spy ({args.py_spy!r} is not on the PATH; pip install py-spy)", file=sys.stderr)
        return 2
    child = [sys.executable, os.path.abspath(__file__), "--loop-only", str(args.sampled), "--history",
             str(args.history), "--depth", str(args.depth), "--cache-write", args.cache_write,
             "--compute-ms", str(args.compute_ms)]
    if args.prefetch_programs is not None:
        child += ["--prefetch-programs", str(args.prefetch_programs)]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.txt")
        done = subprocess.run([spy, "record", "--native", "--rate", str(args.rate), "--format", "raw", "--output",
                               raw, "--", *child])
        if done.returncode or not os.path.exists(raw):
            print(f"py-spy or the sampled loop failed (exit code {done.returncode})", file=sys.stderr)
            return done.returncode or 1
        with open(raw) as f:
            print(sample_shares(f))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=1 << 20, help="history tokens (default %(default)s)")
    ap.add_argument("--depth", type=int, default=2, help="prefetch depth (default %(default)s)")
    ap.add_argument("--prefetch-programs", type=int, default=None,
                    help="persistent programs of a prefetch's pack, 0 the full grid "
                         "(default: the adapter's, half the SMs)")
    ap.add_argument("--python", action="store_true",
                    help="cProfile the layer calls' Python instead of tracing with JAX's profiler")
    ap.add_argument("--rounds", type=int, default=0,
                    help="trace this many times and compare the pieces' medians between the traces")
    ap.add_argument("--sampled", type=int, default=0, metavar="STEPS",
                    help="run STEPS steps of the layer loop under py-spy and report where the host time goes")
    ap.add_argument("--loop-only", type=int, default=0, metavar="STEPS", help=argparse.SUPPRESS)
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy executable for --sampled")
    ap.add_argument("--rate", type=int, default=200, help="py-spy's samples per second (default %(default)s)")
    ap.add_argument("--cache-write", choices=bench.CACHE_WRITES, default="engine",
                    help="who writes each layer's cache (default %(default)s)")
    ap.add_argument("--compute-ms", type=float, default=4.0,
                    help="torch.cuda._sleep per layer, ms (default %(default)s)")
    args = ap.parse_args(argv)
    if args.sampled:
        return sampled(args)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("adapter_host_timeline needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    work = bench.Workload(args.history, 4096, 8, cache_write=args.cache_write)
    print(f"history {args.history}, depth {args.depth}, prefetch programs {args.prefetch_programs}, "
          f"cache write {args.cache_write}, {args.compute_ms} ms of sleep a layer, "
          f"jax {jax.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    compute = bench.compute_kernels(args.compute_ms)["sleep"]
    if args.loop_only:
        adapter = work.adapter(args.depth, args.prefetch_programs)
        start = time.perf_counter()
        rounds = sampled_loop(work, adapter, compute, args.loop_only)
        print(f"host us per layer, median of each 25 steps ({time.perf_counter() - start:.1f} s): "
              + " ".join(f"{r:.0f}" for r in rounds), flush=True)
    elif args.python:
        adapter = work.adapter(args.depth, args.prefetch_programs)
        print(python_profile(work, adapter, compute))
    elif args.rounds:
        adapter = annotated(work.adapter(args.depth, args.prefetch_programs))
        print(rounds_table([per_name(host_events(work, adapter, compute)) for _ in range(args.rounds)]))
    else:
        adapter = annotated(work.adapter(args.depth, args.prefetch_programs))
        print(summary(host_events(work, adapter, compute)))
    adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
