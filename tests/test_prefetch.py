"""The per-layer prefetch orchestrator: upstream's checklist (upstream-system.md 7.2) in JAX terms."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dcp_scenario
from ckv_jax import dcp_step, formats, full_ckv, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch import (PrefetchOrchestrator, RegisteredLayers, SlotStillReferenced,
                             target_layers)
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import build_step_plan
from helpers import ancestors, copies_of_at_least, entry_instructions, mesh_of

FINAL_LENS = np.array([45, 40, 70])
# two chunked-prefill steps after a prefix: positions [h, h + q) are written in each step
STEPS = [(np.array([20, 0, 40]), np.array([17, 23, 18])), (np.array([37, 23, 58]), np.array([8, 17, 12]))]
LAYERS = 4


@pytest.mark.parametrize("depth, slots, targets", [(0, 1, []), (1, 2, [2]), (3, 4, [2, 3, 4])])
def test_depth_controls_ring_and_targets(depth, slots, targets):
    assert target_layers(1, depth, [True] * 6, {}) == targets
    orch = _orchestrator(2, depth)
    assert orch.slots == slots


def test_targets_skip_pending_and_stop_at_first_unregistered_layer():
    registered = [True, True, True, False, True]
    assert target_layers(1, 3, registered, {2: 0}) == []
    assert target_layers(1, 3, registered, {}) == [2]
    assert target_layers(3, 2, [True] * 5, {}) == [4]          # past the last layer
    # a pending layer's cache is not asked (its prefetch read it): the lookahead goes on past it
    assert target_layers(1, 3, [True, True, False, True, True], {2: 0}) == [3, 4]


def test_registered_layers_are_bound_and_alive_caches():
    alive, gone = jnp.arange(4), jnp.arange(4)
    gone.delete()                                               # as a donated cache is
    registered = RegisteredLayers([None, alive, gone, alive])
    assert len(registered) == 4 and [registered[i] for i in range(4)] == [False, True, False, True]
    assert target_layers(0, 3, registered, {}) == [1]          # stops at the deleted cache of layer 2


def test_a_dispatch_prefetches_at_most_its_limit_and_the_lookahead_fills_over_calls():
    assert target_layers(-1, 4, [True] * 8, {}, limit=2) == [0, 1]
    assert target_layers(0, 4, [True] * 8, {1: 1}, limit=2) == [2, 3]     # pending layers do not count
    assert target_layers(1, 4, [True] * 8, {2: 2, 3: 3}, limit=2) == [4, 5]
    assert target_layers(2, 4, [True] * 8, {3: 3, 4: 4, 5: 0}, limit=2) == [6]
    assert dcp_step.PREFETCHES_AT_ONCE == 2


def test_native_record_formats_support_lookahead():
    assert formats.get("fp8_ds_mla").lookahead and formats.get("nvfp4_ds_mla").lookahead
    assert not formats.get("bf16").lookahead and not formats.get("auto").lookahead
    assert _orchestrator(2, 2, fmt="bf16").depth == 0


def _orchestrator(d, depth, fmt="fp8_ds_mla", **kw):
    return PrefetchOrchestrator(mesh_of(d), DcpLayout(d, 1, 8), fmt, max_num_seqs=4,
                                config=GatherConfig(enabled=True, depth=depth, workspace_mib=0, max_tokens=512), **kw)


def test_slot_index_outside_the_ring_is_rejected():
    orch = _orchestrator(2, 1)
    assert orch.slot("target", 1).shape == (2 * orch.memory.capacity, 656)
    with pytest.raises(ValueError, match=r"buffer index 2 is outside \[0, 2\)"):
        orch.slot("target", 2)


def test_pool_exhaustion_is_a_hard_error_and_lanes_are_isolated():
    orch = _orchestrator(2, 1)
    orch.lane("target")
    with pytest.raises(RuntimeError, match="pool exhausted"):
        orch.lane("draft")
    spec = _orchestrator(2, 1, speculative=True)
    assert spec.pool_bytes == 2 * spec.memory.lane_bytes
    a, b = spec.lane("target"), spec.lane("draft")
    assert a.lane != b.lane and spec.pool.ring(a.lane)[0] is not spec.pool.ring(b.lane)[0]


def test_close_returns_the_lane_and_reset_drops_bindings():
    orch = _orchestrator(2, 1)
    lane = orch.lane("target").lane
    ring = orch.pool.ring(lane)
    orch.close_lane("target")
    assert orch.lane("target").lane == lane and orch.pool.ring(lane) is ring
    orch.lane("target").caches.append(jnp.zeros(3))
    orch.reset()
    assert not orch._lanes and orch.lane("target").caches == []


class Engine:
    """A torch-engine-like driver: per step and layer, write the chunk into the layer's paged
    cache (the real writer, through the DCP slot mapping), then ask the orchestrator."""

    def __init__(self, d, fmt, depth, seed=3, **orchestrator_args):
        self.layers = [dcp_scenario.build(d, 1, fmt, FINAL_LENS, FINAL_LENS, seed=seed, kv_seed=50 + l,
                                          written=STEPS[0][0]) for l in range(LAYERS)]
        self.mesh = mesh_of(d)
        self.layout = self.layers[0].layout
        self.caches = [placement.place_caches(sc.caches, self.mesh) for sc in self.layers]
        self.orch = PrefetchOrchestrator(self.mesh, self.layout, fmt, max_num_seqs=4,
                                         config=GatherConfig(enabled=True, depth=depth, workspace_mib=0,
                                                             max_tokens=512), **orchestrator_args)

    def chunk(self, l, hist, q):
        sc = self.layers[l]
        kv = np.concatenate([sc.kv_c[r][h:h + n] for r, (h, n) in enumerate(zip(hist, q))])
        pe = np.concatenate([sc.k_pe[r][h:h + n] for r, (h, n) in enumerate(zip(hist, q))])
        return jnp.asarray(kv), jnp.asarray(pe)

    def write(self, l, plan, kv, pe):
        self.caches[l] = full_ckv.write_records_dcp(self.caches[l], kv, pe, plan, self.layers[l].block_table,
                                                    mesh=self.mesh, format=self.layers[l].fmt)

    def step(self, hist, q, layers=range(LAYERS)):
        plan = build_step_plan(self.layout, hist + q, q, max_num_seqs=4, min_tokens=1)
        self.orch.begin_step(plan, self.layers[0].block_table)
        return plan, self.run_layers(plan, hist, q, layers)

    def run_layers(self, plan, hist, q, layers):
        out = []
        rows = plan.world_size * plan.padded_tokens
        for l in layers:
            kv, pe = self.chunk(l, hist, q)
            self.write(l, plan, kv, pe)
            # copied before the host read: on CPU np.asarray keeps a zero-copy view, which pins the slot
            out.append(np.asarray(jnp.copy(self.orch.gather(l, self.caches[l], kv, pe)))[:rows])
        return out


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("d", [2, 4])
def test_every_depth_gives_the_synchronous_bytes_over_chunked_steps(d, fmt):
    results = {}
    for depth in (0, 1, 2, 3):
        engine = Engine(d, fmt, depth)
        per_step = []
        for s, (hist, q) in enumerate(STEPS):
            plan, workspaces = engine.step(hist, q)
            for l, ws in enumerate(workspaces):
                want = dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q, plan=plan)
                np.testing.assert_array_equal(ws, want, err_msg=f"depth {depth} step {s} layer {l}")
            per_step.append(list(engine.orch.decisions))
        results[depth] = per_step
    # the first step only discovers caches; later steps prefetch the first layers at begin_step
    # and then up to depth layers ahead of each call, at most two per dispatch
    assert all(how == "sync" and not targets for _, _, how, targets in results[2][0])
    assert results[2][1] == [("target", None, "begin_step", (0, 1)), ("target", 0, "prefetched", (2,)),
                             ("target", 1, "prefetched", (3,)), ("target", 2, "prefetched", ()),
                             ("target", 3, "prefetched", ())]
    assert results[3][1] == [("target", None, "begin_step", (0, 1)), ("target", 0, "prefetched", (2, 3)),
                             ("target", 1, "prefetched", ()), ("target", 2, "prefetched", ()),
                             ("target", 3, "prefetched", ())]
    assert [how for _, _, how, _ in results[0][1]] == ["sync"] * LAYERS


def test_interrupted_step_recovers_without_consuming_a_stale_slot():
    engine = Engine(2, "fp8_ds_mla", depth=2)
    engine.step(*STEPS[0])
    hist, q = STEPS[1]
    plan, _ = engine.step(hist, q, layers=[0, 1])               # interrupted after layer 1
    assert set(engine.orch.lane("target").pending) == {2, 3}      # layers 2 and 3 were in flight
    # a repeated pass from layer 0 without begin_step restarts the step: nothing pending is used
    again = engine.run_layers(plan, hist, q, range(LAYERS))
    restart = [d for d in engine.orch.decisions if d[1] == 0][-1]
    assert restart[2] == "sync"
    for l, ws in enumerate(again):
        np.testing.assert_array_equal(ws, dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q,
                                                                          plan=plan))


def test_begin_step_drops_prefetches_of_an_unfinished_step():
    engine = Engine(2, "nvfp4_ds_mla", depth=3)
    engine.step(*STEPS[0])
    hist, q = STEPS[1]
    engine.step(hist, q, layers=[0])                            # layers 1..3 prefetched, never consumed
    assert engine.orch.lane("target").pending
    plan = build_step_plan(engine.layout, hist + q, q, max_num_seqs=4, min_tokens=1)
    engine.orch.begin_step(plan, engine.layers[0].block_table, prefetch=False)
    assert not engine.orch.lane("target").pending and engine.orch.decisions == []
    engine.orch.begin_step(plan, engine.layers[0].block_table)    # the new step's own first prefetches
    assert engine.orch.decisions == [("target", None, "begin_step", (0, 1))]
    out = engine.run_layers(plan, hist, q, range(LAYERS))
    for l, ws in enumerate(out):
        np.testing.assert_array_equal(ws, dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q,
                                                                          plan=plan))


def test_every_rank_takes_the_same_decisions():
    """Decisions are a function of the call sequence: two orchestrators driven alike agree."""
    logs = []
    for _ in range(2):
        engine = Engine(2, "nvfp4_ds_mla", depth=2)
        for hist, q in STEPS:
            engine.step(hist, q)
        logs.append(list(engine.orch.decisions))
    assert logs[0] == logs[1] and any(how == "prefetched" for _, _, how, _ in logs[0])


def test_ineligible_step_and_missing_begin_step_raise():
    orch = _orchestrator(2, 1)
    with pytest.raises(RuntimeError, match="before begin_step"):
        orch.gather(0, None, None, None)
    plan = build_step_plan(DcpLayout(2, 1, 8), np.array([30, 8]), np.array([10, 1]), max_num_seqs=4)
    orch.begin_step(plan, np.zeros((2, 4), np.int32))
    assert not orch.eligible(plan)
    with pytest.raises(RuntimeError, match="ineligible step: not a pure prefill"):
        orch.gather(0, None, None, None)


def test_missing_layer_index_gathers_synchronously_and_lanes_keep_their_own_pending():
    engine = Engine(2, "fp8_ds_mla", depth=1)
    engine.orch = PrefetchOrchestrator(engine.mesh, engine.layout, "fp8_ds_mla", max_num_seqs=4, speculative=True,
                                       config=GatherConfig(enabled=True, depth=1, workspace_mib=0, max_tokens=512))
    engine.step(*STEPS[0])
    hist, q = STEPS[1]
    plan, _ = engine.step(hist, q, layers=[0])                 # target lane: layer 1 pending
    kv, pe = engine.chunk(2, hist, q)
    ws = engine.orch.gather(None, engine.caches[2], kv, pe, key="draft")   # no layer index, other lane
    assert engine.orch.decisions[-1] == ("draft", None, "sync", ())
    assert set(engine.orch.lane("target").pending) == {1} and not engine.orch.lane("draft").pending
    want = dcp_scenario.expected_workspace(engine.layers[2], seq_lens=hist + q, plan=plan)
    got = np.asarray(ws)[:len(want)]
    keep = np.setdiff1d(np.arange(len(got)), dcp_step.chunk_rows(plan))   # layer 2 has not written its chunk
    np.testing.assert_array_equal(got[keep], want[keep])


@pytest.mark.parametrize("depth", [1, 2])
def test_a_call_without_layer_index_drops_the_prefetch_pending_in_its_slot(depth):
    """A no-index call gathers into slot 0 of its lane; after layer `upto` a later layer's
    prefetch may be pending there: that layer must then be prefetched again or gathered when
    called, not patch the no-index call's records.  Every layer stays exact wherever the call
    comes."""
    dropped = []
    for upto in range(LAYERS - 1):
        engine = Engine(2, "fp8_ds_mla", depth)
        engine.step(*STEPS[0])
        hist, q = STEPS[1]
        plan, early = engine.step(hist, q, layers=range(upto + 1))
        in_slot_0 = [t for t, i in engine.orch.lane("target").pending.items() if i == 0]
        dropped += in_slot_0
        kv, pe = engine.chunk(0, hist, q)
        engine.orch.gather(None, engine.caches[0], kv, pe)       # its workspace dropped at once
        assert not [t for t, i in engine.orch.lane("target").pending.items() if i == 0]
        late = engine.run_layers(plan, hist, q, range(upto + 1, LAYERS))
        for l, ws in enumerate(early + late):
            want = dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q, plan=plan)
            np.testing.assert_array_equal(ws, want, err_msg=f"depth {depth}, no-index call after layer {upto}, "
                                                           f"layer {l}")
        # the dropped layer is prefetched again by a later call, or gathered when called
        after = engine.orch.decisions[engine.orch.decisions.index(("target", None, "sync", ())) + 1:]
        for t in in_slot_0:
            own = next(i for i, (_, layer, _, _) in enumerate(after) if layer == t)
            assert after[own][2] == "sync" or any(t in targets for _, _, _, targets in after[:own]), after
    assert dropped, "no call came while a prefetch was pending in slot 0"


@pytest.mark.parametrize("d", [1, 4])
def test_a_gather_writes_straight_into_its_ring_slot(d):
    """The orchestrator's compiled gather program never copies its slot, and with one rank not
    even the gathered rows: the pack writes into the donated slot.  With D > 1 the all-gather's
    rows are copied into the slot at most once (jax 0.10's XLA cannot all-gather into a slice of
    another buffer; jax 0.11's CPU compile was seen to need no copy)."""
    mesh = mesh_of(d)
    padded, capacity, record_bytes = 256, 1024, 656
    slot = placement.replicated(mesh, jnp.zeros((d * capacity, record_bytes), jnp.uint8))[0]
    cache = placement.place_caches([np.zeros((8, 64, record_bytes), np.uint8)] * d, mesh)
    plan = build_step_plan(DcpLayout(d, 1, 64), np.array([200 * d]), np.array([32]), min_world_size=1)
    assert plan.padded_tokens == padded
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 8), np.int32), mesh)
    hlo = dcp_step.gather_program.lower(cache, arrays, slot, None, mesh=mesh, axis_name=placement.DCP_AXIS,
                                        implementation="xla", interpret=False).compile().as_text()
    moved = copies_of_at_least(hlo, d * padded * record_bytes)
    assert not [c for c in moved if "dynamic-update-slice" not in c], moved     # no copy of the slot
    assert len(moved) <= (0 if d == 1 else 1), moved     # jax 0.11's CPU compile writes it in place
    assert "u8[" in hlo, "the check above must see the uint8 buffers"


def test_a_bounded_prefetch_pack_gives_the_same_bytes():
    """Prefetches packed by a few persistent programs (`prefetch_programs`, the Pallas Triton
    pack in interpret mode) give the synchronous bytes, and sync gathers keep the full grid."""
    engine = Engine(2, "fp8_ds_mla", 2, implementation="pallas_triton", interpret=True, prefetch_programs=3)
    assert engine.orch.prefetch_tiles.programs == 3
    for s, (hist, q) in enumerate(STEPS):
        plan, workspaces = engine.step(hist, q)
        for l, ws in enumerate(workspaces):
            want = dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q, plan=plan)
            np.testing.assert_array_equal(ws, want, err_msg=f"step {s} layer {l}")
    assert [how for _, _, how, _ in engine.orch.decisions] == ["begin_step"] + ["prefetched"] * LAYERS
    with pytest.raises(ValueError, match="programs: expected a positive number"):
        dcp_step.bounded_pack_tiles(-1)


def test_a_bounded_pack_takes_larger_tiles_on_fewer_programs():
    """A program moves about its tile per memory latency, so a smaller grid takes the larger
    tile: the sweep's fastest at 33 and at 66 programs, switching between them (45 -> 46)."""
    tiles = {p: dcp_step.bounded_pack_tiles(p) for p in (1, 33, 45, 46, 66, 132)}
    assert {p: (t.rows_per_tile, t.num_warps) for p, t in tiles.items()} == {
        1: (256, 32), 33: (256, 32), 45: (256, 32), 46: (128, 16), 66: (128, 16), 132: (128, 16)}
    assert all(t.programs == p for p, t in tiles.items())


def test_the_default_prefetch_pack_is_the_full_grid_off_a_gpu_and_bad_footprints_are_named():
    """None bounds a prefetch's pack to half of a GPU's SMs (test_interop_gpu.py checks it on
    one); on the CPU there are no SMs to leave free, so it is the full grid, as 0 always is."""
    assert Engine(1, "fp8_ds_mla", 1).orch.prefetch_tiles is None
    assert Engine(1, "fp8_ds_mla", 1, prefetch_programs=0).orch.prefetch_tiles is None
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"prefetch_programs: expected None, 0 .*, got {bad!r}"):
            Engine(1, "fp8_ds_mla", 1, prefetch_programs=bad)


class CountingSignal:
    """A layer-program signal that records the stream handle of every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, stream):
        self.calls.append(stream)


class NativeCountingSignal:
    """The same through the native signal's custom call (`interop.native_signal`; on the CPU its
    handler only counts, in `state`): every in-program call shows as a None in `calls`."""

    def __init__(self):
        self.host_calls = []
        from interop import native_signal
        self.state = native_signal.new_state()

    def __call__(self, stream):
        self.host_calls.append(stream)

    def in_program(self, arrays, *, platform):
        from interop import native_signal
        assert native_signal.load().library is not None, native_signal.load().why
        return native_signal.call(arrays, platform=platform, record_fn=0, wait_fn=0, ready_event=0, then_wait=0,
                                  state=self.state)

    @property
    def calls(self):
        return self.host_calls + [None] * int(self.state[0])


SIGNALS = {"callback": CountingSignal, "native": NativeCountingSignal}


@pytest.mark.parametrize("kind", sorted(SIGNALS))
def test_a_signal_fires_once_per_layer_between_its_own_work_and_the_prefetches(kind):
    """With a signal every call is one program that calls it once per device (no stream handle
    off a GPU), or, without prefetches, the host calls it once after the dispatch; the bytes
    are the synchronous ones."""
    signal = SIGNALS[kind]()
    engine = Engine(2, "fp8_ds_mla", depth=2)
    for s, (hist, q) in enumerate(STEPS):
        plan = build_step_plan(engine.layout, hist + q, q, max_num_seqs=4, min_tokens=1)
        engine.orch.begin_step(plan, engine.layers[0].block_table)
        for l in range(LAYERS):
            kv, pe = engine.chunk(l, hist, q)
            engine.write(l, plan, kv, pe)
            before = len(signal.calls)
            ws = jax.block_until_ready(engine.orch.gather(l, engine.caches[l], kv, pe, signal=signal))
            in_program = bool(engine.orch.decisions[-1][3])      # this call prefetched
            assert signal.calls[before:] == [None] * (2 if in_program else 1), f"step {s} layer {l}"
            want = dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q, plan=plan)
            np.testing.assert_array_equal(np.asarray(jnp.copy(ws))[:len(want)], want, err_msg=f"step {s} layer {l}")
    for extra in (dict(ready=lambda ws: None), dict(after=kv)):
        with pytest.raises(ValueError, match="signal: the in-program signal needs the call's work in one program"):
            engine.orch.gather(0, engine.caches[0], kv, pe, signal=signal, **extra)


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("d, kind, kernels", [(1, "native", "xla"), (2, "callback", "xla"), (4, None, "xla"),
                                              (2, "native", "pallas_triton")])
def test_write_and_gather_writes_the_engines_cache_in_place_and_the_same_workspaces(d, kind, kernels, depth):
    """`write_and_gather` takes the layer's cache write from the engine: over two chunked steps
    (the second prefetching: the cache write and the patch one kernel), with latents in buffers
    larger than the step (junk rows past T, as the torch bridge's persistent buffers), every
    cache holds the bytes the engine's own write gives, in the memory of the cache it was given,
    and every workspace the synchronous bytes; the XLA kernels and the Pallas ones (interpreted
    here)."""
    ours = Engine(d, "fp8_ds_mla", depth, implementation=kernels, interpret=kernels == "pallas_triton")
    theirs = Engine(d, "fp8_ds_mla", depth)          # the engine writes its caches itself
    # caches in JAX's own memory: on the CPU `device_put` may alias the scenario's numpy arrays,
    # and XLA copies a donated buffer that something outside JAX still references
    ours.caches = [jnp.copy(c) for c in ours.caches]
    signal = SIGNALS[kind]() if kind else None
    junk = np.random.default_rng(1)
    for s, (hist, q) in enumerate(STEPS):
        plan = build_step_plan(ours.layout, hist + q, q, max_num_seqs=4, min_tokens=1, min_world_size=1)
        capacity = plan.num_tokens + 5
        ours.orch.begin_step(plan, ours.layers[0].block_table, chunk_capacity=capacity)
        for l in range(LAYERS):
            kv, pe = ours.chunk(l, hist, q)
            theirs.write(l, plan, kv, pe)
            kv_big = jnp.concatenate([kv, jnp.asarray(junk.standard_normal((5, 512)) * 9, kv.dtype)])
            pe_big = jnp.concatenate([pe, jnp.asarray(junk.standard_normal((5, 64)) * 9, pe.dtype)])
            pointers = [shard.data.unsafe_buffer_pointer() for shard in ours.caches[l].addressable_shards]
            ours.caches[l], ws = ours.orch.write_and_gather(l, ours.caches[l], kv_big, pe_big, signal=signal)
            assert [shard.data.unsafe_buffer_pointer() for shard in ours.caches[l].addressable_shards] == pointers, (s, l)
            want = dcp_scenario.expected_workspace(ours.layers[l], seq_lens=hist + q, plan=plan)
            np.testing.assert_array_equal(np.asarray(jnp.copy(ws))[:len(want)], want, err_msg=f"step {s} layer {l}")
            # copied before the host read: a zero-copy view would pin the cache (see run_layers)
            np.testing.assert_array_equal(np.asarray(jnp.copy(ours.caches[l])), np.asarray(theirs.caches[l]),
                                          err_msg=f"cache of step {s} layer {l}")
    hows = [how for _, _, how, _ in ours.orch.decisions]
    assert hows == (["sync"] * LAYERS if depth == 0 else ["begin_step"] + ["prefetched"] * LAYERS)


def test_a_write_into_a_still_referenced_slot_loses_no_cache():
    """`write_and_gather` donates the layer's cache.  When the call's ring slot is still pinned
    (here by a DLPack capsule of the workspace it returned a step earlier) it raises
    `SlotStillReferenced`, and the cache is not lost either way: XLA on a GPU refuses the call
    (the given cache stands, unwritten), XLA on a CPU copies the pinned slot and runs it (the
    error's `written` is the written cache, bound to the layer).  With the pin dropped the next
    call continues from that cache and gives the engine's bytes."""
    ours, theirs = Engine(1, "fp8_ds_mla", 0), Engine(1, "fp8_ds_mla", 0)
    ours.caches = [jnp.copy(c) for c in ours.caches]     # JAX's own memory (see the test above)
    plans = [build_step_plan(ours.layout, h + q, q, max_num_seqs=4, min_tokens=1, min_world_size=1)
             for h, q in STEPS]
    ours.orch.begin_step(plans[0], ours.layers[0].block_table)
    chunk = ours.chunk(0, *STEPS[0])
    theirs.write(0, plans[0], *chunk)
    ours.caches[0], ws = ours.orch.write_and_gather(0, ours.caches[0], *chunk)
    pin = ws.__dlpack__()
    del ws
    ours.orch.begin_step(plans[1], ours.layers[0].block_table)
    chunk = ours.chunk(0, *STEPS[1])
    given = ours.caches[0]
    with pytest.raises(SlotStillReferenced, match="slot 0 is still referenced") as raised:
        ours.orch.write_and_gather(0, given, *chunk)
    unwritten = np.array(theirs.caches[0])               # copies: the engine's cache before and after
    theirs.write(0, plans[1], *chunk)
    written = np.array(theirs.caches[0])
    if raised.value.written is None:                     # refused: nothing ran, nothing donated
        kept, want = given, unwritten
    else:                                                # ran: the written cache replaces the donated one
        kept, want = raised.value.written, written
        assert given.is_deleted() and ours.orch.lane().caches[0] is kept
    np.testing.assert_array_equal(np.asarray(jnp.copy(kept)), want)
    del pin
    ours.caches[0], ws = ours.orch.write_and_gather(0, kept, *chunk)
    np.testing.assert_array_equal(np.asarray(jnp.copy(ours.caches[0])), written)
    want = dcp_scenario.expected_workspace(ours.layers[0], seq_lens=STEPS[1][0] + STEPS[1][1], plan=plans[1])
    np.testing.assert_array_equal(np.asarray(jnp.copy(ws))[:len(want)], want)


@pytest.mark.parametrize("kind", sorted(SIGNALS))
@pytest.mark.parametrize("d", [1, 2])
def test_the_layer_program_signals_after_its_patch_and_before_its_prefetches(d, kind):
    """In the compiled program the callback takes the patched slot and returns it, and every
    instruction that reads a prefetched layer's cache depends on the callback's output, so no
    schedule can move any part of a prefetch ahead of the signal; and no slot is copied (see
    `test_a_gather_writes_straight_into_its_ring_slot` for the all-gather's rows)."""
    mesh = mesh_of(d)
    fmt = formats.get("fp8_ds_mla")
    slots = [placement.replicated(mesh, jnp.zeros((d * 1024, 656), jnp.uint8))[0] for _ in range(3)]
    cache = placement.place_caches([np.zeros((8, 64, 656), np.uint8)] * d, mesh)
    plan = build_step_plan(DcpLayout(d, 1, 64), np.array([200 * d]), np.array([32]), min_world_size=1)
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 8), np.int32), mesh, chunk_capacity=64)
    kv, pe = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    hlo = dcp_step.layer_program.lower(slots[0], None, kv, pe, arrays, (cache, cache), tuple(slots[1:]),
                                       mesh=mesh, layout=fmt.layout, implementation="xla",
                                       signal=SIGNALS[kind]()).compile().as_text()
    moved = copies_of_at_least(hlo, d * 1024 * 656)
    assert not [c for c in moved if "dynamic-update-slice" not in c], moved     # no copy of a slot
    assert len(moved) <= (0 if d == 1 else 2), moved     # D > 1: each all-gather's rows, at most once
    traced = jax.make_jaxpr(lambda *a: dcp_step.layer_program(*a, mesh=mesh, layout=fmt.layout,
                                                              implementation="xla", signal=SIGNALS[kind]()))(
        slots[0], None, kv, pe, arrays, (cache, cache), tuple(slots[1:]))
    assert not traced.effects        # an effect would cost every call jax's slow dispatch path
    ins = entry_instructions(hlo)
    target = "callback" if kind == "callback" else "ckv_host_signal"
    callbacks = [n for n, (_, _, line) in ins.items() if "custom-call(" in line and target in line]
    assert len(callbacks) == 1, callbacks
    callback = callbacks[0]

    above = functools.partial(ancestors, ins)

    cache_params = [n for n, (_, _, line) in ins.items() if 'op_name="prefetch_caches' in line]
    assert len(cache_params) == 2, cache_params
    readers = [n for n, (_, ops, _) in ins.items() if set(ops) & set(cache_params)]
    assert readers and all(callback in above(n) for n in readers), readers
    assert all(ins[n][0] > ins[callback][0] for n in readers)
    patched = ins[callback][1][0]           # the callback's first operand: the patched slot
    slot_param = [n for n, (_, _, line) in ins.items() if 'op_name="slot"' in line]
    assert "parameter(" not in ins[patched][2] and slot_param[0] in above(patched)
    root = [n for n, (_, _, line) in ins.items() if line.lstrip().startswith("ROOT")][0]
    assert callback in above(ins[root][1][0])      # the workspace returned is what passed through it


@pytest.mark.parametrize("d", [1, 2])
def test_the_layer_program_writes_its_cache_in_place_before_the_signal(d):
    """With `write_cache` the program writes the donated cache without copying it, and the
    signal takes the written cache, so the write is ordered before what the consumer waits on."""
    mesh = mesh_of(d)
    fmt = formats.get("fp8_ds_mla")
    slots = [placement.replicated(mesh, jnp.zeros((d * 1024, 656), jnp.uint8))[0] for _ in range(2)]
    cache = placement.place_caches([np.zeros((64, 64, 656), np.uint8)] * d, mesh)    # 2.7 MB a rank
    plan = build_step_plan(DcpLayout(d, 1, 64), np.array([200 * d]), np.array([32]), min_world_size=1)
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 64), np.int32), mesh, chunk_capacity=64)
    kv, pe = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    hlo = dcp_step.layer_program.lower(slots[0], None, kv, pe, arrays, (cache,), tuple(slots[1:]), cache,
                                       mesh=mesh, layout=fmt.layout, implementation="xla",
                                       signal=SIGNALS["native"]()).compile().as_text()
    assert copies_of_at_least(hlo, 64 * 64 * 656) == []
    ins = entry_instructions(hlo)
    callback = [n for n, (_, _, line) in ins.items() if "custom-call(" in line and "ckv_host_signal" in line][0]
    cache_param = [n for n, (_, _, line) in ins.items() if 'op_name="write_cache"' in line and "parameter(" in line]
    # operands: the workspace, the written cache, and the prefetch's slot (one rank) or local_cu
    assert len(cache_param) == 1 and len(ins[callback][1]) == 3, ins[callback][2]
    written = ins[callback][1][1]            # the callback's second operand: the written cache

    above = functools.partial(ancestors, ins)
    assert cache_param[0] in above(written) | {written}
    with pytest.raises(ValueError, match="gather_written: gathers the cache this program writes; pass write_cache"):
        dcp_step.layer_program.lower(slots[0], cache, kv, pe, arrays, gather_written=True, mesh=mesh, layout=fmt.layout)


def test_the_bound_layer_program_is_the_layer_program_with_its_static_arguments_fixed():
    """The orchestrator dispatches `bound_layer_program`: the program `layer_program` lowers to
    for the same static arguments, one jitted function per distinct set of them (a per-call
    static argument is not one it binds)."""
    mesh = mesh_of(2)
    fmt = formats.get("fp8_ds_mla")
    slots = [placement.replicated(mesh, jnp.zeros((2 * 1024, 656), jnp.uint8))[0] for _ in range(2)]
    cache = placement.place_caches([np.zeros((8, 64, 656), np.uint8)] * 2, mesh)
    plan = build_step_plan(DcpLayout(2, 1, 64), np.array([400]), np.array([32]), min_world_size=1)
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 8), np.int32), mesh, chunk_capacity=64)
    kv, pe = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    statics = dict(mesh=mesh, layout=fmt.layout, implementation="xla")
    bound = dcp_step.bound_layer_program(**statics)
    assert dcp_step.bound_layer_program(implementation="xla", layout=fmt.layout, mesh=mesh_of(2)) is bound
    assert dcp_step.bound_layer_program(**statics, interpret=True) is not bound
    signal = SIGNALS["native"]()
    args = (slots[0], None, kv, pe, arrays, (cache,), tuple(slots[1:]), cache)
    assert bound.lower(*args, signal=signal).as_text() == \
        dcp_step.layer_program.lower(*args, signal=signal, **statics).as_text()
    with pytest.raises(TypeError, match="unexpected keyword argument 'signal'"):
        dcp_step.bound_layer_program(**statics, signal=signal)


def test_chunk_buffers_larger_than_the_step_patch_the_same_bytes():
    """A chunk passed in buffers of more rows than the step has tokens (the torch bridge's
    persistent buffers), whose extra rows hold junk, patches exactly the step's tokens."""
    engine = Engine(2, "nvfp4_ds_mla", depth=1)
    engine.step(*STEPS[0])
    hist, q = STEPS[1]
    plan = build_step_plan(engine.layout, hist + q, q, max_num_seqs=4, min_tokens=1)
    capacity = plan.num_tokens + 13
    engine.orch.begin_step(plan, engine.layers[0].block_table, chunk_capacity=capacity)
    junk = np.random.default_rng(0)
    for l in range(LAYERS):
        kv, pe = engine.chunk(l, hist, q)
        engine.write(l, plan, kv, pe)
        kv_big = jnp.concatenate([kv, jnp.asarray(junk.standard_normal((13, 512)) * 9, kv.dtype)])
        pe_big = jnp.concatenate([pe, jnp.asarray(junk.standard_normal((13, 64)) * 9, pe.dtype)])
        if l:          # layer 0's patch is checked against the step's T rows below
            with pytest.raises(ValueError, match=rf"kv_c: expected \[{capacity}, 512\] \(the chunk buffers' rows\)"):
                engine.orch.gather(l, engine.caches[l], kv, pe)
            engine.orch.enter_layer(l - 1)        # the refused call entered layer l: step back
        ws = engine.orch.gather(l, engine.caches[l], kv_big, pe_big)
        want = dcp_scenario.expected_workspace(engine.layers[l], seq_lens=hist + q, plan=plan)
        np.testing.assert_array_equal(np.asarray(jnp.copy(ws))[:len(want)], want, err_msg=f"layer {l}")
    with pytest.raises(ValueError, match="chunk_capacity: expected an int >= the step's"):
        dcp_step.step_arrays(plan, engine.layers[0].block_table, engine.mesh, chunk_capacity=plan.num_tokens - 1)
