"""Shared pieces of the benchmark commands: which implementations a sweep runs, progress lines,
and the ending (JSON file, summary table, exit status)."""
from __future__ import annotations

import json
import sys
import time

import jax

# (header, key, width, format) of the columns of a benchmark row; the device_* ones are absent
# where there is no device timeline (CPU), and print as "-"
_COLUMNS = [("impl", "implementation", 19, "s"), ("mode", "mode", 9, "s"), ("us", "us", 9, ".1f"),
            ("GB/s", "gbps", 7, ".3g"), ("copy", "ceiling_gbps", 7, ".3g"), ("%copy", "pct_of_copy", 6, ".0f"),
            ("dev us", "device_us", 9, ".1f"), ("%copy", "device_pct_of_copy", 6, ".0f"), ("exact", "exact", 5, "")]


def timing_text(row: dict) -> str:
    """One row's times for a progress line: host clock, then the device timeline if measured.
    Rates keep three significant digits (a slow CPU run is 0.0412 GB/s, never "0 GB/s")."""
    text = f"{row['us']:.1f} us {row['gbps']:.3g} GB/s"
    text += " (interpret mode)" if row.get("mode") == "interpret" else f" ({row['pct_of_copy']:.0f}% of copy)"
    if "device_us" in row:
        text += f", device {row['device_us']:.1f} us ({row['device_pct_of_copy']:.1f}% of copy)"
    return text


def _cell(row: dict, key: str, width: int, fmt: str) -> str:
    if row.get(key) is None:
        return f"{'-':>{width}}"
    if fmt and fmt != "s":
        return f"{row[key]:>{width}{fmt}}"
    return f"{str(row[key]):<{width}}"


def run_mode(op, name: str, device, nbytes: int, interpret: bool, log) -> str | None:
    """How a sweep runs implementation `name` of KernelOp `op` on `device` for a buffer of
    `nbytes`: "compiled" where it is supported, "interpret" for a Pallas implementation off its
    hardware when the sweep asked for interpret mode and it runs interpreted here, else None
    (skipped, with the reason logged)."""
    impl = op.implementation(name)
    ok, why = impl.supported_on(device, nbytes, False)
    if ok:
        return "compiled"
    if interpret and name != "xla":
        ok, why = impl.supported_on(device, nbytes, True)
        if ok:
            return "interpret"
        log(f"  {op.name}: skip {name} in interpret mode ({why})")
        return None
    log(f"  {op.name}: skip {name} ({why}" + ("; --interpret runs it in interpret mode)" if name != "xla" else ")"))
    return None


class Progress:
    """`[i/N] what  elapsed, about S s left` lines on stderr, one per finished unit of work."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def step(self, what: str):
        self.done += 1
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {what}: {elapsed:.0f} s elapsed, about {left:.0f} s left",
              file=sys.stderr, flush=True)


def finish(results: list[dict], leading: list[tuple[str, str, int]], json_path: str | None) -> int:
    """Write `results` to `json_path` (if given), print the table with the `leading` columns
    (header, key, width) first, and return 0 iff every row was exact."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                           results=results), f, indent=1)
    cols = [(h, k, w, "s") for h, k, w in leading] + _COLUMNS
    print("\n" + " ".join(f"{h:>{w}}" if f and f != "s" else f"{h:<{w}}" for h, _, w, f in cols))
    for r in results:
        print(" ".join(_cell(r, k, w, f) for _, k, w, f in cols))
    return 0 if all(r["exact"] for r in results) else 1
