"""A DCP step built for tests: requests with prefix history plus a current chunk, per-rank paged
caches written by the real writer through the DCP slot mapping, and the expected gathered
workspace computed from first principles (naive ownership counting, not DcpLayout)."""
import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import ckv_jax
from ckv_jax import formats
from ckv_jax.dcp_layout import DcpLayout
from ckv_jax.step_plan import build_step_plan


@dataclasses.dataclass
class Scenario:
    layout: DcpLayout
    fmt: formats.RecordFormat
    seq_lens: np.ndarray
    query_lens: np.ndarray
    kv_c: list            # per request bf16[L, 512]
    k_pe: list            # per request bf16[L, 64]
    block_table: np.ndarray
    caches: list          # per rank u8[num_blocks, block_size, R]
    plan: object


def build(world_size, interleave, fmt_name, seq_lens, query_lens, *, block_size=8, seed=0,
          extra_blocks=5, writer="xla", history_only=False, kv_seed=None, written=None, special=()):
    """history_only: leave the current chunk's slots as they were (random bytes), as a cache looks
    before the step's layer writes its chunk; written: per request, how many leading positions
    the caches hold (overrides history_only); special: values ("nan", "inf", "subnormal") to
    scatter into the latents (a few elements per request)."""
    rng = np.random.default_rng(seed)
    layout = DcpLayout(world_size, interleave, block_size)
    fmt = formats.get(fmt_name)
    seq_lens = np.asarray(seq_lens, np.int32)
    query_lens = np.asarray(query_lens, np.int32)
    plan = build_step_plan(layout, seq_lens, query_lens, max_num_seqs=max(8, len(seq_lens)))
    need = [max(1, -(-int(max(layout.local_seq_lens([n])[0])) // block_size)) for n in seq_lens]
    max_blocks = max(need) + 2
    num_blocks = sum(need) + extra_blocks
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), max_blocks), np.int32)
    k = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[k:k + n]
        k += n
        # stale entries past the valid prefix: in-range ids of other requests, or garbage
        table[r, n:] = rng.choice([int(ids[0]), -1, num_blocks + 7, 2 ** 31 - 1], size=max_blocks - n)
    rng = rng if kv_seed is None else np.random.default_rng(kv_seed)    # same table, other values
    kv_c = [(rng.standard_normal((n, 512)) * rng.uniform(0.1, 10)).astype(ml_dtypes.bfloat16) for n in seq_lens]
    k_pe = [rng.standard_normal((n, 64)).astype(ml_dtypes.bfloat16) for n in seq_lens]
    values = {"nan": np.nan, "inf": np.inf, "subnormal": 3e-40}        # 3e-40 is subnormal in bf16
    for name in special:
        for kv in kv_c:
            if kv.size:
                flat = kv.reshape(-1)
                at = rng.integers(0, flat.size, size=3)
                flat[at] = np.array([values[name], -values[name], values[name]]).astype(ml_dtypes.bfloat16)
    caches = []
    for rank in range(world_size):
        cache = jnp.asarray(rng.integers(0, 256, (num_blocks, block_size, fmt.record_bytes), dtype=np.uint8))
        for r, n in enumerate(seq_lens):
            n = written[r] if written is not None else (n - query_lens[r] if history_only else n)
            if n == 0:
                continue
            pos = np.arange(n, dtype=np.int32)
            slots = layout.slot_mapping(pos, np.full(n, r, np.int32), table, rank)
            cache = ckv_jax.write_records(cache, jnp.asarray(kv_c[r][:n]), jnp.asarray(k_pe[r][:n]),
                                          jnp.asarray(slots), fmt, implementation=writer)
        caches.append(np.asarray(cache))
    return Scenario(layout, fmt, seq_lens, query_lens, kv_c, k_pe, table, caches, plan)


def expected_workspace(sc: Scenario, seq_lens=None, plan=None):
    """u8[D * P, R] by naive counting: owner of p is (p // I) % D, local = how many earlier
    positions of the request the owner holds, starts = what earlier requests put on the owner.
    seq_lens/plan: a step that covers only the leading positions (default: the scenario's)."""
    d, i = sc.layout.world_size, sc.layout.interleave
    pad = (plan or sc.plan).padded_tokens
    out = np.zeros((d * pad, sc.fmt.record_bytes), np.uint8)
    filled = np.zeros(d, np.int64)
    for r, n in enumerate(sc.seq_lens if seq_lens is None else seq_lens):
        records = np.asarray(sc.fmt.encode(jnp.asarray(sc.kv_c[r][:n]), jnp.asarray(sc.k_pe[r][:n]))) if n else None
        count = np.zeros(d, np.int64)
        for p in range(n):
            owner = (p // i) % d
            out[owner * pad + filled[owner] + count[owner]] = records[p]
            count[owner] += 1
        filled += count
    return out


def global_records(sc: Scenario):
    """u8[sum(L), R]: every request's records in global token order (no DCP involved)."""
    parts = [np.asarray(sc.fmt.encode(jnp.asarray(kv), jnp.asarray(pe))) for kv, pe in zip(sc.kv_c, sc.k_pe) if len(kv)]
    return np.concatenate(parts) if parts else np.zeros((0, sc.fmt.record_bytes), np.uint8)


def chunk_latents(sc: Scenario):
    """The step's current-chunk latents of all T query tokens, in query order."""
    kv = np.concatenate([sc.kv_c[r][n - q:] for r, (n, q) in enumerate(zip(sc.seq_lens, sc.query_lens))])
    pe = np.concatenate([sc.k_pe[r][n - q:] for r, (n, q) in enumerate(zip(sc.seq_lens, sc.query_lens))])
    return jnp.asarray(kv), jnp.asarray(pe)
