"""Measured choice of implementation and tiles, per op, device kind and size: data, not code.

One JSON file per device kind in `pallas_kernels/tuned/` (shipped as package data), written by
`python tools/tune.py --table-out`:

    {"device_kind": "NVIDIA H200", "measured_by": "...",
     "ops": {"<op>": [{"min_work_bytes": int, "order": [name, ...], "configs": {name: {field: value}}}, ...]}}

A lookup takes, for the device kind, the entry with the largest `min_work_bytes` not above the
bytes the op moves; a device kind without a table gets `Entry()`: no measured order and no tiles,
so the op's default order and each kernel's default tiles apply.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any, Mapping

import jax

TABLE_DIR = pathlib.Path(__file__).parent / "tuned"


@dataclasses.dataclass(frozen=True)
class Entry:
    order: tuple[str, ...] = ()                          # fastest first; empty: the op's default order
    configs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)   # name -> tile fields


def table_path(device_kind: str) -> pathlib.Path:
    """The file of a device kind: its name lower-cased, runs of other characters as '_'."""
    return TABLE_DIR / (re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json")


@functools.cache
def table(device_kind: str) -> Mapping[str, tuple[tuple[int, Entry], ...]]:
    """op -> ((min_work_bytes, Entry), ...) sorted by min_work_bytes; {} without a file."""
    path = table_path(device_kind)
    if not device_kind or not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    if doc.get("device_kind") != device_kind:
        raise ValueError(f"{path}: expected device_kind {device_kind!r}, got {doc.get('device_kind')!r}")
    return {op: tuple(sorted(((int(row["min_work_bytes"]), Entry(tuple(row["order"]), row.get("configs", {})))
                              for row in rows), key=lambda row: row[0]))
            for op, rows in doc["ops"].items()}


def lookup(op: str, device: jax.Device, work_bytes: int) -> Entry:
    """The measured entry for `op` moving `work_bytes` (read + written) on `device`."""
    rows = table(getattr(device, "device_kind", "")).get(op, ())
    if not rows:
        return Entry()
    best = rows[0][1]                  # below the smallest measured size: its entry
    for min_bytes, entry in rows:
        if min_bytes <= work_bytes:
            best = entry
    return best
