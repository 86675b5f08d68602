"""Kernel timeline of the torch adapter's step, per CUDA stream, from torch's profiler.

    python tools/adapter_trace.py --out trace            # -> trace.png, trace.json
    python tools/adapter_trace.py --code DIR --out old   # the same workload on another checkout
    python tools/adapter_trace.py --summarize trace.json  # the per-layer phases of a saved run

Runs `interop.bench.Workload` (one request, D = 1, fp8_ds_mla) with `torch.cuda._sleep` compute
(or `--compute matmul`: bf16 matmuls that fill every SM) on a torch stream, two warm steps, then
one step's layers per depth under `torch.profiler` with CUDA activities (which records every
kernel and copy of the process, XLA's included).  The PNG has a panel per depth, a lane per
stream and a bar per kernel; the JSON lists the kernels (stream, name, start and duration in us
from the step's first GPU activity).  Per depth it prints how long the gathers and torch's
compute kernels took while they overlapped one another and while they ran alone, which is
where SM contention shows, and the phases of each layer boundary on torch's stream (compute end
to cache write, the write, to the consumer, on to the next compute; whether JAX's patch started
before the write; with `--cache-write adapter`, JAX's write and patch instead), which show what
of a layer stays exposed at depth >= 1.  `--compute-alone` adds a panel of the same step without
the adapter (the bench's compute-alone baseline), whose layer gaps the depths' are measured against.
--code DIR puts DIR first on the import path for ckv_jax / interop / pallas_kernels, while the
workload still comes from this checkout's interop/bench.py (it uses only the adapter's public
calls, and passes `begin_step` a host block table), so two versions of the adapter run the same
step.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernels_of(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = [dict(stream=int(e["args"].get("stream", -1)), name=e["name"], start=float(e["ts"]), dur=float(e["dur"]))
           for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    t0 = min((k["start"] for k in out), default=0.0)
    for k in out:
        k["start"] -= t0
    return sorted(out, key=lambda k: k["start"])


def category(name: str) -> str:
    if "ckv_gather" in name:
        return "gather"
    if "ckv_write" in name:
        return "patch"
    if any(k in name.lower() for k in ("sleep", "spin", "gemm", "xmma", "nvjet", "cutlass")):
        return "torch compute"
    if "memcpy" in name.lower() or name.startswith("Memcpy") or "copy" in name.lower():
        return "copy"
    return "other"


def contention(ks: list[dict]) -> str:
    """Median duration of gathers and of torch's compute kernels that overlapped a kernel of the
    other kind, against those that ran without one (us)."""
    def overlaps(k, others):
        return any(o["start"] < k["start"] + k["dur"] and k["start"] < o["start"] + o["dur"] for o in others)
    lines = []
    kinds = {c: [k for k in ks if category(k["name"]) == c] for c in ("gather", "torch compute")}
    for mine, other in (("gather", "torch compute"), ("torch compute", "gather")):
        split = {True: [], False: []}
        for k in kinds[mine]:
            split[overlaps(k, kinds[other])].append(k["dur"])
        cells = [f"{'beside' if key else 'alone'} {len(v)} x {statistics.median(v):.1f} us"
                 for key, v in split.items() if v]
        lines.append(f"  {mine}: " + ", ".join(cells))
    return "\n".join(lines)


def chains(ks: list[dict]) -> list[float]:
    """Per layer, us from the end of torch's cache write to the start of torch's consumer: on
    torch's compute stream (the one with the compute kernels) each layer is its compute
    kernel(s), the cache write, then the consumer; at depth 0 the span holds the layer's whole
    gather, with the prefetch only the hand-offs and the patch that torch still waits for."""
    compute = [k for k in ks if category(k["name"]) == "torch compute"]
    if not compute:
        return []
    stream = compute[0]["stream"]
    mine = [k for k in ks if k["stream"] == stream]
    out = []
    for i, k in enumerate(mine[:-2]):
        if category(k["name"]) == "torch compute" and category(mine[i + 1]["name"]) != "torch compute":
            write, consumer = mine[i + 1], mine[i + 2]
            out.append(consumer["start"] - write["start"] - write["dur"])
    return out


def _boundaries(ks: list[dict]):
    """(compute end, next compute start, torch's kernels between them) per boundary between two
    of torch's compute kernels, on the stream of the first."""
    compute = [k for k in ks if category(k["name"]) == "torch compute"]
    for a, b in zip(compute, compute[1:]):
        end, nxt = a["start"] + a["dur"], b["start"]
        yield end, nxt, [k for k in ks if k["stream"] == compute[0]["stream"] and end <= k["start"] < nxt]


def layer_phases(ks: list[dict]) -> list[dict]:
    """Per boundary between two layers' compute on torch's compute stream (us): `to_write` from
    the compute's end to torch's next kernel (the cache write), `write` its duration,
    `patch_first` whether JAX's patch of the slot (the first `ckv_write` kernel that starts after
    the compute ends or during the cache write) started before the cache write did,
    `to_consumer` from the later end of the write and the patch (the write's end where there is no
    patch) to torch's next kernel (the consumer), `to_next` from there to the next compute, and
    `total` compute end to next compute start.  With the step program and the engine's writes
    torch's own patch of the slot (a device-to-device memcpy) comes between the write and the
    consumer, in `to_consumer`.  Layers that do not follow the pattern (a compute kernel not
    followed by a write and a consumer on torch's stream) are skipped."""
    out = []
    for end, nxt, mine in _boundaries(ks):
        after_write = [k for k in mine[1:] if not k["name"].startswith("Memcpy")]
        if not after_write:
            continue
        write, consumer = mine[0], after_write[0]
        write_end = write["start"] + write["dur"]
        patches = [k for k in ks if category(k["name"]) == "patch" and end <= k["start"] < write_end]
        patch = patches[0] if patches else None
        last_end = write_end if patch is None else max(write_end, patch["start"] + patch["dur"])
        out.append(dict(to_write=write["start"] - end, write=write["dur"],
                        patch_first=None if patch is None else patch["start"] < write["start"],
                        to_consumer=consumer["start"] - last_end, to_next=nxt - consumer["start"],
                        total=nxt - end))
    return out


def jax_write_phases(ks: list[dict]) -> list[dict]:
    """`layer_phases` for steps where the adapter writes the caches (`--cache-write adapter`):
    per boundary between two computes on torch's stream (us), `to_write` from the compute's end
    to JAX's first `ckv_write` kernel after it (the cache write, or the patch), `write` from there
    to the end of the last `ckv_write` kernel that starts before torch's next kernel (the
    consumer), `to_consumer` from that end to the consumer, `to_next` and `total` as in
    `layer_phases`.  Boundaries without a JAX write or a consumer are skipped."""
    out = []
    for end, nxt, mine in _boundaries(ks):
        if not mine:
            continue
        consumer = mine[0]
        writes = [k for k in ks if category(k["name"]) == "patch" and end <= k["start"] < consumer["start"]]
        if not writes:
            continue
        write_end = max(k["start"] + k["dur"] for k in writes)
        out.append(dict(to_write=writes[0]["start"] - end, write=write_end - writes[0]["start"],
                        to_consumer=consumer["start"] - write_end, to_next=nxt - consumer["start"], total=nxt - end))
    return out


def _medians(phases: list[dict]) -> dict:
    """The median of each timed phase of `layer_phases` or `jax_write_phases`."""
    return {key: statistics.median(p[key] for p in phases) for key in ("to_write", "write", "to_consumer", "to_next",
                                                                      "total")}


def jax_write_summary(phases: list[dict]) -> str:
    """The medians of `jax_write_phases`, one line."""
    if not phases:
        return "  JAX write phases: none (no compute kernels followed by JAX's writes and torch's consumer)"
    med = _medians(phases)
    return (f"  JAX write phases over {len(phases)} boundaries (medians, us): compute end -> JAX's write "
            f"{med['to_write']:.1f}, cache write and patch {med['write']:.1f}, -> consumer {med['to_consumer']:.1f}, "
            f"consumer -> next compute {med['to_next']:.1f}, compute to compute {med['total']:.1f}")


def phase_lines(ks: list[dict], cache_write: str) -> str:
    """The phase summary of a step whose caches the engine or the adapter wrote."""
    return phases_summary(layer_phases(ks)) if cache_write == "engine" else jax_write_summary(jax_write_phases(ks))


def phases_summary(phases: list[dict]) -> str:
    """The medians of `layer_phases` and how often the patch went first, one line."""
    if not phases:
        return "  layer phases: none (no compute kernels followed by torch's cache write and consumer)"
    med = _medians(phases)
    order = [p["patch_first"] for p in phases if p["patch_first"] is not None]
    patch = f", patch before the cache write in {sum(order)} of {len(order)}" if order else ", no patch"
    return (f"  layer phases over {len(phases)} boundaries (medians, us): compute end -> cache write "
            f"{med['to_write']:.1f}, cache write {med['write']:.1f}, -> consumer {med['to_consumer']:.1f}, "
            f"consumer -> next compute {med['to_next']:.1f}, compute to compute {med['total']:.1f}{patch}")


COLORS = {"torch compute": "tab:blue", "gather": "tab:orange", "patch": "tab:green", "copy": "tab:red",
          "other": "tab:gray"}


def plot(panels: dict, path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lanes = sum(len({k["stream"] for k in ks}) for ks in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.9 * lanes + 0.8 * len(panels)), squeeze=False)
    for ax, (label, ks) in zip(axes[:, 0], panels.items()):
        streams = sorted({k["stream"] for k in ks})
        for lane, s in enumerate(streams):
            for cat in COLORS:
                bars = [(k["start"] / 1e3, max(k["dur"], 1.0) / 1e3) for k in ks if k["stream"] == s
                        and category(k["name"]) == cat]
                if bars:
                    ax.broken_barh(bars, (lane - 0.35, 0.7), color=COLORS[cat], label=cat)
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
        ax.set_xlabel("ms from the step's first GPU activity")
        ax.set_title(label, fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=7, ncol=len(unique))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _profiled_kernels(prof) -> list[dict]:
    """The kernels of a finished `torch.profiler.profile` (see `kernels_of`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return kernels_of(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=ROOT, help="checkout whose ckv_jax/interop run (default: this one)")
    ap.add_argument("--out", help="output prefix: <out>.png and <out>.json (required unless --summarize)")
    ap.add_argument("--summarize", nargs="+", metavar="JSON",
                    help="print the per-layer phases of saved <out>.json files instead of running a step")
    ap.add_argument("--history", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--latents", choices=["in-place", "copied"], default="in-place",
                    help="chunk latents written into the adapter's chunk buffers, or copied there per layer "
                         "(copied for a checkout older than chunk_buffers; default %(default)s)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--depths", default="0,2")
    ap.add_argument("--compute-ms", type=float, default=2.5, help="torch compute per layer, ms (default %(default)s)")
    ap.add_argument("--compute", choices=["sleep", "matmul"], default="sleep",
                    help="torch's compute: one spinning CTA, or matmuls that fill every SM (default %(default)s)")
    ap.add_argument("--label", default="", help="title of the picture")
    ap.add_argument("--stream", default="side", help="torch's stream: default, side or priority (default %(default)s)")
    ap.add_argument("--prefetch-programs", type=int, default=None,
                    help="persistent programs of a prefetch's pack, 0 the full grid "
                         "(default: the adapter's, half the SMs)")
    ap.add_argument("--compute-alone", action="store_true",
                    help="also trace the step without the adapter (compute, the engine's cache writes, the consumer)")
    ap.add_argument("--cache-write", choices=["engine", "adapter"], default="engine",
                    help="who writes each layer's cache: torch (the engine) or the adapter's gather (default %(default)s)")
    ap.add_argument("--ordering", choices=["cuda-events", "step-program"], default=None,
                    help="the adapter's ordering (default: the adapter's own; step-program needs "
                         "CUDA_MODULE_LOADING=EAGER, and with --cache-write engine only gathers)")
    ap.add_argument("--mark", choices=["before-write", "after-write"], default="before-write",
                    help="set_current_chunk before the layer's cache write or after it (default %(default)s)")
    args = ap.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            with open(path) as f:
                saved = json.load(f)
            for depth, ks in saved["kernels"].items():
                print(f"{path} {depth}")
                print(phase_lines(ks, "engine" if depth == "compute_alone" else saved.get("cache_write", "engine")))
        return 0
    if not args.out:
        ap.error("--out is required to run a step")
    sys.path.insert(0, os.path.abspath(args.code))
    import torch
    spec = importlib.util.spec_from_file_location("bench_workload", os.path.join(ROOT, "interop", "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    work = bench.Workload(args.history, args.chunk, args.layers, chunk_in_place=args.latents == "in-place",
                          mark_before_write=args.mark == "before-write",
                          **({} if args.cache_write == "engine" else dict(cache_write="adapter")))
    compute = bench.compute_kernels(args.compute_ms)[args.compute]
    torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")   # cuBLAS ready before any step
    panels, listing = {}, {}
    side = bench.torch_stream(args.stream)
    modes = {}                                    # panel -> who wrote its caches
    if args.compute_alone:
        with torch.cuda.stream(side):
            for _ in range(2):
                work.layers(None, compute)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                work.layers(None, compute)
                torch.cuda.synchronize()
        ks = _profiled_kernels(prof)
        label = f"compute alone (the engine's cache writes): {len(ks)} GPU activities"
        panels[label], listing["compute_alone"], modes[label] = ks, ks, "engine"
    for depth in [int(d) for d in args.depths.split(",")]:
        # options only when asked: an adapter older than them (--code) runs too
        asked = {key: value for key, value in (("prefetch_programs", args.prefetch_programs),
                                               ("ordering", args.ordering)) if value is not None}
        adapter = work.adapter(depth, **asked)
        with torch.cuda.stream(side):
            # the first step discovers the caches and compiles; a step program records its graph at
            # the second and replays it from the third, the traced one
            for _ in range(2):
                work.step(adapter, compute)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                work.begin_step(adapter)                # its prefetches belong to the step
                work.layers(adapter, compute)
                torch.cuda.synchronize()
        ks = _profiled_kernels(prof)
        ordering = getattr(adapter, "ordering", "dlpack (before cuda-events)")
        label = f"depth {depth} ({ordering}): {len(ks)} GPU activities"
        panels[label], listing[f"depth{depth}"], modes[label] = ks, ks, args.cache_write
        adapter.close()
    packs = {None: "the adapter's default", 0: "full-grid"}.get(args.prefetch_programs,
                                                                 f"{args.prefetch_programs}-program")
    title = args.label or (f"{args.layers} layers, {args.history} history + {args.chunk} chunk tokens, "
                           f"{args.compute} {args.compute_ms} ms/layer on torch's {args.stream} stream, "
                           f"{packs} prefetch packs, latents {args.latents}, marked {args.mark}, "
                           f"caches written by the {args.cache_write}")
    plot(panels, args.out + ".png", title)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(title=title, code=os.path.abspath(args.code), cache_write=args.cache_write, kernels=listing), f)
    for label, ks in panels.items():
        print(label)
        print(contention(ks))
        print(phase_lines(ks, modes[label]))
        span = chains(ks)
        if span:
            print(f"  cache write end -> torch's consumer: median {statistics.median(span):.1f} us, per layer "
                  + " ".join(f"{s:.1f}" for s in span))
        for k in ks:
            print(f"  s{k['stream']:<4} {k['start']:10.1f} {k['dur']:8.1f}  {k['name'][:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
