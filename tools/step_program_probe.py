"""A whole step's JAX work queued as one program, each layer behind a flag torch writes
(`dcp_step.step_program` with `interop.stream_handoff.StepFlags`), against the adapter's
per-layer programs (`TorchCkvAdapter`, cuda-events): host time per layer, step time, hidden
share, and exactness under races.  The workload is `interop.bench`'s (one request of H history
tokens plus a C-token chunk, D = 1, fp8_ds_mla, L layers, the adapter writing each layer's cache).

Per layer of a flag step torch queues its compute, raises the flag (`release`), waits on the
layer's event and reads the workspace; begin-step drains the last step, zeroes the flags and
dispatches the program (before the step's first event, as the adapter's begin_step is).
host_us_per_layer = (that begin-step + every layer's release and wait) / L, the adapter's the
median layer's `set_current_chunk` + `gather` (as `interop.bench`).  XLA runs a step program's
first dispatch thunk by thunk, records the second into a CUDA graph and replays it from then on;
the probe counts per dispatch the hooks whose handlers ran (none in a replay).

  check     per layer torch sleeps (2e7 cycles, 10-20 ms), writes that layer's own latents into
            the chunk buffers, then releases it; the workspace torch reads after the event must
            equal the pre-step gather with the layer's records in its chunk rows, and so must the
            written cache's gather.  The control releases before the latents are written and
            must differ.
  abandon   a step released for 3 of L layers, then abandoned: the later caches keep every byte
            and the stream drains.
  tight     begin-step (drain, next_step, dispatch) over N flag steps back to back, no other
            program between them, with the hooks run per dispatch (--tight-steps N, 25).
  hazard    a device-wide synchronization (torch.cuda.synchronize) after layer 0's release blocks
            the host until another thread abandons the step 2 s later: what lazy kernel loading,
            cudaFree (torch's allocator releasing its cache) or any device synchronization does
            mid-step, with no thread to release it, is a deadlock.

    python tools/step_program_probe.py [--histories 262144,1048576] [--depths 0,1,2] [--compute-ms 1,4]
        [--tight-steps 25]
"""
import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every kernel loaded when its module is: CUDA's lazy loading loads a kernel at its first launch
# and synchronizes the device to do so, which waits for JAX's stream, which waits for a flag
# the host has not written yet (a deadlock; see `hazard`)
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import jax  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ckv_jax import dcp_step, placement  # noqa: E402
from interop import bench, bridge, stream_handoff, torch_records  # noqa: E402


class FlagStep:
    """One depth's step program over a `bench.Workload`'s torch caches, driven by flags."""

    def __init__(self, work: bench.Workload, depth: int, stream: int):
        self.depth = depth
        device = jax.devices()[0]
        self.mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=[device])
        self.events = stream_handoff.StreamEvents(torch.device("cuda", 0), stream)
        self.flags = stream_handoff.StepFlags(torch.device("cuda", 0), self.events.jax_stream, stream,
                                              layers=len(work.caches))
        self.hooks_run = []                         # per dispatch: hooks whose handlers ran (0: a replay)
        plan = work.plan
        chunk = plan.num_tokens
        self.ring_t = [torch.zeros((plan.padded_tokens, bench.FMT.record_bytes), dtype=torch.uint8, device="cuda")
                       for _ in range(depth + 1)]
        self.kv_t = torch.empty((chunk, 512), dtype=torch.bfloat16, device="cuda")
        self.pe_t = torch.empty((chunk, 64), dtype=torch.bfloat16, device="cuda")
        rep = NamedSharding(self.mesh, P())
        self.ring = tuple(self._global(t, rep) for t in self.ring_t)
        self.caches = tuple(self._global(c, NamedSharding(self.mesh, P(placement.DCP_AXIS))) for c in work.caches)
        self.kv, self.pe = self._global(self.kv_t, rep), self._global(self.pe_t, rep)
        self.words = self._global(self.flags.words, rep)
        self.arrays = dcp_step.step_arrays(plan, work.table_host.numpy(), self.mesh, chunk_capacity=chunk)
        self.tiles = dcp_step.prefetch_pack_tiles(None, device)

    def _global(self, t, sharding):
        local = bridge.to_jax(t, name="buffer", device=self.mesh.devices.flat[0])
        return jax.make_array_from_single_device_arrays(local.shape, sharding, [local])

    def begin(self):
        """Drain the last step, move the flags on, dispatch this step's program; host seconds."""
        stream = self.events.torch_stream()
        t0 = time.perf_counter()
        self.flags.abandon(stream)
        self.events.torch_after_jax(stream)
        self.flags.next_step(stream)
        self.events.jax_after_torch(stream)
        self.ring, self.caches, self.words = dcp_step.step_program(
            self.ring, self.caches, self.words, (self.kv,), (self.pe,), self.arrays, depth=self.depth, mesh=self.mesh,
            layout=bench.FMT.layout, hooks=self.flags, prefetch_tiles=self.tiles)
        self.hooks_run.append(self.flags.dispatched())
        return time.perf_counter() - t0

    def layer(self, l):
        """Release layer l and make torch wait for its workspace; host seconds; the workspace."""
        stream = self.events.torch_stream()
        t0 = time.perf_counter()
        self.flags.release(stream, l)
        self.flags.torch_after(stream, l)
        ws = self.ring_t[l % (self.depth + 1)]
        return time.perf_counter() - t0, ws

    def layers(self, compute=None):
        """The layer loop of a begun step; host seconds of its releases and waits."""
        total = 0.0
        for l in range(len(self.caches)):
            if compute is not None:
                compute()
            spent, ws = self.layer(l)
            total += spent
            ws[:1].sum()                                  # the layer's consumer: ordered after the event
        return total


def check(work: bench.Workload, runner: FlagStep, control: bool) -> int:
    """Rows of every layer's workspace that differ from the expected (see the module docstring)."""
    layers, rows = len(work.caches), work.plan.padded_tokens
    gen = torch.Generator(device="cuda").manual_seed(11)
    latents = [((torch.randn(work.kv.shape, device="cuda", generator=gen) * 3).to(torch.bfloat16),
                torch.randn(work.pe.shape, device="cuda", generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    def gather(cache):
        return dcp_step.gather_program(cache, runner.arrays, mesh=runner.mesh)

    expected = []
    torch.cuda.synchronize()
    for l in range(layers):                # the pre-step history, then the layer's chunk records
        want = bridge.to_torch(gather(runner.caches[l]).addressable_data(0), name="expected").clone()
        want[torch.as_tensor(work.plan.positions(), device="cuda")] = torch_records.encode(bench.FMT.name, *latents[l])
        expected.append(want[:rows])
    seen = [torch.empty_like(e) for e in expected]
    runner.begin()
    stream = runner.events.torch_stream()
    for l in range(layers):
        if control:
            runner.flags.release(stream, l)
        torch.cuda._sleep(20_000_000)      # ~10-20 ms: the latents come late
        runner.kv_t.copy_(latents[l][0])
        runner.pe_t.copy_(latents[l][1])
        if not control:
            runner.flags.release(stream, l)
        runner.flags.torch_after(stream, l)
        seen[l].copy_(runner.ring_t[l % (runner.depth + 1)][:rows])
    runner.flags.abandon(stream)
    torch.cuda.synchronize()
    bad = sum(int((s != e).any(dim=1).sum()) for s, e in zip(seen, expected))
    if not control:                        # and the written caches gather to the same
        torch.cuda.synchronize()
        for l in range(layers):
            got = bridge.to_torch(gather(runner.caches[l]).addressable_data(0), name="written")[:rows]
            bad += int((got != expected[l]).any(dim=1).sum())
    return bad


def abandon(work: bench.Workload, runner: FlagStep) -> tuple[int, int]:
    """(caches changed after the release, caches written before it) of a step abandoned at 3."""
    torch.cuda.synchronize()
    for c in work.caches:                  # make the chunk's slots stale, so a write shows
        c.view(-1, bench.FMT.record_bytes)[work.slots] ^= 0x5A
    before = [c.clone() for c in work.caches]
    runner.begin()
    stream = runner.events.torch_stream()
    for l in range(3):
        runner.flags.release(stream, l)
        runner.flags.torch_after(stream, l)
    runner.flags.abandon(stream)
    runner.events.torch_after_jax(stream)
    torch.cuda.synchronize()
    changed = [l for l in range(3, len(work.caches)) if not torch.equal(work.caches[l], before[l])]
    written = [l for l in range(3) if not torch.equal(work.caches[l], before[l])]
    return len(changed), len(written)


def hazard(runner: FlagStep, after_s: float = 2.0) -> float:
    """Seconds a torch.cuda.synchronize() mid-step blocks while a watchdog thread abandons the
    step `after_s` later (see the module docstring)."""
    runner.begin()
    stream = runner.events.torch_stream()
    runner.flags.release(stream, 0)
    runner.flags.torch_after(stream, 0)

    def watchdog():
        time.sleep(after_s)
        runner.flags.abandon(stream)

    thread = threading.Thread(target=watchdog)
    t0 = time.perf_counter()
    thread.start()
    torch.cuda.synchronize()
    blocked = time.perf_counter() - t0
    thread.join()
    return blocked


def _split(replays: list, recordings: list) -> str:
    """The begin-step medians of the replayed and the (partly) recorded dispatches."""
    def median(xs):
        return f"{1e6 * statistics.median(xs):.0f}" if xs else "-"
    return f"{len(replays)} replays {median(replays)} us, {len(recordings)} recorded {median(recordings)} us"


def tight_loop(runner: FlagStep, steps: int) -> tuple[list, list]:
    """(begin-step host seconds, hooks run) of `steps` flag steps back to back, each after 2e6
    cycles of sleep on torch's stream and every layer released at once: no other JAX program
    runs between the steps, so XLA's scratch memory stays where the recorded graph has it."""
    stream = runner.events.torch_stream()
    began, first = [], len(runner.hooks_run)
    for _ in range(steps):
        torch.cuda._sleep(2_000_000)
        began.append(runner.begin())
        for l in range(len(runner.caches)):
            runner.flags.release(stream, l)
            runner.flags.torch_after(stream, l)
        torch.cuda.synchronize()
    return began, runner.hooks_run[first:]


def probe_history(args, history: int, stream: int) -> int:
    """Every check and timing of the module docstring at one history size; failures."""
    failures = 0
    work = bench.Workload(history, args.chunk, args.layers, cache_write="adapter")
    runners = {d: FlagStep(work, d, stream) for d in args.depths}
    adapters = {d: work.adapter(d) for d in args.depths}
    try:
        for d, runner in runners.items():
            runner.begin()                                # compiles
            runner.layers()
            if history == min(args.histories):
                bad, bad_control = check(work, runner, False), check(work, runner, True)
                ok = bad == 0 and bad_control > 0
                failures += not ok
                print(f"check H={history} depth {d}: {bad} rows differ; control (released early): {bad_control} "
                      f"rows differ -> {'ok' if ok else 'FAIL'}", flush=True)
            if args.tight_steps:
                began, runs = tight_loop(runner, args.tight_steps)
                print(f"tight loop H={history} depth {d}: begin-step {1e6 * statistics.median(began):.0f} us "
                      f"[{1e6 * min(began):.0f}-{1e6 * max(began):.0f}] over {len(began)} steps, no other program "
                      f"between them; XLA replayed its recorded graph unchanged in {runs.count(0)} | probe "
                      f"{bench.host_probe_us()['jax']:.0f} us", flush=True)
        changed, written = abandon(work, runners[max(args.depths)])
        ok = changed == 0 and written == 3
        failures += not ok
        print(f"abandon H={history}: {changed} caches changed after the release, {written} of 3 written before "
              f"-> {'ok' if ok else 'FAIL'}", flush=True)
        for kind in args.kinds.split(","):
            for x in args.compute_ms:
                compute = bench.compute_kernels(x)[kind]
                probe = bench.host_probe_us()
                alone, flag_steps, adapter_steps = [], {d: [] for d in args.depths}, {d: [] for d in args.depths}
                flag_host, adapter_host = {d: [] for d in args.depths}, {d: [] for d in args.depths}
                flag_begin = {d: [] for d in args.depths}
                replays, recordings = {d: [] for d in args.depths}, {d: [] for d in args.depths}
                for trial in range(2 + args.trials):
                    keep = trial >= 2
                    t = bench.event_ms(lambda: work.layers(None, compute), before=compute)
                    alone += [t] * keep
                    for d in args.depths:
                        runner, adapter, layer_host, began = runners[d], adapters[d], [], []

                        def begin_flags():
                            compute()                     # the previous step's tail
                            began.append(runner.begin())

                        spent = []
                        t = bench.event_ms(lambda: spent.append(runner.layers(compute)), before=begin_flags)
                        if keep:
                            flag_steps[d].append(t)
                            flag_host[d].append((began[0] + spent[0]) / args.layers)
                            flag_begin[d].append(began[0])
                            (replays if runner.hooks_run[-1] == 0 else recordings)[d].append(began[0])

                        def begin_adapter():
                            compute()
                            work.begin_step(adapter)

                        t = bench.event_ms(lambda: work.layers(adapter, compute, layer_host), before=begin_adapter)
                        if keep:
                            adapter_steps[d].append(t)
                            adapter_host[d].append(statistics.median(layer_host))
                base = statistics.median(alone)
                f0, a0 = (statistics.median(flag_steps[min(args.depths)]),
                          statistics.median(adapter_steps[min(args.depths)]))
                for d in args.depths:
                    f, a = statistics.median(flag_steps[d]), statistics.median(adapter_steps[d])
                    print(f"{kind:>6} H={history:>8} X={x:4.1f} ms depth {d}: compute {base:7.2f} ms | flags step "
                          f"{f:7.2f} ms hidden {100 * (1 - (f - base) / (f0 - base)):6.1f}% host "
                          f"{1e6 * statistics.median(flag_host[d]):5.1f} us/layer (begin "
                          f"{1e6 * statistics.median(flag_begin[d]):5.0f} us: "
                          f"{_split(replays[d], recordings[d])}; spread "
                          f"{100 * (max(flag_steps[d]) - min(flag_steps[d])) / f:4.1f}%) | adapter step {a:7.2f} ms "
                          f"hidden {100 * (1 - (a - base) / (a0 - base)):6.1f}% host "
                          f"{1e6 * statistics.median(adapter_host[d]):5.1f} us/layer | probe "
                          f"{probe['jax']:.0f}/{probe['torch']:.0f} us", flush=True)
        blocked = hazard(runners[max(args.depths)])
        print(f"hazard H={history}: torch.cuda.synchronize() mid-step blocked {blocked:.2f} s, until the watchdog "
              f"abandoned the step after 2 s", flush=True)
        for d, runner in runners.items():
            runs = runner.hooks_run
            print(f"H={history} depth {d}: {len(runs)} dispatches; XLA replayed its recorded CUDA graph unchanged in "
                  f"{runs.count(0)}, recorded some hooks anew in {sum(0 < r < 2 * args.layers for r in runs)} "
                  f"(median {statistics.median(runs)} of {2 * args.layers} hooks)", flush=True)
    finally:                       # a step left unreleased (an error mid-step) would hold JAX's stream
        for runner in runners.values():
            runner.flags.abandon(runner.events.torch_stream())
        for a in adapters.values():
            a.close()
        torch.cuda.synchronize()
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/step_program_probe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--histories", type=bench._ints, default=[262144, 1048576])
    ap.add_argument("--depths", type=bench._ints, default=[0, 1, 2])
    ap.add_argument("--compute-ms", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 4.0])
    ap.add_argument("--kinds", default="sleep")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--tight-steps", type=int, default=25, help="steps of the tight loop per depth (0: none)")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        print("step_program_probe needs torch and JAX on a CUDA GPU", file=sys.stderr)
        return 2
    found = stream_handoff.probe(jax.devices()[0])
    if found.stream is None:
        print(f"JAX's compute stream was not found: {found.why}", file=sys.stderr)
        return 2
    failures = 0
    for history in args.histories:
        failures += probe_history(args, history, found.stream)
        torch.cuda.empty_cache()
    print("FAILURES" if failures else "all checks ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
