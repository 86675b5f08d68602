"""Host cost of the pieces of one torch-adapter layer on a GPU, each alone in a loop (median of
300 calls, host clock): the gather, patch and fused layer-program dispatches (the layer program
bound as the orchestrator dispatches it, and with its static arguments passed per call, in
alternating rounds), a trivial donated jit, the event hand-offs, the chunk copy and the slot
lookup.  With --loop instead: the host time of each piece where it runs, timed around each call
inside the adapter's layer loop (`loop_split`), where the pieces cost what they cost in place.
With --floor: the adapter's layer loop against the floor of its mechanism in the same process
(`floor`).

    python tools/adapter_dispatch_probe.py [--loop | --floor [--history H] [--compute-ms X] [--rounds R]]
"""
import argparse
import collections
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from ckv_jax import dcp_step, placement  # noqa: E402
from interop import bench  # noqa: E402
from interop.bench import Workload  # noqa: E402


def median_us(fn, calls=300, warmup=20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


class Donated:
    """A donated buffer threaded through repeated calls: each call consumes the last result."""

    def __init__(self, array):
        self.array = array

    def call(self, fn, *args, **kwargs):
        self.array = fn(self.array, *args, **kwargs)


def main():
    work = Workload(4096, 4096, 2)
    adapter = work.adapter(1)
    for _ in range(2):                       # discover the caches, then compile the prefetch path
        work.step(adapter)
    torch.cuda.synchronize()
    orch = adapter.orch
    lane = orch.lane("target")
    ring = orch.pool.ring(lane.lane)
    cache = adapter._caches[("target", 0)][2]
    arrays = orch._arrays
    static = dict(mesh=orch.mesh, axis_name=placement.DCP_AXIS, implementation=None, interpret=False)

    def gather(slot_array, program=dcp_step.gather_program, **kwargs):
        return program(cache, arrays, slot_array, None, **kwargs)

    slot = Donated(ring[0])
    rows = []
    rows.append(("gather_program jit", median_us(lambda: slot.call(gather, **static))))
    compiled = dcp_step.gather_program.lower(cache, arrays, slot.array, None, **static).compile()
    rows.append(("gather_program compiled", median_us(lambda: slot.call(gather, program=compiled))))
    kv_c, k_pe = placement.replicated(orch.mesh, jnp.zeros((4096, 512), jnp.bfloat16),
                                     jnp.zeros((4096, 64), jnp.bfloat16))
    two = Donated((slot.array, ring[1]))
    chunk = placement.replicated(orch.mesh, jnp.zeros((arrays.chunk_rows.shape[0], 512), jnp.bfloat16),
                                 jnp.zeros((arrays.chunk_rows.shape[0], 64), jnp.bfloat16))

    statics = dict(mesh=orch.mesh, layout=orch.fmt.layout, axis_name=orch.axis_name,
                   implementation=orch.implementation, interpret=orch.interpret, prefetch_tiles=orch.prefetch_tiles)

    def layer(slots, signal, bound=True):
        args = (slots[0], None, *chunk, arrays, (cache,), (slots[1],))
        if bound:       # as the orchestrator dispatches it (`dcp_step.bound_layer_program`)
            ws, (prefetched,), _ = orch._layer_program(*args, signal=signal, gather_written=False)
        else:           # the same program with all its static arguments passed per call
            ws, (prefetched,), _ = dcp_step.layer_program(*args, signal=signal, gather_written=False, **statics)
        return ws, prefetched

    signal = adapter.events.signal
    for _ in range(3):          # rounds, alternating the two ways of passing the static arguments
        for bound in (True, False):
            rows.append((f"layer_program patch + 1 prefetch, signal, {'bound' if bound else 'per call'}",
                         median_us(lambda: (two.call(layer, signal, bound), signal.take()))))
    rows.append(("layer_program patch + 1 prefetch, no signal", median_us(lambda: two.call(layer, None))))
    slot.array, ring[1] = two.array
    rows.append(("patch_program jit", median_us(
        lambda: slot.call(dcp_step.patch_program, kv_c, k_pe, arrays.chunk_rows, None, layout=orch.fmt.layout,
                          device=placement.mesh_device(orch.mesh)))))
    identity = jax.jit(lambda x: x + 0, donate_argnums=0)
    on_mesh = Donated(placement.replicated(orch.mesh, jnp.zeros((64,), jnp.int32))[0])
    rows.append(("trivial donated jit (mesh sharding)", median_us(lambda: on_mesh.call(identity))))
    single = Donated(jnp.zeros((64,), jnp.int32))
    rows.append(("trivial donated jit (single device)", median_us(lambda: single.call(identity))))
    events, stream = adapter.events, torch.cuda.current_stream()
    rows.append(("event pair both ways", median_us(
        lambda: (events.jax_after_torch(stream), events.torch_after_jax(stream)))))
    rows.append(("current_stream", median_us(lambda: torch.cuda.current_stream(events.device))))
    buf = torch.empty(4096, 512, dtype=torch.bfloat16, device="cuda")
    rows.append(("torch copy_ 4096x512", median_us(lambda: buf.copy_(work.kv))))
    rows.append(("is_pending+check_caches", median_us(
        lambda: (orch.is_pending(1), dcp_step.check_caches(orch.fmt, cache, orch._plan)))))
    rows.append(("tensor_of+view", median_us(lambda: orch.pool.tensor_of(ring[1]).detach())))
    rows.append(("check_writable", median_us(lambda: orch.pool.check_writable(lane.lane, 1))))
    for name, us in rows:
        print(f"{name:<40} {us:8.1f} us")


def _timed(owner, name: str, label: str, times: dict):
    """Wrap owner.name so that each call's host time is appended to times[label]."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def loop_split():
    """Host time of each piece of the adapter's calls where they run: in the bench's layer loop
    (depth 2, 1M-token history, 8 layers, 4 ms of `torch.cuda._sleep` per layer), six steps."""
    from ckv_jax import prefetch
    from interop import adapter as adapter_module, bridge, stream_handoff
    times = collections.defaultdict(list)
    pieces = [(adapter_module.TorchCkvAdapter, n, "adapter." + n)
              for n in ("set_current_chunk", "gather", "_cache", "_chunk_on_device", "_require_step")]
    pieces += [(prefetch.PrefetchOrchestrator, n, "orchestrator." + n) for n in ("gather", "_dispatch", "_into_slots")]
    pieces += [(dcp_step, n, "dcp_step." + n) for n in ("check_chunk", "check_caches")]
    pieces += [(stream_handoff.StreamEvents, n, "events." + n) for n in ("jax_after_torch", "torch_after_signal")]
    pieces += [(bridge, "check_tensor", "bridge.check_tensor"), (prefetch, "target_layers", "prefetch.target_layers")]
    pieces += [(adapter_module.TorchWorkspacePool, n, "pool." + n) for n in ("tensor_of", "check_writable")]
    for owner, name, label in pieces:
        _timed(owner, name, label, times)
    work = Workload(1 << 20, 4096, 8)
    adapter = work.adapter(2)
    _timed(adapter.orch, "_layer_program", "orchestrator._layer_program", times)
    sleep = bench.compute_kernels(4.0)["sleep"]
    for _ in range(3):                       # discover the caches, compile, warm up
        work.step(adapter, sleep)
    torch.cuda.synchronize()
    times.clear()
    host = []
    for _ in range(6):
        work.begin_step(adapter)
        work.layers(adapter, sleep, host)
        torch.cuda.synchronize()
    print(f"host us per layer (set_current_chunk + gather): median {1e6 * statistics.median(host):.0f}, "
          f"min {1e6 * min(host):.0f}, max {1e6 * max(host):.0f}")
    for label, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:<34} calls {len(ts):4d}  median {1e6 * statistics.median(ts):7.1f} us  "
              f"max {1e6 * max(ts):8.1f} us")


def floor(history: int, compute_ms: float, rounds: int):
    """Host us a layer (`set_current_chunk` + `gather`, as the bench times it) of the adapter's
    steady state (depth 2, 8 layers, a 4,096-token chunk, the adapter writing the caches, sleep
    compute) against two loops over the same adapter's state in the same process, rounds of 10
    steps taking turns: `orchestrator`, the layer's torch<->JAX hand-offs around
    `PrefetchOrchestrator.write_and_gather` (the adapter's own bookkeeping left out), and `floor`,
    the same hand-offs around one call of the orchestrator's layer program (`dcp_step.layer_program`
    with its static arguments bound, `dcp_step.bound_layer_program`) with the ring and caches indexed
    by hand (no bookkeeping at all: the mechanism's cost, one dispatch and four event commands).
    The floor bounds what any code around the same dispatch could reach on this host."""
    work = Workload(history, 4096, 8, cache_write="adapter")
    adapter = work.adapter(2)
    sleep = bench.compute_kernels(compute_ms)["sleep"]
    for _ in range(3):                       # discover the caches, compile, warm up
        work.step(adapter, sleep)
    torch.cuda.synchronize()
    orch, events = adapter.orch, adapter.events
    state = orch.lane("target")
    ring = orch.pool.ring(state.lane)
    layers, ring_size = len(work.caches), orch.slots

    def chunk_arrays():
        return [adapter._chunk_buffers[(t.dtype, t.shape[1])][1] for t in work.latents]

    def handed_back(caches):
        """The written caches bound again for the adapter's next step (as its gathers bind them)."""
        for layer, cache in enumerate(caches):
            state.caches[layer] = cache
            adapter._bind("target", layer, work.caches[layer], cache)
        state.pending.clear()

    def layer_loop(host, own_work):
        """The layers with the adapter's torch<->JAX hand-offs around own_work(layer, kv_c, k_pe)
        -> the layer's workspace, timed as the bench times the adapter's calls."""
        kv_c, k_pe = chunk_arrays()
        for layer in range(layers):
            sleep()
            t0 = time.perf_counter()
            stream = events.torch_stream()
            events.mark_latents(stream)
            events.jax_after_torch(stream, latents_only=True)
            ws = own_work(layer, kv_c, k_pe)
            events.torch_after_signal(stream)
            view = orch.pool.tensor_of(ws).detach()
            host.append(time.perf_counter() - t0)
            view[:1].sum()
            del view

    def by_orchestrator(host):
        layer_loop(host, lambda layer, kv_c, k_pe: orch.write_and_gather(
            layer, state.caches[layer], kv_c, k_pe, signal=events.signal)[1])
        handed_back(list(state.caches))

    def by_hand(host):
        """begin_step prefetched layers 0 and 1 into slots 0 and 1; layer l patches slot
        l % 3 and prefetches layer l + 2."""
        caches = list(state.caches)

        def own_work(layer, kv_c, k_pe):
            own, targets = layer % ring_size, [t for t in (layer + 2,) if t < layers]
            ws, prefetched, caches[layer] = orch._layer_program(
                ring[own], None, kv_c, k_pe, orch._arrays, tuple(caches[t] for t in targets),
                tuple(ring[t % ring_size] for t in targets), caches[layer],
                signal=events.signal if targets else None)
            ring[own] = ws
            for t, slot in zip(targets, prefetched):
                ring[t % ring_size] = slot
            if not targets:
                events.signal(None)
            return ws

        layer_loop(host, own_work)
        handed_back(caches)

    loops = {"adapter": lambda host: work.layers(adapter, sleep, host), "orchestrator": by_orchestrator,
             "floor": by_hand}
    medians = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            host = []
            for _ in range(10):
                work.begin_step(adapter)
                loop(host)
                torch.cuda.synchronize()
            medians[name].append(1e6 * statistics.median(host))
    probe = bench.host_probe_us()
    print(f"history {history}, depth 2, the adapter writing, {compute_ms} ms of sleep a layer; "
          f"host probe jax {probe['jax']:.0f} us, torch {probe['torch']:.0f} us")
    for name, values in medians.items():
        print(f"{name:<12} host us a layer, median of each round: {' '.join(f'{v:.0f}' for v in values)}"
              f"   median {statistics.median(values):.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--loop", action="store_true", help="each piece's host time inside the layer loop")
    mode.add_argument("--floor", action="store_true", help="the adapter's loop against its mechanism's floor")
    ap.add_argument("--history", type=int, default=262144, help="--floor: history tokens (default %(default)s)")
    ap.add_argument("--compute-ms", type=float, default=1.0, help="--floor: sleep a layer (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=12, help="--floor: rounds of each loop (default %(default)s)")
    args = ap.parse_args()
    if args.loop:
        loop_split()
    elif args.floor:
        floor(args.history, args.compute_ms, args.rounds)
    else:
        main()
