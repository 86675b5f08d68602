"""The torch bridge on CUDA: zero-copy, the graph-capture guard, and ordering under a race."""
import logging
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop
from ckv_jax import dcp_step, formats, full_ckv, placement
from ckv_jax.prefetch_config import GatherConfig
from helpers import copies_of_at_least
from interop import bench, torch_records
from torch_engine_sim import STEPS, TorchEngine

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available() and jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not CUDA:
        pytest.skip("needs torch and JAX on the same CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_round_trip_is_zero_copy(dtype):
    t = torch.randn(64, 64, 41, device="cuda").to(dtype)
    a = interop.to_jax(t, name="t", device=jax.devices()[0])
    assert a.unsafe_buffer_pointer() == t.data_ptr() and list(a.devices())[0].platform == "gpu"
    back = interop.to_torch(a + 0 if dtype == torch.int32 else a)
    if dtype != torch.int32:
        assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_every_entry_raises_under_graph_capture():
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), 1, device="cuda")
    adapter = interop.TorchCkvAdapter(world_size=1, format="fp8_ds_mla", max_num_seqs=4, block_size=16,
                                      config=GatherConfig(enabled=True, depth=1, workspace_mib=0, min_tokens=1,
                                                          max_tokens=512), min_world_size=1)
    hist, q = STEPS[0]
    adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
    kv, pe = engine.chunk(int(q.sum()))
    x = torch.zeros(16, device="cuda")
    z = jnp.zeros(4)                                    # made before: JAX must not allocate under capture
    graph = torch.cuda.CUDAGraph()
    raised = []
    with torch.cuda.graph(graph):
        for call in (lambda: interop.to_jax(kv), lambda: adapter.set_current_chunk(kv, pe),
                     lambda: adapter.gather(0, engine.caches[0]), lambda: adapter.begin_step(hist + q, q, engine.block_table),
                     lambda: interop.to_torch(z)):
            try:
                call()
            except interop.CudaGraphCaptureError:
                raised.append(True)
        x += 1                                          # the captured stock path still works
    assert raised == [True] * 5
    graph.replay()
    torch.cuda.synchronize()
    assert x.sum().item() == 16


def _adapter(depth, ordering=None, native_signal=True, prefetch_programs=None, **kw):
    return interop.TorchCkvAdapter(world_size=1, format="fp8_ds_mla", max_num_seqs=4, block_size=16,
                                   config=GatherConfig(enabled=True, depth=depth, workspace_mib=0, min_tokens=1,
                                                       max_tokens=512), min_world_size=1, ordering=ordering,
                                   native_signal=native_signal, prefetch_programs=prefetch_programs, **kw)


def _step_adapter(depth, **kw):
    """A step-program adapter, after cuBLAS's first matmul: a library torch initializes on first
    use may synchronize the device there while holding the GIL, so that, mid-step, the host
    would wait for the step's program and no watchdog thread could run (a deadlock)."""
    a = torch.ones(64, 64, device="cuda")
    (a @ a).sum().item()
    return _adapter(depth, "step-program", **kw)


def _begin_step_program(adapter, engine, hist, q):
    """begin_step of a step-program adapter on the engine's caches for one step shape: its plan."""
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu(),
                              kv_caches=engine.caches)
    return plan


def _engine_writes_layer(engine, plan, layer, a, matmuls):
    """The layer's latents behind `matmuls` long matmuls on `a`, encoded and written into the
    engine's cache: (a, the chunk's records)."""
    for _ in range(matmuls):
        a = (a @ a).clamp_(-1, 1)
    kv, pe = engine.chunk(plan.num_tokens)
    records = torch_records.encode("fp8_ds_mla", kv, pe)
    engine.write(layer, plan, kv, pe)
    return a, records


def _step_of(layers, timeout_s):
    """A one-GPU engine of `layers` layers, a step-program adapter of depth 1 and STEPS[0]:
    (engine, adapter, plan, begin_step's arguments without the caches)."""
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    hist, q = STEPS[0]
    return (engine, _step_adapter(1, step_timeout_s=timeout_s), engine.plan(hist, q, min_world_size=1),
            (torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu()))


def test_a_prefetch_packs_on_half_the_sms_unless_told_otherwise():
    """The default footprint of a prefetch's pack (every test here runs with it): half the SMs,
    the bounded tiles; 0 the full grid."""
    sms = jax.devices()[0].core_count
    assert sms > 0
    default = _adapter(2)
    full = _adapter(2, prefetch_programs=0)
    assert default.orch.prefetch_tiles == dcp_step.bounded_pack_tiles(sms // 2)
    assert full.orch.prefetch_tiles is None
    default.close()
    full.close()


@pytest.mark.parametrize("depth, ordering", [(d, "cuda-events") for d in range(4)] + [(0, "dlpack"), (2, "dlpack")])
@pytest.mark.parametrize("stream", ["default", "side"])
def test_prefetch_stays_exact_while_torch_writes_and_churns(depth, ordering, stream):
    """Torch delays every cache write and every read of a returned workspace behind long matmuls
    and churns its allocator; JAX's gathers, prefetches and slot reuses must still order right."""
    layers = 6
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(depth, ordering)
    assert adapter.ordering == ordering
    a = torch.randn(4096, 4096, device="cuda")
    for torch_stream, plan, hist, q in _two_rounds_of_steps(engine, stream):
        table = engine.block_table if stream == "default" else engine.block_table.cpu()   # both kinds
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), table)
        got, want = [], []
        for layer in range(layers):
            kv, pe = engine.chunk(plan.num_tokens)
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)             # ~1 ms of torch work before the write
            junk = [torch.empty(1 << 20, device="cuda").fill_(7) for _ in range(8)]   # allocator churn
            del junk
            engine.write(layer, plan, kv, pe)
            snapshot = engine.caches[layer].clone()
            adapter.set_current_chunk(kv, pe)
            ws = adapter.gather(layer, engine.caches[layer])
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)             # the read of ws lands long after the return
            got.append(ws[:adapter.rows].clone())
            want.append(snapshot)
            del ws
        _assert_gathered(engine, plan, torch_stream, got, want, f"depth {depth} {ordering} {stream}")
    adapter.close()


@pytest.mark.parametrize("stream", ["default", "side"])
def test_caches_the_engine_reallocates_are_gathered_from_the_new_memory(stream):
    """With the event ordering: the engine reallocates its caches after two rounds of steps (new
    tensors, other bytes; the old ones dropped at once and torch's allocator churned): the
    prefetches begun from the old tensors are dropped and every workspace is the gather of the
    new cache."""
    layers = 4
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(2, "cuda-events")
    torch_stream = bench.torch_stream(stream)
    steps = STEPS + STEPS + STEPS[-1:]
    with torch.cuda.stream(torch_stream):
        for i, (hist, q) in enumerate(steps):
            if i == len(steps) - 1:
                engine.caches = [torch.randint(0, 256, c.shape, dtype=torch.uint8, device="cuda")
                                 for c in engine.caches]
                for _ in range(16):                      # reuses the memory torch freed
                    torch.empty(1 << 20, device="cuda").fill_(7)
            plan = engine.plan(hist, q, min_world_size=1)
            assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.table_host)
            got, want = [], []
            for layer in range(layers):
                kv, pe = engine.chunk(plan.num_tokens)
                engine.write(layer, plan, kv, pe)
                want.append(engine.caches[layer].clone())
                adapter.set_current_chunk(kv, pe)
                ws = adapter.gather(layer, engine.caches[layer])
                got.append(ws[:adapter.rows].clone())
                del ws
            _assert_gathered(engine, plan, torch_stream, got, want, f"step {i} {stream}")
    # the prefetches begun from the old tensors (at begin_step) were all dropped
    assert [how for _, _, how, _ in adapter.orch.decisions] == ["begin_step"] + ["sync"] * layers
    adapter.close()


def _assert_gathered(engine, plan, torch_stream, got, want, what: str):
    """Once torch's stream is done: each layer's workspace got[l] is the pure-JAX gather of the
    snapshot want[l] of its cache."""
    torch_stream.synchronize()
    for layer, (ws, cache) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(ws.cpu().numpy(), engine.gathered_now(cache, plan), err_msg=f"{what} layer {layer}")


def _two_rounds_of_steps(engine, stream):
    """(torch stream, plan, hist, q) for STEPS twice, run inside torch's `stream` ("default" or
    "side"): the first round discovers the caches, the second prefetches."""
    torch_stream = bench.torch_stream(stream)
    with torch.cuda.stream(torch_stream):
        for _ in range(2):
            for hist, q in STEPS:
                yield torch_stream, engine.plan(hist, q, min_world_size=1), hist, q


@pytest.mark.parametrize("signal", ["native", "callback"])
@pytest.mark.parametrize("depth", range(4))
@pytest.mark.parametrize("stream", ["default", "side"])
def test_latents_marked_before_the_cache_write_keep_every_order(depth, stream, signal):
    """The engine writes its latents into `chunk_buffers()`, marks them (`set_current_chunk`),
    then, behind long matmuls, reads the previous layer's workspace (whose slot this layer's
    prefetch overwrites) and writes the layer's cache.  The patch may start at the mark; the
    sync gathers (depth 0, the first step) must wait for the cache write and the prefetches for
    the read: every workspace read stays exact, with the native signal and the Python one."""
    layers = 5
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(depth, native_signal=signal == "native")
    assert adapter.events.signal.native == (signal == "native")
    a = torch.randn(4096, 4096, device="cuda")
    for torch_stream, plan, hist, q in _two_rounds_of_steps(engine, stream):
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu())
        got, want, previous = [], [], None
        for layer in range(layers):
            kv, pe = engine.chunk(plan.num_tokens)
            kv_c, k_pe = adapter.chunk_buffers()
            kv_c.copy_(kv)
            k_pe.copy_(pe)
            adapter.set_current_chunk(kv_c, k_pe)
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)             # ~1 ms between the mark and the reads
            if previous is not None:
                got.append(previous[:adapter.rows].clone())
                previous = None
            engine.write(layer, plan, kv, pe)
            want.append(engine.caches[layer].clone())
            previous = adapter.gather(layer, engine.caches[layer])
        got.append(previous[:adapter.rows].clone())
        del previous
        _assert_gathered(engine, plan, torch_stream, got, want, f"depth {depth} {stream} {signal}")
    if depth:
        assert {how for _, _, how, _ in adapter.orch.decisions[1:]} == {"prefetched"}
    adapter.close()


@pytest.mark.parametrize("depth", range(4))
@pytest.mark.parametrize("stream", ["default", "side"])
def test_the_adapter_writes_the_cache_in_place_in_every_order(depth, stream):
    """gather(..., write_cache=True): the engine writes its latents into `chunk_buffers()` behind
    long matmuls, marks them, reads the previous layer's workspace behind more matmuls and
    leaves the cache write to the call.  Every workspace read is exact, every cache holds the
    bytes torch's own write gives (read on torch's stream right after the call, in torch's own
    memory), also where the chunk buffers hold more rows than the step."""
    layers = 4
    ours = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    theirs = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(depth)
    pointers = [c.data_ptr() for c in ours.caches]
    a = torch.randn(4096, 4096, device="cuda")
    small = (STEPS[0][0], np.array([2, 2, 2]))       # buffers of 64 rows after the first steps: 6 tokens in them
    for torch_stream, plan, hist, q in list(_two_rounds_of_steps(ours, stream)) + [
            (torch.cuda.current_stream(), ours.plan(*small, min_world_size=1), *small)]:
        with torch.cuda.stream(torch_stream):
            assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), ours.block_table.cpu())
            got, caches, want, a = _written_step(adapter, ours, theirs, plan, a)
            torch_stream.synchronize()
        _assert_written(ours, plan, got, caches, want, f"depth {depth} {stream} T {plan.num_tokens}")
    assert [c.data_ptr() for c in ours.caches] == pointers
    if depth:
        assert {how for _, _, how, _ in adapter.orch.decisions[1:]} == {"prefetched"}
    adapter.close()


def _written_step(adapter, ours, theirs, plan, a, *, copied=()):
    """The layer loop of a begun step whose caches the adapter writes: the engine's latents come
    behind long matmuls (into `chunk_buffers()`, or as its own tensors for the layers in
    `copied`), its read of the previous workspace behind more, `theirs` writes the same chunk
    with torch.  Returns (workspaces read, caches after each call, torch's caches, a)."""
    got, want, caches, previous = [], [], [], None
    for layer in range(ours.layers):
        kv, pe = ours.chunk(plan.num_tokens)
        theirs.chunk(plan.num_tokens)
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)                 # the latents come late
        if layer in copied:
            adapter.set_current_chunk(kv, pe)
        else:
            kv_c, k_pe = adapter.chunk_buffers()
            kv_c.copy_(kv)
            k_pe.copy_(pe)
            adapter.set_current_chunk(kv_c, k_pe)
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)                 # the read of the previous workspace comes late
        if previous is not None:
            got.append(previous[:adapter.rows].clone())
            previous = None
        theirs.write(layer, plan, kv, pe)
        previous = adapter.gather(layer, ours.caches[layer], write_cache=True)
        caches.append(ours.caches[layer].clone())
        want.append(theirs.caches[layer].clone())
    got.append(previous[:adapter.rows].clone())
    return got, caches, want, a


def _assert_written(ours, plan, got, caches, want, what: str):
    """Once torch's stream is done: every cache holds torch's write, every workspace read is the
    pure-JAX gather of it."""
    for layer in range(ours.layers):
        np.testing.assert_array_equal(caches[layer].cpu().numpy(), want[layer].cpu().numpy(),
                                      err_msg=f"cache: {what} layer {layer}")
        np.testing.assert_array_equal(got[layer].cpu().numpy(), ours.gathered_now(want[layer], plan),
                                      err_msg=f"{what} layer {layer}")


def test_a_cache_write_that_misses_the_torch_cache_is_an_error(monkeypatch):
    """The adapter proves the cache write landed in torch's memory: a written cache that is a
    copy (here made so) raises instead of being bound."""
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), 1, device="cuda")
    adapter = _adapter(0)
    hist, q = STEPS[0]
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu())
    real = adapter.orch.write_and_gather
    monkeypatch.setattr(adapter.orch, "write_and_gather",
                        lambda *args, **kw: (lambda cache, ws: (jnp.copy(cache), ws))(*real(*args, **kw)))
    adapter.set_current_chunk(*engine.chunk(plan.num_tokens))
    with pytest.raises(RuntimeError, match="kv_cache: JAX wrote the chunk into a copy at 0x"):
        adapter.gather(0, engine.caches[0], write_cache=True)
    adapter.close()


def test_chunk_buffers_grow_with_the_step_and_stay_exact():
    """The persistent chunk buffers: after a first step that discovers the caches, a 6-token step
    (buffers of 8 rows), a 58-token step (re-allocated and re-imported at 64 rows) and a 37-token
    step (reused, rows past 37 stale), each layer's workspace exact, at depth 2 (every layer
    patched from the buffers).  The 58-token step's latents come as strided views."""
    layers = 3
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(2)
    small = (STEPS[0][0], np.array([2, 2, 2]))      # a pure prefill needs two query tokens per request
    rows = []
    for hist, q in [small, small] + list(STEPS):
        plan = engine.plan(hist, q, min_world_size=1)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu())
        for layer in range(layers):
            kv, pe = engine.chunk(plan.num_tokens)
            engine.write(layer, plan, kv, pe)
            if q is STEPS[0][1]:              # as vLLM hands them: strided views of one [T, 576] tensor
                both = torch.cat([kv, pe], dim=1)
                kv, pe = both[:, :512], both[:, 512:]
                assert not kv.is_contiguous()
            adapter.set_current_chunk(kv, pe)
            ws = adapter.gather(layer, engine.caches[layer])[:adapter.rows].clone()
            np.testing.assert_array_equal(ws.cpu().numpy(), engine.gathered_now(engine.caches[layer], plan),
                                          err_msg=f"T {plan.num_tokens} layer {layer}")
        rows.append(sorted({buffer.shape[0] for buffer, _ in adapter._chunk_buffers.values()}))
    assert rows == [[], [8], [64], [64]]
    with pytest.raises(TypeError, match=r"k_pe: expected one of \['bfloat16'\], got torch.float32"):
        adapter.set_current_chunk(kv, pe.float())
    with pytest.raises(ValueError, match="kv_c: on cpu, expected cuda:0"):
        adapter.set_current_chunk(kv.cpu(), pe)
    assert [how for _, _, how, _ in adapter.orch.decisions] == ["begin_step"] + ["prefetched"] * layers
    adapter.close()


def _device_copies(fn) -> int:
    """Device-to-device copies (torch's copy_ of a chunk, or any XLA copy) while fn() runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "Memcpy DtoD" in e.name)


def test_latents_written_into_the_chunk_buffers_are_taken_without_a_copy():
    """At depth 2 every layer is patched from the chunk buffers.  The engine writes each layer's
    own latents into `chunk_buffers()` behind ~1 ms of matmuls (so a patch that did not wait, or
    read the previous layer's latents, would show); every workspace stays exact, and the layer's
    adapter calls make no device copy (two, one per latent, when other tensors are passed)."""
    layers = 4
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _adapter(2)
    a = torch.randn(4096, 4096, device="cuda")
    copies = {}
    for step, (hist, q) in enumerate(list(STEPS) * 2):
        plan = engine.plan(hist, q, min_world_size=1)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu())
        in_place = step % 2 == 1
        for layer in range(layers):
            kv, pe = engine.chunk(plan.num_tokens)
            engine.write(layer, plan, kv, pe)
            if in_place:
                kv_c, k_pe = adapter.chunk_buffers()
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)
                kv_c.copy_(kv)                        # the engine's projection, written in place
                k_pe.copy_(pe)
            else:
                kv_c, k_pe = kv, pe
            holder = []

            def calls():
                adapter.set_current_chunk(kv_c, k_pe)
                holder.append(adapter.gather(layer, engine.caches[layer]))
            n = _device_copies(calls)
            if step:                                  # the first step only discovers the caches (no patch)
                copies.setdefault(in_place, set()).add(n)
            ws = holder.pop()[:adapter.rows].clone()
            np.testing.assert_array_equal(ws.cpu().numpy(), engine.gathered_now(engine.caches[layer], plan),
                                          err_msg=f"step {step} layer {layer} in place {in_place}")
    assert copies == {False: {2}, True: {0}}
    adapter.close()


def test_the_event_path_is_on_and_uses_jax_compute_stream():
    """The overlap mechanism is really in use: the stream JAX's programs run on (as a
    buffer_callback sees it, in a program of this test) is the one the adapter orders against,
    and the workspaces are the pool's torch memory, written in place; the signal is the native
    one."""
    from jax.experimental.buffer_callback import buffer_callback
    from interop import native_signal
    seen = []
    callback = buffer_callback(lambda ctx, out, x: seen.append(int(ctx.stream)),
                               jax.ShapeDtypeStruct((2,), jnp.float32), input_output_aliases={0: 0})
    jax.block_until_ready(jax.jit(lambda v: callback(v * 3))(jnp.ones((2,), jnp.float32)))
    adapter = _adapter(2)
    assert adapter.ordering == "cuda-events"
    assert adapter.events.signal.native, native_signal.load().why      # the device has a C++ compiler
    assert adapter.events._read_stream is not None         # torch's private stream reader agreed with torch
    assert adapter.events.jax_stream.cuda_stream == seen[0] != 0
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), 3, device="cuda")
    pool = {t.data_ptr() for ring in adapter.orch.pool._tensors for t in ring}
    for hist, q in STEPS:                    # the first step discovers the caches, the second prefetches
        plan = engine.plan(hist, q, min_world_size=1)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu())
        for layer in range(3):
            kv, pe = engine.chunk(plan.num_tokens)
            engine.write(layer, plan, kv, pe)
            adapter.set_current_chunk(kv, pe)
            ws = adapter.gather(layer, engine.caches[layer])
            assert ws.data_ptr() in pool
            with pytest.raises(RuntimeError, match="signalled 0 times"):    # the gather took its one signal
                adapter.events.signal.take()
            del ws
    assert [how for _, _, how, _ in adapter.orch.decisions] == ["begin_step"] + ["prefetched"] * 3
    adapter.events.signal(seen[0] + 1)       # a program on another stream is refused, not waited on
    with pytest.raises(RuntimeError, match="not on JAX's compute stream"):
        adapter.events.signal.take()
    adapter.close()


@pytest.mark.parametrize("ordering", ["cuda-events", "dlpack"])
def test_a_view_held_past_its_slot_reuse_is_an_error(ordering):
    """One slot (depth 0): layer 1 reuses layer 0's.  A sub-view of the returned workspace that
    is still alive makes the reuse raise, before anything is written; dropped, it goes through."""
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), 2, device="cuda")
    adapter = _adapter(0, ordering)
    hist, q = STEPS[0]
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
    kv, pe = engine.chunk(plan.num_tokens)
    adapter.set_current_chunk(kv, pe)
    held = adapter.gather(0, engine.caches[0])[:adapter.rows]       # only a view of the workspace
    before = held.clone()
    adapter.set_current_chunk(kv, pe)
    with pytest.raises(RuntimeError, match="slot 0 is still referenced"):
        adapter.gather(1, engine.caches[1])
    torch.cuda.synchronize()
    assert torch.equal(held, before), "the refused reuse must not have written the slot"
    del held
    adapter.set_current_chunk(kv, pe)
    ws = adapter.gather(1, engine.caches[1])
    assert ws.shape[1] == 656
    del ws
    adapter.close()


def test_without_the_private_api_the_adapter_falls_back_and_says_so(monkeypatch, caplog):
    from interop import stream_handoff
    monkeypatch.setattr(stream_handoff, "_PROBED", {})
    monkeypatch.setitem(sys.modules, "jax.experimental.buffer_callback", None)     # import fails
    with caplog.at_level(logging.WARNING, logger="ckv_jax.interop"):
        adapter = _adapter(1)
    assert adapter.ordering == "dlpack" and adapter.events is None
    assert "falls back to DLPack" in caplog.text and "buffer_callback unavailable" in caplog.text
    with pytest.raises(RuntimeError, match="'cuda-events' is unavailable: .*buffer_callback"):
        _adapter(1, ordering="cuda-events")


def test_without_the_native_signal_the_python_callback_signals_and_says_so(monkeypatch, caplog):
    from interop import native_signal
    monkeypatch.setattr(native_signal, "load", lambda: native_signal.Loaded(None, "no C++ compiler (this test)"))
    with caplog.at_level(logging.WARNING, logger="ckv_jax.interop"):
        adapter = _adapter(1)
    assert adapter.ordering == "cuda-events" and not adapter.events.signal.native
    assert "through a Python callback" in caplog.text and "no C++ compiler (this test)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckv_jax.interop"):
        assert not _adapter(1, native_signal=False).events.signal.native
    assert caplog.text == ""                             # asked for: nothing to warn about


def test_the_gather_program_holds_no_copy_of_the_slot():
    from ckv_jax import dcp_step
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.step_plan import build_step_plan
    mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=jax.devices()[:1])
    slot = placement.replicated(mesh, jnp.zeros((8192, 656), jnp.uint8))[0]
    cache = placement.place_caches([np.zeros((128, 64, 656), np.uint8)], mesh)
    plan = build_step_plan(DcpLayout(1, 1, 64), np.array([8192]), np.array([32]), min_world_size=1)
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 128), np.int32), mesh)
    hlo = dcp_step.gather_program.lower(cache, arrays, slot, None, mesh=mesh, axis_name="dcp",
                                        implementation="pallas_triton", interpret=False).compile().as_text()
    assert copies_of_at_least(hlo, 8192 * 656) == []
    assert "ckv_gather_records" in hlo
    slots = [placement.replicated(mesh, jnp.zeros((8192, 656), jnp.uint8))[0] for _ in range(2)]
    arrays = dcp_step.step_arrays(plan, np.zeros((1, 128), np.int32), mesh, chunk_capacity=64)
    kv, pe = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    hlo = dcp_step.layer_program.lower(slot, None, kv, pe, arrays, (cache, cache), tuple(slots), mesh=mesh,
                                       layout=formats.get("fp8_ds_mla").layout, implementation="pallas_triton",
                                       signal=lambda stream: None).compile().as_text()
    assert copies_of_at_least(hlo, 8192 * 656) == []
    assert hlo.count("ckv_gather_records") >= 2 and "callback" in hlo
    # the adapter's cache write: the donated cache (5.4 MB) is written in place, not copied
    written = placement.place_caches([np.zeros((128, 64, 656), np.uint8)], mesh)
    hlo = dcp_step.layer_program.lower(slot, None, kv, pe, arrays, (cache,), tuple(slots[:1]), written, mesh=mesh,
                                       layout=formats.get("fp8_ds_mla").layout, implementation="pallas_triton",
                                       signal=lambda stream: None).compile().as_text()
    assert copies_of_at_least(hlo, 128 * 64 * 656) == []
    assert hlo.count("ckv_write_records") >= 2 and "callback" in hlo


@pytest.mark.parametrize("ordering, write_cache, remap", [("cuda-events", False, False), ("cuda-events", True, False),
                                                          ("cuda-events", True, True), ("step-program", True, True),
                                                          ("step-program", False, True)])
def test_no_host_synchronization_in_the_layer_loop(ordering, write_cache, remap):
    """torch raises on any synchronizing call in the loop (sync debug mode), and the host
    enqueues a whole step far faster than the GPU runs it, so JAX never blocked either; with the
    cache written by torch or by the adapter, with each layer's top-k remap or without, on
    either ordering (step-program with torch's writes: cache_writes="engine")."""
    layers = 6
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    engine_writes = ordering == "step-program" and not write_cache
    adapter = _step_adapter(2, cache_writes="engine" if engine_writes else "adapter") \
        if ordering == "step-program" else _adapter(2, ordering)
    hist, q = STEPS[0]
    plan = engine.plan(hist, q, min_world_size=1)
    slots = torch.tensor(engine.layout.slot_mapping(plan.positions(), plan.req_id_per_token, engine.table_host, 0),
                         dtype=torch.int64, device="cuda")
    keep = torch.nonzero(slots >= 0).flatten()
    dest = slots[keep]
    seq, qlen, table = torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu()
    chunks = [engine.chunk(plan.num_tokens) for _ in range(layers)]
    every_record = [torch_records.encode("fp8_ds_mla", kv, pe) for kv, pe in chunks]
    records = [r.index_select(0, keep) for r in every_record]
    topk = torch.tensor(np.minimum(np.arange(16)[None, :] * 5, plan.positions()[:, None]), dtype=torch.int32,
                        device="cuda")
    # 20 ms of torch work a layer, and first: a host that waited on the GPU would wait at least
    # that long, twice a step's host time on a slow host (10.4 ms seen on an H100's)
    cycles = _sleep_cycles_per_ms() * 20
    step_caches = dict(kv_caches=engine.caches) if ordering == "step-program" else {}
    spent = {}

    def step():
        torch.cuda._sleep(cycles)                              # queued first: a wait in begin_step would show
        start = time.perf_counter()
        adapter.begin_step(seq, qlen, table, **step_caches)
        spent["begin_step"] = time.perf_counter() - start
        spent["layers' calls"] = 0.0
        for layer in range(layers):
            torch.cuda._sleep(cycles)                          # queued torch work per layer
            if not write_cache:
                engine.caches[layer].view(-1, 656).index_copy_(0, dest, records[layer])
            t0 = time.perf_counter()
            if engine_writes:
                ws = adapter.gather(layer, engine.caches[layer], records=every_record[layer])
            else:
                adapter.set_current_chunk(*chunks[layer])
                ws = adapter.gather(layer, engine.caches[layer], write_cache=write_cache)
            if remap:
                idx, cnt = adapter.remap_topk(topk)
                idx[:1, :1].sum() + cnt[:1].sum()
            spent["layers' calls"] += time.perf_counter() - t0
            ws[:1].sum()
            del ws
        return (time.perf_counter() - start) * 1e3

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        host_ms = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    gpu_start = time.perf_counter()
    torch.cuda.synchronize()
    # any wait of the host on the GPU would last at least the 20 ms of the spin queued first
    parts = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in spent.items())
    assert host_ms < 20, \
        f"the host took {host_ms:.1f} ms to enqueue begin_step and {layers} layers of 20 ms each ({parts})"
    assert (time.perf_counter() - gpu_start) * 1e3 > 60, "the GPU work should still have been queued"
    if remap:
        want_idx, want_cnt = full_ckv.remap_topk(jnp.asarray(topk.cpu().numpy()), plan)
        idx, cnt = adapter.remap_topk(topk)
        np.testing.assert_array_equal(idx.cpu().numpy(), np.asarray(want_idx))
        np.testing.assert_array_equal(cnt.cpu().numpy(), np.asarray(want_cnt))
    adapter.close()


def _sleep_cycles_per_ms():
    """Spin cycles per ms, measured after a first spin has raised the clocks from idle."""
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        rates.append(50_000_000 / start.elapsed_time(end))
    return int(max(rates))


def test_torch_records_on_cuda_are_the_library_encoding():
    from interop import torch_records
    kv = (torch.randn(4096, 512, device="cuda") * torch.rand(4096, 1, device="cuda") * 30).to(torch.bfloat16)
    pe = torch.randn(4096, 64, device="cuda").to(torch.bfloat16)
    fmt = formats.get("fp8_ds_mla")
    want = np.asarray(fmt.encode(interop.to_jax(kv), interop.to_jax(pe)))
    np.testing.assert_array_equal(torch_records.encode(fmt.name, kv, pe).cpu().numpy(), want)


@pytest.mark.parametrize("release_aside", [False, True])
@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("depth", [0, 2])
def test_a_step_program_behind_flags_is_exact_under_a_race_and_writes_nothing_once_abandoned(depth, stream,
                                                                                           release_aside):
    """`dcp_step.step_program` queued ahead with `StepFlags` (each flag written on torch's
    stream, or on the flags' own stream after an event of torch's; torch on its default or a
    side stream): torch writes each layer's own latents into the chunk buffers behind ~10 ms of
    sleep and only then raises the layer's flag; every workspace torch reads after the layer's
    event is the pre-step gather with those latents' records in the chunk rows.  Raising the
    flag before the latents (the control) must differ, and a step abandoned before its program
    ran must leave no flag raised.  A step abandoned after layer 0 leaves the later caches'
    bytes untouched.  XLA runs the program's first dispatch thunk by thunk, records the second
    into a CUDA graph and replays it from the third: the exact steps cover a recording and
    replays."""
    with torch.cuda.stream(bench.torch_stream(stream)):
        _flags_race_and_abandon(depth, release_aside)


def _flags_race_and_abandon(depth, release_aside):
    from interop import bridge, stream_handoff
    from jax.sharding import NamedSharding, PartitionSpec as P
    layers, rows_per_layer = 3, 512
    work = bench.Workload(8192, rows_per_layer, layers, cache_write="adapter")
    device = jax.devices()[0]
    stream = stream_handoff.probe(device).stream
    events = stream_handoff.StreamEvents(torch.device("cuda", 0), stream)
    flags = stream_handoff.StepFlags(torch.device("cuda", 0), events.jax_stream, stream, layers=layers,
                                     release_aside=release_aside)
    mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=[device])
    plan, fmt = work.plan, bench.FMT

    def imported(t, spec):
        local = bridge.to_jax(t, name="buffer", device=device)
        return jax.make_array_from_single_device_arrays(local.shape, NamedSharding(mesh, spec), [local])

    ring_t = [torch.full((plan.padded_tokens, fmt.record_bytes), 0xAB, dtype=torch.uint8, device="cuda")
              for _ in range(depth + 1)]
    kv_t, pe_t = torch.empty_like(work.kv), torch.empty_like(work.pe)
    state = dict(ring=tuple(imported(t, P()) for t in ring_t),
                 caches=tuple(imported(c, P(placement.DCP_AXIS)) for c in work.caches),
                 flags=imported(flags.words, P()))
    chunk = ((imported(kv_t, P()),), (imported(pe_t, P()),))
    arrays = dcp_step.step_arrays(plan, work.table_host.numpy(), mesh, chunk_capacity=plan.num_tokens)
    gen = torch.Generator(device="cuda").manual_seed(4)
    latents = [((torch.randn(work.kv.shape, device="cuda", generator=gen) * 3).to(torch.bfloat16),
                torch.randn(work.pe.shape, device="cuda", generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    replayed = []

    def begin():
        s = torch.cuda.current_stream()
        events.torch_after_jax(s)
        flags.next_step(s)
        events.jax_after_torch(s)
        state["ring"], state["caches"], state["flags"] = dcp_step.step_program(
            state["ring"], state["caches"], state["flags"], *chunk, arrays, depth=depth, mesh=mesh,
            layout=fmt.layout, hooks=flags)
        replayed.append(flags.dispatched() == 0)
        return s

    def run(early: bool):
        """One step; returns the rows of the workspaces torch read that differ from the expected."""
        torch.cuda.synchronize()
        expected = []
        for l in range(layers):
            gathered = dcp_step.gather_program(state["caches"][l], arrays, mesh=mesh)
            want = bridge.to_torch(gathered.addressable_data(0), name="expected").clone()
            want[torch.as_tensor(plan.positions(), device="cuda")] = torch_records.encode(fmt.name, *latents[l])
            expected.append(want)
        seen = [torch.empty_like(e) for e in expected]
        s = begin()
        for l in range(layers):
            if early:
                flags.release(s, l)
            torch.cuda._sleep(10_000_000)
            kv_t.copy_(latents[l][0])
            pe_t.copy_(latents[l][1])
            if not early:
                flags.release(s, l)
            flags.torch_after(s, l)
            seen[l].copy_(ring_t[l % (depth + 1)])
        torch.cuda.synchronize()
        return sum(int((a != b).any(dim=1).sum()) for a, b in zip(seen, expected))

    # every kernel torch launches mid-step launched once before: CUDA's lazy loading of a kernel
    # synchronizes the device, which would wait for a flag the blocked host has not written
    torch.cuda._sleep(1)
    kv_t.copy_(latents[0][0])
    pe_t.copy_(latents[0][1])
    torch.empty_like(ring_t[0]).copy_(ring_t[0])
    # a deadlock fails the test instead of hanging the suite: the step is abandoned after 120 s
    watchdog = threading.Timer(120, lambda: flags.abandon(torch.cuda.current_stream()))
    watchdog.start()
    try:
        assert run(early=False) == 0  # compiles; thunk by thunk
        assert run(early=False) == 0  # recorded
        assert run(early=True) > 0    # the control: the patch read the previous layer's latents
        # a step abandoned before its program was dispatched raises every flag; the next step
        # must not find them raised
        s = torch.cuda.current_stream()
        flags.next_step(s)
        flags.abandon(s)
        assert run(early=False) == 0
        assert replayed == [False, False, True, True], replayed   # the abandoned step dispatched nothing
        # abandoned after layer 0: the chunk's slots made stale first, so a write would show
        for c in work.caches:
            c.view(-1, fmt.record_bytes)[work.slots] ^= 0x5A
        torch.cuda.synchronize()
        before = [c.clone() for c in work.caches]
        s = begin()
        flags.release(s, 0)
        flags.torch_after(s, 0)
        flags.abandon(s)
        events.torch_after_jax(s)
        torch.cuda.synchronize()
        assert not torch.equal(work.caches[0], before[0])
        assert all(torch.equal(work.caches[l], before[l]) for l in range(1, layers))
        with pytest.raises(ValueError, match=r"layer: expected 1 \(layers are released in order\), got 2"):
            begin()
            flags.release(s, 0)
            flags.release(s, 2)
        flags.abandon(s)
        torch.cuda.synchronize()
    finally:
        watchdog.cancel()
        flags.abandon(torch.cuda.current_stream())


# -- the step-program ordering ---------------------------------------------------------------------
@pytest.mark.parametrize("depth", range(4))
@pytest.mark.parametrize("stream", ["default", "side", "priority"])
def test_the_step_program_ordering_is_exact_in_every_order_and_replays(depth, stream):
    """ordering="step-program": the engine writes each layer's latents into `chunk_buffers()`
    behind long matmuls (the first layer's as its own tensors, which the call copies), reads the
    previous layer's workspace behind more matmuls, then calls gather; every workspace read is
    exact and every cache holds the bytes torch's own write gives.  Three rounds of two step
    shapes, each shape's first program executed thunk by thunk."""
    layers = 4
    ours = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    theirs = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _step_adapter(depth, step_timeout_s=120)
    assert adapter.ordering == "step-program"
    pointers = [c.data_ptr() for c in ours.caches]
    a = torch.randn(4096, 4096, device="cuda")
    torch_stream = bench.torch_stream(stream)
    written = []
    for round_ in range(3):
        for hist, q in STEPS:
            with torch.cuda.stream(torch_stream):
                plan = _begin_step_program(adapter, ours, hist, q)
                got, caches, want, a = _written_step(adapter, ours, theirs, plan, a, copied={0})
            written.append((f"depth {depth} {stream} round {round_} T {plan.num_tokens}", plan, got, caches, want))
    torch_stream.synchronize()          # (the checks' JAX gathers once every step is done, none between steps)
    for what, plan, got, caches, want in written:
        _assert_written(ours, plan, got, caches, want, what)
    assert [c.data_ptr() for c in ours.caches] == pointers
    # each shape's first dispatch ran every hook (thunk by thunk), its second recorded the
    # program (the hooks run once more, into the graph); a later one replays it (no hook runs
    # on the host) where every buffer it reads, the step's arrays included, stayed where it was
    runs = adapter.step.hooks_run
    assert runs[:4] == [2 * layers] * 4 and 0 in runs[4:] and set(runs) <= {0, 2 * layers}, runs
    adapter.close()


@pytest.mark.parametrize("depth, patch", [(d, "runs") for d in range(4)] + [(2, "indexed"), (2, "torch runs")])
@pytest.mark.parametrize("stream", ["default", "side", "priority"])
def test_a_step_program_whose_engine_writes_the_caches_is_exact_in_every_order_and_replays(depth, patch, stream,
                                                                                           monkeypatch):
    """cache_writes="engine": per layer the engine's latents come behind long matmuls, it encodes
    them and writes its cache (torch_records), reads the previous layer's workspace behind more
    matmuls, then calls gather with the records (freed at once, so the allocator hands their
    memory to the next layer's); every workspace read is the pure-JAX gather of the cache torch
    wrote.  Three rounds of two step shapes; from a shape's third step on XLA replays the
    program.  torch patches the records in a device copy per run of rows through the driver, by
    torch's `copy_` where the driver's copy is not given (`torch runs`), or (`indexed`, where the
    runs are many) in one indexed copy."""
    if patch == "indexed":
        monkeypatch.setattr(interop.adapter, "MAX_PATCH_RUNS", 0)
    if patch == "torch runs":
        monkeypatch.setattr(interop.native_signal, "memcpy_dtod", lambda: None)
    layers = 4
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _step_adapter(depth, step_timeout_s=120, cache_writes="engine")
    pointers = [c.data_ptr() for c in engine.caches]
    a = torch.randn(4096, 4096, device="cuda")
    torch_stream = bench.torch_stream(stream)
    written = []
    for round_ in range(3):
        for hist, q in STEPS:
            got, caches, previous = [], [], None
            with torch.cuda.stream(torch_stream):
                plan = _begin_step_program(adapter, engine, hist, q)
                for layer in range(layers):
                    a, records = _engine_writes_layer(engine, plan, layer, a, matmuls=4)    # the latents come late
                    for _ in range(4):
                        a = (a @ a).clamp_(-1, 1)               # the read of the previous workspace comes late
                    if previous is not None:
                        got.append(previous[:adapter.rows].clone())
                        previous = None
                    previous = adapter.gather(layer, engine.caches[layer], records=records)
                    del records
                    caches.append(engine.caches[layer].clone())
                got.append(previous[:adapter.rows].clone())
                del previous
            written.append((f"depth {depth} {stream} round {round_} T {plan.num_tokens}", plan, got, caches))
            if depth:
                assert (adapter._patch_runs is None) == (patch == "indexed")
                if patch != "indexed":
                    assert (adapter._device_copy is None) == (patch == "torch runs")
    torch_stream.synchronize()
    for what, plan, got, caches in written:
        for layer in range(layers):
            np.testing.assert_array_equal(got[layer].cpu().numpy(), engine.gathered_now(caches[layer], plan),
                                          err_msg=f"{what} layer {layer}")
    assert [c.data_ptr() for c in engine.caches] == pointers
    runs = adapter.step.hooks_run
    assert runs[:4] == [2 * layers] * 4 and 0 in runs[4:] and set(runs) <= {0, 2 * layers}, runs
    adapter.close()


@pytest.mark.parametrize("stream", ["default", "side"])
def test_a_step_the_engine_abandons_half_way_leaves_the_next_exact(stream):
    """cache_writes="engine" releases each layer on the flags' own stream after an event on
    torch's: a step left after two of four layers, each released behind long matmuls, is
    abandoned by the next begin_step; no late release of the left step may land after the next
    step zeroed its flags (that step's layers would run before torch's writes), so every
    workspace torch read, of the left steps' released layers and the next steps', is the
    gather of the cache torch wrote."""
    layers, depth = 4, 2
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _step_adapter(depth, step_timeout_s=120, cache_writes="engine")
    assert adapter.step.release_aside
    a = torch.randn(4096, 4096, device="cuda")
    torch_stream = bench.torch_stream(stream)
    written = []
    for round_ in range(3):
        for released in (2, layers):
            got, caches = [], []
            with torch.cuda.stream(torch_stream):
                plan = _begin_step_program(adapter, engine, *STEPS[0])
                for layer in range(released):
                    a, records = _engine_writes_layer(engine, plan, layer, a, matmuls=6)    # the release comes late
                    got.append(adapter.gather(layer, engine.caches[layer], records=records)[:adapter.rows].clone())
                    caches.append(engine.caches[layer].clone())
            written.append((f"{stream} round {round_}, {released} layers released", plan, got, caches))
    torch_stream.synchronize()
    assert len(written) == 6
    for what, plan, got, caches in written:
        for layer in range(len(got)):
            np.testing.assert_array_equal(got[layer].cpu().numpy(), engine.gathered_now(caches[layer], plan),
                                          err_msg=f"{what} layer {layer}")
    adapter.close()


@pytest.mark.parametrize("ordering", ["cuda-events", "step-program"])
def test_a_steps_arrays_stay_put_and_a_queued_step_keeps_its_own(ordering):
    """Two steps of the same shapes back to back, the first still queued behind long matmuls
    when the host begins the second: the second step's arrays go into the memory the first's
    programs read (so a recorded program replays), after them on torch's stream, and both
    steps are exact."""
    layers = 3
    ours = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    theirs = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = _step_adapter(2, step_timeout_s=120) if ordering == "step-program" else _adapter(2, ordering)
    a = torch.randn(4096, 4096, device="cuda")
    hist, q = STEPS[0]
    results, pointers = [], []
    for step_hist in (hist, hist + 3):                 # other lengths, the same shapes
        plan = ours.plan(step_hist, q, min_world_size=1)
        caches = dict(kv_caches=ours.caches) if ordering == "step-program" else {}
        assert adapter.begin_step(torch.tensor(step_hist + q), torch.tensor(q), ours.block_table.cpu(), **caches)
        pointers.append([leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(adapter.orch.step_arrays)])
        got, caches, want, a = _written_step(adapter, ours, theirs, plan, a)
        results.append((plan, got, caches, want))
    torch.cuda.synchronize()
    assert pointers[0] == pointers[1]
    for index, (plan, got, caches, want) in enumerate(results):
        _assert_written(ours, plan, got, caches, want, f"{ordering} step {index}")
    adapter.close()


def test_a_step_stalled_by_a_device_synchronization_is_abandoned_and_says_so():
    """A torch.cuda.synchronize() after layer 0's release would wait forever for the step's
    program; the watchdog abandons the step after `step_timeout_s`, the later caches keep their
    bytes, the step's next call raises `StepAbandoned`, and the next step is exact."""
    from interop.step_runner import StepAbandoned
    layers = 3
    engine, adapter, plan, (seq, qlen, table) = _step_of(layers, timeout_s=1.0)
    torch.cuda.synchronize()
    before = [c.clone() for c in engine.caches]
    assert adapter.begin_step(seq, qlen, table, kv_caches=engine.caches)
    adapter.set_current_chunk(*engine.chunk(plan.num_tokens))
    adapter.gather(0, engine.caches[0], write_cache=True)      # (the view dropped at once)
    start = time.perf_counter()
    torch.cuda.synchronize()
    blocked = time.perf_counter() - start
    assert 0.9 < blocked < 30, blocked
    assert not torch.equal(engine.caches[0], before[0])
    assert all(torch.equal(engine.caches[l], before[l]) for l in range(1, layers))
    adapter.set_current_chunk(*engine.chunk(plan.num_tokens))
    with pytest.raises(StepAbandoned, match=r"abandoned at layer 1: no release for 1 s .*layers 1 and later"):
        adapter.gather(1, engine.caches[1], write_cache=True)
    assert adapter.begin_step(seq, qlen, table, kv_caches=engine.caches)
    got, chunks = [], []
    for layer in range(layers):                         # (no JAX work until the step's last gather)
        chunks.append(engine.chunk(plan.num_tokens))
        adapter.set_current_chunk(*chunks[-1])
        ws = adapter.gather(layer, engine.caches[layer], write_cache=True)
        got.append(ws[:adapter.rows].clone())
        del ws
    torch.cuda.synchronize()
    for layer in range(layers):
        engine.write(layer, plan, *chunks[layer])       # what the adapter wrote, once more
        np.testing.assert_array_equal(got[layer].cpu().numpy(), engine.gathered_now(engine.caches[layer], plan))
    adapter.close()


def test_the_step_program_ordering_names_what_it_cannot_take():
    engine, adapter, plan, (seq, qlen, table) = _step_of(3, timeout_s=60)
    with pytest.raises(ValueError, match="kv_caches: the step-program ordering takes every layer's cache at "
                                         "begin_step, got None"):
        adapter.begin_step(seq, qlen, table)
    with pytest.raises(TypeError, match="kv_caches: expected a non-empty sequence of torch caches"):
        adapter.begin_step(seq, qlen, table, kv_caches=engine.caches[0])
    with pytest.raises(ValueError, match="kv_caches: expected one cache tensor of its own per layer"):
        adapter.begin_step(seq, qlen, table, kv_caches=[engine.caches[0]] * 2)
    assert adapter.begin_step(seq, qlen, table, kv_caches=engine.caches)
    records = torch.zeros(64, 656, dtype=torch.uint8, device="cuda")
    attention = (torch.zeros(plan.num_tokens, 16, 576, dtype=torch.bfloat16, device="cuda"), records,
                 torch.zeros(plan.num_tokens, 8, dtype=torch.int32, device="cuda"),
                 torch.zeros(plan.num_tokens, dtype=torch.int32, device="cuda"), 0.1)
    with pytest.raises(RuntimeError, match="sparse_mla_attention: a ckv-jax step program is open on cuda:0"):
        interop.sparse_mla_attention(*attention, format="fp8_ds_mla")       # it would deadlock the step
    with pytest.raises(TypeError, match=r"kv_c_dtype: expected one of \['bfloat16'\] \(the step program"):
        adapter.chunk_buffers(torch.float32)
    kv, pe = engine.chunk(plan.num_tokens)
    adapter.set_current_chunk(kv.float(), pe)
    with pytest.raises(TypeError, match="kv_c: the step-program ordering takes bf16 latents, got torch.float32"):
        adapter.gather(0, engine.caches[0], write_cache=True)
    adapter.set_current_chunk(kv, pe)
    with pytest.raises(ValueError, match=r"write_cache: the step-program ordering writes every layer's cache"):
        adapter.gather(0, engine.caches[0])
    with pytest.raises(ValueError, match=r"layer_idx: expected 0 \(the step program takes its layers in order\), "
                                         r"got 1"):
        adapter.gather(1, engine.caches[1], write_cache=True)
    with pytest.raises(ValueError, match=r"kv_cache: expected the memory begin_step was given as kv_caches\[0\]"):
        adapter.gather(0, engine.caches[0].clone(), write_cache=True)
    with pytest.raises(ValueError, match="lane: the step-program ordering runs one lane, 'target'; got 'draft'"):
        adapter.gather(0, engine.caches[0], write_cache=True, lane="draft")
    held = adapter.gather(0, engine.caches[0], write_cache=True)
    adapter.set_current_chunk(kv, pe)
    with pytest.raises(RuntimeError, match="still referenced"):      # layer 1's release prefetches into its slot
        adapter.gather(1, engine.caches[1], write_cache=True)
    del held
    adapter.close()                                       # abandons the open step: the stream drains
    torch.cuda.synchronize()
    interop.sparse_mla_attention(*attention, format="fp8_ds_mla")           # no step open


def test_a_step_program_whose_engine_writes_the_caches_names_what_it_cannot_take():
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), 2, device="cuda")
    adapter = _step_adapter(1, step_timeout_s=60, cache_writes="engine")
    hist, q = STEPS[0]
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu(),
                              kv_caches=engine.caches)
    t = plan.num_tokens
    records = torch_records.encode("fp8_ds_mla", *engine.chunk(t))
    with pytest.raises(RuntimeError, match="set_current_chunk: this adapter was made with cache_writes='engine'"):
        adapter.set_current_chunk(*engine.chunk(t))
    with pytest.raises(RuntimeError, match="chunk_buffers: this adapter was made with cache_writes='engine'"):
        adapter.chunk_buffers()
    with pytest.raises(ValueError, match="write_cache: with cache_writes='engine' the engine writes the cache"):
        adapter.gather(0, engine.caches[0], write_cache=True, records=records)
    with pytest.raises(TypeError, match=rf"records: expected a torch.Tensor uint8\[{t}, 656\] \(the step's "
                                        r"fp8_ds_mla chunk records\), got NoneType"):
        adapter.gather(0, engine.caches[0])
    with pytest.raises(ValueError, match=rf"records: expected uint8\[{t}, 656\] .*, got torch.uint8\[{t - 1}, 656\]"):
        adapter.gather(0, engine.caches[0], records=records[1:])
    with pytest.raises(ValueError, match=rf"records: expected uint8\[{t}, 656\] .*, got torch.int8\[{t}, 656\]"):
        adapter.gather(0, engine.caches[0], records=records.view(torch.int8))
    with pytest.raises(ValueError, match="records: on cpu, expected cuda:0"):
        adapter.gather(0, engine.caches[0], records=records.cpu())
    adapter.gather(0, engine.caches[0], records=records)      # (the view dropped at once)
    adapter.gather(1, engine.caches[1], records=records)
    adapter.close()


def test_the_step_program_ordering_refuses_lazy_kernel_loading():
    """A process whose CUDA driver loads kernels lazily gets a clear error, not a deadlock."""
    code = ("import interop, jax; from ckv_jax.prefetch_config import GatherConfig\n"
            "try:\n"
            "    interop.TorchCkvAdapter(world_size=1, format='fp8_ds_mla', max_num_seqs=4, min_world_size=1,\n"
            "        config=GatherConfig(enabled=True, depth=1, workspace_mib=0, min_tokens=1, max_tokens=512),\n"
            "        ordering='step-program')\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "refused: ordering: 'step-program' needs CUDA_MODULE_LOADING=EAGER" in done.stdout, \
        done.stdout + done.stderr[-3000:]
