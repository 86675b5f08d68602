"""Two torch engine processes (one CPU device each) joined by `jax.distributed`: the adapter's
workspaces equal the single-process pure-JAX gather of both ranks' caches, and both ranks took
the same decisions in the same order."""
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from ckv_jax import full_ckv
from test_multiprocess import _free_port
from torch_engine_sim import STEPS, TorchEngine
from ckv_jax import formats

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("depth", [0, 2])
def test_two_torch_processes_gather_what_one_jax_process_gathers(tmp_path, depth):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"rank{pid}.npz" for pid in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_adapter_worker.py"), str(pid), "2", str(port),
                               str(depth), str(outs[pid])], env=env, stdout=subprocess.PIPE,
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
    ranks = [np.load(out) for out in outs]
    np.testing.assert_array_equal(ranks[0]["decisions"], ranks[1]["decisions"])
    from test_full_ckv import mesh_of
    mesh = mesh_of(2)
    engine = TorchEngine(2, 0, formats.get("fp8_ds_mla"), 1)
    table = jnp.asarray(engine.block_table.numpy())
    for s, (hist, q) in enumerate(STEPS):
        plan = engine.plan(hist, q)
        for layer in range(3):
            caches = full_ckv.place_caches([r[f"cache_{s}_{layer}"] for r in ranks], mesh)
            want = np.asarray(full_ckv.all_gather_ckv(caches, table, plan, mesh=mesh, format="fp8_ds_mla"))
            for rank, r in enumerate(ranks):
                np.testing.assert_array_equal(r[f"ws_{s}_{layer}"], want, err_msg=f"rank {rank} step {s} layer {layer}")
