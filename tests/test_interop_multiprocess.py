"""Two torch engine processes (one device each: a CPU, or a GPU each) joined by
`jax.distributed`: the adapter's workspaces equal the single-process pure-JAX gather of both
ranks' caches, and both ranks took the same decisions in the same order."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ckv_jax import full_ckv, placement
from helpers import run_workers
from torch_engine_sim import STEPS, TorchEngine
from ckv_jax import formats

pytestmark = pytest.mark.slow


ORDERED = [(0, "engine"), (2, "engine"), (2, "adapter")]


@pytest.mark.parametrize("platform, ordering, depth, writer",
                         [("cpu", None, *case) for case in ORDERED] +
                         [pytest.param("cuda", None, *case, marks=pytest.mark.gpu) for case in ORDERED] +
                         [pytest.param("cuda", "step-program", 2, writer, marks=pytest.mark.gpu)
                          for writer in ("adapter", "engine")])
def test_two_torch_processes_gather_what_one_jax_process_gathers(tmp_path, platform, ordering, depth, writer):
    """writer "adapter": each rank leaves its cache writes to the adapter (its own rank's slots of
    the shared block table) and checks them against its own write.  ordering None: the one the
    platform gives (CPU: dlpack; CUDA: cuda-events)."""
    if platform == "cuda" and not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        pytest.skip("needs two CUDA GPUs")
    outs = [tmp_path / f"rank{pid}.npz" for pid in range(2)]
    asked = [] if ordering is None else [ordering]
    procs, logs = run_workers("mp_adapter_worker.py",
                              lambda pid: [str(depth), str(outs[pid]), platform, writer, *asked], platform=platform)
    for pid, p in enumerate(procs):
        assert p.returncode == 0, logs[pid][-3000:]
    ranks = [np.load(out) for out in outs]
    np.testing.assert_array_equal(ranks[0]["decisions"], ranks[1]["decisions"])
    expected = ordering or ("cuda-events" if platform == "cuda" else "dlpack")
    assert all(str(r["ordering"]) == expected for r in ranks)
    from helpers import mesh_of
    mesh = mesh_of(2)
    engine = TorchEngine(2, 0, formats.get("fp8_ds_mla"), 1)
    table = jnp.asarray(engine.block_table.numpy())
    for s, (hist, q) in enumerate(STEPS):
        plan = engine.plan(hist, q)
        for layer in range(3):
            caches = placement.place_caches([r[f"cache_{s}_{layer}"] for r in ranks], mesh)
            want = np.asarray(full_ckv.all_gather_ckv(caches, table, plan, mesh=mesh, format="fp8_ds_mla"))
            for rank, r in enumerate(ranks):
                np.testing.assert_array_equal(r[f"ws_{s}_{layer}"], want, err_msg=f"rank {rank} step {s} layer {layer}")
