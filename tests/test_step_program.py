"""`dcp_step.step_program`: a whole step's JAX work as one program, each layer's part behind its
wait hook.  Off a GPU the hooks are JAX functions (or the native handlers, which only count);
the GPU's flag waits are tested in test_interop_gpu.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dcp_scenario
import step_case
from ckv_jax import dcp_step, formats
from helpers import ancestors, copies_of_at_least, entry_instructions, mesh_of
from step_case import HIST, LAYERS, QUERY, CapturingHooks


class CountingHooks:
    """The native handlers (`interop.native_signal`), which off a GPU only count their calls:
    the wait's `flag` attribute and the signal's `ready_event` carry the layer."""

    def __init__(self):
        from interop import native_signal
        loaded = native_signal.load()
        if loaded.library is None:
            pytest.skip(loaded.why)
        self.ns = native_signal
        self.wait_state, self.signal_state = native_signal.new_state(), native_signal.new_state()

    def wait(self, layer, arrays, *, platform):
        return self.ns.wait_flag(arrays, platform=platform, wait_fn=0, capturing_fn=0, flag=layer,
                                 state=self.wait_state)

    def signal(self, layer, arrays, *, platform):
        return self.ns.step_signal(arrays, platform=platform, record_fn=0, capturing_fn=0, ready_event=layer,
                                   state=self.signal_state)


def _step(d, fmt="fp8_ds_mla"):
    """`step_case.step` on a D-device mesh: (mesh, layers, plan, arrays, chunks, caches)."""
    mesh = mesh_of(d)
    return (mesh, *step_case.step(mesh, fmt))


def _assert_every_signal_saw_the_synchronous_workspace(hooks, layers, plan, d) -> int:
    """Each layer's signal saw the workspace of the synchronous path in every gathered row;
    returns those rows' count."""
    rows = d * plan.padded_tokens
    assert sorted(hooks.workspaces) == list(range(LAYERS))
    for l, sc in enumerate(layers):
        want = dcp_scenario.expected_workspace(sc, seq_lens=HIST + QUERY, plan=plan)
        np.testing.assert_array_equal(np.asarray(hooks.workspaces[l])[:rows], want, err_msg=f"layer {l}")
    return rows


@pytest.mark.parametrize("d, depth", [(1, 0), (2, 1), (1, 2), (2, 3)])     # every depth, both rank counts
def test_the_step_program_gives_every_layer_its_synchronous_workspace_and_writes_every_cache(d, depth):
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    fmt = formats.get("fp8_ds_mla")
    hooks = CapturingHooks(depth)
    before = [np.asarray(c) for c in caches]
    ring, written, _ = dcp_step.step_program(
        step_case.ring(mesh, depth, plan), tuple(caches), step_case.flags(mesh),
        tuple(jnp.asarray(kv) for kv, _ in chunks), tuple(jnp.asarray(pe) for _, pe in chunks), arrays,
        depth=depth, mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
    jax.block_until_ready(written)
    rows = _assert_every_signal_saw_the_synchronous_workspace(hooks, layers, plan, d)
    # each cache as the per-layer writer leaves it
    expect = step_case.written_caches(mesh, layers, plan, chunks, [np.split(b, d) for b in before], fmt)
    for l in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(jnp.copy(written[l])), np.asarray(expect[l]), err_msg=f"layer {l}")
    for l in range(max(0, LAYERS - depth - 1), LAYERS):       # the ring ends with the last layers' workspaces
        np.testing.assert_array_equal(np.asarray(jnp.copy(ring[l % (depth + 1)]))[:rows],
                                      np.asarray(hooks.workspaces[l])[:rows])


@pytest.mark.parametrize("d, depth", [(1, 0), (2, 1), (1, 2), (2, 3)])
def test_a_gather_only_step_signals_each_layer_once_its_slot_holds_the_written_cache(d, depth):
    """kv_c and k_pe None: the consumer writes each layer's chunk before its release (here, all
    of them before the step), so the slot a layer's signal names holds exactly the synchronous
    workspace; the program writes no cache and leaves the flags as the hooks set them."""
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    fmt = formats.get("fp8_ds_mla")
    written = step_case.written_caches(mesh, layers, plan, chunks, [sc.caches for sc in layers], fmt)
    before = [np.asarray(c) for c in written]
    hooks = CapturingHooks(depth)
    ring, after, flags = dcp_step.step_program(
        step_case.ring(mesh, depth, plan), tuple(written), step_case.flags(mesh), None, None, arrays, depth=depth,
        mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
    jax.block_until_ready(after)
    _assert_every_signal_saw_the_synchronous_workspace(hooks, layers, plan, d)
    for l in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(jnp.copy(after[l])), before[l], err_msg=f"layer {l}'s cache")
    np.testing.assert_array_equal(np.asarray(flags), np.zeros(LAYERS + 1, np.int32))


@pytest.mark.parametrize("depth", [0, 2])
def test_a_step_released_half_way_writes_no_cache_past_the_release(depth):
    """Layers whose wait reports the step abandoned write nothing into their caches (their
    latents never came); the layers before were written."""
    d = 2
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    fmt = formats.get("fp8_ds_mla")
    before = [np.asarray(c) for c in caches]
    hooks = CapturingHooks(depth, abandoned_from=2)
    _, written, flags = dcp_step.step_program(
        step_case.ring(mesh, depth, plan), tuple(caches), step_case.flags(mesh),
        tuple(jnp.asarray(kv) for kv, _ in chunks), tuple(jnp.asarray(pe) for _, pe in chunks), arrays,
        depth=depth, mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
    for l in range(LAYERS):
        after = np.asarray(jnp.copy(written[l]))
        if l < 2:
            assert (after != before[l]).any(), f"layer {l} was not written"
        else:
            np.testing.assert_array_equal(after, before[l], err_msg=f"layer {l} was written after the release")
    assert int(flags[-1]) == 1                 # the word the hooks set is the program's result


def test_the_step_prefetches_at_most_two_layers_at_a_point_and_each_layer_before_its_wait():
    """`prefetch_points`: [0] before layer 0's wait, [l + 1] after layer l's signal."""
    assert dcp_step.prefetch_points(4, 0) == [[], [], [], [], []]
    assert dcp_step.prefetch_points(4, 1) == [[0], [1], [2], [3], []]
    assert dcp_step.prefetch_points(4, 2) == [[0, 1], [2], [3], [], []]
    assert dcp_step.prefetch_points(4, 3) == [[0, 1], [2, 3], [], [], []]
    assert dcp_step.prefetch_points(8, 4) == [[0, 1], [2, 3], [4, 5], [6], [7], [], [], [], []]
    assert dcp_step.prefetch_points(1, 3) == [[0], []]
    for layers in range(1, 12):
        for depth in range(1, 6):
            points = dcp_step.prefetch_points(layers, depth)
            assert sorted(t for p in points for t in p) == list(range(layers))
            for point, targets in enumerate(points):
                assert len(targets) <= dcp_step.PREFETCHES_AT_ONCE
                # layer t is gathered by its own wait, into a slot whose last layer (t - depth - 1)
                # was released before this point
                assert all(point <= t <= point - 1 + depth for t in targets), (layers, depth, point, targets)


@pytest.mark.parametrize("d, depth", [(1, 1), (2, 2), (1, 3)])
def test_the_step_program_orders_each_layer_behind_its_wait_and_copies_nothing(d, depth):
    """In the compiled program layer l's wait precedes its signal, which precedes layer l + 1's
    wait; every read of a later layer's cache (its prefetch, at the point `prefetch_points`
    gives) follows the signal of the layer that issues it and precedes the next wait, and the
    first prefetches precede layer 0's wait; and no slot, cache or flag word is copied (the
    hooks' buffers stay the caller's, so a recorded CUDA graph stays valid)."""
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    fmt = formats.get("fp8_ds_mla")
    hooks = CountingHooks()
    args = (step_case.ring(mesh, depth, plan), tuple(caches), step_case.flags(mesh), (jnp.asarray(chunks[0][0]),),
            (jnp.asarray(chunks[0][1]),), arrays)
    kw = dict(depth=depth, mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
    hlo = dcp_step.step_program.lower(*args, **kw).compile().as_text()
    cache_bytes = caches[0].size // d
    slot_bytes = args[0][0].size
    moved = copies_of_at_least(hlo, min(cache_bytes, slot_bytes))
    assert not [c for c in moved if "dynamic-update-slice" not in c], moved
    assert len(moved) <= (0 if d == 1 else LAYERS), moved     # D > 1: each all-gather's rows, at most once
    ins = entry_instructions(hlo)
    above = functools.partial(ancestors, ins)

    def calls(target, attr):
        found = {}
        for name, (_, _, line) in ins.items():
            if "custom-call(" in line and target in line:
                found[int(line.split(f"{attr} = ")[1].split(" ")[0])] = name
        return found

    waits, signals = calls("ckv_host_wait_flag", "flag"), calls("ckv_host_step_signal", "ready_event")
    assert sorted(waits) == sorted(signals) == list(range(LAYERS))
    flag_words = f"s32[{LAYERS + 1}]"
    assert not [n for n, (_, _, line) in ins.items() if flag_words in line.split("=")[1] and " copy(" in line]
    cache_params = {int(line.split('op_name="caches[')[1].split("]")[0]): n for n, (_, _, line) in ins.items()
                    if "parameter(" in line and 'op_name="caches[' in line}
    issued = {1: {-1: [0], 0: [1], 1: [2], 2: [3]},            # layer l (-1: the step's start) issues
              2: {-1: [0, 1], 0: [2], 1: [3]},                   # the prefetches of these layers
              3: {-1: [0, 1], 0: [2, 3]}}[depth]
    for l in range(LAYERS):
        assert waits[l] in above(signals[l])
        if l + 1 < LAYERS:
            assert signals[l] in above(waits[l + 1])
    for l, targets in issued.items():
        for t in targets:
            # (a bitcast reads nothing: it names the buffer for the layer's own writer, later)
            readers = [n for n, (_, ops, line) in ins.items()
                       if cache_params[t] in ops and "ckv_host" not in line and " bitcast(" not in line]
            assert readers and all(l < 0 or signals[l] in above(n) for n in readers), (l, t, readers)
            assert all(n in above(waits[l + 1]) for n in readers), (l, t, readers)
    jax.block_until_ready(dcp_step.step_program(*args, **kw))
    assert hooks.wait_state[0] == hooks.signal_state[0] == LAYERS * d     # once per layer and device


@pytest.mark.parametrize("d, depth", [(1, 0), (2, 0), (2, 2)])
def test_a_gather_only_step_reads_each_cache_after_its_release_and_copies_nothing(d, depth):
    """kv_c and k_pe None: every read of layer t's cache follows the wait that releases it
    (layer t - depth's; none for the first depth layers), and its signal follows those reads and
    precedes the next wait; no slot, cache or flag word is copied."""
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    fmt = formats.get("fp8_ds_mla")
    hooks = CountingHooks()
    args = (step_case.ring(mesh, depth, plan), tuple(caches), step_case.flags(mesh), None, None, arrays)
    kw = dict(depth=depth, mesh=mesh, layout=fmt.layout, hooks=hooks, implementation="xla")
    hlo = dcp_step.step_program.lower(*args, **kw).compile().as_text()
    moved = copies_of_at_least(hlo, min(caches[0].size // d, args[0][0].size))
    assert not [c for c in moved if "dynamic-update-slice" not in c], moved
    assert len(moved) <= (0 if d == 1 else LAYERS), moved
    ins = entry_instructions(hlo)
    above = functools.partial(ancestors, ins)

    def calls(target, attr):
        return {int(line.split(f"{attr} = ")[1].split(" ")[0]): name for name, (_, _, line) in ins.items()
                if "custom-call(" in line and target in line}

    waits, signals = calls("ckv_host_wait_flag", "flag"), calls("ckv_host_step_signal", "ready_event")
    assert sorted(waits) == sorted(signals) == list(range(LAYERS))
    assert not [n for n, (_, _, line) in ins.items() if f"s32[{LAYERS + 1}]" in line.split("=")[1] and " copy(" in line]
    cache_params = {int(line.split('op_name="caches[')[1].split("]")[0]): n for n, (_, _, line) in ins.items()
                    if "parameter(" in line and 'op_name="caches[' in line}
    for t in range(LAYERS):
        # (the program's result tuple returns the unwritten cache as it came)
        readers = [n for n, (_, ops, line) in ins.items() if cache_params[t] in ops
                   and "ckv_host" not in line and " bitcast(" not in line and " tuple(" not in line]
        assert readers and all(n in above(signals[t]) for n in readers), (t, readers)
        release = t - depth
        if release >= 0:
            assert all(waits[release] in above(n) for n in readers), (t, readers)
            if release + 1 < LAYERS:
                assert signals[t] in above(waits[release + 1])
        else:
            assert signals[t] in above(waits[0])
    jax.block_until_ready(dcp_step.step_program(*args, **kw))
    assert hooks.wait_state[0] == hooks.signal_state[0] == LAYERS * d


def test_the_step_program_names_a_wrong_ring_chunk_or_flags():
    mesh, layers, plan, arrays, chunks, caches = _step(1)
    fmt = formats.get("fp8_ds_mla")
    kv, pe = (jnp.asarray(chunks[0][0]),), (jnp.asarray(chunks[0][1]),)
    kw = dict(mesh=mesh, layout=fmt.layout, hooks=CapturingHooks(1), implementation="xla")
    ring, flags = step_case.ring(mesh, 1, plan), step_case.flags(mesh)
    with pytest.raises(ValueError, match=r"ring: expected depth \+ 1 = 2 slots, got 3"):
        dcp_step.step_program.lower(step_case.ring(mesh, 2, plan), tuple(caches), flags, kv, pe, arrays, depth=1, **kw)
    with pytest.raises(ValueError, match=r"kv_c, k_pe: expected one chunk buffer pair or one per layer \(4\), got 2"):
        dcp_step.step_program.lower(ring, tuple(caches), flags, kv * 2, pe * 2, arrays, depth=1, **kw)
    with pytest.raises(ValueError, match=r"kv_c, k_pe: expected both chunk buffers or both None \(the consumer "
                                         r"writes the chunk\), got None and buffers"):
        dcp_step.step_program.lower(ring, tuple(caches), flags, None, pe, arrays, depth=1, **kw)
    with pytest.raises(ValueError, match=r"flags: expected int32\[5\] \(a word a layer and the abandon word\), "
                                         r"got uint32\[5\]"):
        dcp_step.step_program.lower(ring, tuple(caches), flags.astype(jnp.uint32), kv, pe, arrays, depth=1, **kw)


def test_the_step_hooks_name_a_wrong_state():
    from interop import native_signal
    import array
    CountingHooks()                         # skips without the native library
    x = jnp.zeros(4, jnp.uint8)
    with pytest.raises(TypeError, match=r"state: expected new_state\(\)"):
        native_signal.wait_flag((x,), platform="cpu", wait_fn=0, capturing_fn=0, flag=0,
                                state=array.array("I", [0, 0]))
    with pytest.raises(TypeError, match=r"state: expected new_state\(\)"):
        native_signal.step_signal((x,), platform="cpu", record_fn=0, capturing_fn=0, ready_event=0, state=[0, 0])


@pytest.mark.slow
def test_two_processes_run_the_step_program_as_one_process_of_two_devices(tmp_path):
    """Real `jax.distributed` processes of one CPU device each (mp_step_worker.py), for both
    writers: in each process every layer's signalled workspace is the synchronous path's, its
    shard of every cache is the per-layer writer's, its ring ends with the last layers'
    workspaces and no flag word was set."""
    from helpers import run_workers
    outs = [tmp_path / f"rank{pid}.npz" for pid in range(2)]
    procs, logs = run_workers("mp_step_worker.py", lambda pid: [str(outs[pid])])
    for pid, p in enumerate(procs):
        assert p.returncode == 0, logs[pid][-3000:]
    ranks = [np.load(out) for out in outs]
    d = 2
    mesh, layers, plan, arrays, chunks, caches = _step(d)
    written = step_case.written_caches(mesh, layers, plan, chunks, [sc.caches for sc in layers],
                                       formats.get("fp8_ds_mla"))
    rows = d * plan.padded_tokens
    for writer, depth in step_case.PROCESS_CASES:
        key = f"{writer}_{depth}"
        for rank, saved in enumerate(ranks):
            signalled = CapturingHooks(depth)
            signalled.workspaces = {l: saved[f"{key}_ws_{l}"] for l in range(LAYERS)}
            _assert_every_signal_saw_the_synchronous_workspace(signalled, layers, plan, d)
            for l in range(LAYERS):
                np.testing.assert_array_equal(saved[f"{key}_cache_{l}"], np.asarray(written[l].addressable_data(rank)),
                                              err_msg=f"{key}: rank {rank}'s shard of layer {l}'s cache")
            for l in range(max(0, LAYERS - depth - 1), LAYERS):
                np.testing.assert_array_equal(saved[f"{key}_slot_{l % (depth + 1)}"][:rows],
                                              saved[f"{key}_ws_{l}"][:rows], err_msg=f"{key}: rank {rank}'s slot")
            for i, slot in enumerate(step_case.ring(mesh, depth, plan)):
                # each process's copy of the replicated ring is the host's poison, and the rows
                # past the workspace's keep it
                np.testing.assert_array_equal(saved[f"{key}_poisoned_{i}"], np.asarray(slot.addressable_data(0)))
                np.testing.assert_array_equal(saved[f"{key}_slot_{i}"][rows:], saved[f"{key}_poisoned_{i}"][rows:],
                                              err_msg=f"{key}: rank {rank} wrote slot {i} past the workspace")
            np.testing.assert_array_equal(saved[f"{key}_flags"], np.zeros(LAYERS + 1, np.int32))
