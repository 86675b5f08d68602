"""One rank of the 2-process torch-adapter test (run by test_interop_multiprocess.py): a torch
engine process with one device, its own caches, and `TorchCkvAdapter` over `jax.distributed`.

usage: python mp_adapter_worker.py PROCESS_ID NUM_PROCESSES PORT DEPTH OUT.npz [cpu|cuda] [engine|adapter]

cuda: process i drives GPU i (JAX's local device and torch's device), so the adapter takes its
cuda-events ordering and each layer program's all-gather crosses the GPUs over NCCL.
adapter: the adapter writes each layer's cache (`write_cache=True`); the rank checks it against
a twin engine that writes its own.
"""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS = 3


def main():
    pid, nproc, port, depth, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                    sys.argv[5])
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    writer = sys.argv[7] if len(sys.argv) > 7 else "engine"
    local = dict(local_device_ids=[pid]) if device == "cuda" else {}
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60, **local)
    if device == "cuda":
        torch.cuda.set_device(pid)
        device = f"cuda:{pid}"
    import interop
    from ckv_jax import formats
    from ckv_jax.prefetch_config import GatherConfig
    from torch_engine_sim import STEPS, TorchEngine

    engine = TorchEngine(nproc, pid, formats.get("fp8_ds_mla"), LAYERS, device=device)
    twin = TorchEngine(nproc, pid, formats.get("fp8_ds_mla"), LAYERS, device=device)
    adapter = interop.TorchCkvAdapter(world_size=nproc, format="fp8_ds_mla", max_num_seqs=4, block_size=16,
                                      config=GatherConfig(enabled=True, depth=depth, workspace_mib=0,
                                                          min_tokens=1, max_tokens=512))
    saved = {}
    for s, (hist, q) in enumerate(STEPS):
        plan = engine.plan(hist, q)
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu()), plan.why
        for layer in range(LAYERS):
            kv, pe = engine.chunk(plan.num_tokens)
            twin.chunk(plan.num_tokens)
            twin.write(layer, plan, kv, pe)
            if writer == "engine":
                engine.write(layer, plan, kv, pe)
            adapter.set_current_chunk(kv, pe)
            ws = adapter.gather(layer, engine.caches[layer], write_cache=writer == "adapter")
            assert torch.equal(engine.caches[layer], twin.caches[layer]), f"rank {pid} step {s} layer {layer}"
            saved[f"ws_{s}_{layer}"] = ws[:adapter.rows].cpu().numpy().copy()
            saved[f"cache_{s}_{layer}"] = engine.caches[layer].cpu().numpy().copy()
            del ws
    saved["decisions"] = np.array([str(d) for d in adapter.orch.decisions])
    saved["ordering"] = np.array(adapter.ordering)
    adapter.close()
    np.savez(out, **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
