"""The measured implementation choice: the tuned tables (data), their lookup, the selection
object of each op, and the sweep's table rows."""
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckv_jax import dcp_step, formats
from ckv_jax.benchmarks import timing as timing_mod
from pallas_kernels import cache_writer, paged_gather, selection, sparse_mla_attention, tuning
from pallas_kernels.cache_writer import WriterTiles
from pallas_kernels.paged_gather import GatherTiles
from pallas_kernels.record_layout import RecordLayout
from pallas_kernels.sparse_mla_attention import AttentionTiles

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import tune  # noqa: E402  (a maintainer tool, not installed)
from helpers import FakeDevice  # noqa: E402

OPS = {op.name: op for op in (paged_gather.GATHER_RECORDS, paged_gather.GATHER_DEQUANT, paged_gather.GATHER_SLOTS,
                              cache_writer.WRITE_RECORDS, sparse_mla_attention.SPARSE_MLA_ATTENTION)}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """tuned(op, rows): a table of this host's device kind holding `rows` (min_work_bytes, order,
    configs) for `op`, read from a JSON file as the shipped tables are."""
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning.table.cache_clear()

    def write(op, rows):
        kind = jax.devices()[0].device_kind
        doc = dict(device_kind=kind, measured_by="test", ops={op: [
            dict(min_work_bytes=lo, order=list(order), configs=configs) for lo, order, configs in rows]})
        tuning.table_path(kind).write_text(json.dumps(doc))
        tuning.table.cache_clear()
    yield write
    tuning.table.cache_clear()


def test_shipped_tables_are_valid():
    paths = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert paths, "the H200 table is measured and must be shipped"
    for path in paths:
        doc = json.loads(path.read_text())
        assert tuning.table_path(doc["device_kind"]) == path
        for op, rows in doc["ops"].items():
            bounds = [row["min_work_bytes"] for row in rows]
            assert bounds[0] == 0 and bounds == sorted(set(bounds)), (op, path)
            for row in rows:
                assert row["order"] and set(row["order"]) <= set(OPS[op].names), (op, row)
                for impl, fields in row["configs"].items():
                    assert impl in row["order"]
                    OPS[op].tile_type(impl)(**fields)      # every tuned config is constructible


def test_lookup_picks_the_entry_by_bytes_and_falls_back_to_the_default():
    rows = json.loads(tuning.table_path("NVIDIA H200").read_text())["ops"]["gather_records"]
    h200 = FakeDevice("NVIDIA H200")
    for i, row in enumerate(rows):
        lo = row["min_work_bytes"]
        for nbytes in {lo, lo + 1, (rows[i + 1]["min_work_bytes"] - 1) if i + 1 < len(rows) else 10 * lo + 1}:
            entry = tuning.lookup("gather_records", h200, nbytes)
            assert entry.order == tuple(row["order"]) and entry.configs == row["configs"], (nbytes, i)
    assert tuning.lookup("gather_records", FakeDevice("some other GPU"), 1 << 30) == tuning.Entry()
    assert tuning.lookup("gather_records", jax.devices()[0], 1 << 30) == tuning.Entry()


def test_select_prefers_the_callers_config(tuned):
    tuned("gather_records", [(0, ("pallas_triton",), {"pallas_triton": {"rows_per_tile": 4, "num_warps": 2}})])
    op, cpu = paged_gather.GATHER_RECORDS, jax.devices()[0]
    assert op.select(None, cpu, 1024, 1024, interpret=True).config == GatherTiles(4, 2)
    given = GatherTiles(32, 8)
    assert op.select(None, cpu, 1024, 1024, interpret=True, config=given).config is given
    assert op.select("xla", cpu, 1024, 1024).config is None


def test_a_tuned_order_falls_back_to_the_rest_of_the_default_order(tuned):
    cpu = jax.devices()[0]
    # Pallas Triton is not supported compiled on a CPU: the default order's xla is the fallback
    tuned("gather_records", [(0, ("pallas_triton",), {})])
    assert paged_gather.GATHER_RECORDS.select(None, cpu, 1024, 1024).name == "xla"
    tuned("gather_records", [(0, ("pallas_mosaic_gpu", "pallas_triton"), {})])
    assert paged_gather.GATHER_RECORDS.select(None, cpu, 1024, 1024).name == "xla"


def test_an_implementation_with_its_own_tiles_gets_them_from_the_table(tuned):
    """The attention's Mosaic GPU kernel has a tile type of its own: a measured config of it
    reaches the selection as that type (the op's type is the Triton kernel's)."""
    from pallas_kernels.sparse_mla_attention import MosaicAttentionTiles
    from pallas_kernels.sparse_mla_attention import api as attention_api
    tuned("sparse_mla_attention", [(0, ("pallas_mosaic_gpu", "pallas_triton"),
                                    {"pallas_mosaic_gpu": {"copy_issuers": 1},   # not the default
                                     "pallas_triton": {"block_h": 32}})])
    cpu, fp8 = jax.devices()[0], formats.get("fp8_ds_mla").layout
    chosen = attention_api.select(None, cpu, fp8, 1 << 20, 64, 16, 2048, interpret=True)
    assert (chosen.name, chosen.config) == ("pallas_mosaic_gpu", MosaicAttentionTiles(copy_issuers=1))
    # records the Mosaic kernel does not read (a layout of no registered format): the next measured
    # implementation, with its own tiles
    unread = RecordLayout("fp8_tiles", quant_block=64)
    chosen = attention_api.select(None, cpu, unread, 1 << 20, 64, 16, 2048, interpret=True)
    assert (chosen.name, chosen.config) == ("pallas_triton", AttentionTiles(block_h=32))


def test_selection_rejects_unknown_names_and_types():
    cpu = jax.devices()[0]
    with pytest.raises(ValueError, match=r"implementation: expected one of \['pallas_triton', 'xla'\]"):
        cache_writer.WRITE_RECORDS.select("cuda", cpu, 1024, 1024)
    with pytest.raises(TypeError, match="implementation: expected None, a name or a sequence of names"):
        cache_writer.WRITE_RECORDS.select(3, cpu, 1024, 1024)
    with pytest.raises(ValueError, match="default_order: names \\['nope'\\]"):
        selection.KernelOp("x", (), ("nope",))


def test_a_selected_kernel_is_hashable_and_equal_by_value():
    """jit caches key on the selection (a static argument): equal choices must hash equal."""
    cpu = jax.devices()[0]
    a = cache_writer.WRITE_RECORDS.select("xla", cpu, 1024, 1024, config=WriterTiles(4, 2))
    b = cache_writer.WRITE_RECORDS.select("xla", cpu, 2048, 4096, config=WriterTiles(4, 2))
    assert a == b and hash(a) == hash(b)


def test_the_api_runs_the_tuned_config(tuned):
    """A table entry for this device kind reaches the kernel: the tuned 4-row tiles run (in
    interpret mode) and the result equals the reference."""
    cpu = jax.devices()[0]
    tuned("gather_records", [(0, ("pallas_triton", "xla"), {"pallas_triton": {"rows_per_tile": 4, "num_warps": 2}})])
    chosen = paged_gather.select_records(None, cpu, 4 * 8 * 16, 500, 16, interpret=True)
    assert (chosen.name, chosen.config) == ("pallas_triton", GatherTiles(4, 2))
    rng = np.random.default_rng(3)
    fmt = formats.get("fp8_ds_mla")
    cache = jnp.asarray(rng.integers(0, 256, (6, 8, fmt.record_bytes), dtype=np.uint8))
    table = jnp.asarray([[4, 1, 5]], jnp.int32)
    cu = jnp.asarray([0, 21], jnp.int32)
    got = paged_gather.gather_records(cache, table, cu, num_rows=27, interpret=True)
    want = paged_gather.gather_records_reference(cache, table, cu, num_rows=27)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_tune_tool_writes_the_table_the_lookup_reads(tmp_path, monkeypatch):
    a = {"rows_per_tile": 8, "num_warps": 4}
    results = [_result("gather_records", f, 100, impl, cfg, us) for f in ("fp8", "nvfp4")
               for impl, cfg, us in (("pallas_triton", a, 10.0), ("xla", None, 30.0))]
    tune.write_table(results, "Some GPU", tmp_path)
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning.table.cache_clear()
    try:
        entry = tuning.lookup("gather_records", FakeDevice("Some GPU"), 1)
    finally:
        tuning.table.cache_clear()
    assert entry == tuning.Entry(("pallas_triton", "xla"), {"pallas_triton": a})


def _result(op, fmt, size, impl, config, us, exact=True, baseline=False):
    return dict(op=op, format=fmt, size=size, implementation=impl, config=config, us=us,
                bytes_moved=2 * size * 656, exact=exact, **({"baseline": True} if baseline else {}))


def test_sweep_table_rows_pick_the_fastest_exact_non_baseline_over_both_formats():
    a, b = {"rows_per_tile": 8, "num_warps": 4}, {"rows_per_tile": 16, "num_warps": 4}
    results = [
        # size 100: config a is faster summed over the formats though b wins one of them
        _result("gather_records", "fp8", 100, "pallas_triton", a, 10.0),
        _result("gather_records", "nvfp4", 100, "pallas_triton", a, 10.0),
        _result("gather_records", "fp8", 100, "pallas_triton", b, 9.0),
        _result("gather_records", "nvfp4", 100, "pallas_triton", b, 12.0),
        _result("gather_records", "fp8", 100, "xla", None, 30.0),
        _result("gather_records", "nvfp4", 100, "xla", None, 30.0),
        # size 400: xla wins; an inexact config and a baseline, though faster, never count
        _result("gather_records", "fp8", 400, "pallas_triton", a, 50.0),
        _result("gather_records", "nvfp4", 400, "pallas_triton", a, 50.0),
        _result("gather_records", "fp8", 400, "pallas_triton", b, 1.0, exact=False),
        _result("gather_records", "nvfp4", 400, "pallas_triton", b, 1.0),
        _result("gather_records", "fp8", 400, "xla", None, 40.0),
        _result("gather_records", "nvfp4", 400, "xla", None, 40.0),
        _result("gather_records", "fp8", 400, "torch_index_select_pages", None, 2.0, baseline=True),
        _result("gather_records", "nvfp4", 400, "torch_index_select_pages", None, 2.0, baseline=True),
    ]
    # a sweep of 16 requests (where b would win) adds nothing: the table is built from one request
    results += [dict(_result("gather_records", f, s, "pallas_triton", b, 0.5), requests=16)
                for f in ("fp8", "nvfp4") for s in (100, 400, 1600)]
    rows = tune.table_rows(results)["gather_records"]
    assert len(rows) == 2
    assert rows[0] == (0, ("pallas_triton", "xla"), {"pallas_triton": a})
    assert rows[1] == (int((2 * 100 * 656 * 2 * 400 * 656) ** 0.5), ("xla", "pallas_triton"), {"pallas_triton": a})


def test_sweep_table_rows_leave_out_the_persistent_pack():
    """The persistent pack's rows (its footprint is `prefetch_programs`, not a table entry) add
    no table entry, however fast."""
    full = {"rows_per_tile": 8, "num_warps": 4, "programs": 0}
    bounded = {"rows_per_tile": 256, "num_warps": 16, "programs": 33}
    results = [_result("gather_records", f, 100, "pallas_triton", full, 10.0) for f in ("fp8", "nvfp4")]
    results += [_result(tune.PERSISTENT_OP, f, 100, "pallas_triton", bounded, 5.0) for f in ("fp8", "nvfp4")]
    rows = tune.table_rows(results)
    assert set(rows) == {"gather_records"}
    assert rows["gather_records"][0][2] == {"pallas_triton": full}


def test_the_persistent_candidates_are_valid_bounded_tiles():
    """Each candidate is a persistent config at any program count, and the sweep's sizes cover
    the torch adapter bench's two histories."""
    configs = tune.persistent_configs(33)
    assert len(configs) == len(set(configs)) == len(tune.PERSISTENT_CANDIDATES)
    assert all(c.programs == 33 for c in configs)
    # the prefetch's tiles at either grid size are among them, as the baseline of the others
    assert dcp_step.bounded_pack_tiles(33) in configs
    assert dataclasses.replace(dcp_step.bounded_pack_tiles(66), programs=33) in configs
    assert tune.SIZES[tune.PERSISTENT_OP] == (262144, 1048576)


@pytest.mark.parametrize("option, text", [("--persistent-programs", "0,33"), ("--persistent-programs", "a"),
                                          ("--persistent-programs", ""), ("--tokens", "4096,-1")])
def test_the_sweep_checks_its_counts_before_anything_runs(option, text, capsys):
    with pytest.raises(SystemExit):
        tune.main(["--ops", tune.PERSISTENT_OP, option, text])
    assert f"{option}: expected comma-separated positive integers, got {text!r}" in capsys.readouterr().err


def test_sweep_table_rows_rank_by_device_time_where_every_candidate_has_one():
    a, b = {"rows_per_tile": 8, "num_warps": 4}, {"rows_per_tile": 16, "num_warps": 4}
    results = []
    for fmt in ("fp8", "nvfp4"):
        # size 100: a is faster on the host clock, b on the device timeline: the device decides
        results += [dict(_result("gather_records", fmt, 100, "pallas_triton", a, 10.0), device_us=8.0),
                    dict(_result("gather_records", fmt, 100, "pallas_triton", b, 11.0), device_us=7.0),
                    dict(_result("gather_records", fmt, 100, "xla", None, 12.0), device_us=7.5)]
        # size 400: xla has no device time, so every candidate is ranked on the host clock
        results += [dict(_result("gather_records", fmt, 400, "pallas_triton", a, 40.0), device_us=1.0),
                    _result("gather_records", fmt, 400, "xla", None, 30.0)]
    rows = tune.table_rows(results)["gather_records"]
    assert rows[0][1:] == (("pallas_triton", "xla"), {"pallas_triton": b})
    assert rows[1][1:] == (("xla", "pallas_triton"), {"pallas_triton": a})


def test_merge_results_averages_each_config_over_the_sweeps(tmp_path):
    cfg = {"rows_per_tile": 8, "num_warps": 4}
    paths = []
    for i, us in enumerate([10.0, 20.0]):
        path = tmp_path / f"sweep{i}.json"
        rows = [dict(_result("gather_slots", "fp8", 64, "pallas_triton", cfg, us, exact=i == 0), device_us=us / 2),
                _result("gather_slots", "fp8", 64, "xla", None, 50.0 + i),
                dict(_result("gather_slots", "fp8", 64, "xla", None, 90.0), requests=4)]
        path.write_text(json.dumps(dict(results=rows)))
        paths.append(path)
    merged = tune.merge_results(paths)
    assert [r["us"] for r in merged if r.get("requests") == 4] == [90.0]     # kept apart
    merged = {r["implementation"]: r for r in merged if "requests" not in r}
    assert merged["pallas_triton"]["us"] == pytest.approx(15.0)
    assert merged["pallas_triton"]["device_us"] == pytest.approx(7.5)
    assert merged["pallas_triton"]["exact"] is False                 # inexact in one sweep: inexact
    assert merged["xla"]["us"] == pytest.approx(50.5)
    assert merged["xla"]["gbps"] == pytest.approx(2 * 64 * 656 / 50.5e-6 / 1e9)
    assert "device_us" not in merged["xla"]


@pytest.mark.parametrize("num_reqs, want", [(1, "pallas_mosaic_gpu"), (3, "pallas_triton")])
def test_mosaic_pack_is_chosen_for_one_request_only(monkeypatch, tuned, num_reqs, want):
    """The measured order may put Mosaic GPU first; its grid grows with the requests, so the
    automatic choice passes it over for several (the kernel that runs is recorded)."""
    if paged_gather.api.compat.mosaic_gpu_interpret_params() is None:
        pytest.skip("this jax has no Mosaic GPU interpret mode")
    tuned("gather_records", [(0, ("pallas_mosaic_gpu", "pallas_triton", "xla"), {})])
    ran = []

    def recorded(impl):
        def run(*a, **k):
            ran.append(impl.name)
            return impl.run(*a, **k)
        return dataclasses.replace(impl, run=run)

    op = paged_gather.GATHER_RECORDS
    monkeypatch.setattr(paged_gather.api, "GATHER_RECORDS",
                        dataclasses.replace(op, implementations=tuple(map(recorded, op.implementations))))
    rng = np.random.default_rng(num_reqs)
    cache = jnp.asarray(rng.integers(0, 256, (6, 8, 656), dtype=np.uint8))
    table = jnp.asarray(rng.integers(0, 6, (num_reqs, 2)).astype(np.int32))
    cu = jnp.asarray(np.arange(num_reqs + 1) * 9, jnp.int32)
    got = paged_gather.gather_records(cache, table, cu, num_rows=9 * num_reqs + 4, interpret=True)
    want_rows = paged_gather.gather_records_reference(cache, table, cu, num_rows=9 * num_reqs + 4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_rows))
    assert ran == [want]


@pytest.mark.parametrize("num_requests", [1, 3, 16])
def test_sweep_request_tables_cover_the_tokens_on_distinct_pages(num_requests):
    table, cu, pages = tune.request_tables(np.random.default_rng(0), 500, 4096, num_requests)
    assert cu[0] == 0 and cu[-1] == 4096 - 17 and np.all(np.diff(cu) > 0)
    assert len(set(pages.tolist())) == len(pages) and table.shape[0] == num_requests
    for r in range(num_requests):
        need = -(-(cu[r + 1] - cu[r]) // tune.BLOCK)
        np.testing.assert_array_equal(table[r, :need], pages[sum(-(-(cu[k + 1] - cu[k]) // tune.BLOCK)
                                                                 for k in range(r)):][:need])


def test_timing_without_a_gpu_timeline_reports_no_device_time():
    """On CPU the profile has no GPU stream lines: the host-clock figure stays, device is None."""
    inputs = [(jnp.full((256, 256), i, jnp.float32),) for i in range(3)]
    timing = timing_mod.measure_pure(lambda x: x * 2 + 1, inputs, trials=3)
    assert np.isfinite(timing.seconds) and (timing.device_seconds is None) == (jax.default_backend() != "gpu")
    state = jnp.zeros((64,), jnp.float32)
    timing, state = timing_mod.measure_in_place(lambda s, x: s + x[0, :64], state, inputs, trials=2)
    assert (timing.device_seconds is None) == (jax.default_backend() != "gpu")
    # each program adds its inputs' values: many (0 + 1 + 2) and one (0) to warm up, both again in
    # each of the 2 trials, then many once under the profiler; all chained through the state
    np.testing.assert_array_equal(np.asarray(state), np.full(64, 3 + 2 * 3 + 3, np.float32))


def test_gpu_span_reads_only_the_gpu_stream_lines():
    """The span of a profile built as XSpace text: the stream line's first start to last end,
    not the annotation line of the same plane nor the host plane."""
    from jax.profiler import ProfileData
    profile = ProfileData.from_text_proto('''
        planes { id: 1 name: "/device:GPU:0"
          lines { id: 1 name: "Stream #14(Compute)" timestamp_ns: 1000
            events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
            events { metadata_id: 1 offset_ps: 6000000 duration_ps: 3000000 } }
          lines { id: 2 name: "Stream #15(MemcpyD2D)" timestamp_ns: 12000
            events { metadata_id: 1 offset_ps: 0 duration_ps: 1000000 } }
          lines { id: 3 name: "XLA Ops" timestamp_ns: 0
            events { metadata_id: 1 offset_ps: 0 duration_ps: 99000000 } }
          event_metadata { key: 1 value { id: 1 name: "kernel" } } }
        planes { id: 2 name: "/host:CPU"
          lines { id: 1 name: "python" timestamp_ns: 0
            events { metadata_id: 1 offset_ps: 0 duration_ps: 99000000 } }
          event_metadata { key: 1 value { id: 1 name: "host" } } }''')
    assert timing_mod.gpu_span_ns(profile) == 13000 - 1000
    assert timing_mod.gpu_span_ns(ProfileData.from_text_proto('planes { id: 2 name: "/host:CPU" }')) is None


def test_sweep_exactness_lets_nan_payloads_differ_in_bf16_only():
    ref = np.array([1.5, np.nan, -0.0], jnp.bfloat16)
    quieted = ref.view(np.uint16).copy()
    quieted[1] = 0x7FC1                          # another NaN payload
    assert tune.same_bits(quieted.view(jnp.bfloat16), ref)
    for bad in (0x3FC1, 0x0000):                 # a different number; a number where NaN was
        wrong = ref.view(np.uint16).copy()
        wrong[0 if bad == 0x3FC1 else 1] = bad
        assert not tune.same_bits(wrong.view(jnp.bfloat16), ref)
    assert not tune.same_bits(np.array([1.5, np.nan, 0.0], jnp.bfloat16), ref)     # +0 where -0 was
    raw = np.arange(8, dtype=np.uint8)
    assert tune.same_bits(raw.copy(), raw) and not tune.same_bits(raw[::-1].copy(), raw)


def test_result_fields_and_report_with_and_without_a_device_time(capsys):
    from ckv_jax.benchmarks import report
    moved = 4_000_000_000
    both = timing_mod.result_fields(timing_mod.Timing(2e-3, 1e-3), moved, timing_mod.Timing(1.6e-3, 0.9e-3))
    assert both["us"] == pytest.approx(2000) and both["gbps"] == pytest.approx(2000)
    assert both["pct_of_copy"] == pytest.approx(80) and both["device_pct_of_copy"] == pytest.approx(90)
    assert both["device_us"] == pytest.approx(1000) and both["device_ceiling_gbps"] == pytest.approx(moved / 0.9e-3 / 1e9)
    host = timing_mod.result_fields(timing_mod.Timing(2e-3, None), moved, timing_mod.Timing(1.6e-3, 0.9e-3))
    assert not any(k.startswith("device") for k in host)
    assert "device 1000.0 us (90.0% of copy)" in report.timing_text(both) and "device" not in report.timing_text(host)
    rows = [dict(op="x", implementation="a", exact=True, **both), dict(op="x", implementation="b", exact=True, **host)]
    assert report.finish(rows, [("op", "op", 4)], None) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[7:9] == ["1000.0", "90"] and lines[-1].split()[7:9] == ["-", "-"]   # after the mode column
    assert timing_mod.fastest([None, timing_mod.Timing(3.0, None), timing_mod.Timing(2.0, 5.0)]) == (2.0, 5.0)


def test_the_sweep_takes_mosaic_attention_configs_from_the_command_line(capsys):
    """`--mosaic-configs`: ';'-separated field=value lists, integers and flags; a field the config
    does not have, a value of neither kind or a config it rejects fail before anything runs."""
    from pallas_kernels.sparse_mla_attention import MosaicAttentionTiles
    configs = tune.parse_mosaic_configs("copy_issuers=128, k_slots=2,compute_registers=208 ;split_scores=False;")
    assert configs == [MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=208),
                       MosaicAttentionTiles(split_scores=False)]
    for text, message in (("k_slots=2,slots=2", "expected field=value with a field of block_k, "),
                          ("k_slots", "got 'k_slots'"),
                          ("compute_registers=two", "compute_registers: expected an integer, true or false, got 'two'"),
                          (" ; ", "expected at least one config")):
        with pytest.raises(ValueError, match=message):
            tune.parse_mosaic_configs(text)
    with pytest.raises(SystemExit):
        tune.main(["--ops", "sparse_mla_attention", "--mosaic-configs", "compute_registers=236"])
    assert "compute_registers: expected a multiple of 8" in capsys.readouterr().err
