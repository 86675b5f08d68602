"""One rank of the 2-process step-program test (run by test_step_program.py): `step_case`'s step
on a mesh of one CPU device a process, every case of `step_case.PROCESS_CASES`; each process
saves what its own device holds.

usage: python mp_step_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz
"""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import mp_worker  # noqa: E402


def main():
    _, nproc, (out,) = mp_worker.join(sys.argv)
    import step_case
    from ckv_jax import dcp_step, formats, placement
    from helpers import mesh_of
    mesh = mesh_of(nproc)
    fmt = formats.get("fp8_ds_mla")
    saved = {}
    for writer, depth in step_case.PROCESS_CASES:
        layers, plan, arrays, chunks, caches = step_case.step(mesh)
        hooks = step_case.CapturingHooks(depth)
        if writer == "adapter":
            # the latents as an engine holds them: the same values in every process
            kv_c = tuple(placement.replicated(mesh, kv)[0] for kv, _ in chunks)
            k_pe = tuple(placement.replicated(mesh, pe)[0] for _, pe in chunks)
        else:
            caches = step_case.written_caches(mesh, layers, plan, chunks, [sc.caches for sc in layers], fmt)
            kv_c = k_pe = None
        poisoned = step_case.ring(mesh, depth, plan)
        key = f"{writer}_{depth}"
        for i, slot in enumerate(poisoned):         # (read before the program donates it)
            saved[f"{key}_poisoned_{i}"] = np.asarray(slot.addressable_shards[0].data)
        ring, written, flags = dcp_step.step_program(
            poisoned, tuple(caches), step_case.flags(mesh), kv_c, k_pe, arrays, depth=depth,
            mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
        jax.block_until_ready(written)
        for l in range(step_case.LAYERS):
            saved[f"{key}_ws_{l}"] = np.asarray(hooks.workspaces[l])
            saved[f"{key}_cache_{l}"] = np.asarray(written[l].addressable_data(0))
        for i, slot in enumerate(ring):
            saved[f"{key}_slot_{i}"] = np.asarray(slot.addressable_data(0))
        saved[f"{key}_flags"] = np.asarray(flags.addressable_data(0))
    np.savez(out, **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
