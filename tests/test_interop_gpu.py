"""The torch bridge on CUDA: zero-copy, the graph-capture guard, and ordering under a race."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop
from ckv_jax import formats, full_ckv
from ckv_jax.prefetch_config import GatherConfig
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


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_stays_exact_while_torch_writes_and_churns(depth):
    """Torch delays every cache write and every read of a returned workspace behind long matmuls
    and churns its allocator; JAX's gathers, prefetches and slot reuses must still order right."""
    layers = 6
    engine = TorchEngine(1, 0, formats.get("fp8_ds_mla"), layers, device="cuda")
    adapter = interop.TorchCkvAdapter(world_size=1, format="fp8_ds_mla", max_num_seqs=4, block_size=16,
                                      config=GatherConfig(enabled=True, depth=depth, workspace_mib=0, min_tokens=1,
                                                          max_tokens=512), min_world_size=1)
    a = torch.randn(4096, 4096, device="cuda")
    mesh = jax.make_mesh((1,), (full_ckv.DCP_AXIS,), devices=jax.devices()[:1])
    for _ in range(2):
        for hist, q in STEPS:
            plan = engine.plan(hist, q, min_world_size=1)
            assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table)
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
            for layer in range(layers):
                expect = full_ckv.all_gather_ckv(full_ckv.place_caches([want[layer].cpu().numpy()], mesh),
                                                 jnp.asarray(engine.block_table.cpu().numpy()), plan, mesh=mesh,
                                                 format="fp8_ds_mla")
                np.testing.assert_array_equal(got[layer].cpu().numpy(), np.asarray(expect),
                                              err_msg=f"depth {depth} layer {layer}")
    adapter.close()


def test_torch_records_on_cuda_are_the_library_encoding():
    from interop import torch_records
    kv = (torch.randn(4096, 512, device="cuda") * torch.rand(4096, 1, device="cuda") * 30).to(torch.bfloat16)
    pe = torch.randn(4096, 64, device="cuda").to(torch.bfloat16)
    fmt = formats.get("fp8_ds_mla")
    want = np.asarray(fmt.encode(interop.to_jax(kv), interop.to_jax(pe)))
    np.testing.assert_array_equal(torch_records.encode(fmt.name, kv, pe).cpu().numpy(), want)
