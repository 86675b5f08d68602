"""Per-layer orchestrator of depth-N CKV prefetch, for engines that call once per layer.

The in-program form is `pipelined_prefill.prefill_layers`; this is the stateful form of the same
rules (upstream's prefetch registry).  A pool of ring slots is allocated once from the memory
plan; each execution lane (target model, draft model, micro-batch) leases its own S = depth + 1
slots of D * C records.  Per step:

    orch.begin_step(plan, block_table)             # drops pending prefetches, keeps cache bindings
    for layer in range(L):
        cache = ...write this layer's chunk...     # the engine's own paged-cache write
        ws = orch.gather(layer, cache, kv_c, k_pe)  # prefetched + patched, or gathered now
        # or: cache, ws = orch.write_and_gather(layer, cache, kv_c, k_pe): the write in the same program
        ...attention over ws (u8[D * C, R]; rows past D * P are unreachable)...

`begin_step` issues the gathers of the first layers and `gather` those of layers L+1..L+depth
that are registered and not already pending (JAX dispatch is asynchronous: they run on JAX's
stream while the caller continues), stopping at the first layer whose cache is not registered,
so the first step only discovers caches; each dispatch prefetches at most
`dcp_step.PREFETCHES_AT_ONCE` layers, so the lookahead fills over the first calls.  A call's own
work and its prefetches are one program.  Ordering comes from data dependencies: a prefetch reads the registered (pre-step) cache of its
layer, and JAX orders a later donation or overwrite of that cache after the read.

Invariant: every decision (sync or prefetched, which targets) depends only on the call sequence
(layer indices, which caches were registered, the plan's eligibility), never on device state,
so every rank of a multi-process run makes the same decisions in the same order and their
collectives match.  `decisions` records them.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Callable, Hashable

import jax
import jax.numpy as jnp

from ckv_jax import dcp_step, formats, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch_config import GatherConfig, MemoryPlan, memory_plan
from ckv_jax.step_plan import StepPlan

log = logging.getLogger("ckv_jax.prefetch")


def target_layers(layer: int, depth: int, registered, pending, limit: int | None = None) -> list[int]:
    """Layers to prefetch when entering `layer`: layer+1..layer+depth, skipping pending ones,
    stopping at the first other layer without a registered cache (or past the last layer), the
    first `limit` of them (all with None).  A pending layer's cache is not asked: its prefetch
    has read it already.

    registered: sequence whose entry i is truthy when layer i's cache is registered.
    """
    targets = []
    for t in range(layer + 1, min(layer + depth + 1, len(registered))):
        if t in pending:
            continue
        if len(targets) == limit or not registered[t]:
            break
        targets.append(t)
    return targets


class WorkspacePool:
    """`lanes` rings of `slots` gathered slots u8[D * C, R], allocated once, replicated on the mesh.

    allocate(rows, record_bytes) -> a replicated u8[rows, record_bytes] array: where the slots'
    memory comes from (default: JAX's allocator).  A caller that allocates them elsewhere (the
    torch bridge: torch's memory, imported once) overrides `check_writable`, which is called
    before a gather overwrites a slot.
    """

    def __init__(self, mesh: jax.sharding.Mesh, plan: MemoryPlan, world_size: int, record_bytes: int,
                 allocate: Callable[[int, int], jax.Array] | None = None):
        if plan.lanes <= 0 or plan.slots <= 0:
            raise ValueError(f"plan: expected positive lanes and slots, got {plan.lanes}, {plan.slots}")
        self.plan = plan
        rows = world_size * plan.capacity
        if allocate is None:
            def allocate(n, r):
                return placement.replicated(mesh, jnp.zeros((n, r), jnp.uint8))[0]
        # one buffer per slot: slots are donated one at a time, so they must not share storage
        self._rings = [[allocate(rows, record_bytes) for _ in range(plan.slots)] for _ in range(plan.lanes)]
        self._free = list(range(plan.lanes - 1, -1, -1))          # LIFO
        self._leased: set[int] = set()

    def check_writable(self, lane: int, index: int):
        """Raise if slot `index` of `lane` must not be overwritten now.  JAX-owned slots need no
        check before: a slot still referenced cannot be donated (`_into_slots` raises after)."""

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"CKV prefetch workspace pool exhausted: more than {self.plan.lanes} execution "
                               "lane(s) are in use; plan the pool with more ubatches / speculative lanes")
        lane = self._free.pop()
        self._leased.add(lane)
        return lane

    def release(self, lane: int):
        if lane not in self._leased:
            raise RuntimeError(f"CKV workspace lane {lane} is not leased")
        self._leased.remove(lane)
        self._free.append(lane)

    def ring(self, lane: int) -> list:
        return self._rings[lane]


@dataclasses.dataclass
class LaneState:
    lane: int
    caches: list = dataclasses.field(default_factory=list)     # layer -> registered cache or None
    pending: dict = dataclasses.field(default_factory=dict)    # layer -> ring slot
    last_layer: int | None = None
    # a live view of `caches` (grown and rebound in place, never replaced), made once
    registered: "RegisteredLayers" = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.registered = RegisteredLayers(self.caches)


class RegisteredLayers(Sequence):
    """registered[i]: layer i's cache is bound and alive.  Evaluated per entry read: a call reads
    the next `depth` layers only, and asking every layer's array would cost each call host time
    in proportion to the model's layers."""

    def __init__(self, caches: list):
        self._caches = caches

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i: int) -> bool:
        c = self._caches[i]
        return c is not None and not c.is_deleted()


class PrefetchOrchestrator:
    """Depth-N prefetch for per-layer callers; see the module docstring.  `prefetch_programs`: the
    persistent programs of a prefetch's pack: None for half the GPU's SMs
    (`dcp_step.default_prefetch_programs`), 0 for the full grid of a synchronous gather, n > 0 for
    n (`dcp_step.bounded_pack_tiles`)."""

    def __init__(self, mesh: jax.sharding.Mesh, layout: DcpLayout, format: str | formats.RecordFormat, *,
                 max_num_seqs: int, config: GatherConfig = GatherConfig(), ubatches: int = 1,
                 speculative: bool = False,
                 axis_name: str = placement.DCP_AXIS, implementation=None, interpret: bool = False,
                 pool_type: type[WorkspacePool] = WorkspacePool, pool_args: dict | None = None,
                 prefetch_programs: int | None = None):
        self.fmt = formats.get(format)
        self.layout = layout
        self.mesh = mesh
        self.axis_name = axis_name
        self.config = config
        self.memory = memory_plan(layout, self.fmt, max_num_seqs=max_num_seqs, config=config,
                                  ubatches=ubatches, speculative=speculative)
        self.depth = self.memory.depth if self.fmt.lookahead else 0
        if self.memory.depth and not self.depth:
            log.debug("format %s has no lookahead; gathering synchronously", self.fmt.name)
        self.pool = pool_type(mesh, self.memory, layout.world_size, self.fmt.record_bytes, **(pool_args or {}))
        self.prefetch_tiles = dcp_step.prefetch_pack_tiles(prefetch_programs, placement.mesh_device(mesh))
        self.implementation = dcp_step.static_implementation(implementation)
        self.interpret = interpret
        # the layer program with the static arguments fixed for this orchestrator bound once:
        # a layer's dispatch then hashes none of them
        self._layer_program = dcp_step.bound_layer_program(
            mesh=mesh, layout=self.fmt.layout, axis_name=axis_name, implementation=self.implementation,
            interpret=interpret, prefetch_tiles=self.prefetch_tiles)
        # XLA on a GPU refuses to run a program that donates a buffer something else still
        # references; elsewhere (XLA on a CPU) it runs it on a copy, which only a check after the
        # call can tell (`_into_slots`)
        self._donation_may_copy = placement.mesh_device(mesh).platform != "gpu"
        self._lanes: dict[Hashable, LaneState] = {}
        self._plan: StepPlan | None = None
        self._arrays: dcp_step.StepArrays | None = None
        self._checked_chunk: tuple | None = None      # (kv_c, k_pe) last checked against the step
        self.decisions: list[tuple] = []

    @property
    def slots(self) -> int:
        return self.memory.slots

    @property
    def pool_bytes(self) -> int:
        """Bytes the engine must reserve before sizing its KV cache."""
        return self.memory.total_bytes

    @property
    def step_arrays(self) -> dcp_step.StepArrays:
        """The device arrays of the step `begin_step` began (for a caller that runs the step's
        work as one program, `dcp_step.step_program`)."""
        if self._arrays is None:
            raise RuntimeError("step_arrays: no step begun (call begin_step first)")
        return self._arrays

    # -- lanes ---------------------------------------------------------------------------------
    def lane(self, key: Hashable = "target") -> LaneState:
        if key not in self._lanes:
            self._lanes[key] = LaneState(self.pool.acquire())
        return self._lanes[key]

    def close_lane(self, key: Hashable):
        state = self._lanes.pop(key)
        self.pool.release(state.lane)

    def reset(self):
        """The reset hook: drop every lane's cache bindings and pending prefetches, free all slots."""
        for key in list(self._lanes):
            self.close_lane(key)
        self._plan = None

    def slot(self, key: Hashable, index: int):
        if not 0 <= index < self.slots:
            raise ValueError(f"CKV gather buffer index {index} is outside [0, {self.slots})")
        return self.pool.ring(self.lane(key).lane)[index]

    def is_pending(self, layer: int | None, key: Hashable = "target") -> bool:
        """Whether `layer` was prefetched in this step (its gather will patch the chunk in)."""
        state = self._lanes.get(key)
        return layer is not None and state is not None and layer in state.pending and \
            (state.last_layer is None or layer > state.last_layer)

    def drop_pending(self, layer: int, key: Hashable = "target"):
        """Forget a prefetch of `layer` pending in this step, for a caller that knows the layer's
        cache now lives in other memory than the one registered (an engine that reallocated its
        caches): the prefetch read the old memory, so the layer gathers when it is called.  Every
        rank must drop the same prefetches (engines reallocate in lockstep), or their collectives
        would not match."""
        state = self._lanes.get(key)
        if state is not None:
            state.pending.pop(layer, None)

    def in_flight(self) -> list:
        """The ring slots that prefetches of this step are writing and nobody has consumed yet
        (the torch bridge makes torch's stream wait for them before it frees their inputs)."""
        return [self.pool.ring(state.lane)[index] for state in self._lanes.values()
                for index in state.pending.values()]

    # -- step ----------------------------------------------------------------------------------
    def eligible(self, plan: StepPlan) -> bool:
        if not plan.eligible:
            log.debug("full-CKV gather not used this step: %s", plan.why)
        return plan.eligible

    def begin_step(self, plan: StepPlan, block_table, *, prefetch: bool = True, chunk_capacity: int | None = None,
                   after=None, place=None):
        """Start a step: pending prefetches of every lane are dropped, cache bindings kept.

        prefetch: dispatch at once, for every lane, the gathers of its first registered layers
        (up to `depth` of them, at most `dcp_step.PREFETCHES_AT_ONCE`).  A gather reads only the
        history, which earlier steps wrote, and each layer patches its current chunk in when it
        is called; so layer 0's gather also runs beside whatever the engine does before layer
        0's attention, instead of in front of it.
        chunk_capacity: the rows of the buffers the chunk's latents will come in, when more than
        the step's tokens (`dcp_step.step_arrays`).  after: see `gather`.
        place: how the step's host arrays (`dcp_step.host_step_arrays`) reach the mesh, a function
        of them returning the device arrays, ordered before every program of the step; None:
        `jax.device_put`, replicated (new buffers every step).
        """
        if plan.layout != self.layout:
            raise ValueError(f"plan: expected layout {self.layout}, got {plan.layout}")
        if plan.padded_tokens > self.memory.capacity:
            raise ValueError(f"plan: P={plan.padded_tokens} exceeds the pool's capacity C={self.memory.capacity}")
        dcp_step.check_block_table(plan, block_table)
        self._plan = plan
        self._checked_chunk = None
        # every gather and patch of the step reuses them
        if place is None:
            self._arrays = dcp_step.step_arrays(plan, block_table, self.mesh, chunk_capacity=chunk_capacity)
        else:
            self._arrays = place(dcp_step.host_step_arrays(plan, block_table, chunk_capacity=chunk_capacity))
        for state in self._lanes.values():
            state.pending.clear()
            state.last_layer = None
        self.decisions = []
        if not (prefetch and plan.eligible):
            return
        for key, state in self._lanes.items():
            targets = target_layers(-1, self.depth, state.registered, state.pending, dcp_step.PREFETCHES_AT_ONCE)
            if not targets:
                continue
            if after is None:
                self._dispatch(state, None, None, None, None, targets, None)
            else:
                self._prefetches_after(state, targets, after)
            self.decisions.append((key, None, "begin_step", tuple(targets)))

    def enter_layer(self, layer: int, key: Hashable = "target"):
        """A layer index at or below the last one restarts the step (a repeated or interrupted pass)."""
        _enter(self.lane(key), layer)

    def write_and_gather(self, layer: int | None, cache, kv_c, k_pe, *, key: Hashable = "target", signal=None):
        """`gather` for an engine that leaves the layer's cache write to this call: the chunk
        (kv_c, k_pe) is written into `cache` (donated; the layer's sharded cache as it was before
        this step's write) with ckv-jax's writer, in the same program as the layer's patch or
        gather and its prefetches (one dispatch), ahead of both.  Returns (the written cache,
        which replaces `cache` in every later call, the workspace).  signal: see `gather`; it
        then follows the cache write too.  A ring slot still referenced raises
        `SlotStillReferenced`; where the program had already run (XLA on a CPU), the error's
        `written` is the written cache, which replaces `cache` as the return value would."""
        written = []
        try:
            ws = self._layer_call(layer, cache, kv_c, k_pe, key, None, None, signal, written)
        except SlotStillReferenced as e:
            if written:       # the program ran: its cache write stands, and the given cache was donated
                e.written = written[0]
            raise
        return written[0], ws

    def gather(self, layer: int | None, cache, kv_c, k_pe, *, key: Hashable = "target", after=None,
               ready: Callable[[jax.Array], None] | None = None, signal=None):
        """The gathered workspace u8[D * C, R] of `layer` for this step, current chunk included.

        cache: this layer's u8[D * num_blocks, block_size, R] (sharded) after the layer wrote its
        chunk; kv_c / k_pe: the chunk (patched into a prefetched slot).  layer None: no lookahead;
        the call gathers into slot 0 of the lane's ring, and a prefetch pending there is dropped
        (that layer is prefetched again by a later call, or gathered when called).  The returned
        array is the ring slot itself: it stays valid until the slot is reused (depth + 1 layers
        later, or the next step), when it is donated to the next gather and JAX raises on any
        further use of it.  Every gather writes its rows straight into its slot.

        The layer's own work (the patch or the gather) and the prefetches of later layers are one
        program, one dispatch (`dcp_step.layer_program`), unless `ready` or `after` is given.
        after: an array every computation dispatched by this call takes as an (unused) input, so it
        runs only once `after` is ready (the torch bridge's DLPack path passes a fresh import from
        torch's current stream); these calls dispatch `dcp_step.gather_program` and
        `patch_program`.
        signal: a static hashable callable the program calls, in stream order, between the
        layer's own work and the prefetches (`dcp_step.signal_when_ready`, once per device, with
        the program's stream; or its native form, `in_program`): a consumer on another stream
        waits on what it records and so never waits for the prefetches.  A call without
        prefetches calls it once on the host right after the dispatch instead, with stream None
        (the program ends with the own work).
        ready: the host-side form of the same hook, for consumers that wait through an export:
        called with the workspace once its own computation is dispatched; the prefetches are then
        dispatched separately, after it.
        """
        return self._layer_call(layer, cache, kv_c, k_pe, key, after, ready, signal, None)

    def _layer_call(self, layer, cache, kv_c, k_pe, key, after, ready, signal, written: list | None):
        """`gather`, and with `written` (a list) `write_and_gather`, which receives the written cache."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("CKV gather called before begin_step")
        if not plan.eligible:
            raise RuntimeError(f"CKV gather called for an ineligible step: {plan.why}")
        if signal is not None and (ready is not None or after is not None):
            raise ValueError("signal: the in-program signal needs the call's work in one program; "
                             "it does not combine with ready or after")
        state = self.lane(key)
        write = written is not None
        if layer is None:                      # no layer index: no lookahead for this call
            dcp_step.check_caches(self.fmt, cache, plan)
            if write:
                self._check_chunk(kv_c, k_pe)
            # it gathers into slot 0: a prefetch pending there is dropped (a later call prefetches
            # that layer again, or it gathers when called), or that layer would patch this call's
            # records
            for t in [t for t, i in state.pending.items() if i == 0]:
                del state.pending[t]
            ws = self._own_and_prefetches(state, 0, cache, kv_c, k_pe, (), after, ready, signal,
                                          cache if write else None, written)
            self.decisions.append((key, None, "sync", ()))
            return ws
        _enter(state, layer)
        while len(state.caches) <= layer:
            state.caches.append(None)
        if state.caches[layer] is not cache:   # checked once per cache object: the layout is fixed
            dcp_step.check_caches(self.fmt, cache, plan)
            state.caches[layer] = cache
        if layer in state.pending or write:
            self._check_chunk(kv_c, k_pe)
        if layer in state.pending:
            index, own_cache, how = state.pending.pop(layer), None, "prefetched"
        else:
            index, own_cache, how = layer % self.slots, cache, "sync"
        targets = target_layers(layer, self.depth, state.registered, state.pending, dcp_step.PREFETCHES_AT_ONCE)
        try:
            ws = self._own_and_prefetches(state, index, own_cache, kv_c, k_pe, targets, after, ready, signal,
                                          cache if write else None, written)
        finally:
            if written:     # the donated cache's successor (same memory), also where the call raised after it ran
                state.caches[layer] = written[0]
        self.decisions.append((key, layer, how, tuple(targets)))
        return ws

    def _check_chunk(self, kv_c, k_pe):
        if self._checked_chunk is None or self._checked_chunk[0] is not kv_c or self._checked_chunk[1] is not k_pe:
            dcp_step.check_chunk(self.fmt, kv_c, k_pe, self._plan, rows=self._arrays.chunk_rows.shape[0])
            self._checked_chunk = (kv_c, k_pe)     # the torch bridge passes the same buffers every layer

    def _own_and_prefetches(self, state: LaneState, index: int, own_cache, kv_c, k_pe, targets, after, ready,
                            signal, write_cache=None, written=None):
        """Slot `index` patched (own_cache None) or gathered from own_cache, then the gathers of
        `targets`: one program, or with `ready` / `after` the own work, ready(workspace), then
        each prefetch, as programs that take `after`.  write_cache, written: see `_dispatch`
        (`write_and_gather` passes neither `ready` nor `after`)."""
        if ready is None and after is None:
            if targets or signal is None:
                return self._dispatch(state, index, own_cache, kv_c, k_pe, targets, signal, write_cache, written)
            # nothing follows the own work in its program: the host marks the same point right
            # after the dispatch, which saves the in-program callback
            ws = self._dispatch(state, index, own_cache, kv_c, k_pe, (), None, write_cache, written)
            signal(None)
            return ws
        ws = self._dispatch_after(state, index, own_cache, kv_c, k_pe, after)
        if ready is not None:
            ready(ws)
        self._prefetches_after(state, targets, after)
        return ws

    def _dispatch(self, state: LaneState, index, own_cache, kv_c, k_pe, targets, signal, write_cache=None,
                  written=None):
        """One layer program (`dcp_step.layer_program`, bound for this orchestrator): slot `index`
        (None: none) patched or gathered, then the gathers of the layers `targets` into their ring
        slots, which become pending.  write_cache: the layer's cache (donated), which the program
        first writes the chunk into (and gathers, when own_cache is the same cache); `written` (a
        list) receives its result."""
        ring, lane = self.pool.ring(state.lane), state.lane
        targets_slots = [t % len(ring) for t in targets]
        if own_cache is not None:                  # the slots a gather overwrites
            self.pool.check_writable(lane, index)
        for i in targets_slots:
            self.pool.check_writable(lane, i)
        indices = targets_slots if index is None else [index, *targets_slots]
        own_slot = None if index is None else ring[index]
        prefetch_slots = tuple([ring[i] for i in targets_slots])
        try:
            ws, prefetched, cache = self._layer_program(
                own_slot, None if write_cache is not None else own_cache, kv_c, k_pe, self._arrays,
                tuple([state.caches[t] for t in targets]), prefetch_slots, write_cache, signal=signal,
                gather_written=write_cache is not None and own_cache is not None)
        except (jax.errors.JaxRuntimeError, ValueError) as e:     # jax 0.11 raises INVALID_ARGUMENT as ValueError
            if _refused_donation(e):
                raise slot_still_referenced(*indices) from e
            raise
        if write_cache is not None:
            written.append(cache)
        if index is None:
            self._into_slots(ring, indices, prefetch_slots, prefetched)
        else:
            self._into_slots(ring, indices, (own_slot, *prefetch_slots), (ws, *prefetched))
        for t, i in zip(targets, targets_slots):
            state.pending[t] = i
        return ws

    def _prefetches_after(self, state: LaneState, targets, after):
        """The gathers of `targets` into their ring slots, one program each that takes `after`."""
        for t in targets:
            self._dispatch_after(state, t % self.slots, state.caches[t], None, None, after, self.prefetch_tiles)
            state.pending[t] = t % self.slots

    def _dispatch_after(self, state: LaneState, index: int, cache, kv_c, k_pe, after, tiles=None):
        """Slot `index` patched (cache None) or gathered from `cache` by a program that takes `after`."""
        if cache is None:
            program = functools.partial(dcp_step.patch_program, kv_c=kv_c, k_pe=k_pe, rows=self._arrays.chunk_rows,
                                        after=after, layout=self.fmt.layout, implementation=self.implementation,
                                        interpret=self.interpret, device=placement.mesh_device(self.mesh))
        else:
            self.pool.check_writable(state.lane, index)
            program = functools.partial(dcp_step.gather_program, cache, self._arrays, after=after, mesh=self.mesh,
                                        axis_name=self.axis_name, implementation=self.implementation,
                                        interpret=self.interpret, tiles=tiles)
        ring = self.pool.ring(state.lane)
        given = ring[index]
        try:
            ws = program(given)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if _refused_donation(e):
                raise slot_still_referenced(index) from e
            raise
        self._into_slots(ring, [index], [given], [ws])
        return ws

    def _into_slots(self, ring: list, indices: list[int], given: list, new: list):
        """Ring slots `indices`, which a program took as `given` (donated), replaced by its results
        `new`.  A slot something else still references (a torch view of a workspace returned
        earlier) cannot be donated: XLA on a GPU refuses the call (`_refused_donation`), XLA on a
        CPU silently runs it on a copy, which leaves the given slot alive; the pool never grows,
        so either is the slot's error."""
        for i, array in zip(indices, new):
            ring[i] = array
        if self._donation_may_copy:
            kept = [i for i, slot in zip(indices, given) if not slot.is_deleted()]
            if kept:
                raise slot_still_referenced(*kept)


def _refused_donation(error: Exception) -> bool:
    """Whether a program's error is XLA's refusal to donate a buffer something else references."""
    return "external reference" in str(error)


def _enter(state: LaneState, layer: int):
    if state.last_layer is not None and layer <= state.last_layer:
        state.pending.clear()
    state.last_layer = layer


class SlotStillReferenced(RuntimeError):
    """Ring slots about to be reused while a workspace returned from one of them lives on.

    written: None, or the layer's written cache when a `write_and_gather` program had already
    run (XLA on a CPU copies a donated buffer that something still references instead of
    refusing the call): the cache given to the call was donated to it, so this array, which the
    orchestrator has also bound to the layer, is the cache from now on."""

    def __init__(self, message: str):
        super().__init__(message)
        self.written = None


def slot_still_referenced(*indices: int) -> SlotStillReferenced:
    """The error of ring slots about to be reused while a workspace returned from one lives on."""
    which = f"slot {indices[0]}" if len(indices) == 1 else f"one of slots {', '.join(map(str, indices))}"
    return SlotStillReferenced(f"CKV workspace ring {which} is still referenced (a workspace returned by an "
                               "earlier gather, or a view of it, is alive outside ckv-jax); drop it before its "
                               "slot is reused")
