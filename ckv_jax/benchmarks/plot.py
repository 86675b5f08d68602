"""`ckv-jax plot results.json [more.json ...]`: bandwidth as % of the copy ceiling, and prefill step
time vs depth (several files of one machine, e.g. separate kernel and prefill sweeps, plot together)."""
from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ckv-jax plot", description=__doc__)
    ap.add_argument("results", nargs="+", help="JSON files written by `ckv-jax bench`")
    ap.add_argument("--out-dir", default=".", help="where the PNG files go")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        ap.error("plot needs matplotlib: pip install 'ckv-jax[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, data = [], {}
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        results += data["results"]
    title = f"{data.get('device', '?')} (jax {data.get('jax', '?')})"
    written = []
    kernel = [r for r in results if "pct_of_copy" in r]
    if kernel:
        fig, ax = plt.subplots(figsize=(8, 5))
        series = {}
        for r in kernel:
            label = f"{r['op']} {r['format']} {r['implementation']}" + (f" {r['pattern']}" if "pattern" in r else "")
            series.setdefault(label, []).append((r["bytes_moved"] / 1e6, r["pct_of_copy"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("bytes moved per call (MB, read + write)")
        ax.set_ylabel("% of the copy ceiling of the same bytes")
        ax.axhline(100, color="grey", lw=0.8, ls="--")
        ax.set_title(f"CKV kernels vs copy ceiling: {title}")
        ax.legend(fontsize=6, ncol=2)
        path = os.path.join(args.out_dir, "bandwidth.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)
    steps = [r for r in results if r["op"] == "prefill_step"]
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(r["depth"]) for r in steps], [r["us"] / 1e3 for r in steps])
        r0 = steps[0]
        ax.set_xlabel("prefetch depth")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{r0['layers']} layers, context {r0['tokens']}, chunk {r0['chunk']}, D={r0['dcp']}\n{title}",
                     fontsize=9)
        path = os.path.join(args.out_dir, "prefill_depth.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)
    if not written:
        ap.error(f"{', '.join(args.results)}: no kernel or prefill results to plot")
    for path in written:
        print(f"wrote {path}")
    return 0
