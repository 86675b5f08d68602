"""A torch engine's side of a DCP prefill, for the interop tests: per rank, paged caches that torch
owns and writes itself (interop.torch_records), one shared block table, chunked prefill steps."""
import jax
import jax.numpy as jnp
import numpy as np
import torch

from ckv_jax import full_ckv, placement
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan
from interop import torch_records

# (history, query) per request per step: prefix history, a request that starts late, ragged chunks
STEPS = [(np.array([20, 0, 40]), np.array([17, 23, 18])), (np.array([37, 23, 58]), np.array([8, 17, 12]))]


class TorchEngine:
    def __init__(self, world_size, rank, fmt, layers, *, block_size=16, device="cpu", seed=0):
        self.layout = DcpLayout(world_size, 1, block_size)
        self.rank, self.fmt, self.layers, self.device = rank, fmt, layers, device
        rng = np.random.default_rng(seed)                     # same seed on every rank: same table
        final = STEPS[-1][0] + STEPS[-1][1]
        per_req = [-(-int(self.layout.local_seq_lens([n])[0].max()) // block_size) for n in final]
        num_blocks = sum(per_req) + 3
        ids = rng.permutation(num_blocks)
        table = np.zeros((len(final), max(per_req) + 1), np.int32)
        k = 0
        for r, n in enumerate(per_req):
            table[r, :n] = ids[k:k + n]
            k += n
        self.table_host = table                               # the engine builds metadata on the host
        self.block_table = torch.tensor(table, device=device)
        gen = torch.Generator().manual_seed(1000 + rank)
        # garbage in every slot before the step writes: stale bytes must never reach a workspace
        self.caches = [torch.randint(0, 256, (num_blocks, block_size, fmt.record_bytes), dtype=torch.uint8,
                                     generator=gen).to(device) for _ in range(layers)]
        self.latents = np.random.default_rng(seed + 1)        # identical chunks on every rank

    def plan(self, hist, q, **kw):
        return build_step_plan(self.layout, hist + q, q, max_num_seqs=4, min_tokens=1, max_tokens=512, **kw)

    def chunk(self, num_tokens):
        kv = torch.tensor(self.latents.standard_normal((num_tokens, 512)) * 3, dtype=torch.bfloat16)
        pe = torch.tensor(self.latents.standard_normal((num_tokens, 64)), dtype=torch.bfloat16)
        return kv.to(self.device), pe.to(self.device)

    def write(self, layer, plan, kv, pe):
        """This rank's share of the chunk into its cache of `layer` (the DCP slot mapping)."""
        slots = self.layout.slot_mapping(plan.positions(), plan.req_id_per_token, self.table_host, self.rank)
        torch_records.write(self.caches[layer], torch_records.encode(self.fmt.name, kv, pe), slots)

    def gathered_now(self, cache: torch.Tensor, plan) -> np.ndarray:
        """The pure-JAX answer of a one-rank engine: `cache` (one layer's, after its write, or a
        snapshot of it) gathered now on one device through the engine's block table."""
        mesh = jax.make_mesh((1,), (placement.DCP_AXIS,), devices=jax.devices()[:1])
        return np.asarray(full_ckv.all_gather_ckv(placement.place_caches([cache.cpu().numpy()], mesh),
                                                  jnp.asarray(self.table_host), plan, mesh=mesh, format=self.fmt))
