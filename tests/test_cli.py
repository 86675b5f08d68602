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


def test_demo_writes_and_reads_back_every_format():
    proc = _run("demo", "--tokens", "300", "--block-size", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all records match" in proc.stdout
    for name in ("fp8_ds_mla", "nvfp4_ds_mla", "bf16"):
        assert f" {name} " in proc.stdout


def test_env_reports_versions_and_lowering():
    proc = _run("env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import jax
    assert f"jax                         {jax.__version__}" in proc.stdout or jax.__version__ in proc.stdout
    assert "pallas triton lowering" in proc.stdout and "dlpack self-check" in proc.stdout


def test_cli_rejects_unknown_command_and_bad_flags():
    assert _run("bogus").returncode == 2
    proc = _run("demo", "--tokens", "0")
    assert proc.returncode == 2 and "--tokens and --block-size must be positive" in proc.stderr
