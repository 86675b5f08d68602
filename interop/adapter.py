"""`TorchCkvAdapter`: the full-CKV gather with depth-N prefetch for a torch engine, called where
upstream's engine calls it.  One process per GPU (as vLLM runs); D > 1 ranks are the processes
of one `jax.distributed` run, whose mesh axis `dcp` spans one device per process.

    adapter = TorchCkvAdapter(world_size=D, format="fp8_ds_mla", max_num_seqs=8,
                              config=GatherConfig(enabled=True, depth=2))   # at model init: plans
    reserve(adapter.pool_bytes)                                              # and allocates the pool
    if adapter.begin_step(seq_lens_cpu, query_lens_cpu, block_table):        # per step
        for layer in range(L):
            ...the engine writes the chunk into kv_caches[layer] (torch)...
            adapter.set_current_chunk(kv_c, k_pe)                            # bf16 [T, 512], [T, 64]
            ws = adapter.gather(layer, kv_caches[layer])                     # torch u8[D * C, R]
            ...attention over ws[:adapter.rows] with adapter.remap_topk(topk)...
    else: ...the stock path...
    adapter.close()

The work of `gather` runs on JAX's stream: the prefetches of layers L+1..L+N overlap torch's
compute of layer L.  Ordering follows `interop.bridge`: each call imports the chunk's latents from
torch's current stream and every JAX computation it dispatches takes them as an input (so it runs
after torch's cache writes and after torch's reads of a reused slot); the returned workspace is
a torch view of the ring slot, exported so that torch's stream waits for the gather and patch.
Torch tensors the calls imported are kept alive until the step is drained (next `begin_step`
or `close`), after torch's stream has waited for every computation that reads them.

The returned view is valid until its ring slot is reused (depth + 1 layers later, or the next
step); drop it before that, or the next reuse raises (the pool never grows).
"""
from __future__ import annotations

import logging

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from ckv_jax import formats, full_ckv
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.prefetch import PrefetchOrchestrator
from ckv_jax.prefetch_config import GatherConfig
from ckv_jax.step_plan import build_step_plan
from interop import bridge

log = logging.getLogger("ckv_jax.interop")


class TorchCkvAdapter:
    """See the module docstring.  `min_world_size=1` runs the full path with D = 1 (tests and
    single-GPU benchmarks); serving leaves it at 2."""

    def __init__(self, *, world_size: int, format: str, max_num_seqs: int, config: GatherConfig,
                 interleave: int = 1, block_size: int = 64, mesh: jax.sharding.Mesh | None = None,
                 ubatches: int = 1, speculative: bool = False, implementation=None, interpret: bool = False,
                 min_world_size: int = 2):
        bridge.check_not_capturing("TorchCkvAdapter")
        if not config.enabled:
            raise ValueError("config: the full-CKV gather is disabled (GatherConfig.enabled / CKV_JAX_GATHER)")
        self.fmt = formats.get(format)
        self.layout = DcpLayout(world_size, interleave, block_size)
        if mesh is None:
            mesh = jax.make_mesh((world_size,), (full_ckv.DCP_AXIS,), devices=jax.devices()[:world_size])
        if mesh.shape.get(full_ckv.DCP_AXIS) != world_size:
            raise ValueError(f"mesh: expected axis {full_ckv.DCP_AXIS!r} of size {world_size}, got {dict(mesh.shape)}")
        local = mesh.local_devices
        if len(local) != 1:
            raise ValueError(f"mesh: expected one device of this process (one process per GPU), got {len(local)}")
        self.mesh, self.device = mesh, local[0]
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.min_world_size = min_world_size
        self.orch = PrefetchOrchestrator(mesh, self.layout, self.fmt.name, max_num_seqs=max_num_seqs, config=config,
                                         ubatches=ubatches, speculative=speculative,
                                         implementation=implementation, interpret=interpret)
        self.plan = None
        self._caches: dict = {}            # (lane, layer) -> (data_ptr, shape, global cache array)
        self._chunk = None
        self._keepalive: list = []         # torch tensors JAX may still read this step

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
    def begin_step(self, seq_lens, query_lens, block_table: torch.Tensor) -> bool:
        """Plan the step; False (and a debug log of why) when it must take the stock path.

        seq_lens, query_lens: host int[R] (tensors on the CPU or arrays; seq_lens include the
        chunk); block_table: int32[R, max_blocks] on this GPU, identical on every rank.
        """
        bridge.check_not_capturing("begin_step")
        self._drain()
        seq_lens = _host_ints("seq_lens", seq_lens)
        query_lens = _host_ints("query_lens", query_lens)
        plan = build_step_plan(self.layout, seq_lens, query_lens, max_num_seqs=self.max_num_seqs,
                               max_tokens=self.config.max_tokens, min_tokens=self.config.min_tokens,
                               min_world_size=self.min_world_size)
        self.plan = plan
        if not self.orch.eligible(plan):
            return False
        table = self._replicated(bridge.to_jax(block_table, name="block_table", device=self.device), block_table)
        self.orch.begin_step(plan, table)
        return True

    def set_current_chunk(self, kv_c: torch.Tensor, k_pe: torch.Tensor):
        """The current chunk's latents of all T tokens of the step (every rank holds them all),
        for the patch of the next `gather`: kv_c bf16[T, 512] and k_pe bf16[T, 64] on this GPU.
        Checked now, imported by `gather` (so the import is also the fresh one that orders it)."""
        self._require_step("set_current_chunk")
        bridge.check_tensor("kv_c", kv_c, self.device)
        bridge.check_tensor("k_pe", k_pe, self.device)
        self._chunk = (kv_c, k_pe)

    def gather(self, layer_idx: int | None, kv_cache: torch.Tensor, *, lane="target",
               after: torch.cuda.Event | torch.cuda.Stream | None = None) -> torch.Tensor:
        """This layer's gathered workspace u8[D * C, R] (rank-major rows, current chunk patched)
        as a torch view, after the layer wrote its chunk into `kv_cache` u8[num_blocks, block_size, R].

        layer_idx None: no lookahead for this call.  after: an event or stream of cache writes
        made on another torch stream than the current one.
        """
        self._require_step("gather")
        if self._chunk is None:
            raise RuntimeError("gather: call set_current_chunk(kv_c, k_pe) for this layer first")
        cache = self._cache(lane, layer_idx, kv_cache)
        bridge.join_stream(kv_cache.device, after)
        # imported now, after the engine's cache write: every computation of this call takes kv_c
        # as an input, which orders it after torch's work so far (writes, and reads of reused slots)
        kv_c, k_pe = (self._replicated(bridge.to_jax(t, name=n, device=self.device), t)
                      for n, t in zip(("kv_c", "k_pe"), self._chunk))
        self._chunk = None
        ws = self.orch.gather(layer_idx, cache, kv_c, k_pe, key=lane, after=kv_c)
        return bridge.to_torch(ws.addressable_shards[0].data, name="workspace")

    def remap_topk(self, topk: torch.Tensor):
        """Global top-k i32[T, K] (positions per request, -1 = none) -> (workspace rows, counts) as
        torch int32 tensors on this GPU (torch's stream waits for them)."""
        self._require_step("remap_topk")
        idx, cnt = full_ckv.remap_topk(bridge.to_jax(topk, name="topk", device=self.device), self.plan)
        return bridge.to_torch(idx, name="indices"), bridge.to_torch(cnt, name="counts")

    def close(self):
        """Wait (on torch's stream) for in-flight work, drop every cache binding and lane."""
        self._drain()
        self.orch.reset()
        self._caches.clear()
        self.plan = None

    reset = close

    # -- internals -------------------------------------------------------------------------------
    def _require_step(self, what):
        bridge.check_not_capturing(what)
        if self.plan is None or not self.plan.eligible:
            raise RuntimeError(f"{what}: no eligible step begun (begin_step returned False or was not called)")

    def _replicated(self, local: jax.Array, tensor: torch.Tensor) -> jax.Array:
        self._keepalive.append(tensor)
        return jax.make_array_from_single_device_arrays(local.shape, NamedSharding(self.mesh, P()), [local])

    def _cache(self, lane, layer_idx, kv_cache: torch.Tensor) -> jax.Array:
        """The global sharded cache u8[D * num_blocks, block_size, R], imported once per tensor."""
        key = (lane, layer_idx)
        held = self._caches.get(key)
        if held is not None and held[0] == kv_cache.data_ptr() and held[1] == tuple(kv_cache.shape):
            return held[2]
        if kv_cache.dim() != 3 or kv_cache.shape[2] != self.fmt.record_bytes:
            raise ValueError(f"kv_cache: expected uint8[num_blocks, block_size, {self.fmt.record_bytes}] for "
                             f"{self.fmt.name}, got {kv_cache.dtype}{list(kv_cache.shape)}")
        local = bridge.to_jax(kv_cache, name="kv_cache", device=self.device)
        shape = (self.layout.world_size * local.shape[0],) + tuple(local.shape[1:])
        cache = jax.make_array_from_single_device_arrays(
            shape, NamedSharding(self.mesh, P(full_ckv.DCP_AXIS)), [local])
        if layer_idx is not None:         # a per-call (no layer index) cache is not kept bound
            self._caches[key] = (kv_cache.data_ptr(), tuple(kv_cache.shape), cache, kv_cache)
        return cache

    def _drain(self):
        """Make torch's stream wait for every JAX computation still reading step inputs (dropped
        prefetches included), then release the torch tensors they read."""
        for ws in self.orch.in_flight():
            bridge.to_torch(ws.addressable_shards[0].data, name="in-flight workspace")
        self._keepalive.clear()
        self._chunk = None


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
