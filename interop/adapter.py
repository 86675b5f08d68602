"""`TorchCkvAdapter`: the full-CKV gather with depth-N prefetch for a torch engine, called where
upstream's engine calls it.  One process per GPU (as vLLM runs); D > 1 ranks are the processes
of one `jax.distributed` run, whose mesh axis `dcp` spans one device per process.

    adapter = TorchCkvAdapter(world_size=D, format="fp8_ds_mla", max_num_seqs=8,
                              config=GatherConfig(enabled=True, depth=2))   # at model init: plans
    reserve(adapter.pool_bytes)                                              # and allocates the pool
    if adapter.begin_step(seq_lens_cpu, query_lens_cpu, block_table):        # per step
        for layer in range(L):
            kv_c, k_pe = adapter.chunk_buffers()                             # bf16 [T, 512], [T, 64]
            ...the engine writes the layer's latents into them...
            adapter.set_current_chunk(kv_c, k_pe)                            # (other tensors: copied)
            ...and the chunk into kv_caches[layer]...                       # (or, instead:)
            ws = adapter.gather(layer, kv_caches[layer])                     # torch u8[D * C, R]
            # ws = adapter.gather(layer, kv_caches[layer], write_cache=True)  # the adapter writes it
            ...attention over ws[:adapter.rows] with adapter.remap_topk(topk)...
    else: ...the stock path...
    adapter.close()

The work of `gather` runs on JAX's compute stream: the prefetches of layers L+1..L+N run there
while torch computes layer L.  Three ordering protocols, chosen once (`ordering`):

* ``"cuda-events"`` (CUDA, where `interop.stream_handoff` finds JAX's compute stream): the ring
  slots are torch memory imported into JAX once, and every gather and patch writes into them in
  place; the chunk's latents are read from two persistent buffers, imported once (again only
  when a step has more tokens than they hold), which the engine writes into (`chunk_buffers`)
  or torch copies other tensors into; the step's arrays (block table, slots, lengths) are one
  torch buffer per set of shapes, refreshed by a copy on torch's stream
  (`interop.resident_arrays`).  `begin_step` dispatches the gathers of the first layers (`depth`
  of them, at most two; JAX's stream first waits on torch's, for that copy and the caches' last
  writes).  Per call: JAX's stream waits on an event of torch's current stream (so JAX runs
  after torch's cache writes, the chunk copy and torch's reads of a slot it reuses; a patch of
  latents in the chunk buffers waits only for the point `set_current_chunk` marked,
  so it runs beside the cache write); one program writes the layer's cache when the engine
  leaves that to it (`write_cache=True`; with a patch, one kernel stores each record into the
  cache and the slot), patches (or gathers) the layer's slot,
  records an event on JAX's stream from inside the program (`dcp_step.signal_when_ready`, in
  native code where it can be built), makes JAX's stream wait for torch's point of the call,
  then gathers the later layers; torch's stream waits on that event, so torch never waits for
  the prefetches.  No import, export or host synchronization per layer; one dispatch.
* ``"dlpack"`` (CPU tensors, or when the stream hand-off is unavailable, logged): each call
  imports the chunk's latents from torch's current stream and every JAX computation of the call
  takes them as an input; the workspace is exported (torch's stream waits for it) before the
  prefetches are dispatched.  Imported tensors are kept alive until the step is drained.
* ``"step-program"`` (CUDA, asked for by name): `begin_step(..., kv_caches=every layer's cache)`
  dispatches the whole step's JAX work as one program (`interop.step_runner`), each layer's part
  behind a flag; `gather(l, kv_caches[l], write_cache=True)`, called for l = 0, 1, ... in
  order, raises layer l's flag on torch's stream (its latents are in the chunk buffers, its
  cache holds the history) and makes torch's stream wait on the layer's event.  The program
  writes each layer's cache, patches or gathers its slot and prefetches layer l + depth (XLA
  records it as a CUDA graph and mostly replays it from a step shape's third step on;
  `interop.step_runner` says when).  Per layer the host writes one word and waits on one event.
  The process must load CUDA kernels eagerly (CUDA_MODULE_LOADING=EAGER) and make no
  device-wide synchronization while a step is open: its program holds JAX's stream until the
  host releases the next layer, so such a synchronization waits until the watchdog
  (`step_timeout_s`) abandons the step, and the step's next call raises `StepAbandoned`.  The
  watchdog is a Python thread: a host blocked inside a torch op that holds the GIL (a library
  torch initializes on first use, such as cuBLAS at the process's first matmul, synchronizing
  the device) cannot be rescued, so run every such library once before the first step.
  kv_c must be bf16, one lane only (no ubatches or speculative lanes).
  With `cache_writes="engine"` the engine writes each layer's cache itself and passes the
  chunk's encoded records to `gather(l, kv_caches[l], records=...)`: the program only gathers.
  At depth > 0 torch waits on the event of the slot's gather (which ran layers earlier),
  patches the records into the slot on its own stream (one device copy a run of consecutive
  rows, `contiguous_runs`, queued through the driver: one with D = 1; one indexed copy of
  8-byte words where they are more than `MAX_PATCH_RUNS`), and only then releases the layer, on
  the flags' own stream (`StepFlags` release_aside): the next gather does not compete with the
  patch, and the flag's write does not hold torch's stream.  At depth 0 the release comes
  first (the layer's gather waits for it).  No JAX work lies between a layer's cache write and
  its attention; the engine's writer produces the records once (e.g. into a [T, 1, R] buffer
  through slots 0..T-1).  Measured at 262K on an H100 it hides 87.3-88.8% at depths 1-2 on
  both streams, where the adapter's writer hides 84.9-85.1% on a side stream and 91.1-91.6% on
  the default one (BENCHMARKS.md, forty-third section; the side stream's figure is that of the
  first side stream its process used, fifty-second section).

The returned view is valid until its ring slot is reused (depth + 1 layers later, or the next
step); drop it (and every view of it) before that, or the reuse raises (the pool never grows).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ckv_jax import dcp_step, formats, placement, validation
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch import PrefetchOrchestrator, WorkspacePool, slot_still_referenced
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import build_step_plan
from interop import bridge, native_signal, resident_arrays, step_runner, stream_handoff, torch_records, torch_topk

log = logging.getLogger("ckv_jax.interop")


class TorchWorkspacePool(WorkspacePool):
    """Ring slots in torch's memory (so the engine's allocator accounts for them), imported into
    JAX once; JAX writes each gather and patch into them in place (the slot is donated and the
    kernels alias it).  `tensor_of` finds the torch tensor of a workspace JAX returned, which
    also proves the write was in place."""

    def __init__(self, mesh, plan, world_size, record_bytes, *, device: torch.device, jax_device):
        tensors = []

        def allocate(rows, record_bytes):
            t = torch.zeros((rows, record_bytes), dtype=torch.uint8, device=device)
            tensors.append(t)
            return placement.assemble_replicated(mesh, [bridge.to_jax(t, name="workspace slot", device=jax_device)])

        super().__init__(mesh, plan, world_size, record_bytes, allocate=allocate)
        self._tensors = [tensors[lane * plan.slots:(lane + 1) * plan.slots] for lane in range(plan.lanes)]
        self._by_pointer = {t.data_ptr(): t for t in tensors}
        # each slot's storage, held (one reference), and the pool's own references to it: any
        # more are views held elsewhere
        self._storages = [[t.untyped_storage() for t in lane] for lane in self._tensors]
        self._own_refs = [[stream_handoff.storage_use_count(s) for s in lane] for lane in self._storages]

    def check_writable(self, lane: int, index: int):
        if stream_handoff.storage_use_count(self._storages[lane][index]) > self._own_refs[lane][index]:
            raise slot_still_referenced(index)

    def slot_tensor(self, lane: int, index: int) -> torch.Tensor:
        """The torch tensor of slot `index` of `lane`."""
        return self._tensors[lane][index]

    def tensor_of(self, workspace: jax.Array) -> torch.Tensor:
        pointer = workspace.unsafe_buffer_pointer()          # the one shard this process holds
        t = self._by_pointer.get(pointer)
        if t is None:
            raise RuntimeError(f"workspace at 0x{pointer:x} is not a ring slot: JAX did not write the gather into its "
                               "slot in place (a donated slot was copied)")
        return t


class TorchCkvAdapter:
    """See the module docstring.  `min_world_size=1` runs the full path with D = 1 (tests and
    single-GPU benchmarks); serving leaves it at 2.  `ordering` forces a protocol ("dlpack"),
    None picks "cuda-events" where it is available.  `prefetch_programs`: the persistent
    programs of a prefetch's pack (`PrefetchOrchestrator`'s).  `native_signal=False` keeps the
    cuda-events ordering's in-program signal a Python callback instead of the native custom call
    (to compare them).  `step_timeout_s`: how long an open step of the "step-program" ordering
    may see no `gather` before its watchdog abandons it.  `cache_writes`: the step-program
    ordering's writer of the chunk, "adapter" (the program, from `set_current_chunk`'s latents)
    or "engine" (the engine's own writer; `gather` takes the chunk's records)."""

    def __init__(self, *, world_size: int, format: str, max_num_seqs: int, config: GatherConfig,
                 interleave: int = 1, block_size: int = 64, mesh: jax.sharding.Mesh | None = None,
                 ubatches: int = 1, speculative: bool = False, implementation=None, interpret: bool = False,
                 min_world_size: int = 2, ordering: str | None = None, prefetch_programs: int | None = None,
                 native_signal: bool = True, step_timeout_s: float = 10.0, cache_writes: str = "adapter"):
        bridge.check_not_capturing("TorchCkvAdapter")
        if not config.enabled:
            raise ValueError("config: the full-CKV gather is disabled (GatherConfig.enabled / CKV_JAX_GATHER)")
        if ordering not in ORDERINGS:
            raise ValueError(f"ordering: expected one of {ORDERINGS}, got {ordering!r}")
        if cache_writes not in CACHE_WRITES:
            raise ValueError(f"cache_writes: expected one of {CACHE_WRITES}, got {cache_writes!r}")
        if cache_writes == "engine" and ordering != "step-program":
            raise ValueError(f"cache_writes: 'engine' is the step-program ordering's (the others take write_cache "
                             f"per gather), got ordering={ordering!r}")
        self.cache_writes = cache_writes
        if ordering == "step-program" and (ubatches != 1 or speculative):
            raise ValueError(f"ordering: 'step-program' runs one lane, got ubatches={ubatches}, "
                             f"speculative={speculative}")
        self.fmt = formats.get(format)
        self.layout = DcpLayout(world_size, interleave, block_size)
        if mesh is None:
            mesh = jax.make_mesh((world_size,), (placement.DCP_AXIS,), devices=jax.devices()[:world_size])
        placement.mesh_axis_size(mesh, placement.DCP_AXIS, world_size)
        local = mesh.local_devices
        if len(local) != 1:
            raise ValueError(f"mesh: expected one device of this process (one process per GPU), got {len(local)}")
        self.mesh, self.device = mesh, local[0]
        self._rank = list(mesh.devices.flat).index(self.device)     # this process's place on the DCP axis
        # torch's device of the same memory: the GPU of JAX's device, or the host
        self.torch_device = torch.device("cuda", self.device.local_hardware_id) if self.device.platform == "gpu" \
            else torch.device("cpu")
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.min_world_size = min_world_size
        self.events = self._stream_events(ordering, native_signal)
        self.ordering = "step-program" if ordering == "step-program" else self.events.name if self.events else "dlpack"
        pool = {}
        if self.events:
            pool = dict(pool_type=TorchWorkspacePool,
                        pool_args=dict(device=self.torch_device, jax_device=self.device))
        self.orch = PrefetchOrchestrator(mesh, self.layout, self.fmt, max_num_seqs=max_num_seqs, config=config,
                                         ubatches=ubatches, speculative=speculative,
                                         implementation=implementation, interpret=interpret,
                                         prefetch_programs=prefetch_programs, **pool)
        self.plan = None
        self._caches: dict = {}            # (lane, layer) -> (data_ptr, torch.Size, global cache array, tensor)
        self._chunk = None
        self._chunk_marked = False         # cuda-events: the chunk is in the chunk buffers, marked final
        self._chunk_rows = 0               # cuda-events: rows of the persistent chunk buffers
        self._chunk_buffers: dict = {}     # cuda-events: (dtype, width) -> (torch buffer, its JAX array)
        self._chunk_views: dict = {}       # cuda-events: (dtype, width) -> this step's rows of that buffer
        self._marked_chunk = None          # cuda-events: (kv_c, k_pe, their buffers' JAX arrays) marked last
        self._latent_widths = (self.fmt.nope_dim, self.fmt.rope_dim)   # read per layer; the format's are properties
        self._keepalive: list = []         # torch tensors JAX may still read this step
        self._host_slots = None            # DLPack path: this rank's cache slot of every chunk token
        self._topk_tables = None           # the step's `torch_topk.TopkTables`
        # cache_writes="engine", depth > 0: how torch patches the chunk's records into a slot, as
        # (token start, token end, first row) runs, or where they are many int64[T] rows on the GPU
        self._patch_runs: list[tuple[int, int, int]] | None = None
        self._patch_rows: torch.Tensor | None = None
        self._device_copy = None           # cache_writes="engine": the driver's device copy, for the runs
        # cuda-events and step-program: the step's arrays in memory that stays put
        self._resident = resident_arrays.ResidentStepArrays(mesh, self.device, self.torch_device) \
            if self.events else None
        self.step = None                   # step-program: the `step_runner.StepRunner`
        if self.ordering == "step-program":
            self.step = step_runner.StepRunner(
                self.events, mesh, depth=self.orch.depth, layout=self.fmt.layout,
                implementation=self.orch.implementation, interpret=interpret,
                prefetch_tiles=self.orch.prefetch_tiles, timeout_s=step_timeout_s,
                release_aside=self._engine_writes)

    def _stream_events(self, ordering, native_signal):
        if ordering == "dlpack" or self.device.platform != "gpu" or not torch.cuda.is_available():
            if ordering is not None and ordering != "dlpack":
                raise ValueError(f"ordering: {ordering!r} needs a CUDA device, got JAX's {self.device}")
            return None
        found = stream_handoff.probe(self.device)
        if found.stream is None:
            if ordering is not None:
                raise RuntimeError(f"ordering: {ordering!r} is unavailable: {found.why}")
            log.warning("torch<->JAX ordering falls back to DLPack imports and exports per layer "
                        "(host-bound, no prefetch overlap): %s", found.why)
            return None
        return stream_handoff.StreamEvents(self.torch_device, found.stream, native=native_signal)

    @property
    def _engine_writes(self) -> bool:
        """cache_writes="engine": the engine writes the chunk, `gather` takes its records."""
        return self.cache_writes == "engine"

    # -- planning --------------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        """Bytes of the preallocated prefetch pool on this GPU (for the engine's KV planning)."""
        return self.orch.pool_bytes

    @property
    def rows(self) -> int:
        """D * P: the gathered rows of this step; rows past it in a returned workspace are stale."""
        return self.layout.world_size * self.plan.padded_tokens

    # -- per step --------------------------------------------------------------------------------
    def begin_step(self, seq_lens, query_lens, block_table: torch.Tensor, kv_caches=None) -> bool:
        """Plan the step; False (and a debug log of why) when it must take the stock path.

        seq_lens, query_lens: host int[R] (tensors on the CPU or arrays; seq_lens include the
        chunk); block_table: int32[R, max_blocks], identical on every rank: on the host (a CPU
        tensor such as vLLM's block_table_cpu, or an array), or on this GPU, where reading it
        makes the host wait for the work torch has queued so far.
        With the cuda-events ordering the gathers of the first layers (`depth` of them, at most
        two) start here, after the work queued on torch's current stream so far.
        kv_caches: the step-program ordering's every layer's cache u8[num_blocks, block_size, R]
        (a sequence, layer l at [l]; no other ordering takes it): the step's program, dispatched
        here, writes and gathers them.
        """
        bridge.check_not_capturing("begin_step")
        if (kv_caches is None) != (self.step is None):
            raise ValueError(f"kv_caches: the {self.ordering} ordering " +
                             ("takes every layer's cache at begin_step, got None" if self.step is not None
                              else "takes each layer's cache in gather, not at begin_step"))
        if kv_caches is not None and (isinstance(kv_caches, torch.Tensor) or not hasattr(kv_caches, "__len__")
                                      or not len(kv_caches)):
            raise TypeError(f"kv_caches: expected a non-empty sequence of torch caches (one a layer), "
                            f"got {type(kv_caches).__name__}")
        self._drain()
        seq_lens = _host_ints("seq_lens", seq_lens)
        query_lens = _host_ints("query_lens", query_lens)
        plan = build_step_plan(self.layout, seq_lens, query_lens, max_num_seqs=self.max_num_seqs,
                               max_tokens=self.config.max_tokens, min_tokens=self.config.min_tokens,
                               min_world_size=self.min_world_size)
        self.plan = plan
        if not self.orch.eligible(plan):
            return False
        table = self._host_table(block_table)
        self._topk_tables = torch_topk.TopkTables(plan, self.torch_device)      # (before any JAX work of the step)
        if self.events is None:
            self._host_slots = dcp_step.dcp_slot_mapping(plan, table)[self._rank]     # for write_cache
            self.orch.begin_step(plan, table, prefetch=False)
            return True
        self._chunk_rows = max(self._chunk_rows, 1 << max(plan.num_tokens - 1, 0).bit_length())
        if self.step is not None:
            self._begin_step_program(plan, table, kv_caches)
            return True
        self.orch.begin_step(plan, table, chunk_capacity=self._chunk_rows, place=self._place_arrays)
        return True

    def _place_arrays(self, host):
        """cuda-events: the step's arrays into the resident buffer, then JAX's stream after torch's
        (the copy, and the caches' last writes, before the first prefetches)."""
        arrays = self._resident.refresh(host)
        self.events.jax_after_torch(self.events.torch_stream())
        return arrays

    def _begin_step_program(self, plan, table, kv_caches):
        """step-program: bind the caches, size the chunk buffers, dispatch the step's program."""
        # (the runner orders its program after the arrays' copy on torch's stream)
        self.orch.begin_step(plan, table, prefetch=False, chunk_capacity=self._chunk_rows,
                             place=self._resident.refresh)
        caches = [self._cache("target", layer, kv_cache) for layer, kv_cache in enumerate(kv_caches)]
        if len({t.data_ptr() for t in kv_caches}) != len(kv_caches):
            raise ValueError("kv_caches: expected one cache tensor of its own per layer; some share memory "
                             "(the program writes each in place)")
        if self._engine_writes:
            kv_c = k_pe = None
            if self.orch.depth:         # (depth 0 gathers the written caches: no patch)
                rows = dcp_step.chunk_rows(plan)
                runs = contiguous_runs(rows)
                if len(runs) <= MAX_PATCH_RUNS:
                    self._patch_runs = runs
                    if self._device_copy is None:
                        self._device_copy = native_signal.memcpy_dtod()
                else:
                    # pinned, so the copy does not wait for the host (torch's host allocator
                    # keeps the block until the copy ran)
                    rows = torch.from_numpy(rows.astype(np.int64)).pin_memory()
                    self._patch_rows = rows.to(self.torch_device, non_blocking=True)
        else:
            kv_c, k_pe = (self._chunk_buffers[(t.dtype, t.shape[1])][1] for t in self.chunk_buffers())
        lane = self.orch.lane("target").lane
        ring, slots = self.orch.pool.ring(lane), self.orch.depth + 1
        # the slots of layers 0..depth-1, which the program gathers before layer 1's wait
        for index in range(min(self.orch.depth, len(caches))):
            self.orch.pool.check_writable(lane, index)
        ring[:slots], written = self.step.begin(ring[:slots], caches, kv_c, k_pe, self.orch.step_arrays)
        for slot in ring[:slots]:
            self.orch.pool.tensor_of(slot)              # raises where JAX wrote a slot into a copy
        for layer, (kv_cache, cache) in enumerate(zip(kv_caches, written)):
            self._rebind("target", layer, kv_cache, cache)

    def _host_table(self, block_table):
        if isinstance(block_table, torch.Tensor):
            bridge.check_tensor("block_table", block_table, None if block_table.device.type == "cpu" else self.device)
            # the host reads it to plan the step: a GPU table costs a wait for torch's queue
            return block_table.cpu().numpy()
        return np.asarray(block_table)

    def chunk_buffers(self, kv_c_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the engine can write this step's chunk latents so that `set_current_chunk` takes
        them without a copy: kv_c kv_c_dtype[T, nope_dim] and k_pe bf16[T, rope_dim] on this GPU,
        T the step's query tokens (e.g. the `out=` of the kv_a projection's norm and the RoPE's
        output).  With the cuda-events ordering they are the adapter's persistent buffers (the
        same memory every layer and step while T fits; write each layer's latents in stream order
        before its `gather`: torch's stream already waited for the previous layer's patch when it
        produces the next latents); with the DLPack path, fresh tensors per call."""
        self._require_step("chunk_buffers")
        self._check_latents_taken("chunk_buffers")
        dtypes = (torch.bfloat16,) if self.step is not None else KV_C_DTYPES
        if kv_c_dtype not in dtypes:
            raise TypeError(f"kv_c_dtype: expected one of {bridge.dtype_names(dtypes)}"
                            f"{' (the step program reads bf16 latents)' if self.step else ''}, got {kv_c_dtype}")
        shapes = ((kv_c_dtype, self.fmt.nope_dim), (torch.bfloat16, self.fmt.rope_dim))
        if self.events is None:
            return tuple(torch.empty((self.plan.num_tokens, w), dtype=d, device=self.torch_device) for d, w in shapes)
        return tuple(self._chunk_view(d, w) for d, w in shapes)

    def set_current_chunk(self, kv_c: torch.Tensor, k_pe: torch.Tensor):
        """The current chunk's latents of all T tokens of the step (every rank holds them all),
        for the patch of the next `gather`: kv_c [T, nope_dim] (bf16, f16 or f32) and k_pe
        bf16[T, rope_dim] on this GPU.  Call it once torch's stream has written them and before
        the layer's cache write: a prefetched layer's patch reads nothing else, so it then runs
        beside the cache write instead of after it.

        With the cuda-events ordering, latents the engine wrote into `chunk_buffers()` are taken
        as they are and are final from this call on (torch must not write them again before the
        `gather`); any other tensors, of any strides (vLLM's split views of one [T, 576]
        projection), are checked now and copied into those buffers by `gather`, where the patch
        then starts after the cache write.  The DLPack path imports them in `gather` and needs
        them compact."""
        self._require_step("set_current_chunk")
        self._check_latents_taken("set_current_chunk")
        if self.events is None:
            bridge.check_tensor("kv_c", kv_c, self.device)
            bridge.check_tensor("k_pe", k_pe, self.device)
            self._chunk = (kv_c, k_pe)
            return
        self._chunk = (kv_c, k_pe)
        marked = self._marked_chunk
        if marked is None or kv_c is not marked[0] or k_pe is not marked[1]:
            # the very tensors chunk_buffers() returned need no check (the common case)
            views = self._chunk_views
            if not (kv_c is views.get((kv_c.dtype, self._latent_widths[0])) and
                    k_pe is views.get((torch.bfloat16, self._latent_widths[1]))):
                _check_copied("kv_c", kv_c, KV_C_DTYPES, self.torch_device)
                _check_copied("k_pe", k_pe, (torch.bfloat16,), self.torch_device)
                if not (self._in_chunk_buffers(kv_c) and self._in_chunk_buffers(k_pe)):
                    self._chunk_marked = False
                    return
            # kept for the step's later layers, which pass the same tensors
            self._marked_chunk = (kv_c, k_pe) + tuple(self._chunk_buffers[(t.dtype, t.shape[1])][1]
                                                      for t in (kv_c, k_pe))
        self._chunk_marked = True
        if self.step is None:           # (a step program's layer waits for its release alone)
            self.events.mark_latents(self.events.torch_stream())

    def gather(self, layer_idx: int | None, kv_cache: torch.Tensor, *, lane="target",
               after: torch.cuda.Event | torch.cuda.Stream | None = None, write_cache: bool = False,
               records: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's gathered workspace u8[D * C, R] (rank-major rows, current chunk patched)
        as a torch view, after the layer wrote its chunk into `kv_cache` u8[num_blocks, block_size, R].

        layer_idx None: no lookahead for this call (it gathers into the lane's first ring slot;
        a prefetch pending there is dropped, and its layer is prefetched again or gathered when
        called).  after: an event or stream of cache writes made on another torch stream than
        the current one.  The view is ordered for torch's current stream; a reader on another
        stream waits for this one first.
        write_cache: the engine leaves this layer's cache write to this call, which writes the
        chunk (`set_current_chunk`'s latents) into `kv_cache` with ckv-jax's writer, through the
        step's slot mapping, before the gather; the written cache is ordered for torch's current
        stream like the view.  With the cuda-events ordering the write is part of the layer's one
        program, in place in `kv_cache`, and waits only for the latents' mark (the engine must
        not write or read the cache of this layer between the mark and the call); with the
        DLPack path JAX encodes the records and torch scatters them (`torch_records.write`).
        With the step-program ordering the call releases layer `layer_idx` (the next in order) to
        the program begin_step dispatched: `kv_cache` must be the cache given there for the
        layer, `write_cache` True and `lane` "target".
        records: with `cache_writes="engine"` (and only then), the chunk's records u8[T, R] of all
        T tokens of the step (every rank's), encoded by the engine, which wrote this rank's into
        `kv_cache` before the call (`write_cache` False): at depth > 0 torch copies them into the
        workspace's chunk rows on its current stream, after the slot's gather.
        """
        self._require_step("gather")
        if not isinstance(write_cache, bool):
            raise TypeError(f"write_cache: expected a bool, got {type(write_cache).__name__}")
        if self._engine_writes:
            return self._release_layer(layer_idx, kv_cache, lane, after, write_cache, records)
        if records is not None:
            raise ValueError("records: only an adapter made with cache_writes='engine' takes the chunk's records "
                             "(this one writes the chunk from set_current_chunk's latents)")
        if self._chunk is None:
            raise RuntimeError("gather: call set_current_chunk(kv_c, k_pe) for this layer first")
        if self.step is not None:
            return self._release_layer(layer_idx, kv_cache, lane, after, write_cache, None)
        cache = self._cache(lane, layer_idx, kv_cache)
        if after is not None:
            bridge.join_stream(kv_cache.device, after)
        chunk, self._chunk = self._chunk, None
        if self.events is None:
            if write_cache:
                self._write_dlpack(kv_cache, chunk)
            return self._gather_dlpack(layer_idx, lane, cache, chunk)
        stream = self.events.torch_stream()
        patch = self.orch.is_pending(layer_idx, lane)
        kv_c, k_pe = self._chunk_on_device(chunk) if patch or write_cache else (None, None)
        # after the cache write, the chunk copy and torch's reads of reused slots; a patch of
        # latents marked final only after that mark (its prefetches wait for the rest in-program)
        self.events.jax_after_torch(stream, latents_only=patch and self._chunk_marked)
        if write_cache:
            written, ws = self.orch.write_and_gather(layer_idx, cache, kv_c, k_pe, key=lane,
                                                     signal=self.events.signal)
            self._rebind(lane, layer_idx, kv_cache, written)
        else:
            ws = self.orch.gather(layer_idx, cache, kv_c, k_pe, key=lane, signal=self.events.signal)
        self.events.torch_after_signal(stream)  # torch waits for this layer's slot, not for the prefetches
        return self.orch.pool.tensor_of(ws).detach()    # a view: the slot's reuse check counts it

    def _release_layer(self, layer_idx, kv_cache, lane, after, write_cache, records) -> torch.Tensor:
        """step-program: hand layer `layer_idx` to the step's program (see the module docstring)."""
        if lane != "target":
            raise ValueError(f"lane: the step-program ordering runs one lane, 'target'; got {lane!r}")
        if self._engine_writes:
            if write_cache:
                raise ValueError("write_cache: with cache_writes='engine' the engine writes the cache; pass "
                                 "write_cache=False and the chunk's records")
            self._check_records(records)
        elif not write_cache:
            raise ValueError("write_cache: the step-program ordering writes every layer's cache in the step's "
                             "program; pass write_cache=True (and leave the cache write to it), or make the "
                             "adapter with cache_writes='engine'")
        self.step.raise_if_abandoned()
        expected = self.step.next_layer
        if layer_idx != expected:
            raise ValueError(f"layer_idx: expected {expected} (the step program takes its layers in order"
                             f"{'' if expected is not None else '; every layer of this step was released'}), "
                             f"got {layer_idx}")
        held = self._caches.get((lane, layer_idx))
        if not isinstance(kv_cache, torch.Tensor) or held is None or held[0] != kv_cache.data_ptr() \
                or held[1] != kv_cache.shape:
            raise ValueError(f"kv_cache: expected the memory begin_step was given as kv_caches[{layer_idx}] "
                             "(the step's program works on that one)")
        bridge.join_stream(kv_cache.device, after)
        depth, lane_index = self.orch.depth, self.orch.lane(lane).lane
        if self._engine_writes:
            self._check_writable_after_release(layer_idx, lane_index)
            slot = self.orch.pool.slot_tensor(lane_index, layer_idx % (depth + 1))
            # at depth > 0 on torch's stream after the slot's gather, and before the release
            patch = (lambda stream: patch_chunk(slot, records, runs=self._patch_runs, rows=self._patch_rows,
                                                device_copy=self._device_copy, stream=stream.cuda_stream)) if depth \
                else None
            self.step.release(layer_idx, patch)
            return slot.detach()
        chunk, self._chunk = self._chunk, None
        if not self._chunk_marked:
            if chunk[0].dtype != torch.bfloat16:
                raise TypeError(f"kv_c: the step-program ordering takes bf16 latents, got {chunk[0].dtype}")
            self._chunk_on_device(chunk)                # copied into the chunk buffers on torch's stream
        self._check_writable_after_release(layer_idx, lane_index)
        self.step.release(layer_idx)
        return self.orch.pool.slot_tensor(lane_index, layer_idx % (depth + 1)).detach()

    def _check_writable_after_release(self, layer_idx: int, lane_index: int):
        """step-program: the slot the program overwrites after layer `layer_idx`'s release, the
        layer's own (depth 0) or the one that layer + depth is prefetched into (the last layer's,
        which torch read before this), holds no view but the pool's."""
        depth = self.orch.depth
        if depth == 0 or layer_idx + depth < self.step.flags.layers:
            self.orch.pool.check_writable(lane_index, (layer_idx + depth) % (depth + 1))

    def _check_latents_taken(self, what: str):
        if self._engine_writes:
            raise RuntimeError(f"{what}: this adapter was made with cache_writes='engine': the engine writes the "
                               "chunk itself and passes its records to gather(records=)")

    def _check_records(self, records):
        def want():
            return f"uint8[{self.plan.num_tokens}, {self.fmt.record_bytes}] (the step's {self.fmt.name} chunk records)"
        if not isinstance(records, torch.Tensor):
            raise TypeError(f"records: expected a torch.Tensor {want()}, got {type(records).__name__}")
        if records.dtype != torch.uint8 or records.shape != (self.plan.num_tokens, self.fmt.record_bytes):
            raise ValueError(f"records: expected {want()}, got {records.dtype}{list(records.shape)}")
        if records.device != self.torch_device:
            raise ValueError(f"records: on {records.device}, expected {self.torch_device} (the adapter's GPU)")

    def _rebind(self, lane, layer_idx, kv_cache: torch.Tensor, written: jax.Array):
        """The written cache (the donated one's successor) as the binding of `kv_cache`, which it
        must alias: JAX wrote torch's memory in place, or the write is lost and this raises."""
        held = self._caches.get((lane, layer_idx)) if layer_idx is not None else None
        pointer = written.unsafe_buffer_pointer()        # the one shard this process holds (no new array)
        # (`_cache` bound the tensor at this call, so the binding holds its pointer)
        if pointer != (kv_cache.data_ptr() if held is None else held[0]):
            raise RuntimeError(f"kv_cache: JAX wrote the chunk into a copy at 0x{pointer:x}, not into the torch "
                               f"cache at 0x{kv_cache.data_ptr():x} (a donated cache was copied)")
        if held is not None:            # the same tensor and memory: only the array is new
            self._caches[(lane, layer_idx)] = (held[0], held[1], written, held[3])

    def _write_dlpack(self, kv_cache: torch.Tensor, chunk):
        """The DLPack path's cache write: JAX encodes the chunk's records (XLA on a CPU would
        write a donated import into a copy), torch scatters this rank's into `kv_cache`."""
        kv_c, k_pe = self._import_chunk(chunk)
        records = bridge.to_torch(self.fmt.encode(kv_c, k_pe).addressable_data(0), name="records")
        torch_records.write(kv_cache, records, self._host_slots)

    def _gather_dlpack(self, layer_idx, lane, cache, chunk):
        # imported now, after the engine's cache write: every computation of this call takes kv_c
        # as an input, which orders it after torch's work so far (writes, and reads of reused slots)
        kv_c, k_pe = self._import_chunk(chunk)
        exported = []
        # exported before any prefetch is dispatched: torch's wait then covers this layer's work only
        self.orch.gather(layer_idx, cache, kv_c, k_pe, key=lane, after=kv_c,
                         ready=lambda ws: exported.append(bridge.to_torch(ws.addressable_data(0), name="workspace")))
        return exported[0]

    def _import_chunk(self, chunk):
        """The DLPack path's import of the chunk (kv_c, k_pe) as replicated JAX arrays, ordered
        after the work torch's current stream holds now; the tensors are kept alive for the step."""
        return tuple(self._replicated(bridge.to_jax(t, name=n, device=self.device), t)
                     for n, t in zip(("kv_c", "k_pe"), chunk))

    def _chunk_on_device(self, chunk):
        """cuda-events: the chunk in the first T rows of the persistent buffers (copied there on
        torch's stream unless the engine wrote it there, `chunk_buffers`); returns their JAX
        arrays (all rows: the step's `chunk_rows` mark the rows past T as padding)."""
        if self._chunk_marked:           # set_current_chunk found them in the buffers' rows of this step
            return self._marked_chunk[2:]
        out = []
        rows = self.plan.num_tokens
        for name, t in zip(("kv_c", "k_pe"), chunk):
            if t.dim() != 2 or t.shape[0] != rows:
                raise ValueError(f"{name}: expected [{rows}, width] (the step's query tokens), "
                                 f"got {t.dtype}{list(t.shape)}")
            if not self._in_chunk_buffers(t):
                self._chunk_view(t.dtype, t.shape[1]).copy_(t)
            out.append(self._chunk_buffers[(t.dtype, t.shape[1])][1])
        return out

    def _in_chunk_buffers(self, t: torch.Tensor) -> bool:
        """Whether `t` is this step's rows of a persistent chunk buffer (`chunk_buffers`)."""
        view = self._chunk_views.get((t.dtype, t.shape[1])) if t.dim() == 2 else None
        return view is not None and t.data_ptr() == view.data_ptr() and t.shape == view.shape \
            and t.stride() == view.stride()

    def _chunk_view(self, dtype: torch.dtype, width: int) -> torch.Tensor:
        """This step's first T rows of the persistent [rows, width] buffer of `dtype`; the buffer is
        allocated and imported into JAX only when missing or smaller than `_chunk_rows`."""
        key = (dtype, width)
        view = self._chunk_views.get(key)
        if view is not None:
            return view
        held = self._chunk_buffers.get(key)
        if held is None or held[0].shape[0] != self._chunk_rows:
            buf = torch.empty((self._chunk_rows, width), dtype=dtype, device=self.torch_device)
            held = self._chunk_buffers[key] = (buf, placement.assemble_replicated(
                self.mesh, [bridge.to_jax(buf, name="chunk buffer", device=self.device)]))
        view = self._chunk_views[key] = held[0][:self.plan.num_tokens]     # sliced once per step
        return view

    def remap_topk(self, topk: torch.Tensor):
        """Global top-k i32[T, K] (positions per request, -1 = none) on the adapter's device ->
        (workspace rows i32[T, K], counts i32[T]), `full_ckv.remap_topk`'s map computed by torch
        on its current stream (`interop.torch_topk`)."""
        self._require_step("remap_topk")
        return torch_topk.remap_topk(topk, self._topk_tables)

    def close(self):
        """Wait (on torch's stream) for in-flight work, drop every cache binding and lane."""
        self._drain()
        if self.step is not None:
            self.step.close()
        self.orch.reset()
        self._caches.clear()
        self.plan = None

    # -- internals -------------------------------------------------------------------------------
    def _require_step(self, what):
        bridge.check_not_capturing(what, cuda_initialized=self.events is not None)
        if self.plan is None or not self.plan.eligible:
            raise RuntimeError(f"{what}: no eligible step begun (begin_step returned False or was not called)")

    def _replicated(self, local: jax.Array, tensor: torch.Tensor) -> jax.Array:
        self._keepalive.append(tensor)
        return placement.assemble_replicated(self.mesh, [local])

    def _cache(self, lane, layer_idx, kv_cache: torch.Tensor) -> jax.Array:
        """The global sharded cache u8[D * num_blocks, block_size, R], imported once per tensor."""
        key = (lane, layer_idx)
        held = self._caches.get(key)
        if held is not None and held[0] == kv_cache.data_ptr() and held[1] == kv_cache.shape:
            return held[2]
        if held is not None:
            # the engine reallocated this layer's cache: a prefetch of it read the old tensor, which
            # stays alive until the step is drained (JAX may still be reading it)
            self._keepalive.append(held[3])
            self.orch.drop_pending(layer_idx, lane)
        if kv_cache.dim() != 3 or kv_cache.shape[2] != self.fmt.record_bytes:
            raise ValueError(f"kv_cache: expected uint8[num_blocks, block_size, {self.fmt.record_bytes}] for "
                             f"{self.fmt.name}, got {kv_cache.dtype}{list(kv_cache.shape)}")
        local = bridge.to_jax(kv_cache, name="kv_cache", device=self.device)
        shape = (self.layout.world_size * local.shape[0],) + tuple(local.shape[1:])
        cache = jax.make_array_from_single_device_arrays(shape, placement.cache_sharding(self.mesh), [local])
        if layer_idx is not None:         # a per-call (no layer index) cache is not kept bound
            self._bind(lane, layer_idx, kv_cache, cache)
        else:
            self._keepalive.append(kv_cache)
        return cache

    def _bind(self, lane, layer_idx, kv_cache: torch.Tensor, cache: jax.Array):
        """`cache`, JAX's array of `kv_cache`'s memory, as the binding of (lane, layer_idx)."""
        self._caches[(lane, layer_idx)] = (kv_cache.data_ptr(), kv_cache.shape, cache, kv_cache)

    def _drain(self):
        """Make torch's stream wait for every JAX computation still reading step inputs (dropped
        prefetches included), then release the torch tensors they read.  An open step program
        is abandoned first (its unreleased layers write nothing)."""
        if self.step is not None:
            self.step.abandon()
        if self.events is not None:
            self.events.torch_after_jax(self.events.torch_stream())
        else:
            for ws in self.orch.in_flight():
                bridge.to_torch(ws.addressable_data(0), name="in-flight workspace")
        self._keepalive.clear()
        self._chunk_views.clear()
        self._marked_chunk = None
        self._chunk = None
        self._topk_tables = None
        self._patch_runs = self._patch_rows = None


ORDERINGS = (None, "cuda-events", "dlpack", "step-program")
CACHE_WRITES = ("adapter", "engine")

# the writer's latent dtypes (`ckv_jax.validation.KV_C_DTYPES`) as torch dtypes
KV_C_DTYPES = tuple(getattr(torch, jnp.dtype(d).name) for d in validation.KV_C_DTYPES)


# where the chunk's records fill at most this many runs of consecutive workspace rows (with D = 1
# one: each request's chunk ends its rows, where the next request's begin), torch patches a slot
# with one device copy a run: cheaper on the host and the GPU than one indexed copy of every row
# (BENCHMARKS.md, forty-third section)
MAX_PATCH_RUNS = 4


def contiguous_runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, row) for each maximal run of tokens start..end-1 whose rows are
    row..row + end - start - 1, in token order; rows: int[T]."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(rows)]])
    return [(int(a), int(b), int(rows[a])) for a, b in zip(starts, ends)]


def patch_chunk(workspace: torch.Tensor, records: torch.Tensor, *, runs=None, rows=None, device_copy=None,
                stream: int | None = None):
    """workspace[rows[t]] = records[t] for every token t, on torch's current stream: one copy a
    run of `contiguous_runs` where `runs` is given, else one indexed copy through `rows`
    (int64[T] on the workspace's device).
    device_copy, stream: the driver's cuMemcpyDtoDAsync (`native_signal.memcpy_dtod`) and the
    handle of torch's current stream.  Where both are given and both tensors are contiguous, of
    one dtype and row width, each run is queued through the driver on `stream`: the device copy
    torch's `copy_` queues, without its dispatch (BENCHMARKS.md, forty-ninth section).  Each run
    is checked against both tensors' rows first."""
    if runs is None:
        _copy_rows(workspace, rows, records)
        return
    if device_copy is not None and stream is not None and records.device == workspace.device \
            and records.dtype == workspace.dtype and records.shape[1:] == workspace.shape[1:] \
            and records.is_contiguous() and workspace.is_contiguous():
        _device_copy_runs(workspace, records, runs, device_copy, stream)
        return
    for start, end, row in runs:
        workspace[row:row + end - start].copy_(records[start:end])


def _device_copy_runs(workspace: torch.Tensor, records: torch.Tensor, runs, device_copy, stream: int):
    tokens, rows = records.shape[0], workspace.shape[0]
    for start, end, row in runs:        # all checked before any is queued
        if not (0 <= start < end <= tokens and 0 <= row and row + end - start <= rows):
            raise ValueError(f"runs: ({start}, {end}, {row}) reaches past the records' {tokens} rows or the "
                             f"workspace's {rows}")
    width = records.stride(0) * records.element_size()         # bytes a row
    into, of = workspace.data_ptr(), records.data_ptr()
    for start, end, row in runs:
        native_signal.check_result(device_copy(into + row * width, of + start * width, (end - start) * width,
                                                stream), "cuMemcpyDtoDAsync")


def _copy_rows(workspace: torch.Tensor, rows: torch.Tensor, records: torch.Tensor):
    """workspace[rows[t]] = records[t] on torch's current stream, in 8-byte words where both
    are whole words (one load and store per word instead of per byte)."""
    if records.is_contiguous() and records.shape[1] % 8 == 0 and records.data_ptr() % 8 == 0 \
            and workspace.data_ptr() % 8 == 0:
        workspace, records = workspace.view(torch.int64), records.view(torch.int64)
    workspace.index_copy_(0, rows, records)


def _check_copied(name: str, tensor, dtypes, device: torch.device):
    """A tensor torch will copy on this device: type, dtype, device and grad (no layout rule)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name}: expected one of {bridge.dtype_names(dtypes)}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device} (the adapter's GPU)")
    if tensor.requires_grad:
        raise ValueError(f"{name}: requires grad; pass tensor.detach()")


def _host_ints(name, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected host lengths (a CPU tensor, as vLLM's *_cpu), got one on {x.device}; "
                             "reading it would synchronize the GPU")
        x = x.numpy()
    a = np.asarray(x)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected int[num_reqs], got {a.dtype}{list(a.shape)}")
    return a
