"""tools/compile_offline.py (a maintainer tool, not installed): the attention kernel's Mosaic GPU
module taken from its CUDA lowering, the stand-in CUDA driver the offline compile runs against,
the plugin checks and the summary table.  The compile itself needs the CUDA PJRT plugin (a
400 MB wheel): set CKV_JAX_CUDA_PLUGIN to its xla_cuda_plugin.so to run that test too."""
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import compile_offline  # noqa: E402
from test_sass_regions import SASS  # noqa: E402

from pallas_kernels.sparse_mla_attention.pallas_mosaic_gpu import MosaicAttentionTiles  # noqa: E402

MLIR_BYTECODE_MAGIC = b"ML\xefR"
# fp8's default config at 64 heads, by ptxas release (benchmarks/results/cpu_2026-12-05/27_..)
WGMMAS_AT_208 = {"13.0": "serialized", "13.5": "async"}


def test_the_module_is_the_lowered_kernels_mosaic_bytecode_and_follows_the_config():
    base = MosaicAttentionTiles(copy_issuers=128, k_slots=2, compute_registers=208)
    first = compile_offline.mosaic_module("fp8_ds_mla", 64, base)
    again = compile_offline.mosaic_module("fp8_ds_mla", 64, base)
    other = compile_offline.mosaic_module("fp8_ds_mla", 64, MosaicAttentionTiles(copy_issuers=128, k_slots=2,
                                                                                  compute_registers=216))
    partials = compile_offline.mosaic_module("fp8_ds_mla", 64, base, jnp.float32)
    assert first.startswith(MLIR_BYTECODE_MAGIC) and len(first) > 10_000
    assert first == again and first != other and first != partials


def test_the_stand_in_driver_answers_sm90_and_refuses_to_load(tmp_path):
    library = compile_offline.build_stand_in_driver(tmp_path)
    assert library.name == "libcuda.so.1"
    driver = ctypes.CDLL(str(library))
    device, major, minor, text = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_char_p()
    assert driver.cuCtxGetDevice(ctypes.byref(device)) == 0 and device.value == 0
    assert driver.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) == 0 and major.value == 9
    assert driver.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0) == 0 and minor.value == 0
    assert driver.cuDeviceGetAttribute(ctypes.byref(major), 1, 0) == 100      # any other attribute: no device
    assert driver.cuModuleLoadData(ctypes.byref(ctypes.c_void_p()), None) == 100
    assert driver.cuGetErrorString(100, ctypes.byref(text)) == 0 and b"stand-in" in text.value


def test_a_missing_or_mismatched_plugin_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--plugin: no file .*absent\.so"):
        compile_offline.check_plugin(tmp_path / "absent.so")
    plugin = tmp_path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"")
    (tmp_path / "jax_cuda13_pjrt-0.0.1.dist-info").mkdir()
    with pytest.raises(SystemExit, match=r"--plugin: jax_cuda13_pjrt-0\.0\.1\.dist-info is for jax 0\.0\.1, this is jax "):
        compile_offline.check_plugin(plugin)
    # a library without the compile entry (the stand-in driver has a symbol table, not the entry)
    library = str(compile_offline.build_stand_in_driver(tmp_path))
    assert set(compile_offline._symbol_addresses(library, ("cuInit",))) == {"cuInit"}
    with pytest.raises(SystemExit, match=r"--plugin: .* has no symbol MosaicGpuCompile"):
        compile_offline._symbol_addresses(library, ("MosaicGpuCompile", "cuInit"))


def test_the_summary_row_reads_registers_spills_and_each_regions_loop():
    report = ("ptxas info    : Function properties for kernel\n"
              "    304 bytes stack frame, 752 bytes spill stores, 740 bytes spill loads\n"
              "ptxas info    : Used 168 registers, used 16 barriers, 304 bytes cumulative stack size\n")
    assert compile_offline.summary_row("0", report, SASS) == "0 | 168 | 752/740 | async | dealloc@40: 5/1 | try_alloc@232: 4/1"
    serialized = "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized\n" + report
    assert compile_offline.summary_row("0", serialized, SASS).split(" | ")[3] == "serialized"


@pytest.mark.skipif(not os.environ.get("CKV_JAX_CUDA_PLUGIN"), reason="CKV_JAX_CUDA_PLUGIN names no CUDA PJRT plugin")
def test_a_config_compiles_to_sm90a_ptx_without_a_gpu(tmp_path, capsys):
    compile_offline.main(["--plugin", os.environ["CKV_JAX_CUDA_PLUGIN"], "--heads", "64", "--out", str(tmp_path),
                          "--mosaic-configs", "copy_issuers=128,k_slots=2,compute_registers=208"])
    ptx = (tmp_path / "0" / "kernel.ptx").read_text()
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    assert re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx) == [("dec", "88")] + [("inc", "208")] * 2
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("0 | 168 | ") and "dealloc@88" in row
    # whether ptxas serializes the wgmmas at 208 registers is its release's choice: the two
    # releases compiled so far each have their verdict; another must give one of the two
    release = re.search(r"release (\d+\.\d+)", subprocess.run(["ptxas", "--version"], capture_output=True,
                                                                text=True).stdout).group(1)
    verdict = row.split(" | ")[3]
    assert verdict == WGMMAS_AT_208[release] if release in WGMMAS_AT_208 else verdict in ("serialized", "async")
    assert row.count("try_alloc@208") == 2
