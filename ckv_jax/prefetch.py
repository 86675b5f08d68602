"""Per-layer orchestrator of depth-N CKV prefetch, for engines that call once per layer.

The in-program form is `pipelined_prefill.prefill_layers`; this is the stateful form of the same
rules (upstream's prefetch registry).  A pool of ring slots is allocated once from the memory
plan; each execution lane (target model, draft model, micro-batch) leases its own S = depth + 1
slots of D * C records.  Per step:

    orch.begin_step(plan, block_table)             # drops pending prefetches, keeps cache bindings
    for layer in range(L):
        cache = ...write this layer's chunk...     # the engine's own paged-cache write
        ws = orch.gather(layer, cache, kv_c, k_pe)  # prefetched + patched, or gathered now
        ...attention over ws (u8[D * C, R]; rows past D * P are unreachable)...

`gather` issues the gathers of layers L+1..L+depth that are registered and not already pending
(JAX dispatch is asynchronous: they run on JAX's stream while the caller continues), stopping
at the first layer whose cache is not registered, so the first step only discovers caches.
Ordering comes from data dependencies: a prefetch reads the registered (pre-step) cache of its
layer, and JAX orders a later donation or overwrite of that cache after the read.

Invariant: every decision (sync or prefetched, which targets) depends only on the call sequence
(layer indices, which caches were registered, the plan's eligibility), never on device state,
so every rank of a multi-process run makes the same decisions in the same order and their
collectives match.  `decisions` records them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Hashable

import jax
import jax.numpy as jnp

from ckv_jax import dcp_step, formats, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch_config import GatherConfig, MemoryPlan, memory_plan
from ckv_jax.step_plan import StepPlan

log = logging.getLogger("ckv_jax.prefetch")


def target_layers(layer: int, depth: int, registered, pending) -> list[int]:
    """Layers to prefetch when entering `layer`: layer+1..layer+depth, skipping pending ones,
    stopping at the first layer without a registered cache (or past the last layer).

    registered: sequence whose entry i is truthy when layer i's cache is registered.
    """
    targets = []
    for t in range(layer + 1, layer + depth + 1):
        if t >= len(registered) or not registered[t]:
            break
        if t not in pending:
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
        check before: a slot still referenced cannot be donated (`_into_slot` raises after)."""

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

    def registered(self) -> list[bool]:
        return [c is not None and not c.is_deleted() for c in self.caches]


class PrefetchOrchestrator:
    """Depth-N prefetch for per-layer callers; see the module docstring."""

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
        # prefetches pack with the full grid of a synchronous gather unless given a bounded one
        self.prefetch_tiles = dcp_step.bounded_pack_tiles(prefetch_programs) if prefetch_programs else None
        self.implementation = dcp_step.static_implementation(implementation)
        self.interpret = interpret
        self._lanes: dict[Hashable, LaneState] = {}
        self._plan: StepPlan | None = None
        self._arrays: dcp_step.StepArrays | None = None
        self.decisions: list[tuple] = []

    @property
    def slots(self) -> int:
        return self.memory.slots

    @property
    def pool_bytes(self) -> int:
        """Bytes the engine must reserve before sizing its KV cache."""
        return self.memory.total_bytes

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

    def begin_step(self, plan: StepPlan, block_table):
        """Start a step: pending prefetches of every lane are dropped, cache bindings kept."""
        if plan.layout != self.layout:
            raise ValueError(f"plan: expected layout {self.layout}, got {plan.layout}")
        if plan.padded_tokens > self.memory.capacity:
            raise ValueError(f"plan: P={plan.padded_tokens} exceeds the pool's capacity C={self.memory.capacity}")
        dcp_step.check_block_table(plan, block_table)
        self._plan = plan
        self._arrays = dcp_step.step_arrays(plan, block_table, self.mesh)   # every gather and patch reuses them
        for state in self._lanes.values():
            state.pending.clear()
            state.last_layer = None
        self.decisions = []

    def enter_layer(self, layer: int, key: Hashable = "target"):
        """A layer index at or below the last one restarts the step (a repeated or interrupted pass)."""
        state = self.lane(key)
        if state.last_layer is not None and layer <= state.last_layer:
            state.pending.clear()
        state.last_layer = layer

    def gather(self, layer: int | None, cache, kv_c, k_pe, *, key: Hashable = "target", after=None,
               ready: Callable[[jax.Array], None] | None = None):
        """The gathered workspace u8[D * C, R] of `layer` for this step, current chunk included.

        cache: this layer's u8[D * num_blocks, block_size, R] (sharded) after the layer wrote its
        chunk; kv_c / k_pe: the chunk (patched into a prefetched slot).  layer None: no lookahead.
        The returned array is the ring slot itself: it stays valid until the slot is reused
        (depth + 1 layers later, or the next step), when it is donated to the next gather and
        JAX raises on any further use of it.  Every gather writes its rows straight into its slot.
        after: an array every computation dispatched by this call takes as an (unused) input, so it
        runs only once `after` is ready (the torch bridge's DLPack path passes a fresh import from
        torch's current stream).
        ready: called with the workspace once its own computations (gather or patch) are
        dispatched and before any prefetch of a later layer is: a consumer on another stream
        hooks its wait here, so that the wait does not cover the prefetches.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("CKV gather called before begin_step")
        if not plan.eligible:
            raise RuntimeError(f"CKV gather called for an ineligible step: {plan.why}")
        state = self.lane(key)
        if layer is None:                      # no layer index: no lookahead for this call
            ws = self._gather_into(state, 0, cache, after)
            if ready is not None:
                ready(ws)
            self.decisions.append((key, None, "sync", ()))
            return ws
        self.enter_layer(layer, key)
        while len(state.caches) <= layer:
            state.caches.append(None)
        state.caches[layer] = cache
        if layer in state.pending:
            dcp_step.check_chunk(self.fmt, kv_c, k_pe, plan)
            ws, how = self._into_slot(state, state.pending.pop(layer), lambda slot: dcp_step.patch_program(
                slot, kv_c, k_pe, self._arrays.chunk_rows, after, layout=self.fmt.layout,
                implementation=self.implementation, interpret=self.interpret,
                device=placement.mesh_device(self.mesh))), "prefetched"
        else:
            ws, how = self._gather_into(state, layer % self.slots, cache, after), "sync"
        if ready is not None:
            ready(ws)
        targets = target_layers(layer, self.depth, state.registered(), state.pending)
        for t in targets:
            self._gather_into(state, t % self.slots, state.caches[t], after, self.prefetch_tiles)
            state.pending[t] = t % self.slots
        self.decisions.append((key, layer, how, tuple(targets)))
        return ws

    def _gather_into(self, state: LaneState, index: int, cache, after, tiles=None):
        dcp_step.check_caches(self.fmt, cache, self._plan)   # the table was checked at begin_step
        self.pool.check_writable(state.lane, index)
        return self._into_slot(state, index, lambda slot: dcp_step.gather_program(
            cache, self._arrays, slot, after, mesh=self.mesh, axis_name=self.axis_name,
            implementation=self.implementation, interpret=self.interpret, tiles=tiles))

    def _into_slot(self, state: LaneState, index: int, program: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """Ring slot `index` replaced by program(slot), which donates the slot.  A slot something
        else still references (a torch view of a workspace returned earlier) cannot be donated:
        XLA on a GPU refuses the call, XLA on a CPU silently allocates a new buffer instead; the
        pool never grows, so either is the slot's error."""
        ring = self.pool.ring(state.lane)
        slot = ring[index]
        try:
            ring[index] = program(slot)
        except (jax.errors.JaxRuntimeError, ValueError) as e:     # jax 0.11 raises INVALID_ARGUMENT as ValueError
            if "external reference" not in str(e):
                raise
            raise slot_still_referenced(index) from e
        if not slot.is_deleted():
            raise slot_still_referenced(index)
        return ring[index]


def slot_still_referenced(index: int) -> RuntimeError:
    """The error of a ring slot about to be reused while a workspace returned from it lives on."""
    return RuntimeError(f"CKV workspace ring slot {index} is still referenced (a workspace returned by an "
                        "earlier gather, or a view of it, is alive outside ckv-jax); drop it before its slot "
                        "is reused")
