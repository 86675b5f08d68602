"""Argument checks shared by the public entry points.

Two tiers: host checks of shapes and dtypes that cost nothing and always run, and opt-in data
checks (`validate=True`, or `CKV_JAX_VALIDATE=1` in the environment) that read index values
back to the host and therefore need concrete (non-traced) arrays.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ckv_jax.environment import env_bool

ENV_VALIDATE = "CKV_JAX_VALIDATE"
KV_C_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def validation_enabled(validate: bool | None) -> bool:
    """`validate` if given, else the CKV_JAX_VALIDATE environment variable."""
    if validate is not None:
        return bool(validate)
    return env_bool(ENV_VALIDATE, False)


def describe(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(jnp.shape(x))}"


def _require_array(name: str, x):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")


@functools.lru_cache(maxsize=None)
def _dtypes(dtypes: tuple) -> tuple:
    return tuple(jnp.dtype(d) for d in dtypes)


def check_array(name: str, x, dtypes, shape_pattern: str, ndim: int):
    """Reads attributes only (no array op): the one-call API runs it on every call."""
    _require_array(name, x)
    dtypes = _dtypes(tuple(dtypes))
    dtype = x.dtype if isinstance(x.dtype, np.dtype) else jnp.dtype(x.dtype)
    if dtype not in dtypes:
        want = " or ".join(d.name for d in dtypes)
        raise TypeError(f"{name}: expected {want}{shape_pattern}, got {describe(x)}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected rank {ndim} {shape_pattern}, got {describe(x)}")


def check_values(fmt, kv_c, k_pe) -> int:
    """Checks kv_c [T, nope_dim] and k_pe bf16[T, rope_dim]; returns T."""
    check_array("kv_c", kv_c, KV_C_DTYPES, f"[T, {fmt.nope_dim}]", 2)
    check_array("k_pe", k_pe, (jnp.bfloat16,), f"[T, {fmt.rope_dim}]", 2)
    if kv_c.shape[1] != fmt.nope_dim:
        raise ValueError(f"kv_c: expected [T, {fmt.nope_dim}] for format {fmt.name}, got {describe(kv_c)}")
    if k_pe.shape[1] != fmt.rope_dim:
        raise ValueError(f"k_pe: expected bfloat16[T, {fmt.rope_dim}] for format {fmt.name}, got {describe(k_pe)}")
    if kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"k_pe: expected the same T as kv_c ({kv_c.shape[0]}), got {describe(k_pe)}")
    return kv_c.shape[0]


def check_records(fmt, records, *, name: str = "records", rows: str = "T"):
    """uint8[rows, R] records of `fmt`; `name` and `rows` are what the error calls them."""
    check_array(name, records, (jnp.uint8,), f"[{rows}, {fmt.record_bytes}]", 2)
    if records.shape[1] != fmt.record_bytes:
        raise ValueError(f"{name}: expected uint8[{rows}, {fmt.record_bytes}] for format {fmt.name}, "
                         f"got {describe(records)}")


def check_cache(fmt, cache):
    pattern = f"[num_blocks, block_size, {fmt.record_bytes}]"
    check_array("cache", cache, (jnp.uint8,), pattern, 3)
    if cache.shape[2] != fmt.record_bytes:
        raise ValueError(f"cache: expected uint8{pattern} for format {fmt.name} "
                         f"({fmt.record_bytes}-byte records), got {describe(cache)}")


def check_slot_mapping(slot_mapping, num_tokens: int):
    _require_array("slot_mapping", slot_mapping)
    if jnp.dtype(slot_mapping.dtype) != jnp.int32:
        raise TypeError(f"slot_mapping: expected int32[{num_tokens}], got {describe(slot_mapping)} "
                        "(convert explicitly after checking the range; int64 is never truncated silently)")
    if jnp.shape(slot_mapping) != (num_tokens,):
        raise ValueError(f"slot_mapping: expected int32[{num_tokens}] (one slot per token of kv_c), "
                         f"got {describe(slot_mapping)}")


def concrete(name: str, x) -> np.ndarray:
    """Host copy of `x` for data checks; a clear error when `x` is traced."""
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"{name}: validation mode reads values back to the host and needs a concrete "
                         f"array; call outside jax.jit or pass validate=False (or unset {ENV_VALIDATE})")
    return np.asarray(x)


def check_slot_values(slot_mapping, num_slots: int):
    """Every slot is -1 (skip) or in [0, num_slots), and valid slots are unique."""
    slots = concrete("slot_mapping", slot_mapping)
    bad = np.flatnonzero((slots < -1) | (slots >= num_slots))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"slot_mapping: entry {i} is {int(slots[i])}, expected -1 or a slot in "
                         f"[0, {num_slots}) ({bad.size} bad entries)")
    valid = slots[slots >= 0]
    uniq, counts = np.unique(valid, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[np.argmax(counts > 1)])
        where = np.flatnonzero(slots == dup).tolist()
        raise ValueError(f"slot_mapping: slot {dup} appears at entries {where}; valid slots must be unique")


def check_finite_scales(fmt, workspace, plan):
    """Opt-in: every record a rank contributed to the gathered workspace u8[D * P, R] has finite
    quantization scales (rows past a rank's total are padding and not checked).  A non-finite
    scale comes from a corrupt cache slot inside a request's valid prefix."""
    names = {"tile_scales_f32": np.float32, "group_scales_e4m3": None}
    segments = [s for s in fmt.layout.segments if s.name in names]
    if not segments:
        return
    ws = concrete("workspace", workspace)
    for owner in range(plan.world_size):
        count = int(plan.local_cu_seq_lens[owner, -1])
        rows = ws[owner * plan.padded_tokens: owner * plan.padded_tokens + count]
        for seg in segments:
            raw = np.ascontiguousarray(rows[:, seg.offset:seg.offset + seg.width])
            if seg.name == "tile_scales_f32":
                bad = ~np.isfinite(raw.view(np.float32)).all(axis=1)
            else:                                         # e4m3fn: 0x7F / 0xFF are its only NaNs
                bad = ((raw & 0x7F) == 0x7F).any(axis=1)
            hit = np.flatnonzero(bad)
            if hit.size:
                j = int(hit[0])
                raise ValueError(f"caches: rank {owner} local record {j} (workspace row "
                                 f"{owner * plan.padded_tokens + j}) has a non-finite {seg.name} scale; expected "
                                 "finite scales in every record of a request's valid prefix")
