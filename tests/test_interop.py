"""The torch bridge and the engine adapter with real torch tensors (CPU here, CUDA on a GPU)."""
import ctypes
import gc
import os
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop
from ckv_jax import formats, full_ckv, placement
from ckv_jax.prefetch_config import GatherConfig
from interop import torch_records
from torch_engine_sim import STEPS, TorchEngine

FP8 = formats.get("fp8_ds_mla")


def one_device_mesh():
    return jax.make_mesh((1,), (placement.DCP_AXIS,), devices=jax.devices()[:1])


# -- bridge ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_round_trip_is_zero_copy_both_ways(dtype):
    t = torch.randn(64, 16, 41).to(dtype) if dtype.is_floating_point else torch.randint(0, 100, (64, 16, 41)).to(dtype)
    a = interop.to_jax(t, name="t")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.dtype == jnp.dtype(str(dtype).replace("torch.", ""))
    back = interop.to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    t.view(torch.uint8).view(-1)[:8] = 7                  # shared memory, not a snapshot
    seen = jax.lax.bitcast_convert_type(a.ravel()[:8] + 0 if dtype == torch.uint8 else a.ravel()[:8], jnp.uint8)
    assert np.asarray(seen).ravel()[:8].tolist() == [7] * 8


def test_every_rejected_input_names_the_argument():
    cache = torch.zeros(8, 16, 656, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"slot_mapping: int64 .*int32_indices"):
        interop.to_jax(torch.zeros(16, dtype=torch.int64), name="slot_mapping")
    with pytest.raises(ValueError, match=r"kv_cache: a non-compact view"):
        interop.to_jax(cache[:, :, :576], name="kv_cache")
    with pytest.raises(ValueError, match=r"kv_cache: data pointer .* not 32-byte aligned"):
        interop.to_jax(cache.view(-1)[1:4097], name="kv_cache")
    with pytest.raises(TypeError, match=r"x: dtype torch.float64"):
        interop.to_jax(torch.zeros(4, dtype=torch.float64), name="x")
    with pytest.raises(ValueError, match=r"q: requires grad"):
        interop.to_jax(torch.zeros(4, requires_grad=True), name="q")
    with pytest.raises(TypeError, match=r"block_table: expected a torch.Tensor, got ndarray"):
        interop.to_jax(np.zeros(4, np.int32), name="block_table")
    with pytest.raises(ValueError, match=r"kv_cache: data pointer .* not 64-byte aligned .*CPU backend would import "
                                         r"a copy"):
        interop.to_jax(cache.view(-1)[32:4128], name="kv_cache")
    with pytest.raises(ValueError, match=r"kv_cache: on cpu, expected the device of JAX's"):
        interop.to_jax(cache, name="kv_cache", device=jax.devices()[1])
    with pytest.raises(ValueError, match=r"single-device"):
        interop.to_torch(placement.replicated(jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2]),
                                             jnp.zeros(4))[0])


def test_int64_indices_convert_only_on_request_and_only_when_they_fit():
    slots = torch.tensor([0, 5, -1, 2 ** 31 - 1], dtype=torch.int64)
    got = interop.int32_indices(slots, name="slot_mapping")
    assert got.dtype == torch.int32 and got.tolist() == slots.tolist()
    with pytest.raises(ValueError, match=r"slot_mapping: values in \[0, 2147483648\] do not fit int32"):
        interop.int32_indices(torch.tensor([0, 2 ** 31]), name="slot_mapping")
    with pytest.raises(TypeError, match="expected int32 or int64"):
        interop.int32_indices(torch.zeros(3, dtype=torch.int16))


def test_torch_records_are_the_library_encoding():
    kv = (torch.randn(200, 512) * torch.rand(200, 1) * 30).to(torch.bfloat16)
    kv[3] = 0
    pe = torch.randn(200, 64).to(torch.bfloat16)
    for name in ("fp8_ds_mla", "bf16"):
        fmt = formats.get(name)
        want = np.asarray(fmt.encode(interop.to_jax(kv), interop.to_jax(pe)))
        got = torch_records.encode(name, kv, pe)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(torch_records.decode(name, got).numpy(), np.asarray(fmt.decode(jnp.asarray(want))))


# -- adapter -----------------------------------------------------------------------------------
def _adapter(depth, engine, **kw):
    cfg = GatherConfig(enabled=True, depth=depth, workspace_mib=0, min_tokens=1, max_tokens=512)
    return interop.TorchCkvAdapter(world_size=engine.layout.world_size, format=engine.fmt.name, max_num_seqs=4,
                                   config=cfg, block_size=engine.layout.block_size, mesh=one_device_mesh(),
                                   min_world_size=1, **kw)


def _adapter_step(adapter, engine, hist, q) -> list[str]:
    """One step of every layer: the engine writes its chunk, the adapter gathers, and each
    workspace must be the pure-JAX gather of the layer's cache now.  Returns the decisions."""
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
    for layer in range(engine.layers):
        kv, pe = engine.chunk(plan.num_tokens)
        engine.write(layer, plan, kv, pe)
        adapter.set_current_chunk(kv, pe)
        ws = adapter.gather(layer, engine.caches[layer])
        assert ws.dtype == torch.uint8 and ws.shape == (adapter.orch.memory.capacity, FP8.record_bytes)
        got = ws[:adapter.rows].numpy().copy()
        del ws                                        # a slot is reused depth + 1 layers later
        np.testing.assert_array_equal(got, engine.gathered_now(engine.caches[layer], plan), err_msg=f"layer {layer}")
    return [how for _, _, how, _ in adapter.orch.decisions]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_adapter_workspaces_equal_the_pure_jax_gather(depth):
    layers = 3
    engine = TorchEngine(1, 0, FP8, layers)
    adapter = _adapter(depth, engine)
    assert adapter.pool_bytes == interop.planned_pool_bytes(world_size=1, format="fp8_ds_mla", max_num_seqs=4,
                                                            config=adapter.config, block_size=16)
    kinds = [_adapter_step(adapter, engine, hist, q) for hist, q in STEPS][-1]
    # the last step: layer 0 is gathered when entered; with lookahead every later layer was prefetched
    assert kinds == ["sync"] + (["sync"] if depth == 0 else ["prefetched"]) * (layers - 1)
    adapter.close()


def test_caches_the_engine_reallocates_are_gathered_from_the_new_memory():
    """An engine that reallocates its caches between steps (new tensors, other bytes): the
    prefetches begun from the old tensors are dropped, every workspace is the gather of the new
    cache, and the old tensors are released once the next step begins."""
    layers = 3
    engine = TorchEngine(1, 0, FP8, layers)
    adapter = _adapter(2, engine)
    for hist, q in STEPS:
        _adapter_step(adapter, engine, hist, q)
    gen = torch.Generator().manual_seed(7)
    old = [weakref.ref(c) for c in engine.caches]
    engine.caches = [torch.randint(0, 256, c.shape, dtype=torch.uint8, generator=gen) for c in engine.caches]
    # layers 1 and 2 had prefetches from the old tensors
    assert _adapter_step(adapter, engine, *STEPS[1]) == ["sync"] * layers
    assert _adapter_step(adapter, engine, *STEPS[1]) == ["sync"] + ["prefetched"] * (layers - 1)
    gc.collect()
    assert not [r for r in old if r() is not None], "the adapter still holds a reallocated cache"
    adapter.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_write_cache_leaves_the_engines_bytes_in_its_own_cache(depth):
    """gather(..., write_cache=True) on the DLPack path: the adapter writes the chunk into the
    engine's torch cache (the same tensor, the bytes torch's own write gives; garbage in the
    other slots stays) and every workspace is the gather of that cache."""
    layers = 3
    ours, theirs = TorchEngine(1, 0, FP8, layers), TorchEngine(1, 0, FP8, layers)
    adapter = _adapter(depth, ours)
    for hist, q in STEPS:
        plan = ours.plan(hist, q, min_world_size=1)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), ours.block_table)
        for layer in range(layers):
            kv, pe = ours.chunk(plan.num_tokens)
            theirs.chunk(plan.num_tokens)                 # keeps the twins' latents in step
            theirs.write(layer, plan, kv, pe)
            pointer = ours.caches[layer].data_ptr()
            adapter.set_current_chunk(kv, pe)
            ws = adapter.gather(layer, ours.caches[layer], write_cache=True)
            got = ws[:adapter.rows].numpy().copy()
            del ws
            assert ours.caches[layer].data_ptr() == pointer
            np.testing.assert_array_equal(ours.caches[layer].numpy(), theirs.caches[layer].numpy())
            np.testing.assert_array_equal(got, ours.gathered_now(ours.caches[layer], plan))
    adapter.set_current_chunk(kv, pe)
    with pytest.raises(TypeError, match="write_cache: expected a bool, got int"):
        adapter.gather(0, ours.caches[0], write_cache=1)
    adapter.close()


def test_chunk_buffers_on_the_dlpack_path_are_fresh_tensors_the_engine_fills():
    """chunk_buffers() before a layer's gather: kv_c and k_pe of the step's T rows, written by the
    engine and taken by set_current_chunk; every workspace exact; a wrong dtype is named."""
    layers = 2
    engine = TorchEngine(1, 0, FP8, layers)
    adapter = _adapter(2, engine)
    with pytest.raises(RuntimeError, match="chunk_buffers: no eligible step begun"):
        adapter.chunk_buffers()
    for hist, q in STEPS:
        plan = engine.plan(hist, q, min_world_size=1)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
        for layer in range(layers):
            kv_c, k_pe = adapter.chunk_buffers()
            assert (kv_c.dtype, tuple(kv_c.shape)) == (torch.bfloat16, (plan.num_tokens, 512))
            assert (k_pe.dtype, tuple(k_pe.shape)) == (torch.bfloat16, (plan.num_tokens, 64))
            kv, pe = engine.chunk(plan.num_tokens)
            kv_c.copy_(kv)
            k_pe.copy_(pe)
            engine.write(layer, plan, kv, pe)
            adapter.set_current_chunk(kv_c, k_pe)
            ws = adapter.gather(layer, engine.caches[layer])
            got = ws[:adapter.rows].numpy().copy()
            del ws
            np.testing.assert_array_equal(got, engine.gathered_now(engine.caches[layer], plan))
    assert adapter.chunk_buffers(torch.float32)[0].dtype == torch.float32
    with pytest.raises(TypeError, match=r"kv_c_dtype: expected one of \['bfloat16', 'float16', 'float32'\], "
                                        r"got torch.int8"):
        adapter.chunk_buffers(torch.int8)
    adapter.close()


def test_adapter_remaps_topk_and_takes_the_stock_path_when_ineligible():
    engine = TorchEngine(1, 0, FP8, 1)
    adapter = _adapter(1, engine)
    hist, q = STEPS[0]
    assert not adapter.begin_step(torch.tensor(hist + np.array([5, 1, 3])), torch.tensor([5, 1, 3]), engine.block_table)
    assert "not a pure prefill" in adapter.plan.why
    with pytest.raises(RuntimeError, match="no eligible step"):
        adapter.set_current_chunk(*engine.chunk(9))
    plan = engine.plan(hist, q, min_world_size=1)
    assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
    with pytest.raises(RuntimeError, match="set_current_chunk"):
        adapter.gather(0, engine.caches[0])
    both = torch.cat(engine.chunk(plan.num_tokens), dim=1)           # the DLPack path imports: compact only
    with pytest.raises(ValueError, match="kv_c: a non-compact view"):
        adapter.set_current_chunk(both[:, :512], both[:, 512:])
    topk = torch.tensor(np.minimum(np.arange(8)[None, :] * 3, plan.positions()[:, None]), dtype=torch.int32)
    idx, cnt = adapter.remap_topk(topk)
    want_idx, want_cnt = full_ckv.remap_topk(jnp.asarray(topk.numpy()), plan)
    np.testing.assert_array_equal(idx.numpy(), np.asarray(want_idx))
    np.testing.assert_array_equal(cnt.numpy(), np.asarray(want_cnt))
    with pytest.raises(ValueError, match="seq_lens: expected host lengths"):
        adapter.begin_step(torch.tensor(hist + q, device="meta"), torch.tensor(q), engine.block_table)


def test_a_workspace_held_past_its_slot_reuse_is_an_error_not_a_new_allocation():
    engine = TorchEngine(1, 0, FP8, 3)
    adapter = _adapter(0, engine)                         # one slot: layer 1 reuses layer 0's
    hist, q = STEPS[0]
    plan = engine.plan(hist, q, min_world_size=1)
    adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
    kv, pe = engine.chunk(plan.num_tokens)
    adapter.set_current_chunk(kv, pe)
    held = adapter.gather(0, engine.caches[0])
    adapter.set_current_chunk(kv, pe)
    with pytest.raises(RuntimeError, match="slot 0 is still referenced"):
        adapter.gather(1, engine.caches[1])
    del held


def test_memory_setup_refuses_a_running_backend_and_configures_a_fresh_process():
    jax.devices()
    with pytest.raises(RuntimeError, match="already running"):
        interop.configure_jax_memory()
    code = ("import interop, os; s = interop.configure_jax_memory(fraction=0.3); import jax; jax.devices(); "
            "print(s['XLA_PYTHON_CLIENT_PREALLOCATE'], os.environ['XLA_CLIENT_MEM_FRACTION'])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0 and proc.stdout.split() == ["false", "0.3000"], proc.stderr
    with pytest.raises(ValueError, match=r"fraction: expected a value in \(0, 1\]"):
        interop.configure_jax_memory(fraction=1.5)


# -- projection-buffer guard --------------------------------------------------------------------
def test_attention_output_layouts_compact_to_token_major():
    t, h, dv = 5, 4, 8
    want = torch.randn(t, h, dv)
    compact = want.clone()
    pitched = torch.zeros(t, h + 3, dv)[:, :h]                      # capacity-pitched token-major
    pitched[:] = want
    head_major = want.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    head_pitched = torch.zeros(h, t + 6, dv)[:, :t].permute(1, 0, 2)
    head_pitched[:] = want
    for out, layout in [(compact, "token-major"), (pitched, "token-major"), (head_major, "head-major"),
                        (head_pitched, "head-major")]:
        assert interop.attention_layout(out, t, h, dv) == layout
        flat = interop.compact_attention_output(out, t, h, dv)
        assert flat.is_contiguous() and torch.equal(flat, want.reshape(t, h * dv))
    assert interop.compact_attention_output(compact, t, h, dv).data_ptr() == compact.data_ptr()   # no copy
    with pytest.raises(ValueError, match=r"strides .* neither token-major"):
        interop.attention_layout(torch.randn(t, dv, h).permute(0, 2, 1), t, h, dv)
    with pytest.raises(ValueError, match=r"expected shape \[T, H, Dv\] = \[5, 4, 8\]"):
        interop.attention_layout(torch.randn(t, h * dv), t, h, dv)


# -- attention over torch tensors ---------------------------------------------------------------
def test_attention_over_torch_tensors_is_the_library_call_on_the_same_memory():
    """interop.sparse_mla_attention equals ckv_jax.sparse_mla_attention on copies of the same
    values, bit for bit (same implementation), with holes, rows past the table, a count of 0
    and counts below K; its outputs are torch tensors of the documented dtypes."""
    import ckv_jax
    rng = np.random.default_rng(11)
    t, h, k, n = 5, 4, 24, 90
    kv = rng.standard_normal((n, 512)).astype(jnp.bfloat16)
    pe = rng.standard_normal((n, 64)).astype(jnp.bfloat16)
    records = np.asarray(FP8.encode(jnp.asarray(kv), jnp.asarray(pe)))
    q = (rng.standard_normal((t, h, 576)) * 2).astype(np.float32)
    indices = rng.integers(0, n, (t, k)).astype(np.int32)
    indices[0, 3] = -1
    indices[1, 5] = n + 7
    counts = np.array([k, 17, 0, 9, k], np.int32)
    out, lse = interop.sparse_mla_attention(torch.tensor(q).to(torch.bfloat16), torch.tensor(records),
                                            torch.tensor(indices), torch.tensor(counts), 0.07, format="fp8_ds_mla")
    assert (out.dtype, tuple(out.shape), lse.dtype, tuple(lse.shape)) == (torch.bfloat16, (t, h, 512), torch.float32,
                                                                          (t, h))
    want = ckv_jax.sparse_mla_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(records), jnp.asarray(indices),
                                        jnp.asarray(counts), 0.07, format="fp8_ds_mla")
    np.testing.assert_array_equal(out.float().numpy(), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(lse.numpy(), np.asarray(want[1]))
    assert np.isneginf(lse[2].numpy()).all() and not out[2].any()            # count 0: an empty row
    assert np.isfinite(lse[[0, 1, 3, 4]].numpy()).all()


def test_attention_over_torch_tensors_names_a_bad_argument():
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    records = torch.zeros(16, 656, dtype=torch.uint8)
    idx, cnt = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"indices: int64 .*int32_indices"):
        interop.sparse_mla_attention(q, records, idx.long(), cnt, 0.1, format="fp8_ds_mla")
    with pytest.raises(TypeError, match=r"records: expected a torch.Tensor, got ndarray"):
        interop.sparse_mla_attention(q, records.numpy(), idx, cnt, 0.1, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"records: .*656"):
        interop.sparse_mla_attention(q, torch.zeros(16, 432, dtype=torch.uint8), idx, cnt, 0.1, format="fp8_ds_mla")
    with pytest.raises(ValueError, match=r"sm_scale: expected a positive finite number"):
        interop.sparse_mla_attention(q, records, idx, cnt, -1.0, format="fp8_ds_mla")


# -- ordering protocol -------------------------------------------------------------------------
def test_cpu_tensors_take_the_dlpack_path_and_events_are_refused():
    engine = TorchEngine(1, 0, FP8, 1)
    assert _adapter(1, engine).ordering == "dlpack"
    with pytest.raises(ValueError, match=r"ordering: 'cuda-events' needs a CUDA device, got JAX's"):
        _adapter(1, engine, ordering="cuda-events")
    with pytest.raises(ValueError, match=r"ordering: 'step-program' needs a CUDA device, got JAX's"):
        _adapter(1, engine, ordering="step-program")
    with pytest.raises(ValueError, match=r"ordering: 'step-program' runs one lane, got ubatches=2"):
        _adapter(1, engine, ordering="step-program", ubatches=2)
    with pytest.raises(ValueError, match=r"ordering: expected one of \(None, 'cuda-events', 'dlpack', "
                                         r"'step-program'\), got 'nccl'"):
        _adapter(1, engine, ordering="nccl")
    with pytest.raises(ValueError, match=r"cache_writes: expected one of \('adapter', 'engine'\), got 'torch'"):
        _adapter(1, engine, cache_writes="torch")
    with pytest.raises(ValueError, match=r"cache_writes: 'engine' is the step-program ordering's \(the others take "
                                         r"write_cache per gather\), got ordering=None"):
        _adapter(1, engine, cache_writes="engine")
    adapter = _adapter(1, engine)
    hist, q = STEPS[0]
    with pytest.raises(ValueError, match="records: only an adapter made with cache_writes='engine' takes"):
        adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
        adapter.set_current_chunk(*engine.chunk(int(q.sum())))
        adapter.gather(0, engine.caches[0], records=torch.zeros(int(q.sum()), 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv_caches: the dlpack ordering takes each layer's cache in gather"):
        adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table, kv_caches=engine.caches)


def test_the_stream_probe_refuses_what_it_cannot_vouch_for(monkeypatch):
    from interop import stream_handoff
    found = stream_handoff.probe(jax.devices("cpu")[0])
    assert found.stream is None and "is not a GPU" in found.why
    assert stream_handoff._version("0.11.2") == (0, 11, 2) and stream_handoff._version("0.12.0rc1") == (0, 12, 0)
    gpu = type("FakeGpu", (), {"platform": "gpu"})()
    monkeypatch.setattr(jax, "__version__", "0.12.0")
    assert "not of the release line whose compute-stream hand-off was checked (0.11.*)" in stream_handoff._probe(gpu).why


def test_the_private_stream_reader_is_used_only_where_it_agrees_with_torch(monkeypatch):
    """`current_stream_reader` takes torch's private reader of the current stream only when it
    exists and names the stream `torch.cuda.current_stream` names; else None (the public call)."""
    from interop import stream_handoff
    public = type("FakeStream", (), dict(stream_id=7, device_index=0, device_type=1))()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: public)

    def reading(value):
        def read(index):
            if isinstance(value, Exception):
                raise value
            return value
        monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", read, raising=False)
        return stream_handoff.current_stream_reader(0)

    reader = reading((7, 0, 1))
    assert reader is not None and reader() == (7, 0, 1)
    assert reading((8, 0, 1)) is None                        # another stream than torch's own answer
    assert reading(RuntimeError("no CUDA")) is None
    monkeypatch.delattr(torch._C, "_cuda_getCurrentStream", raising=False)
    assert stream_handoff.current_stream_reader(0) is None


def test_storage_use_count_sees_every_view():
    from interop import stream_handoff
    slot = torch.zeros(64, 656, dtype=torch.uint8)
    storage = slot.untyped_storage()
    own = stream_handoff.storage_use_count(storage)
    assert own == 2                                     # the tensor and the storage object
    view = slot[:]
    sub = view[:10]
    del view
    assert stream_handoff.storage_use_count(storage) == own + 1, "a view of a view still pins the slot"
    del sub
    assert stream_handoff.storage_use_count(storage) == own


def test_contiguous_runs_cover_every_row_once_and_are_maximal():
    """The engine's patch copies runs of consecutive workspace rows: from the runs, every token's
    row is recovered, and no run continues into the next (that copy would be one too many)."""
    from ckv_jax import dcp_step
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.step_plan import build_step_plan
    from interop.adapter import contiguous_runs
    rng = np.random.default_rng(7)
    cases = [np.array([], np.int32), np.array([5], np.int32), rng.integers(0, 50, 40)]
    for world_size, interleave in ((1, 1), (2, 1), (2, 16), (4, 4)):
        hist = rng.integers(0, 300, 3)
        q = rng.integers(1, 40, 3)
        plan = build_step_plan(DcpLayout(world_size, interleave, 16), hist + q, q, max_num_seqs=3, max_tokens=4096,
                               min_tokens=1, min_world_size=1)
        cases.append(dcp_step.chunk_rows(plan))
    for rows in cases:
        runs = contiguous_runs(rows)
        rebuilt = np.full(len(rows), -1, np.int64)
        for start, end, row in runs:
            assert 0 <= start < end <= len(rows)
            rebuilt[start:end] = np.arange(row, row + end - start)
        assert np.array_equal(rebuilt, rows), rows
        if len(rows):               # consecutive runs in token order, none continuing into the next
            assert [start for start, _, _ in runs] == [0] + [end for _, end, _ in runs[:-1]]
        for (_, end, _), (_, _, next_row) in zip(runs, runs[1:]):
            assert next_row != rows[end - 1] + 1
    assert len(contiguous_runs(dcp_step.chunk_rows(build_step_plan(
        DcpLayout(1, 1, 16), np.array([60, 30]), np.array([20, 30]), max_num_seqs=2, max_tokens=4096, min_tokens=1,
        min_world_size=1)))) == 1   # D = 1: each request's chunk ends its rows, where the next request's begin


@pytest.mark.parametrize("world_size, interleave", [(1, 1), (2, 1), (2, 16)])
def test_the_engines_patch_writes_every_chunk_row_and_nothing_else_by_runs_or_indexed(world_size, interleave):
    """The engine mode's patch of a slot (`patch_chunk`), by runs and by one indexed copy, on a
    poisoned workspace: each chunk row holds its token's record, every other row its poison."""
    from ckv_jax import dcp_step
    from ckv_jax.dcp_layout import DcpLayout
    from ckv_jax.step_plan import build_step_plan
    from interop.adapter import contiguous_runs, patch_chunk
    rng = np.random.default_rng(world_size * 100 + interleave)
    q = rng.integers(1, 40, 3)
    plan = build_step_plan(DcpLayout(world_size, interleave, 16), rng.integers(0, 300, 3) + q, q, max_num_seqs=3,
                           max_tokens=4096, min_tokens=1, min_world_size=1)
    rows = dcp_step.chunk_rows(plan)
    records = rng.integers(0, 256, (plan.num_tokens, 656), dtype=np.uint8)
    poison = rng.integers(0, 256, (world_size * plan.padded_tokens, 656), dtype=np.uint8)   # rank-major
    want = poison.copy()
    want[rows] = records
    copies = []

    def host_copy(into, of, size, stream):      # the driver's device copy, as a host copy of CPU tensors
        copies.append(stream)
        ctypes.memmove(into, of, size)
        return 0
    for how in ("runs", "indexed", "driver"):
        workspace = torch.from_numpy(poison.copy())
        kw = dict(rows=torch.from_numpy(rows.astype(np.int64))) if how == "indexed" else dict(runs=contiguous_runs(rows))
        if how == "driver":
            kw.update(device_copy=host_copy, stream=7)
        patch_chunk(workspace, torch.from_numpy(records), **kw)
        np.testing.assert_array_equal(workspace.numpy(), want, err_msg=how)
    assert copies == [7] * len(contiguous_runs(rows))


def test_the_engines_patch_through_the_driver_checks_every_run_before_it_copies():
    """A run past the records' rows or the workspace's raises before any copy is queued."""
    from interop.adapter import patch_chunk
    records = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (8, 656), dtype=np.uint8))
    copies = []

    def host_copy(into, of, size, stream):
        copies.append((into, of, size))
        return 0
    for runs in ([(0, 4, 0), (4, 9, 10)], [(0, 4, 0), (4, 8, 13)], [(0, 4, -1)], [(3, 3, 0)]):
        workspace = torch.zeros(16, 656, dtype=torch.uint8)
        with pytest.raises(ValueError, match="runs:"):
            patch_chunk(workspace, records, runs=runs, device_copy=host_copy, stream=0)
    assert copies == []
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync failed with CUresult 1"):
        patch_chunk(torch.zeros(16, 656, dtype=torch.uint8), records, runs=[(0, 8, 0)],
                    device_copy=lambda *a: 1, stream=0)
