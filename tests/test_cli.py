"""The `ckv-jax` command in a subprocess, as a user runs it."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    return subprocess.run([sys.executable, "-m", "ckv_jax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla"])
def test_demo_runs_a_dcp_prefill_and_checks_it(fmt):
    proc = _run("demo", "--format", fmt, "--dcp", "2", "--depth", "1", "--layers", "2", "--context", "96",
                "--chunk", "32", "--requests", "1", "--heads", "2", "--topk", "16", "--block-size", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DCP 2 on cpu, depth 1" in proc.stdout
    assert "2 layers x 3 steps: all steps match" in proc.stdout
    assert proc.stdout.count("depth 1 == depth 0: True") == 3


def test_env_reports_versions_and_lowering():
    proc = _run("env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import jax
    jax_line = next(line for line in proc.stdout.splitlines() if line.startswith("jax "))
    assert jax_line.split()[-1] == jax.__version__
    assert "pallas triton lowering" in proc.stdout and "dlpack self-check" in proc.stdout


def test_cli_rejects_unknown_command_and_bad_flags():
    assert _run("bogus").returncode == 2
    proc = _run("demo", "--chunk", "0")
    assert proc.returncode == 2 and "--chunk must be positive" in proc.stderr
    proc = _run("demo", "--dcp", "3", "--heads", "8")
    assert proc.returncode == 2 and "--heads 8 must be divisible by --dcp 3" in proc.stderr


def test_bench_writes_json_and_plot_writes_pngs(tmp_path):
    out = tmp_path / "results.json"
    proc = _run("bench", "--ops", "writer,gather,patch,prefill", "--tokens", "128", "--formats", "nvfp4_ds_mla",
                "--patterns", "random", "--chunk", "32", "--prefill-chunk", "32", "--depths", "0,1", "--layers", "1", "--context", "128",
                "--repeats", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    data = json.loads(out.read_text())
    assert data["backend"] == "cpu" and data["command"].startswith("ckv-jax bench")
    ops = {r["op"] for r in data["results"]}
    assert ops == {"write_records", "gather_raw", "gather_dequant", "patch", "prefill_step"}
    assert all(r["exact"] for r in data["results"])
    assert [r["depth"] for r in data["results"] if r["op"] == "prefill_step"] == [0, 1]
    proc = _run("plot", str(out), "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("bandwidth.png", "prefill_depth.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
