"""The adapter trace tool's per-layer phases (maintainer tool, not installed), read from kernel
lists built by hand: the numbers each phase must come to are worked out in the comments."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import adapter_trace  # noqa: E402

TORCH, JAX = 7, 14


def kernel(stream, name, start, dur):
    return dict(stream=stream, name=name, start=float(start), dur=float(dur))


def two_layers():
    """Three computes of 1,000 us; after the first the patch goes first (the write waits for
    it), after the second the patch starts while the write runs and ends after it."""
    return sorted([
        kernel(TORCH, "spin_kernel", 0, 1000),
        kernel(JAX, "ckv_write_records_fp8_tiles_r656", 1002, 5),     # patch 1002-1007
        kernel(TORCH, "index_elementwise_kernel", 1005, 11),          # write 1005-1016
        kernel(JAX, "ckv_gather_records_r656", 1010, 120),            # a prefetch: not torch's
        kernel(TORCH, "direct_copy_kernel", 1019, 3),                 # consumer: 3 after the write
        kernel(TORCH, "spin_kernel", 1030, 1000),                     # 30 after the compute's end
        kernel(TORCH, "index_elementwise_kernel", 2032, 11),          # write 2032-2043
        kernel(JAX, "ckv_write_records_fp8_tiles_r656", 2040, 6),     # patch 2040-2046, after the write began
        kernel(TORCH, "direct_copy_kernel", 2049, 3),                 # consumer: 3 after the patch's end
        kernel(TORCH, "spin_kernel", 2060, 1000),
    ], key=lambda k: k["start"])


def test_layer_phases_split_each_boundary_and_order_the_patch():
    first, second = adapter_trace.layer_phases(two_layers())
    assert first == dict(to_write=5.0, write=11.0, patch_first=True, to_consumer=3.0, to_next=11.0, total=30.0)
    assert second == dict(to_write=2.0, write=11.0, patch_first=False, to_consumer=3.0, to_next=11.0, total=30.0)


def test_a_layer_without_a_patch_counts_from_the_cache_write():
    ks = [k for k in two_layers() if "ckv_" not in k["name"]]
    phases = adapter_trace.layer_phases(ks)
    assert [p["patch_first"] for p in phases] == [None, None]
    assert [p["to_consumer"] for p in phases] == [3.0, 6.0]          # from the writes' ends, 1016 and 2043
    assert adapter_trace.phases_summary(phases).endswith("compute to compute 30.0, no patch")


def test_summarize_reads_a_saved_trace(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(dict(title="t", code=".", kernels={"depth1": two_layers(), "depth0": []})))
    assert adapter_trace.main(["--summarize", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path} depth1"
    assert "over 2 boundaries" in out[1] and "patch before the cache write in 1 of 2" in out[1]
    assert "compute end -> cache write 3.5" in out[1]                # the median of 5 and 2
    assert out[3].startswith("  layer phases: none")


def test_jax_write_phases_span_the_cache_write_and_patch_to_the_consumer():
    """The adapter writes the cache: after each compute JAX's cache write and patch run, torch's
    stream has only the consumer."""
    ks = sorted([
        kernel(TORCH, "spin_kernel", 0, 1000),
        kernel(JAX, "ckv_write_records_fp8_tiles_r656", 1004, 3),     # the cache write 1004-1007
        kernel(JAX, "ckv_write_records_fp8_tiles_r656", 1007, 4),     # the patch 1007-1011
        kernel(JAX, "ckv_gather_records_r656", 1012, 120),            # a prefetch
        kernel(TORCH, "direct_copy_kernel", 1014, 3),                 # consumer: 3 after the patch
        kernel(TORCH, "spin_kernel", 1020, 1000),
        kernel(TORCH, "spin_kernel", 2030, 1000),                     # no JAX write: skipped
    ], key=lambda k: k["start"])
    phases = adapter_trace.jax_write_phases(ks)
    assert phases == [dict(to_write=4.0, write=7.0, to_consumer=3.0, to_next=6.0, total=20.0)]
    assert "cache write and patch 7.0, -> consumer 3.0" in adapter_trace.phase_lines(ks, "adapter")
