"""Configuration and memory plan of the full-CKV gather with depth-N cross-layer prefetch.

Per execution lane the pool holds one local staging region of C records and S = depth + 1
gathered slots of D * C records: `(1 + S * D) * C * record_bytes` bytes.  `memory_plan` computes
it from the configuration alone, so an engine can reserve the pool before it sizes its KV
cache.  Depth is clamped to the largest value whose lane fits `workspace_mib` (0 = unlimited);
depth 0 keeps its synchronous slot even over budget.
"""
from __future__ import annotations

import dataclasses
import logging

from ckv_jax import formats
from ckv_jax.environment import env_bool, env_int
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS, capacity

log = logging.getLogger("ckv_jax.prefetch")

ENV_GATHER = "CKV_JAX_GATHER"
ENV_DEPTH = "CKV_JAX_PREFETCH_DEPTH"
ENV_WORKSPACE_MIB = "CKV_JAX_PREFETCH_WORKSPACE_MIB"
ENV_MIN_TOKENS = "CKV_JAX_GATHER_MIN_TOKENS"
ENV_MAX_TOKENS = "CKV_JAX_GATHER_MAX_TOKENS"
DEFAULT_WORKSPACE_MIB = 1024
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Full-CKV gather settings; every knob defaults to off / upstream's value."""
    enabled: bool = False
    depth: int = 0
    workspace_mib: int = DEFAULT_WORKSPACE_MIB
    min_tokens: int = DEFAULT_MIN_TOKENS
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self):
        for name in ("depth", "workspace_mib", "min_tokens", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if self.depth < 0:
            raise ValueError(f"depth: expected >= 0, got {self.depth}")
        if self.workspace_mib < 0:
            raise ValueError(f"workspace_mib: expected >= 0 (0 = unlimited), got {self.workspace_mib}")
        if self.min_tokens < 0 or self.max_tokens <= 0:
            raise ValueError(f"min_tokens, max_tokens: expected >= 0 and > 0, got {self.min_tokens}, {self.max_tokens}")

    @classmethod
    def from_env(cls, environ=None) -> "GatherConfig":
        """Read the CKV_JAX_* variables.  Non-numeric values raise; a negative depth or workspace
        budget falls back to 0 with a warning (as upstream does)."""
        return cls(enabled=env_bool(ENV_GATHER, False, environ),
                   depth=env_int(ENV_DEPTH, 0, environ, negative_to_zero=True),
                   workspace_mib=env_int(ENV_WORKSPACE_MIB, DEFAULT_WORKSPACE_MIB, environ, negative_to_zero=True),
                   min_tokens=env_int(ENV_MIN_TOKENS, DEFAULT_MIN_TOKENS, environ),
                   max_tokens=env_int(ENV_MAX_TOKENS, DEFAULT_MAX_TOKENS, environ))


def execution_lanes(ubatches: int = 1, speculative: bool = False) -> int:
    """Lanes = max(1, ubatches) * (2 if speculative decoding else 1)."""
    return max(1, ubatches) * (2 if speculative else 1)


def lane_bytes(world_size: int, capacity_rows: int, record_bytes: int, depth: int) -> int:
    return (1 + (depth + 1) * world_size) * capacity_rows * record_bytes


def depth_within_budget(requested: int, budget_bytes: int, world_size: int, capacity_rows: int,
                        record_bytes: int) -> int:
    """The largest depth <= requested whose lane fits the budget (budget <= 0: no limit); 0 if none."""
    if budget_bytes <= 0:
        return requested
    for depth in range(requested, -1, -1):
        if lane_bytes(world_size, capacity_rows, record_bytes, depth) <= budget_bytes:
            return depth
    return 0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    capacity: int           # C: local rows per rank
    depth: int              # after the budget clamp
    requested_depth: int
    slots: int              # S = depth + 1
    lanes: int
    lane_bytes: int
    total_bytes: int

    @property
    def clamped(self) -> bool:
        return self.depth < self.requested_depth


def memory_plan(layout: DcpLayout, format, *, max_num_seqs: int, config: GatherConfig = GatherConfig(),
                ubatches: int = 1, speculative: bool = False) -> MemoryPlan:
    """Bytes of the prefetch pool for this configuration (all lanes), before any allocation."""
    fmt = formats.get(format)
    cap = capacity(layout, config.max_tokens, max_num_seqs)
    depth = depth_within_budget(config.depth, config.workspace_mib * MIB, layout.world_size, cap, fmt.record_bytes)
    if depth < config.depth:
        log.info("CKV prefetch depth %d does not fit %d MiB per lane (D=%d, C=%d, %d-byte records); using %d",
                 config.depth, config.workspace_mib, layout.world_size, cap, fmt.record_bytes, depth)
    per_lane = lane_bytes(layout.world_size, cap, fmt.record_bytes, depth)
    lanes = execution_lanes(ubatches, speculative)
    return MemoryPlan(cap, depth, config.depth, depth + 1, lanes, per_lane, lanes * per_lane)
