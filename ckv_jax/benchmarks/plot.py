"""`ckv-jax plot results.json [more.json ...]`: bandwidth as % of the copy ceiling, prefill step
time vs depth, and attention TFLOP/s vs heads (several files of one machine, e.g. separate kernel
and prefill sweeps, plot together)."""
from __future__ import annotations

import argparse
import json
import os


LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def load(paths, error):
    """The results and the metadata of the last file; `error(message)` for a missing or malformed one."""
    results, meta = [], {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            error(f"{path}: {e.strerror}")
        except json.JSONDecodeError as e:
            error(f"{path}: not JSON ({e.msg} at line {e.lineno})")
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            error(f"{path}: expected the JSON of `ckv-jax bench` (an object with a results list)")
        results += data["results"]
        meta = data
    return results, meta


def line_styles(keys) -> dict:
    """(op, pattern, format, implementation) -> (colour index, line style, marker): colour per
    implementation, line style per format, marker per op and pattern, so two series differ in
    at least one of them."""
    impls = sorted({k[3] for k in keys})
    fmts = sorted({k[2] for k in keys})
    kinds = sorted({k[:2] for k in keys})
    return {k: (impls.index(k[3]) % 10, LINESTYLES[fmts.index(k[2]) % len(LINESTYLES)],
                MARKERS[kinds.index(k[:2]) % len(MARKERS)]) for k in keys}


def _limits(values, log=False):
    """Axis limits just around the data (a 10% margin; multiplicative on a log axis)."""
    lo, hi = min(values), max(values)
    if log:
        return lo / 1.3, hi * 1.3
    pad = 0.1 * (hi - lo) or 0.1 * abs(hi) or 1.0
    return lo - pad, hi + pad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ckv-jax plot", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON files written by `ckv-jax bench`")
    ap.add_argument("--out-dir", default=".", help="where the PNG files go")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        ap.error("plot needs matplotlib: pip install 'ckv-jax[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, data = load(args.results, ap.error)
    if not os.path.isdir(args.out_dir):
        ap.error(f"--out-dir {args.out_dir}: not a directory")
    title = f"{data.get('device', '?')} (jax {data.get('jax', '?')})"
    written = []

    def save(fig, name):
        path = os.path.join(args.out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)
    kernel = [r for r in results if r.get("pct_of_copy") is not None]
    if kernel:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        colors = plt.get_cmap("tab10")
        series = {}
        for r in kernel:
            key = (r["op"], r.get("pattern", ""), r["format"], r["implementation"])
            series.setdefault(key, []).append((r["bytes_moved"] / 1e6, r["pct_of_copy"]))
        styles = line_styles(series)
        for (op, pattern, fmt, impl), pts in sorted(series.items()):
            pts.sort()
            color, linestyle, marker = styles[(op, pattern, fmt, impl)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors(color), linestyle=linestyle,
                    marker=marker, label=f"{op}{' ' + pattern if pattern else ''} {fmt} {impl}")
        xs = [p[0] for pts in series.values() for p in pts]
        ys = [p[1] for pts in series.values() for p in pts]
        ax.set_xscale("log")
        ax.set_xlim(*_limits(xs, log=True))
        ax.set_ylim(*_limits(ys))
        ax.set_xlabel("bytes moved per call (MB, read + write)")
        ax.set_ylabel("% of the copy ceiling of the same bytes")
        if min(ys) <= 100 <= max(ys) * 1.1:
            ax.axhline(100, color="grey", lw=0.8, ls="--")
        ax.set_title(f"CKV kernels vs copy ceiling: {title}\ncolour: implementation, line: format, marker: op",
                     fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        save(fig, "bandwidth.png")
    steps = [r for r in results if r["op"] == "prefill_step"]
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        depths = [str(r["depth"]) for r in steps]
        ax.bar(depths, [r["us"] / 1e3 for r in steps], label="step")
        if all(r.get("gather_share_pct") is not None for r in steps):
            ax.bar(depths, [max(0.0, r["us"] * r["gather_share_pct"] / 1e5) for r in steps], hatch="//", color="tab:orange",
                   label="gathers exposed")
            ax.legend(fontsize=7)
        r0 = steps[0]
        ax.set_xlabel("prefetch depth")
        ax.set_ylabel("step time (ms)")
        mesh = f"mesh of {r0['dcp']} {data.get('backend', '?')} device(s) ({data.get('device', '?')})"
        shape = f", {r0['heads']} heads, top-k {r0['top_k']}, attention {r0['attention']}" if "heads" in r0 else ""
        ax.set_title(f"{r0['layers']} layers, context {r0['tokens']}, chunk {r0['chunk']}, D={r0['dcp']}{shape}\n"
                     f"{mesh}, jax {data.get('jax', '?')}", fontsize=9)
        save(fig, "prefill_depth.png")
    attention = [r for r in results if r["op"] == "attention"]
    if attention:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = plt.get_cmap("tab10")
        series = {}
        for r in attention:
            rate = r.get("device_tflops", r["tflops"])
            impl = r["implementation"] + (" bf16 keys" if r.get("keys") == "bf16" else "")
            series.setdefault(("attention", r.get("mode", ""), r["format"], impl), []).append(
                (r["heads"], rate))
        styles = line_styles(series)
        for key, pts in sorted(series.items()):
            pts.sort()
            color, linestyle, marker = styles[key]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors(color), linestyle=linestyle, marker=marker,
                    label=" ".join(k for k in key[1:] if k))
        matmul = attention[0].get("device_matmul_tflops", attention[0]["matmul_tflops"])
        ax.axhline(matmul, color="grey", lw=0.8, ls="--", label=f"bf16 matmul {matmul:.3g} TFLOP/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query heads")
        clock = ", device timeline" if "device_tflops" in attention[0] else ""
        ax.set_ylabel(f"TFLOP/s (2 T H K (576 + 512)){clock}")
        r0 = attention[0]
        ax.set_title(f"sparse-MLA attention, T={r0['tokens']}, top-k {r0['top_k']}, {r0['rows']} records: {title}",
                     fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "attention.png")
    if not written:
        ap.error(f"{', '.join(args.results)}: no kernel, prefill or attention results to plot")
    for path in written:
        print(f"wrote {path}")
    return 0
