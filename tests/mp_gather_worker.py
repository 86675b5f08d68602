"""One process of the 2-process x 2-device full-CKV gather test (run by test_multiprocess.py).

usage: python mp_gather_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npy [--die]
"""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "2"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mp_worker  # noqa: E402


def main():
    _, _, (out, *_) = mp_worker.join(sys.argv)
    if "--die" in sys.argv:                                   # the fault test: vanish mid-run
        os._exit(3)
    import dcp_scenario
    from ckv_jax import full_ckv, placement
    from mp_case import CASE
    sc = dcp_scenario.build(**CASE)
    mesh = jax.make_mesh((len(jax.devices()),), (placement.DCP_AXIS,))
    ws = full_ckv.all_gather_ckv(placement.place_caches(sc.caches, mesh), jnp.asarray(sc.block_table), sc.plan,
                                 mesh=mesh, format=CASE["fmt_name"])
    local = np.asarray(ws.addressable_shards[0].data)       # replicated: every shard is the whole workspace
    np.save(out, local)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
