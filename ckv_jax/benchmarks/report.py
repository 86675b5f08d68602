"""Shared ending of the benchmark commands: JSON file, summary table, exit status."""
from __future__ import annotations

import json

import jax

# (header, key, width, format) of the columns every benchmark row has
_COLUMNS = [("impl", "implementation", 19, "s"), ("us", "us", 9, ".1f"), ("GB/s", "gbps", 6, ".0f"),
            ("copy", "ceiling_gbps", 6, ".0f"), ("%copy", "pct_of_copy", 6, ".0f"), ("exact", "exact", 5, "")]


def finish(results: list[dict], leading: list[tuple[str, str, int]], json_path: str | None) -> int:
    """Write `results` to `json_path` (if given), print the table with the `leading` columns
    (header, key, width) first, and return 0 iff every row was exact."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)
    cols = [(h, k, w, "s") for h, k, w in leading] + _COLUMNS
    print("\n" + " ".join(f"{h:>{w}}" if f and f != "s" else f"{h:<{w}}" for h, _, w, f in cols))
    for r in results:
        print(" ".join(f"{r[k]:>{w}{f}}" if f and f != "s" else f"{str(r[k]):<{w}}" for _, k, w, f in cols))
    return 0 if all(r["exact"] for r in results) else 1
