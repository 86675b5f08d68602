"""`python -m interop.bench`: the torch adapter on a CUDA GPU, as a torch engine sees it.

* overhead: host time of one layer's adapter calls (`set_current_chunk` + `gather`, i.e. the
  imports, the dispatches and the export) with a tiny workspace, so the kernels are negligible;
  beside it a naive torch -> JAX -> torch round trip (import the cache, a jitted gather, export).
* overlap: L layers where torch computes X ms per layer (matmuls on its stream) and the adapter
  gathers a Y ms workspace (JAX's stream); step time from CUDA events at depth 0 (X + Y expected)
  and at depth >= 1 (max(X, Y) is the ideal).  X is calibrated to Y in the same run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

import interop
from ckv_jax import formats, full_ckv
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import build_step_plan
from interop import torch_records

FMT = formats.get("fp8_ds_mla")


class _Setup:
    """One request of `context` tokens (the last `chunk` of them this step) on D = 1."""

    def __init__(self, context, chunk, layers, depth, block_size=64):
        self.layout = DcpLayout(1, 1, block_size)
        blocks = -(-context // block_size)
        self.table = torch.randperm(blocks, device="cuda", dtype=torch.int32)[None, :].contiguous()
        self.caches = [torch.randint(0, 256, (blocks, block_size, FMT.record_bytes), dtype=torch.uint8, device="cuda")
                       for _ in range(layers)]
        self.seq, self.q = np.array([context]), np.array([chunk])
        self.plan = build_step_plan(self.layout, self.seq, self.q, max_tokens=context, min_tokens=1,
                                    min_world_size=1)
        self.kv = (torch.randn(chunk, 512, device="cuda") * 3).to(torch.bfloat16)
        self.pe = torch.randn(chunk, 64, device="cuda").to(torch.bfloat16)
        self.records = torch_records.encode(FMT.name, self.kv, self.pe)
        slots = self.layout.slot_mapping(self.plan.positions(), self.plan.req_id_per_token, self.table.cpu().numpy(), 0)
        self.slots = slots                                # host slots: the write never syncs
        self.adapter = interop.TorchCkvAdapter(
            world_size=1, format=FMT.name, max_num_seqs=1, block_size=block_size, min_world_size=1,
            config=GatherConfig(enabled=True, depth=depth, workspace_mib=0, min_tokens=1, max_tokens=context))

    def step(self, compute=None):
        a = self.adapter
        a.begin_step(self.seq, self.q, self.table)
        for layer, cache in enumerate(self.caches):
            if compute is not None:
                compute()
            torch_records.write(cache, self.records, self.slots)
            a.set_current_chunk(self.kv, self.pe)
            ws = a.gather(layer, cache)
            ws[:1].sum()                                  # the layer's consumer (waits for the gather)
            del ws


def overhead(layers: int, trials: int) -> dict:
    out = {}
    for depth in (0, 2):
        s = _Setup(context=256, chunk=64, layers=layers, depth=depth)
        for _ in range(3):
            s.step()
        torch.cuda.synchronize()
        per_layer = []
        for _ in range(trials):
            torch.cuda.synchronize()
            start = time.perf_counter()
            s.step()
            per_layer.append((time.perf_counter() - start) / layers)
        torch.cuda.synchronize()
        out[f"adapter_depth{depth}_us"] = statistics.median(per_layer) * 1e6
        s.adapter.close()

    # naive: every call imports the cache and the table, runs a jitted gather, exports the result
    s = _Setup(context=256, chunk=64, layers=layers, depth=0)
    mesh = s.adapter.mesh
    num_rows = s.plan.padded_tokens
    local_cu = jnp.asarray(s.plan.local_cu_seq_lens)

    sharded = NamedSharding(mesh, P(full_ckv.DCP_AXIS))

    def naive(cache):
        c = jax.device_put(interop.to_jax(cache), sharded)          # one device: no copy
        t, cu = full_ckv.replicated(mesh, interop.to_jax(s.table), local_cu)
        ws = full_ckv.all_gather_placed(c, t, cu, mesh=mesh, axis_name=full_ckv.DCP_AXIS, num_rows=num_rows,
                                        implementation=None, interpret=False)
        return interop.to_torch(ws.addressable_shards[0].data)

    for _ in range(3):
        [naive(c)[:1].sum() for c in s.caches]
    torch.cuda.synchronize()
    per_layer = []
    for _ in range(trials):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for c in s.caches:
            naive(c)[:1].sum()
        per_layer.append((time.perf_counter() - start) / layers)
    torch.cuda.synchronize()
    out["naive_round_trip_us"] = statistics.median(per_layer) * 1e6

    # the pieces of one adapter call, host time each (median of 200)
    local = interop.to_jax(s.kv)
    pieces = {"import_us": lambda: interop.to_jax(s.kv),
              "make_global_us": lambda: jax.make_array_from_single_device_arrays(
                  local.shape, NamedSharding(mesh, P()), [local]),
              "export_us": lambda: interop.to_torch(local)}
    for name, fn in pieces.items():
        for _ in range(20):
            fn()
        times = []
        for _ in range(200):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    s.adapter.close()
    return out


@contextlib.contextmanager
def _timing(targets, timers):
    """Wrap each (owner, attribute, label) with a host timer that appends to timers[label]
    (nested calls are timed each on its own: an outer label includes its inner ones)."""
    saved = []
    for owner, attr, label in targets:
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _name=label, **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                timers[_name].append(time.perf_counter() - start)

        saved.append((owner, attr, fn))
        setattr(owner, attr, timed)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def breakdown(layers: int, trials: int, with_compute: bool) -> dict:
    """Host time per layer of each piece of the adapter calls, measured inside the layer loop
    (with_compute: torch queues ~1 ms of matmuls per layer first, as in the overlap run)."""
    s = _Setup(context=256, chunk=64, layers=layers, depth=0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    compute = (lambda: [a @ a for _ in range(4)]) if with_compute else None
    for _ in range(3):
        s.step(compute)
    torch.cuda.synchronize()
    timers = collections.defaultdict(list)
    targets = [(jax.dlpack, "from_dlpack", "from_dlpack"), (interop.bridge, "to_jax", "to_jax"),
               (interop.bridge, "to_torch", "to_torch"),
               (jax, "make_array_from_single_device_arrays", "make_array_from_single_device_arrays"),
               (s.adapter.orch, "gather", "orchestrator_gather"), (torch_records, "write", "torch_records_write"),
               (s.adapter, "set_current_chunk", "set_current_chunk"), (s.adapter, "gather", "adapter_gather"),
               (s.adapter, "begin_step", "begin_step")]
    totals = []
    with _timing(targets, timers):
        for _ in range(trials):
            torch.cuda.synchronize()
            start = time.perf_counter()
            s.step(compute)
            totals.append(time.perf_counter() - start)
            torch.cuda.synchronize()
    s.adapter.close()
    per_layer = {f"{name}_us": sum(ts) / (trials * layers) * 1e6 for name, ts in timers.items()}
    per_layer["calls_per_layer"] = {name: len(ts) / (trials * layers) for name, ts in timers.items()}
    per_layer["step_per_layer_us"] = statistics.median(totals) / layers * 1e6
    return per_layer


def _event_ms(fn, trials=5) -> float:
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def overlap(context: int, chunk: int, layers: int, depths, side_stream: bool) -> list[dict]:
    """side_stream: torch works on a stream of its own instead of the legacy default stream (which
    synchronizes with every blocking stream of the device)."""
    if side_stream:
        with torch.cuda.stream(torch.cuda.Stream()):
            return overlap(context, chunk, layers, depths, False)
    rows = []
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    matmul_ms = _event_ms(lambda: [a @ a for _ in range(20)]) / 20
    base = _Setup(context, chunk, layers, depth=0)
    for _ in range(2):
        base.step()
    y_ms = _event_ms(base.step) / layers                  # gather (+ write) per layer, no compute
    reps = max(1, round(y_ms / matmul_ms))

    def compute():
        for _ in range(reps):
            a @ a

    x_ms = _event_ms(lambda: [compute() for _ in range(layers)]) / layers
    base.adapter.close()
    del base
    for depth in depths:
        s = _Setup(context, chunk, layers, depth)
        for _ in range(2):
            s.step(compute)
        step_ms = _event_ms(functools.partial(s.step, compute))
        rows.append(dict(depth=depth, layers=layers, context=context, chunk=chunk, compute_ms_per_layer=x_ms,
                         gather_ms_per_layer=y_ms, step_ms=step_ms, serial_ms=layers * (x_ms + y_ms),
                         ideal_ms=layers * max(x_ms, y_ms),
                         over_ideal_pct=100 * (step_ms / (layers * max(x_ms, y_ms)) - 1)))
        s.adapter.close()
        del s
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1 << 20, help="tokens of the request in the overlap run")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--depths", default="0,1,2")
    ap.add_argument("--out", default="interop.json")
    ap.add_argument("--skip-overlap", action="store_true", help="only the host-cost measurements")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("interop.bench needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    over = overhead(layers=32, trials=9)
    print("per-layer host overhead (us): " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in over.items()), flush=True)
    pieces = {}
    for with_compute in (False, True):
        pieces["with_compute" if with_compute else "idle_gpu"] = b = breakdown(32, 5, with_compute)
        print(f"host time per layer inside the loop ({'torch matmuls queued' if with_compute else 'idle GPU'}): "
              + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in b.items() if k.endswith("_us")), flush=True)
    rows = []
    for side in () if args.skip_overlap else (False, True):
        for r in overlap(args.context, args.chunk, args.layers, [int(d) for d in args.depths.split(",")], side):
            rows.append(dict(r, torch_stream="side" if side else "default"))
    print(f"\n{'torch stream':>12} {'depth':>5} {'X ms/layer':>10} {'Y ms/layer':>10} {'step ms':>8} {'X+Y':>8} "
          f"{'max(X,Y)':>8} {'vs ideal':>8}")
    for r in rows:
        print(f"{r['torch_stream']:>12} {r['depth']:>5} {r['compute_ms_per_layer']:>10.3f} "
              f"{r['gather_ms_per_layer']:>10.3f} {r['step_ms']:>8.2f} {r['serial_ms']:>8.2f} {r['ideal_ms']:>8.2f} "
              f"{r['over_ideal_pct']:>7.1f}%")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), jax=jax.__version__, torch=torch.__version__,
                       command="python -m interop.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                       overhead=over, breakdown=pieces, overlap=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
