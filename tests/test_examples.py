"""The examples in `examples/`, run as their users run them, with small flags."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_flax_example_prefills_through_dcp_and_matches_one_device():
    import jax
    if jax.default_backend() != "cpu" and jax.device_count() < 2:       # on CPUs the example makes two
        pytest.skip(f"--dcp 2 on {jax.default_backend()} needs two devices")
    proc = _example("flax_mla.py", "--dcp", "2", "--depth", "1", "--layers", "2", "--heads", "4",
                    "--requests", "1", "--prefix", "32", "--chunk", "32", "--steps", "1", "--topk", "24")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(line.endswith(" match") for line in lines), proc.stdout
    assert "D=2, depth 1" in lines[0]


@pytest.mark.parametrize("attention, cache_write", [("auto", "engine"), ("torch", "engine"), ("auto", "adapter")])
def test_torch_engine_example_matches_the_pure_jax_path(attention, cache_write):
    proc = _example("torch_engine.py", "--depth", "1", "--layers", "2", "--context", "192", "--chunk", "96",
                    "--attention", attention, "--cache-write", cache_write)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"attention {attention}, caches written by the {cache_write}" in proc.stdout
    assert proc.stdout.count("-> match") == 2 and "all chunks match" in proc.stdout, proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("cache_write", ["engine", "adapter"])
def test_torch_engine_example_runs_a_step_program_and_matches_the_pure_jax_path(cache_write):
    import jax
    import torch
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        pytest.skip("--ordering step-program needs torch and JAX on a CUDA GPU")
    proc = _example("torch_engine.py", "--depth", "1", "--layers", "2", "--context", "192", "--chunk", "96",
                    "--attention", "torch", "--cache-write", cache_write, "--ordering", "step-program")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"caches written by the {cache_write}, ordering step-program" in proc.stdout
    assert proc.stdout.count("-> match") == 2 and "all chunks match" in proc.stdout, proc.stdout
