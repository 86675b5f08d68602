"""The step of the step-program tests, for one process (test_step_program.py) and for each
process of a `jax.distributed` run (mp_step_worker.py): LAYERS layers whose caches hold the
history HIST, a chunk of QUERY tokens a request, the hooks that capture each signalled
workspace, a poisoned ring and the flags."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import dcp_scenario
from ckv_jax import dcp_step, full_ckv, placement
from ckv_jax.step_plan import build_step_plan

LAYERS = 4
FINAL_LENS = np.array([45, 40, 70])
HIST, QUERY = np.array([20, 0, 40]), np.array([17, 23, 18])
# the 2-process run's (writer, depth): "adapter", the program writes each layer's chunk from its
# latents; "engine", the caches hold the written chunk and the program only gathers
PROCESS_CASES = [("adapter", 0), ("adapter", 2), ("adapter", 3), ("engine", 0), ("engine", 2)]


class CapturingHooks:
    """Hooks that send each layer's workspace to the host when it is signalled, and report the
    step abandoned from layer `abandoned_from` on (None: never).  In a run of several
    processes each process captures its own device's copy."""

    def __init__(self, depth, abandoned_from=None):
        self.depth, self.abandoned_from = depth, abandoned_from
        self.workspaces = {}

    def wait(self, layer, arrays, *, platform):
        word = int(self.abandoned_from is not None and layer >= self.abandoned_from)
        return arrays[:-1] + (arrays[-1].at[-1].set(word),)        # the abandon word, flags[L]

    def signal(self, layer, arrays, *, platform):
        own = arrays[layer % (self.depth + 1)]
        jax.debug.callback(functools.partial(self.workspaces.__setitem__, layer), own)
        return arrays


def step(mesh, fmt="fp8_ds_mla"):
    """L layers' scenarios whose caches hold the history HIST, the step's plan, arrays, chunk
    latents per layer (host arrays) and the caches placed on `mesh`, a D-device mesh."""
    d = placement.mesh_axis_size(mesh)
    layers = [dcp_scenario.build(d, 1, fmt, FINAL_LENS, FINAL_LENS, seed=3, kv_seed=50 + l, written=HIST)
              for l in range(LAYERS)]
    plan = build_step_plan(layers[0].layout, HIST + QUERY, QUERY, max_num_seqs=4, min_tokens=1)
    capacity = 64
    arrays = dcp_step.step_arrays(plan, layers[0].block_table, mesh, chunk_capacity=capacity)
    chunks = []
    for sc in layers:
        kv = np.concatenate([sc.kv_c[r][h:h + n] for r, (h, n) in enumerate(zip(HIST, QUERY))])
        pe = np.concatenate([sc.k_pe[r][h:h + n] for r, (h, n) in enumerate(zip(HIST, QUERY))])
        pad = capacity - len(kv)
        # rows past the step's tokens hold values the program must not write anywhere
        chunks.append((np.concatenate([kv, np.full((pad, kv.shape[1]), 7, kv.dtype)]),
                       np.concatenate([pe, np.full((pad, pe.shape[1]), 7, pe.dtype)])))
    caches = [placement.place_caches(sc.caches, mesh) for sc in layers]
    return layers, plan, arrays, chunks, caches


def flags(mesh):
    """The hooks' words, int32[L + 1], all 0: no layer abandoned."""
    return placement.replicated(mesh, np.zeros(LAYERS + 1, np.int32))[0]


def ring(mesh, depth, plan):
    """depth + 1 slots, poisoned: every row a layer reads must be written by the step."""
    rng = np.random.default_rng(9)
    d = placement.mesh_axis_size(mesh)
    return tuple(placement.replicated(mesh, rng.integers(0, 256, (d * plan.padded_tokens + 16, 656), dtype=np.uint8))[0]
                 for _ in range(depth + 1))


def written_caches(mesh, layers, plan, chunks, per_rank_caches, fmt):
    """Each layer's sharded cache once its chunk is written (the per-layer writer,
    `full_ckv.write_records_dcp`): per_rank_caches[l] is layer l's caches, one a rank."""
    n = int(QUERY.sum())
    return [full_ckv.write_records_dcp(placement.place_caches(caches, mesh), jnp.asarray(kv[:n]), jnp.asarray(pe[:n]),
                                       plan, sc.block_table, mesh=mesh, format=fmt)
            for caches, sc, (kv, pe) in zip(per_rank_caches, layers, chunks)]
