"""`python -m interop.bench`: how much of the gather the torch adapter's prefetch hides, on a GPU.

One request of H history tokens plus a C-token chunk, fp8_ds_mla, L layers, D = 1, or D > 1 ranks
with `--processes D`: D processes on this machine's first D GPUs, one rank each, joined by
`jax.distributed` (each layer's gather all-gathers the ranks' shares over NCCL; every rank
reports its own rows, and the ranks start each timed step together).  Per layer
torch computes X ms, calls `set_current_chunk` (the latents are final), writes the chunk into the
layer's paged cache (`--mark after-write`: the other way round), calls `gather`, and reads the
workspace (a one-row consumer that orders after it).  `--indexer-pct P` moves P% of X to between
the latents' mark and the cache write, where a sparse-MLA layer runs its indexer (vLLM's order:
latents, indexer, cache write, attention); the default 0 puts nothing there, so the patch's
hand-offs between the streams lie on torch's path (the worst case).  The chunk's latents come in the adapter's
`chunk_buffers` (`--latents in-place`: the engine's projection writes them there, so the step's
first fill is untimed and no layer copies them) or as the engine's own tensors, which the
adapter copies per layer (`--latents copied`).  The engine writes each layer's cache itself
(`--cache-writes engine`: the records scattered in 8-byte words, `--engine-write words`, as an
engine's writer kernel stores them, or byte by byte, `bytes`, torch's element-wise kernel that
earlier runs used), or leaves it to the adapter (`adapter`: `gather(..., write_cache=True)`
writes it with ckv-jax's writer in the layer's program); the compute alone always has the
engine's write.  With `--ordering step-program` an adapter's program either writes the caches
(`adapter`) or only gathers (`engine`: the engine writes its caches and `gather` takes the
chunk's records, which torch copies into the workspace, `TorchCkvAdapter(cache_writes=)`).
`--torch-marks before|after` records a timing event on torch's stream just
before or after each layer's compute in every variant, as an engine's own marks would: the
hand-offs between the streams take a few microseconds more or less with such incidental
commands.  Two kinds of
compute: `sleep` (`torch.cuda._sleep`: one spinning CTA, the SMs stay free, so this measures the
ordering machinery alone) and `matmul` (bf16 matmuls that fill every SM: the realistic worst
case).  Per row:

  gather_ms_per_layer  the GPU time of a layer's JAX work: events on JAX's compute stream around
                       each depth-0 layer's calls, without compute, the span opened once the host
                       has queued the calls' work (median over layers and trials)
  compute_only_ms      the same step with the adapter calls left out (compute, cache writes, and
                       the consumer's kernels over a stand-in row); compute_only_spread_pct
                       its (max - min) / median over the trials
  step_ms              CUDA events on torch's stream around the step's layer loop (median of
                       trials; spread_pct = (max - min) / median of those trials).  Within a
                       trial the compute alone and every depth take turns, so a drift of the
                       GPU's clocks between them does not bias hidden_pct.  Before the
                       first event torch queues one layer's compute (the previous step's tail)
                       and the host calls `begin_step` (host time begin_step_us), as an engine
                       prepares a step while the last one runs: the first event fires when the
                       tail ends, and the gathers `begin_step` dispatched start after it too
  hidden_pct           100 * (1 - (step_N - compute_only) / (step_0 - compute_only)): the share
                       of the depth-0 step's exposed gather time that depth N hides; above 100
                       (marked * in the printed table) a depth-N step ran faster than the compute
                       alone, so the baseline moved by more than what is left exposed
  exposed_us_per_layer 1000 * (step_N - compute_only) / layers: what a depth-N step adds to the
                       compute alone, per layer.  hidden_pct divides by depth 0's exposed
                       time, so it moves with that step too (a slower depth 0 raises it with no
                       depth N faster); this figure does not, and compares across runs
  host_us_per_layer    host wall time of one layer's `set_current_chunk` + `gather` (median)
  step_host_us_per_layer  host wall time of a step's `begin_step` and every layer's calls, per
                       layer (median over trials): with `--ordering step-program` begin_step
                       dispatches the whole step's program, which this counts
  replayed_steps       with `--ordering step-program`, "replayed/dispatched": of the row's steps
                       (warm-up trials included), those whose program XLA replayed as a recorded
                       CUDA graph, running no hook on the host
  host_probe_us        the host's speed at that row: one dispatch of a trivial jitted program
                       and one small torch op (median of a loop of each, us), so host figures
                       of different runs can be told apart from a slower machine
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils

import interop
from ckv_jax import dcp_step, formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import build_step_plan
from interop import torch_records
from pallas_kernels import paged_gather

FMT = formats.get("fp8_ds_mla")


class Workload:
    """The torch engine's side of one step on rank `rank` of `world_size` DCP ranks (one process
    each, `--processes`): the rank's caches, the block table every rank shares, the chunk's
    latents (the same on every rank) and the device slots of the chunk's tokens the rank owns.
    Every rank draws the same table, caches and latents from `seed`."""

    def __init__(self, history: int, chunk: int, layers: int, block_size: int = 64, seed: int = 0,
                 chunk_in_place: bool = True, mark_before_write: bool = True, native_signal: bool = True,
                 cache_write: str = "engine", engine_write: str = "words", world_size: int = 1, rank: int = 0,
                 device: str = "cuda"):
        if cache_write not in CACHE_WRITES:
            raise ValueError(f"cache_write: expected one of {CACHE_WRITES}, got {cache_write!r}")
        if engine_write not in ENGINE_WRITES:
            raise ValueError(f"engine_write: expected one of {ENGINE_WRITES}, got {engine_write!r}")
        self.cache_write, self.engine_write = cache_write, engine_write
        self.chunk_in_place = chunk_in_place
        self.mark_before_write = mark_before_write
        self.native_signal = native_signal
        self.layout = DcpLayout(world_size, 1, block_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank!r}")
        self.rank = rank
        gen = torch.Generator(device=device).manual_seed(seed)
        context = history + chunk
        blocks = -(-context // (block_size * world_size))        # a block holds block_size tokens of each rank
        self.table = torch.randperm(blocks, device=device, dtype=torch.int32, generator=gen)[None, :].contiguous()
        self.table_host = self.table.cpu()                # what begin_step reads (no host wait)
        self.caches = [torch.randint(0, 256, (blocks, block_size, FMT.record_bytes), dtype=torch.uint8,
                                     device=device, generator=gen) for _ in range(layers)]
        self.seq, self.q = np.array([context]), np.array([chunk])
        self.local_len = int(self.layout.local_seq_lens(self.seq, rank)[0])      # the rank's tokens of the request
        self.plan = build_step_plan(self.layout, self.seq, self.q, max_tokens=context, min_tokens=1,
                                    min_world_size=1)
        self.kv = (torch.randn(chunk, 512, device=device, generator=gen) * 3).to(torch.bfloat16)
        self.pe = torch.randn(chunk, 64, device=device, generator=gen).to(torch.bfloat16)
        self.records = torch_records.encode(FMT.name, self.kv, self.pe)
        self.stand_in = torch.zeros((1, FMT.record_bytes), dtype=torch.uint8, device=device)
        slots = self.layout.slot_mapping(self.plan.positions(), self.plan.req_id_per_token,
                                         self.table_host.numpy(), rank)
        owned = torch.from_numpy(np.flatnonzero(slots >= 0)).to(device)
        self.owned_records = self.records[owned]           # the rank's share of the chunk, in its cache write
        self.owned_words = self.owned_records.view(torch.int64)          # 82 words a record
        # on the device: no sync per write
        self.slots = torch.tensor(slots[slots >= 0], dtype=torch.int64, device=device)

    def adapter(self, depth: int, prefetch_programs: int | None = None,
                ordering: str | None = None) -> interop.TorchCkvAdapter:
        # options only when asked: an adapter older than them (adapter_trace --code) runs too
        asked = dict(native_signal=False) if not self.native_signal else {}
        if ordering is not None:
            asked["ordering"] = ordering
        if ordering == "step-program":        # the program writes the caches, or only gathers
            asked["cache_writes"] = self.cache_write
        return interop.TorchCkvAdapter(
            world_size=self.layout.world_size, format=FMT.name, max_num_seqs=1, block_size=self.layout.block_size,
            min_world_size=1,
            config=GatherConfig(enabled=True, depth=depth, workspace_mib=0, min_tokens=1,
                                max_tokens=int(self.seq[0])), prefetch_programs=prefetch_programs, **asked)

    def write(self, layer: int, indexer=None):
        """The layer's cache write by the engine, after the indexer's compute (`layers`) when
        given: the step's records scattered into their slots as 8-byte words (`words`, as an
        engine's writer kernel stores them) or as bytes (`bytes`: torch's element-wise kernel,
        about 5,000 CTAs that fill the SMs for ~11 us)."""
        if indexer is not None:
            indexer()
        rows = self.caches[layer].view(-1, FMT.record_bytes)
        if self.engine_write == "words":
            rows.view(torch.int64).index_copy_(0, self.slots, self.owned_words)
        else:
            rows.index_copy_(0, self.slots, self.owned_records)

    def begin_step(self, adapter) -> bool:
        caches = dict(kv_caches=self.caches) if adapter.ordering == "step-program" else {}
        began = adapter.begin_step(self.seq, self.q, self.table_host, **caches)
        self.latents = (self.kv, self.pe)
        if began and self.chunk_in_place and not _takes_records(adapter):   # as the engine's projection would
            self.latents = adapter.chunk_buffers()
            for buffer, value in zip(self.latents, (self.kv, self.pe)):
                buffer.copy_(value)
        return began

    def step(self, adapter, compute=None, host=None, jax_events=None):
        """One step: `begin_step`, then the layers."""
        if adapter is not None:
            self.begin_step(adapter)
        self.layers(adapter, compute, host, jax_events)

    def layers(self, adapter, compute=None, host=None, jax_events=None, indexer=None, after_layer=None):
        """The layer loop of a begun step (adapter None: compute and the engine's cache writes
        only; with an adapter and `cache_write="adapter"` the adapter's gather writes them).  host: a
        list that receives each layer's adapter host time; jax_events: a list that receives
        (start, end) events recorded on JAX's stream around each layer's calls; indexer: compute
        queued just before the cache write (after the latents' mark, unless marked after the write);
        after_layer: called at the end of each layer with an adapter, untimed."""
        for layer, cache in enumerate(self.caches):
            if compute is not None:
                compute()
            if adapter is None:
                self.write(layer, indexer)
                self.stand_in[:1].sum()                   # the consumer's own kernels, over no workspace
                continue
            if jax_events is not None:
                # the span opens after 1 ms of torch's sleep, which JAX's stream waits for: by then
                # the host has queued the layer's JAX work, so the span is its GPU time, not the
                # host's time to dispatch it (which a slow host would put in the span)
                compute_kernels(1.0)["sleep"]()
                adapter.events.jax_after_torch(adapter.events.torch_stream())
                start = torch.cuda.Event(enable_timing=True)
                start.record(adapter.events.jax_stream)
            adapter_writes = self.cache_write == "adapter"
            # a step program that only gathers takes the records the engine wrote, no latents
            records = dict(records=self.records) if _takes_records(adapter) else {}
            if not (self.mark_before_write or adapter_writes):
                self.write(layer, indexer)
            t0 = time.perf_counter()
            if not records:
                adapter.set_current_chunk(*self.latents)     # the latents are final
            t1 = time.perf_counter()
            if adapter_writes:
                if indexer is not None:
                    indexer()
            elif self.mark_before_write:
                self.write(layer, indexer)
            t2 = time.perf_counter()
            ws = adapter.gather(layer, cache, write_cache=adapter_writes, **records)
            if host is not None:
                host.append(t1 - t0 + time.perf_counter() - t2)
            if jax_events is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(adapter.events.jax_stream)
                jax_events.append((start, end))
            ws[:1].sum()                                  # the layer's consumer: ordered after the gather
            del ws
            if after_layer is not None:
                after_layer()


def _takes_records(adapter) -> bool:
    """A step-program adapter whose engine writes the caches: `gather` takes the chunk's records."""
    return getattr(adapter, "cache_writes", "adapter") == "engine"


def wait_for_every_process():
    """With several processes (`--processes`), return once every process got here: the ranks
    start each timed step together, so no rank's step counts the time its first all-gather
    waits for a later rank.  A collective on JAX's stream; never call it while a step is open."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("interop.bench")


def event_ms(fn, before=None) -> float:
    """CUDA events on torch's current stream around fn(); before() runs first, untimed (after
    every process got here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    wait_for_every_process()
    if before is not None:
        before()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@functools.cache
def _compute_rates() -> tuple[float, torch.Tensor, float]:
    """(ms per sleep cycle, the matmul operand, ms per matmul), measured once per process."""
    cycles = 10_000_000
    per_cycle_ms = statistics.median(event_ms(lambda: torch.cuda._sleep(cycles)) for _ in range(3)) / cycles
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    per_matmul_ms = statistics.median(event_ms(lambda: [a @ a for _ in range(20)]) for _ in range(3)) / 20
    return per_cycle_ms, a, per_matmul_ms


def _with_marks(kernels: dict, marks: str) -> dict:
    """`kernels` (`compute_kernels`) with an event recorded on torch's current stream before or
    after each call (`TORCH_MARKS`)."""
    if marks not in TORCH_MARKS:
        raise ValueError(f"marks: expected one of {TORCH_MARKS}, got {marks!r}")
    if marks == "none":
        return kernels
    event = torch.cuda.Event(enable_timing=True)          # a timing mark, as an engine's would be

    def marked(fn):
        def call():
            if marks == "before":
                event.record()
            fn()
            if marks == "after":
                event.record()
        return call
    return {kind: marked(fn) for kind, fn in kernels.items()}


def compute_kernels(target_ms: float) -> dict:
    """kind -> a function that queues about target_ms of that compute on torch's current stream."""
    per_cycle_ms, a, per_matmul_ms = _compute_rates()
    sleep_cycles = max(1, round(target_ms / per_cycle_ms))
    reps = max(1, round(target_ms / per_matmul_ms))
    return {"sleep": lambda: torch.cuda._sleep(sleep_cycles), "matmul": lambda: [a @ a for _ in range(reps)]}


def _jax_ms_per_layer(work: Workload, adapter, trials: int) -> float:
    """The GPU time of a depth-0 layer's JAX work without compute: events on JAX's stream around
    each layer's calls; on the DLPack path (no stream handle) the step's time less the cache
    writes alone, per layer."""
    if adapter.events is None:
        writes = statistics.median(timed(lambda: work.layers(None), trials))
        step = timed(lambda: work.layers(adapter), trials, before=lambda: work.begin_step(adapter))
        return (statistics.median(step) - writes) / len(work.caches)
    work.step(adapter)                                    # compiles: the GPU would idle inside the spans
    spans = []
    for _ in range(trials):
        events = []
        torch.cuda.synchronize()
        wait_for_every_process()
        work.begin_step(adapter)
        work.layers(adapter, jax_events=events)
        torch.cuda.synchronize()
        spans += [s.elapsed_time(e) for s, e in events]
    return statistics.median(spans)


def timed(fn, trials: int, warmup: int = 2, before=None) -> list[float]:
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    return [event_ms(fn, before) for _ in range(trials)]


def pack_bandwidth(work: Workload, programs, calls: int = 20) -> list[dict]:
    """The pack of the rank's share of one layer's history alone (GB/s of bytes read + written,
    CUDA events on JAX's stream around `calls` calls), written into a donated buffer as a
    prefetch writes its ring slot: the full grid and persistent grids of `programs` programs
    (`ckv_jax.dcp_step.bounded_pack_tiles`), beside a torch device copy of the same bytes."""
    adapter = work.adapter(1)
    stream = adapter.events.jax_stream
    cache = interop.to_jax(work.caches[0], device=adapter.device)
    table = interop.to_jax(work.table, device=adapter.device)
    cu = jax.device_put(np.array([0, work.local_len], np.int32), adapter.device)   # the rank's whole request
    rows = work.plan.padded_tokens
    moved = 2 * rows * FMT.record_bytes
    slot = jax.device_put(np.zeros((rows, FMT.record_bytes), np.uint8), adapter.device)
    out = []
    for n in [0] + list(programs):
        tiles = None if n == 0 else dcp_step.bounded_pack_tiles(n)
        pack = jax.jit(lambda c, t, u, o, tiles=tiles: paged_gather.gather_records(
            c, t, u, num_rows=rows, out=o, config=tiles, device=adapter.device), donate_argnums=3)
        slot = jax.block_until_ready(pack(cache, table, cu, slot))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(calls):
            slot = pack(cache, table, cu, slot)
        end.record(stream)
        jax.block_until_ready(slot)
        end.synchronize()
        us = start.elapsed_time(end) * 1e3 / calls
        out.append(dict(programs=n, tiles=str(tiles), us=us, gbps=moved / us / 1e3))
    src = work.caches[0].view(-1)[:rows * FMT.record_bytes]
    dst = torch.empty_like(src)
    us = event_ms(lambda: [dst.copy_(src) for _ in range(calls)]) * 1e3 / calls
    out.append(dict(programs=None, tiles="torch device copy", us=us, gbps=moved / us / 1e3))
    adapter.close()
    return out


STREAMS = ("default", "side", "priority")
CACHE_WRITES = ("engine", "adapter")       # who writes each layer's cache in a step with the adapter
ENGINE_WRITES = ("words", "bytes")         # the engine's stand-in cache write (`Workload.write`)
# an event torch records on its stream around each layer's compute, as an engine's own timing or
# profiling marks would: none, or just before or just after the compute
TORCH_MARKS = ("none", "before", "after")


def torch_stream(kind: str) -> torch.cuda.Stream:
    """The torch stream an engine computes on: its default stream, a side stream, or a side
    stream of the greatest priority torch offers (`priority`), whose kernels the GPU's block
    scheduler starts ahead of pending programs of lower-priority streams, JAX's included.
    Each call takes the next side stream of torch's pool (round robin over 32 a priority): the
    step program's layer boundary has cost the first side stream of a process about 10 us more
    than the default stream, and a second one often no more than the default stream, of either
    priority (BENCHMARKS.md, fifty-second section): read a side stream's rows with the order in
    which `--streams` used it."""
    if kind == "default":
        return torch.cuda.default_stream()
    if kind == "side":
        return torch.cuda.Stream()
    if kind == "priority":
        return torch.cuda.Stream(priority=-(1 << 10))      # torch maps it to the greatest it has
    raise ValueError(f"streams: expected names of {STREAMS}, got {kind!r}")


_bump = jax.jit(lambda v: v + 1)         # the host probe's trivial program, compiled once


def host_probe_us(calls: int = 300, before=None) -> dict:
    """The host's speed now: median us of one dispatch of a trivial jitted program (its result
    dropped; JAX queues it) and of one small torch op, each over `calls` calls in a loop.
    before: called once before the loops (e.g. to queue them behind other work)."""
    x = jax.device_put(np.zeros(1, np.float32))
    t = torch.zeros(1, device="cuda")
    jax.block_until_ready(_bump(x))
    if before is not None:
        before()
    out = {}
    for name, fn in (("jax", lambda: _bump(x)), ("torch", lambda: t.add(1))):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = 1e6 * statistics.median(times)
    jax.block_until_ready(_bump(x))
    torch.cuda.synchronize()
    return out


def _interleaved(work: Workload, adapters: dict, depths, compute, trials: int, warmup: int = 2, indexer=None):
    """Step times (ms) of the compute alone and of each depth, the variants taking turns within
    every trial, so a drift of the GPU's clocks (a spinning or multiplying kernel's time follows
    them; a hot GPU after matmuls runs slower for a while) falls on all of them alike.  Returns
    (compute_only, steps by depth, host s per layer by depth, begin_step host s by depth, host s
    per step (begin_step and every layer's calls) by depth)."""
    compute_only, steps = [], {d: [] for d in depths}
    host, begin, step_host = {d: [] for d in depths}, {d: [] for d in depths}, {d: [] for d in depths}
    for trial in range(warmup + trials):
        keep = trial >= warmup
        t = event_ms(lambda: work.layers(None, compute, indexer=indexer), before=compute)
        if keep:
            compute_only.append(t)
        for depth in depths:
            adapter, layer_host, began = adapters[depth], [], []

            def begin_step():
                compute()                                 # the previous step's tail
                t0 = time.perf_counter()
                work.begin_step(adapter)
                began.append(time.perf_counter() - t0)

            t = event_ms(lambda: work.layers(adapter, compute, layer_host, indexer=indexer), before=begin_step)
            if keep:
                steps[depth].append(t)
                host[depth] += layer_host
                begin[depth] += began
                step_host[depth].append(began[-1] + sum(layer_host))
    return compute_only, steps, host, begin, step_host


def _check_step_program_writes(ordering, cache_writes):
    """A step program's adapter is made for one writer: its program writes the caches or only gathers."""
    if ordering == "step-program" and len(cache_writes) != 1:
        raise ValueError("cache-writes: with ordering 'step-program' an adapter's program writes the caches or only "
                         f"gathers; expected one writer, got {','.join(cache_writes)}")


def run(histories, chunk, layers, depths, compute_ms, kinds, streams, trials, prefetch_programs=None,
        chunk_in_place=True, mark_before_write=True, native_signal=True, indexer_pct=0.0,
        cache_writes=("engine",), engine_write="words", torch_marks="none", ordering=None, world_size=1,
        rank=0) -> list[dict]:
    """The rows of the matrix (module docstring).  indexer_pct: the share of each X queued just
    before the cache write (0: none).  cache_writes: who writes the caches in the steps with the
    adapter (`CACHE_WRITES`), each a set of rows; the compute alone always has the engine's
    write, `engine_write` (`ENGINE_WRITES`).  torch_marks: `TORCH_MARKS`, an event recorded on
    torch's stream before or after each layer's compute, in every variant.  ordering: the
    adapters' (None: the adapter's default); gather_ms_per_layer is always measured with the
    cuda-events ordering's per-layer programs (a step program's layers have no dispatch of their
    own to put events around).  world_size, rank: this process's rank of a run of `world_size`
    processes, one GPU and one DCP rank each (`--processes`); every process runs the same rows."""
    _check_step_program_writes(ordering, cache_writes)
    rows = []
    computes = {x: _with_marks(compute_kernels(x * (1 - indexer_pct / 100)), torch_marks) for x in compute_ms}
    indexers = {x: compute_kernels(x * indexer_pct / 100) if indexer_pct else None for x in compute_ms}
    for history in histories:
        work = Workload(history, chunk, layers, chunk_in_place=chunk_in_place, mark_before_write=mark_before_write,
                        native_signal=native_signal, cache_write=cache_writes[0], engine_write=engine_write,
                        world_size=world_size, rank=rank)
        adapters = {d: work.adapter(d, prefetch_programs, ordering) for d in depths}
        base = work.adapter(min(depths), prefetch_programs) if ordering == "step-program" else adapters[min(depths)]
        gather_ms = {}
        for cache_write in cache_writes:
            work.cache_write = cache_write
            gather_ms[cache_write] = _jax_ms_per_layer(work, base, trials)
        if base is not adapters[min(depths)]:
            base.close()
        for stream_kind in streams:
            stream = torch_stream(stream_kind)
            with torch.cuda.stream(stream):
                for kind, x, cache_write in itertools.product(kinds, compute_ms, cache_writes):
                    work.cache_write = cache_write
                    compute = computes[x][kind]
                    indexer = indexers[x] and indexers[x][kind]
                    probe = host_probe_us()
                    runs_before = {d: len(a.step.hooks_run) for d, a in adapters.items() if a.step is not None}
                    compute_only, steps, host, begin, step_host = _interleaved(work, adapters, depths, compute,
                                                                               trials, indexer=indexer)
                    alone = statistics.median(compute_only)
                    by_depth = {}
                    for depth in depths:
                        by_depth[depth] = statistics.median(steps[depth])
                        rows.append(dict(
                            compute_kind=kind, torch_stream=stream_kind, depth=depth, history=history,
                            chunk=chunk, layers=layers, world_size=world_size, rank=rank,
                            ordering=adapters[depth].ordering,
                            cache_write=cache_write, engine_write=engine_write,
                            chunk_latents="in-place" if chunk_in_place else "copied",
                            latents_marked="before-write" if mark_before_write else "after-write",
                            indexer_pct=indexer_pct, torch_marks=torch_marks,
                            signal=_signal_kind(adapters[depth]),
                            prefetch_tiles=str(adapters[depth].orch.prefetch_tiles),
                            compute_ms_per_layer=alone / layers, gather_ms_per_layer=gather_ms[cache_write],
                            compute_only_ms=alone,
                            compute_only_spread_pct=100 * (max(compute_only) - min(compute_only)) / alone,
                            step_ms=by_depth[depth],
                            spread_pct=100 * (max(steps[depth]) - min(steps[depth])) / by_depth[depth],
                            host_us_per_layer=1e6 * statistics.median(host[depth]),
                            begin_step_us=1e6 * statistics.median(begin[depth]),
                            step_host_us_per_layer=1e6 * statistics.median(step_host[depth]) / layers,
                            host_probe_jax_us=probe["jax"], host_probe_torch_us=probe["torch"],
                            replayed_steps=_replayed(adapters[depth], runs_before.get(depth))))
                    exposed0 = by_depth[min(depths)] - alone
                    for r in rows[-len(depths):]:
                        r["hidden_pct"] = 100 * (1 - (r["step_ms"] - alone) / exposed0)
                        r["exposed_us_per_layer"] = 1e3 * (r["step_ms"] - alone) / layers
                    print(_line(rows[-len(depths):]), flush=True)
        for a in adapters.values():
            a.close()
        work = adapters = base = None                     # free the caches and pools before the next history
        torch.cuda.empty_cache()
    return rows


HEADER = (f"{'kind':>6} {'stream':>7} {'writer':>7} {'history':>8} {'X ms':>6} {'gather ms':>9} "
          f"{'compute ms (spread %)':>21} "
          f"{'depth: step ms (hidden %, exposed us/layer, host us/layer, spread %)  host probe jax/torch'}")


def _line(rows) -> str:
    """One printed row of a history, kind, stream, writer and X: every depth's cells; a rank of
    several processes prefixes it with its rank."""
    r0 = rows[0]
    rank = f"rank {r0['rank']}: " if r0.get("world_size", 1) > 1 else ""
    cells = "  ".join(f"d{r['depth']} {r['step_ms']:7.2f} ({r['hidden_pct']:5.1f}%{'*' * (r['hidden_pct'] > 100)}, "
                      f"{r['exposed_us_per_layer']:5.1f}, {r['host_us_per_layer']:4.0f}, {r['spread_pct']:.1f}"
                      f"{'' if r['replayed_steps'] is None else ', replayed ' + r['replayed_steps']})" for r in rows)
    return (f"{rank}{r0['compute_kind']:>6} {r0['torch_stream']:>7} {r0['cache_write']:>7} {r0['history']:>8} "
            f"{r0['compute_ms_per_layer']:6.2f} "
            f"{r0['gather_ms_per_layer']:9.3f} {r0['compute_only_ms']:13.2f} ({r0['compute_only_spread_pct']:4.1f}) "
            f"{cells}  "
            f"probe {r0['host_probe_jax_us']:.0f}/{r0['host_probe_torch_us']:.0f} us")


def _replayed(adapter, runs_before) -> str | None:
    """step-program: "replayed/dispatched" of the steps since `runs_before` dispatches."""
    if adapter.step is None:
        return None
    runs = adapter.step.hooks_run[runs_before:]
    return f"{runs.count(0)}/{len(runs)}"


def _signal_kind(adapter) -> str:
    if adapter.events is None:
        return "export"
    return "native" if adapter.events.signal.native else "callback"


def _ints(text):
    return [int(v) for v in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--histories", type=_ints, default=[262144, 1048576], help="history tokens (default %(default)s)")
    ap.add_argument("--chunk", type=int, default=4096, help="chunk tokens (default %(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="layers per step (default %(default)s)")
    ap.add_argument("--depths", type=_ints, default=[0, 1, 2, 3], help="prefetch depths (default %(default)s)")
    ap.add_argument("--compute-ms", type=lambda t: [float(v) for v in t.split(",")], default=[1.0, 4.0, 10.0],
                    help="torch compute per layer, ms (default %(default)s)")
    ap.add_argument("--kinds", type=lambda t: t.split(","), default=["sleep", "matmul"],
                    help="torch compute kinds (default %(default)s)")
    ap.add_argument("--streams", type=lambda t: t.split(","), default=list(STREAMS),
                    help=f"torch streams, of {', '.join(STREAMS)} (default %(default)s)")
    ap.add_argument("--trials", type=int, default=5, help="timed steps per row (default %(default)s)")
    ap.add_argument("--prefetch-programs", type=int, default=None,
                    help="persistent programs of a prefetch's pack, 0 the full grid "
                         "(default: the adapter's, half the SMs)")
    ap.add_argument("--pack-programs", type=_ints, default=[33, 66, 132],
                    help="persistent grids whose standalone pack bandwidth is measured (default %(default)s)")
    ap.add_argument("--latents", choices=["in-place", "copied"], default="in-place",
                    help="latents written into the adapter's chunk buffers, or copied there per layer "
                         "(default %(default)s)")
    ap.add_argument("--mark", choices=["before-write", "after-write"], default="before-write",
                    help="where the engine calls set_current_chunk: before the layer's cache write (the "
                         "patch runs beside it) or after it (default %(default)s)")
    ap.add_argument("--indexer-pct", type=float, default=0.0,
                    help="percent of X queued between the latents' mark and the cache write, where a "
                         "sparse-MLA layer runs its indexer (default %(default)s: none, the worst case)")
    ap.add_argument("--cache-writes", type=lambda t: t.split(","), default=["engine"],
                    help=f"who writes each layer's cache in the steps with the adapter, of {', '.join(CACHE_WRITES)}: "
                         "the engine (torch) or the adapter's gather (write_cache=True) (default %(default)s)")
    ap.add_argument("--engine-write", choices=ENGINE_WRITES, default="words",
                    help="the engine's stand-in cache write: the records scattered as 8-byte words or as bytes "
                         "(default %(default)s)")
    ap.add_argument("--torch-marks", choices=TORCH_MARKS, default="none",
                    help="an event recorded on torch's stream just before or after each layer's compute, in "
                         "every variant, as an engine's timing marks would be (default %(default)s)")
    ap.add_argument("--signal", choices=["native", "callback"], default="native",
                    help="the layer program's in-program signal: the native custom call, or the Python "
                         "callback (default %(default)s)")
    ap.add_argument("--ordering", choices=["cuda-events", "step-program"], default="cuda-events",
                    help="the adapters' ordering: a program per layer, or the whole step's as one program behind "
                         "flags (with one --cache-writes: adapter, the program writes the caches; engine, the "
                         "engine does and torch patches the workspace) (default %(default)s)")
    ap.add_argument("--processes", type=int, default=1,
                    help="run as this many processes on this machine's first GPUs, one GPU and one DCP rank each, "
                         "joined by jax.distributed on 127.0.0.1; the JSON holds every rank's rows (default "
                         "%(default)s)")
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)     # set by the launcher
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="interop.json", help="JSON results (default %(default)s)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.processes < 1:
        print(f"--processes: expected a positive number of processes, got {args.processes}", file=sys.stderr)
        return 2
    if args.process_id is not None and not (0 <= args.process_id < args.processes and args.coordinator):
        print(f"--process-id: expected 0 <= id < --processes = {args.processes} and a --coordinator (the "
              f"launcher's), got {args.process_id} and {args.coordinator!r}", file=sys.stderr)
        return 2
    if args.ordering == "step-program":
        try:
            _check_step_program_writes(args.ordering, args.cache_writes)
        except ValueError as e:
            print(f"--{e}", file=sys.stderr)
            return 2
        # read when CUDA initializes, which nothing in this process did yet (the adapter checks)
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    if args.processes > 1 and args.process_id is None:
        return _launch(args.processes, argv, args.out)
    needs_gpu = "interop.bench needs torch and JAX on a CUDA GPU"
    if not torch.cuda.is_available():
        print(needs_gpu, file=sys.stderr)
        return 2
    rank = args.process_id or 0
    if args.process_id is not None:
        jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=rank,
                                   local_device_ids=[rank], initialization_timeout=120)
        torch.cuda.set_device(rank)
    if jax.default_backend() != "gpu":
        print(needs_gpu, file=sys.stderr)
        return 2
    if not 0 <= args.indexer_pct < 100:
        print(f"--indexer-pct: expected a percentage in [0, 100), got {args.indexer_pct}", file=sys.stderr)
        return 2
    if 0 not in args.depths:
        print("--depths: depth 0 is the baseline of hidden_pct; include it", file=sys.stderr)
        return 2
    args.depths = sorted(args.depths)
    unknown = [k for k in args.cache_writes if k not in CACHE_WRITES]
    if unknown:
        print(f"--cache-writes: expected names of {', '.join(CACHE_WRITES)}, got {unknown}", file=sys.stderr)
        return 2
    unknown = [k for k in args.streams if k not in STREAMS]
    if unknown:
        print(f"--streams: expected names of {', '.join(STREAMS)}, got {unknown}", file=sys.stderr)
        return 2
    work = Workload(max(args.histories), args.chunk, 1, world_size=args.processes, rank=rank)
    pack = pack_bandwidth(work, args.pack_programs)
    print(f"{f'rank {rank}: ' if args.processes > 1 else ''}pack of {work.local_len} records alone: " + ", ".join(
        f"{p['tiles']}: {p['us']:.1f} us ({p['gbps']:.0f} GB/s)" for p in pack), flush=True)
    del work
    if rank == 0:
        print(HEADER, flush=True)
    rows = run(args.histories, args.chunk, args.layers, args.depths, args.compute_ms, args.kinds, args.streams,
               args.trials, args.prefetch_programs, args.latents == "in-place", args.mark == "before-write",
               args.signal == "native", args.indexer_pct, args.cache_writes, args.engine_write, args.torch_marks,
               args.ordering, world_size=args.processes, rank=rank)
    if any(r["hidden_pct"] > 100 for r in rows):
        print("* hidden above 100%: the step with the adapter ran faster than the compute alone; the baseline "
              "moved by more than what stays exposed (compare its spread)", flush=True)
    out = args.out if args.process_id is None else rank_out(args.out, rank)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), jax=jax.__version__, torch=torch.__version__,
                       command="python -m interop.bench " + " ".join(argv), pack=pack, rows=rows), f, indent=1)
    if args.process_id is not None:
        jax.distributed.shutdown()
    return 0


def rank_out(out: str, rank: int) -> str:
    """Where process `rank` of a `--processes` run writes its JSON: `out` with `.rank<N>` before
    its extension."""
    root, ext = os.path.splitext(out)
    return f"{root}.rank{rank}{ext}"


def merge_ranks(parts: list[dict], command: str) -> dict:
    """One JSON of a `--processes` run from each rank's (in rank order): every rank's rows (each
    names its rank), each rank's standalone pack by rank, and the launcher's command."""
    ranks = [part["rows"][0]["rank"] if part["rows"] else None for part in parts]
    if ranks != list(range(len(parts))):
        raise ValueError(f"parts: expected the ranks 0..{len(parts) - 1} in order, got rows of ranks {ranks}")
    packs = {str(rank): part["pack"] for rank, part in enumerate(parts)}
    return dict({k: v for k, v in parts[0].items() if k not in ("rows", "pack", "command")},
                processes=len(parts), command=command, pack=packs, rows=[row for part in parts for row in part["rows"]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(processes: int, argv: list[str], out: str) -> int:
    """`--processes`: this bench as `processes` processes of rank 0.. on GPUs 0.., then their JSON
    merged into `out` (`merge_ranks`).  A process that fails stops the others, whose
    collectives would otherwise wait for it."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < processes:
        print(f"--processes: expected at most the {found} CUDA GPUs this machine has, got {processes}", file=sys.stderr)
        return 2
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "interop.bench", *argv, "--process-id", str(rank),
                               "--coordinator", coordinator]) for rank in range(processes)]
    def first_failed():
        return next((rank for rank, p in enumerate(procs) if p.poll() not in (None, 0)), None)

    while first_failed() is None and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    failed = first_failed()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failed is not None:
        print(f"interop.bench: process {failed} exited with {procs[failed].returncode}; the others were stopped",
              file=sys.stderr)
        return 1
    parts = []
    for rank in range(processes):
        with open(rank_out(out, rank)) as f:
            parts.append(json.load(f))
    with open(out, "w") as f:
        json.dump(merge_ranks(parts, "python -m interop.bench " + " ".join(argv)), f, indent=1)
    for rank in range(processes):
        os.remove(rank_out(out, rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
