"""Real `jax.distributed` processes on 127.0.0.1: 2 processes x 2 CPU devices gather the same
bytes as one process with 4 devices."""
import jax.numpy as jnp
import numpy as np
import pytest

import dcp_scenario
from ckv_jax import full_ckv, placement
from helpers import run_workers
from mp_case import CASE

pytestmark = pytest.mark.slow


def test_two_processes_gather_the_same_bytes_as_one(tmp_path):
    outs = [tmp_path / f"ws{pid}.npy" for pid in range(2)]
    procs, logs = run_workers("mp_gather_worker.py", lambda pid: [str(outs[pid])])
    for pid, p in enumerate(procs):
        assert p.returncode == 0, logs[pid][-3000:]

    sc = dcp_scenario.build(**CASE)
    from helpers import mesh_of
    mesh = mesh_of(4)
    single = np.asarray(full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table),
                                                sc.plan, mesh=mesh, format=CASE["fmt_name"]))
    np.testing.assert_array_equal(single, dcp_scenario.expected_workspace(sc))
    for out in outs:
        np.testing.assert_array_equal(np.load(out), single)
