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
# NVIDIA H200, printed by `python -m ckv_jax.benchmarks.tune --table-from <files>` from the sweeps
# benchmarks/results/h200_2026-12-03/8_device_timeline_dequant_v3/tune_{gathers,slots_writer,
# small_packs}.json (gathers) and .../10_fp8_tile_division_e2m1_split/tune_writer_call3.json
# (writer), ranked by device-timeline time (`ckv_jax.benchmarks.timing`).
TABLE: dict[tuple[str, str], tuple[tuple[int, tuple[str, ...], dict[str, dict[str, Any]]], ...]] = {
    ('gather_dequant', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (415236096, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
    ),
    ('gather_records', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (40038580, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (80077161, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 4, 'rows_per_tile': 8}}),
        (226492416, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
        (640617292, ('pallas_triton', 'pallas_mosaic_gpu', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
    ),
    ('gather_slots', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
        (14155776, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
        (320308646, ('pallas_triton', 'xla'),
         {'pallas_triton': {'evict_first': False, 'max_piece_bytes': 512, 'num_warps': 2, 'rows_per_tile': 4}}),
    ),
    ('write_records', 'NVIDIA H200'): (
        (0, ('pallas_triton', 'xla'),
         {'pallas_triton': {'num_warps': 4, 'tokens_per_block': 4}}),
        (52035584, ('pallas_triton', 'xla'),
         {'pallas_triton': {'num_warps': 4, 'tokens_per_block': 8}}),
        (294357714, ('pallas_triton', 'xla'),
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


def pick(op: str, choose, implementation, device: jax.Device, cache_bytes: int, work_bytes: int, *,
         config_type, interpret: bool = False, config=None, skip: tuple[str, ...] = ()):
    """(implementation, config) of `op` on `device`: `choose` (a registry's `_registry.choose`)
    over the measured order for `work_bytes`, whose `skip` names are left out (they still run when
    asked for by name), and the caller's config, else the tuned one, else None (the kernel's
    default)."""
    choice = lookup(op, device, work_bytes)
    order = None if choice.order is None else tuple(n for n in choice.order if n not in skip)
    impl = choose(implementation, device, cache_bytes, interpret=interpret, tuned_order=order)
    return impl, config_for(choice, impl.name, config_type, config)


def check_power_of_two_fields(config, names) -> None:
    """Config fields that must be positive powers of two (tile sizes, warps): TypeError for a
    non-int, ValueError otherwise."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v <= 0 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v}")


def config_for(choice: Choice, implementation: str, config_type, given=None):
    """`given` if the caller passed one, else the tuned config of `implementation`, else None."""
    if given is not None:
        return given
    fields = choice.configs.get(implementation)
    return config_type(**fields) if fields else None
