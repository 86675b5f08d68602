"""One rank of the 2-process torch-adapter test (run by test_interop_multiprocess.py): a torch
engine process with one device, its own caches, and `TorchCkvAdapter` over `jax.distributed`.

usage: python mp_adapter_worker.py PROCESS_ID NUM_PROCESSES PORT DEPTH OUT.npz [cpu|cuda] [engine|adapter]
       [step-program]

cuda: process i drives GPU i (JAX's local device and torch's device), so the adapter takes its
cuda-events ordering and each layer program's all-gather crosses the GPUs over NCCL.
adapter: the adapter writes each layer's cache (`write_cache=True`); the rank checks it against
a twin engine that writes its own.
step-program (cuda): the adapter's step-program ordering, whose one program a step holds every
layer's all-gather, each behind the layer's flag; the ranks copy each workspace and cache on
torch's stream and read them once the step is done (a read mid-step would wait for the program,
which waits for the host: the ordering's hazard).
"""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
os.environ["CUDA_MODULE_LOADING"] = "EAGER"         # the step-program ordering's (no lazy load mid-step)
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mp_worker  # noqa: E402

LAYERS = 3


def main():
    # the worker's own arguments first: a GPU worker joins the run with its GPU only
    pid, (depth, out, *options) = int(sys.argv[1]), sys.argv[4:]
    depth = int(depth)
    device = options[0] if options else "cpu"
    writer = options[1] if len(options) > 1 else "engine"
    ordering = options[2] if len(options) > 2 else None
    _, nproc, _ = mp_worker.join(sys.argv, local_device_ids=[pid] if device == "cuda" else None)
    if device == "cuda":
        torch.cuda.set_device(pid)
        device = f"cuda:{pid}"
    import interop
    from ckv_jax import formats
    from ckv_jax.prefetch_config import GatherConfig
    from interop import torch_records
    from torch_engine_sim import STEPS, TorchEngine

    engine = TorchEngine(nproc, pid, formats.get("fp8_ds_mla"), LAYERS, device=device)
    twin = TorchEngine(nproc, pid, formats.get("fp8_ds_mla"), LAYERS, device=device)
    step_program = ordering == "step-program"
    asked = dict(ordering=ordering, cache_writes=writer) if step_program else {}
    adapter = interop.TorchCkvAdapter(world_size=nproc, format="fp8_ds_mla", max_num_seqs=4, block_size=16,
                                      config=GatherConfig(enabled=True, depth=depth, workspace_mib=0,
                                                          min_tokens=1, max_tokens=512), **asked)
    saved = {}
    for s, (hist, q) in enumerate(STEPS):
        plan = engine.plan(hist, q)
        caches = dict(kv_caches=engine.caches) if step_program else {}
        assert adapter.begin_step(torch.tensor(hist + q), torch.tensor(q), engine.block_table.cpu(), **caches), \
            plan.why
        copies = {}                                   # read once the step is done (step-program)
        for layer in range(LAYERS):
            kv, pe = engine.chunk(plan.num_tokens)
            twin.chunk(plan.num_tokens)
            twin.write(layer, plan, kv, pe)
            if writer == "engine":
                engine.write(layer, plan, kv, pe)
            if step_program and writer == "engine":
                ws = adapter.gather(layer, engine.caches[layer],
                                    records=torch_records.encode("fp8_ds_mla", kv, pe))
            else:
                adapter.set_current_chunk(kv, pe)
                ws = adapter.gather(layer, engine.caches[layer], write_cache=writer == "adapter")
            copies[f"ws_{s}_{layer}"] = ws[:adapter.rows].clone()
            copies[f"cache_{s}_{layer}"] = engine.caches[layer].clone()
            del ws
        for name, copy in copies.items():
            saved[name] = copy.cpu().numpy()
        for layer in range(LAYERS):
            assert torch.equal(engine.caches[layer], twin.caches[layer]), f"rank {pid} step {s} layer {layer}"
    saved["decisions"] = np.array([str(d) for d in adapter.orch.decisions])
    saved["ordering"] = np.array(adapter.ordering)
    adapter.close()
    np.savez(out, **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
