"""Measured choice of implementation and config, per op, device kind and size.

`python -m ckv_jax.benchmarks.tune` times every implementation and every candidate config of an
op side by side on one device (each checked against its reference first) and prints its winners
in the form of TABLE; the rows below are pasted from such a run, named in BENCHMARKS.md
("Tuning table").  A lookup takes, for the device kind, the row with the largest `min_bytes`
not above the op's bytes moved; a device kind without rows gets the heuristic default: the
implementations in their registry order, each with its default config.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class Choice:
    order: tuple[str, ...] | None                 # fastest first; None: the registry's default order
    configs: Mapping[str, Mapping[str, Any]]      # implementation -> config fields for this size


DEFAULT = Choice(None, {})

# (op, device kind) -> rows (min_bytes, order, {implementation: config fields}), by min_bytes.
# NVIDIA H200: the four sweeps of 2026-12-03 (benchmarks/results/h200_2026-12-03/*/tune.json),
# printed by `python -m ckv_jax.benchmarks.tune --table-from <those files>`.
TABLE: dict[tuple[str, str], tuple[tuple[int, tuple[str, ...], dict[str, dict[str, Any]]], ...]] = {
    ('gather_dequant', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (207618048, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 8, 'rows_per_tile': 16}}),
        (830472192, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
    ),
    ('gather_records', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
        (40038580, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (80077161, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 8, 'rows_per_tile': 32}}),
        (160154323, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (320308646, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (640617292, ('pallas_mosaic_gpu', 'pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
    ),
    ('gather_slots', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 16}}),
        (5004822, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 8, 'rows_per_tile': 32}}),
        (40038580, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 4}}),
        (320308646, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 8, 'rows_per_tile': 16}}),
    ),
    ('write_records', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'num_warps': 4, 'tokens_per_block': 8}}),
        (73589428, ('pallas_triton', 'xla'),
         {'pallas_triton': {'num_warps': 2, 'tokens_per_block': 4}}),
        (832569344, ('pallas_triton', 'xla'),
         {'pallas_triton': {'num_warps': 2, 'tokens_per_block': 4}}),
    ),
}


def lookup(op: str, device: jax.Device, work_bytes: int) -> Choice:
    """The measured choice for `op` moving `work_bytes` (read + written) on `device`."""
    rows = TABLE.get((op, getattr(device, "device_kind", "")))
    if not rows:
        return DEFAULT
    best = rows[0]
    for row in rows:
        if row[0] <= work_bytes:
            best = row
    _, order, configs = best
    return Choice(order, configs)


def config_for(choice: Choice, implementation: str, config_type, given=None):
    """`given` if the caller passed one, else the tuned config of `implementation`, else None."""
    if given is not None:
        return given
    fields = choice.configs.get(implementation)
    return config_type(**fields) if fields else None
