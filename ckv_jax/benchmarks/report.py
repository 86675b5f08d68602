"""Shared ending of the benchmark commands: JSON file, summary table, exit status."""
from __future__ import annotations

import json

import jax

# (header, key, width, format) of the columns of a benchmark row; the device_* ones are absent
# where there is no device timeline (CPU), and print as "-"
_COLUMNS = [("impl", "implementation", 19, "s"), ("us", "us", 9, ".1f"), ("GB/s", "gbps", 6, ".0f"),
            ("copy", "ceiling_gbps", 6, ".0f"), ("%copy", "pct_of_copy", 6, ".0f"),
            ("dev us", "device_us", 9, ".1f"), ("%copy", "device_pct_of_copy", 6, ".0f"), ("exact", "exact", 5, "")]


def timing_text(row: dict) -> str:
    """One row's times for a progress line: host clock, then the device timeline if measured."""
    text = f"{row['us']:.1f} us {row['gbps']:.0f} GB/s ({row['pct_of_copy']:.0f}% of copy)"
    if "device_us" in row:
        text += f", device {row['device_us']:.1f} us ({row['device_pct_of_copy']:.1f}% of copy)"
    return text


def _cell(row: dict, key: str, width: int, fmt: str) -> str:
    if key not in row:
        return f"{'-':>{width}}"
    if fmt and fmt != "s":
        return f"{row[key]:>{width}{fmt}}"
    return f"{str(row[key]):<{width}}"


def finish(results: list[dict], leading: list[tuple[str, str, int]], json_path: str | None) -> int:
    """Write `results` to `json_path` (if given), print the table with the `leading` columns
    (header, key, width) first, and return 0 iff every row was exact."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)
    cols = [(h, k, w, "s") for h, k, w in leading] + _COLUMNS
    print("\n" + " ".join(f"{h:>{w}}" if f and f != "s" else f"{h:<{w}}" for h, _, w, f in cols))
    for r in results:
        print(" ".join(_cell(r, k, w, f) for _, k, w, f in cols))
    return 0 if all(r["exact"] for r in results) else 1
