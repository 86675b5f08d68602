"""Prefetch configuration, environment knobs and the memory plan (upstream checklist rows)."""
import logging

import pytest

from ckv_jax import prefetch_config as pc
from ckv_jax.dcp_layout import DcpLayout


@pytest.mark.parametrize("depth, mib", [(0, 102.7), (1, 184.9), (2, 267.0), (3, 349.2)])
def test_memory_plan_matches_the_upstream_table(depth, mib):
    plan = pc.memory_plan(DcpLayout(4), "fp8_ds_mla", max_num_seqs=8,
                          config=pc.GatherConfig(depth=depth, workspace_mib=0, max_tokens=131072))
    assert plan.capacity == 32832 and plan.depth == depth and plan.slots == depth + 1
    assert round(plan.lane_bytes / pc.MIB, 1) == mib


@pytest.mark.parametrize("d, max_tokens, rb, mibs", [
    (4, 524288, 432, [270.1, 486.2, 702.3, 918.4]),
    (8, 131072, 656, [92.6, 174.9, 257.3, 339.6]),
])
def test_memory_plan_other_rows(d, max_tokens, rb, mibs):
    fmt = "nvfp4_ds_mla" if rb == 432 else "fp8_ds_mla"
    for depth, mib in enumerate(mibs):
        plan = pc.memory_plan(DcpLayout(d), fmt, max_num_seqs=8,
                              config=pc.GatherConfig(depth=depth, workspace_mib=0, max_tokens=max_tokens))
        assert round(plan.lane_bytes / pc.MIB, 1) == mib


def test_budget_clamp_keeps_the_sync_slot():
    unit = 1024 * 256        # C * R of the upstream test: D=4, C=1024, R=256 -> 5 / 9 / 13 units
    assert [pc.lane_bytes(4, 1024, 256, d) // unit for d in range(3)] == [5, 9, 13]
    assert pc.depth_within_budget(3, 13 * unit, 4, 1024, 256) == 2
    assert pc.depth_within_budget(3, 4 * unit, 4, 1024, 256) == 0
    assert pc.depth_within_budget(3, 0, 4, 1024, 256) == 3
    assert pc.depth_within_budget(0, 13 * unit, 4, 1024, 256) == 0


def test_clamp_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="ckv_jax.prefetch"):
        plan = pc.memory_plan(DcpLayout(4), "fp8_ds_mla", max_num_seqs=8,
                              config=pc.GatherConfig(depth=2, workspace_mib=1024, max_tokens=524288))
    assert plan.depth == 1 and plan.clamped
    assert "does not fit 1024 MiB" in caplog.text


@pytest.mark.parametrize("ubatches, spec, lanes", [(0, False, 1), (1, False, 1), (2, False, 2), (1, True, 2),
                                                   (2, True, 4)])
def test_execution_lanes(ubatches, spec, lanes):
    assert pc.execution_lanes(ubatches, spec) == lanes
    plan = pc.memory_plan(DcpLayout(2), "fp8_ds_mla", max_num_seqs=4, ubatches=ubatches, speculative=spec)
    assert plan.lanes == lanes and plan.total_bytes == lanes * plan.lane_bytes


def test_env_knobs_default_off_and_parse():
    assert pc.GatherConfig.from_env({}) == pc.GatherConfig()
    cfg = pc.GatherConfig.from_env({pc.ENV_GATHER: "1", pc.ENV_DEPTH: "2", pc.ENV_WORKSPACE_MIB: "512",
                                    pc.ENV_MIN_TOKENS: "8192", pc.ENV_MAX_TOKENS: "65536"})
    assert cfg == pc.GatherConfig(True, 2, 512, 8192, 65536)


def test_env_knobs_reject_or_fall_back(caplog):
    with pytest.raises(ValueError, match="CKV_JAX_PREFETCH_DEPTH: expected an integer, got 'two'"):
        pc.GatherConfig.from_env({pc.ENV_DEPTH: "two"})
    with pytest.raises(ValueError, match="CKV_JAX_GATHER: expected 0/1/true/false"):
        pc.GatherConfig.from_env({pc.ENV_GATHER: "maybe"})
    with pytest.raises(ValueError, match="CKV_JAX_GATHER_MAX_TOKENS: expected a non-negative integer"):
        pc.GatherConfig.from_env({pc.ENV_MAX_TOKENS: "-5"})
    with caplog.at_level(logging.WARNING, logger="ckv_jax.prefetch"):
        cfg = pc.GatherConfig.from_env({pc.ENV_DEPTH: "-3", pc.ENV_WORKSPACE_MIB: "-1"})
    assert cfg.depth == 0 and cfg.workspace_mib == 0 and "is negative; using 0" in caplog.text


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="depth: expected >= 0"):
        pc.GatherConfig(depth=-1)
    with pytest.raises(TypeError, match="depth: expected an int"):
        pc.GatherConfig(depth=1.5)
