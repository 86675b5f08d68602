"""Real `jax.distributed` processes on 127.0.0.1: 2 processes x 2 CPU devices gather the same
bytes as one process with 4 devices."""
import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import dcp_scenario
from ckv_jax import full_ckv
from mp_case import CASE

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_gather_the_same_bytes_as_one(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"ws{pid}.npy" for pid in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_gather_worker.py"), str(pid), "2",
                               str(port), str(outs[pid])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    sc = dcp_scenario.build(**CASE)
    from test_full_ckv import mesh_of
    mesh = mesh_of(4)
    single = np.asarray(full_ckv.all_gather_ckv(full_ckv.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table),
                                                sc.plan, mesh=mesh, format=CASE["fmt_name"]))
    np.testing.assert_array_equal(single, dcp_scenario.expected_workspace(sc))
    for out in outs:
        np.testing.assert_array_equal(np.load(out), single)
