"""Mosaic GPU sparse-MLA attention over fp8_ds_mla, nvfp4_ds_mla and bf16 records, with wgmma on SM90.

Grid (T, ceil(H / 64)): CTA (t, b) computes heads [64 b, 64 b + 64) of query token t, the wgmma's
M.  A last block of fewer heads (16 or 32 a rank at TP 4-8) still computes 64 rows, but only its
own travel: its Q rows are copied into SMEM as they are (H padded to a multiple of 8 in GMEM at
most), and its output goes out through SMEM, staged where the K tiles were, by a copy of its rows;
no padded copy of Q or of the output is made in GMEM.  Three warpgroups (four with two memory
warpgroups, below):

- the memory warpgroup copies the token's index row into SMEM once, then per tile of `block_k`
  top-k entries issues (as one, or from each of its warps for a quarter of the rows:
  `copy_issuers` 1 or 4) three bulk copies per row (`cp.async.bulk`, no tensor map; a copy must
  move a multiple of 128 bytes, and a ref has one dtype): the NoPE bytes (fp8: e4m3 [0, 512);
  nvfp4: packed e2m1 [0, 256)), the 128 bytes from the scales on (fp8: f32, the tile scales in
  its first four words; nvfp4: u8, the 32 group scales first) and the RoPE (bf16).  An entry
  that is a hole, outside [0, N) or past the token's count copies row 0 instead, so every tile
  receives the same bytes; the compute side masks it out.  Or (`copy_issuers=128`, compiled)
  each of its 128 threads copies its own 16-byte chunks of the tile (`cp.async`, inline PTX in
  `pallas_kernels.mosaic_ptx`): groups of 8 threads read 128 contiguous bytes of a row, a
  thread's four rows, chunk and swizzle fixed, its row indices read from GMEM once a tile, and
  masked entries' chunks written as zeros without a read; each thread arrives once a tile on
  the slot's mbarrier when its copies landed.  One slot: the next tile's copies start once both
  compute warpgroups have moved this one into the K tile.
- compute warpgroup w writes its share of the shared bf16 K tile [block_k, 576] (warpgroup 0
  also the RoPE), rows of masked entries zeroed.  fp8: NoPE parts 2w and 2w + 1 (128 columns
  each), the e4m3 values themselves (exact in bf16), and its parts' float32 tile scales into a
  [4, block_k] table (a value per K row there, re-read as a value per score column).  nvfp4:
  packed bytes [128 w, 128 w + 128), each nibble's e2m1 value times its group's e4m3 scale
  (exact in bf16), the low nibbles (even elements) into the first 256 columns and the high ones
  (odd elements) into the last 256: the queries come in and the output leaves in that order, as
  in the Triton kernel.  After both have written, each computes the scores of its half of the
  tile's entries (`split_scores`; otherwise every score): fp8, five wgmmas (the RoPE and the
  four NoPE parts, each into its own accumulator, so each part's tile scale multiplies its own
  products); nvfp4, one over all 576 columns (the scales are in K).  Then the online softmax in
  float32, the row maxima and the softmax weights (bf16) of both halves exchanged through SMEM;
  then its half of the values: for each of its parts, (P times the part's fp8 scales) in bf16 @
  K[:, part] into a [64, 128] float32 accumulator.  So each warpgroup holds 256 of the 512
  output columns (128 registers a thread), and writes them straight to GMEM at the end, once the
  two have summed their softmax denominators.

Every record value reaches the MMAs exactly, as in the Triton kernel (pallas_triton.py): the
scales multiply the float32 products, and only the softmax weights round to bf16 (split: once
exchanged, and again once multiplied by the part's scale).  Same contract as
`reference.attention_reference`; SM90+ (wgmma, bulk copies).

bf16 records skip the raw slot: the memory warpgroup copies each record straight into the K tile:
with bulk copies, one TMA copy per 128-byte chunk of a row into `k_rows`, a second view of the
same SMEM whose rows are the tile's swizzled 128-byte rows (the swizzle depends on the address
alone; a copy into one row of the tiled view would cut its 8-row tiles), masked entries copying a
row of zeros; with per-thread copies, each 16-byte chunk to its swizzled place.  Without the raw
slot two K tiles fit beside Q (`k_slots=2`) once the token's indices pass through a ring of two
tiles instead of SMEM whole, so the copies of tile i + 1 run during tile i's products.  Split
scores' exchange does not fit beside them and all of Q: there each compute warpgroup holds Q's
RoPE columns in registers (bf16[64, 64], 16 registers a thread; they arrive through the exchange's
SMEM, which the softmax weights then reuse), and its RoPE scores are a wgmma with A in registers.

fp8 and nvfp4 records converted by the memory warpgroups (`copy_issuers=128`, `k_slots=2`,
compiled; the default, with split scores, `compute_registers=208` and `memory_warpgroups=2`):
their threads load their chunks of each row into registers (the thread mapping of the per-thread
copies), convert them to bf16 (inline PTX, exact: fp8's e4m3 values themselves, whose f32 upper
halves are the bf16; nvfp4's e2m1 values times their group's e4m3 scale) and store them at their
swizzled places in one of two K tiles, the RoPE as it is and fp8's tile scales into a table per K
tile; the compute warpgroups only wait, score and accumulate.  The conversion loop is one warp
per SM sub-partition waiting out its loads, and registers bound how many are in flight (fp8: 159
TFLOP/s with 40 registers a memory thread, 222 with 88, which split scores leave by needing only
208 in each compute warpgroup); a fourth warpgroup doubles those warps: each memory warpgroup
converts half of every tile's rows, with 256 - `compute_registers` registers a thread (the CTA's
512 threads launch with 128 each); the slot barriers count both, and the first alone copies the
ring's indices.

Where it stands (BENCHMARKS.md; T = 4,096, top-k 2,048, 262K records, device timeline): bf16
313 TFLOP/s at 64 heads and 352 at 128 (split scores over two K tiles filled by per-thread
copies; 276.5 with every score in both compute warpgroups; 172 with four issuing warps, where 576
bulk copies a tile, each with its own barrier arrival, were the bound).  fp8 231 at 64 and at 128
heads with two memory warpgroups (one: 224.6 / 224.2 in the sweep that chose two; 146.7 converting in
the compute warpgroups), where its compute warpgroups' five exact score chains are the limit
(ptxas serializes their wgmmas for want of registers, and they spill); nvfp4 239 and 245 (214.9
with one memory warpgroup; 149.2 converting in the compute warpgroups).  The
history with one raw slot: ncu had both compute warpgroups spilling (16M local-memory requests at
T = 256) and 46% of the SMEM wavefronts excessive; then no tile-shaped scale or mask array was
held across the wgmmas, the raw rows were padded off one SMEM bank (excessive wavefronts 1%), and
`split_scores` gave each compute warpgroup half of the tile's entries: half the score wgmmas and
exponentials, the row maxima and the bf16 softmax weights exchanged through SMEM (147.6); four
copy issuers matter there (95.3 with one).  With Q and the output padded to 64 heads in GMEM
fp8's call took 5.44 ms at 16 heads and 5.46 at 32 against 5.18 at 64; without those copies
(about 0.5 GB at 16 heads) 5.10 and 4.94 against 5.03.

Interpret mode (CPU tests) runs the same pipeline, copies, barriers and masks; it has no register
layouts, tiles or swizzles, and its wgmma takes neither a transposed operand nor an accumulator
initialised from a value, so there the loads are plain, bf16's copies write whole rows of the K
tile, and the products are float32 dots of the same SMEM tiles.  It has no inline PTX either: the
per-thread copies run there as one issuer's Pallas copies, and fp8 and nvfp4 records that the
memory warpgroups would convert go through one raw slot, converted by the compute warpgroups.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, record_codec, selection
from pallas_kernels.record_layout import RecordLayout

HEADS_PER_CTA = 64          # the wgmma's M
PART = 128                  # NoPE columns per part (one fp8 scale tile; each compute warpgroup accumulates two)
NUM_PARTS = 4
NOPE_DIM, ROPE_DIM = 512, 64
# The records the kernel reads.  fp8_ds_mla: e4m3 NoPE [0, 512), four f32 tile scales [512, 528),
# bf16 RoPE [528, 656).  nvfp4_ds_mla: e2m1 NoPE [0, 256) (byte b holds elements 2b and 2b + 1),
# 32 e4m3 group scales [256, 288) (one per 16 elements), padding, bf16 RoPE [304, 432)
FP8 = RecordLayout("fp8_tiles", nope_dim=NOPE_DIM, rope_dim=ROPE_DIM, quant_block=PART)
NVFP4 = RecordLayout("nvfp4_groups", nope_dim=NOPE_DIM, rope_dim=ROPE_DIM, quant_block=16, pad_bytes=16)
# bf16: NoPE and RoPE values [0, 1152), copied as they are into the K tile
BF16 = RecordLayout("bf16", nope_dim=NOPE_DIM, rope_dim=ROPE_DIM)
LAYOUTS = (FP8, NVFP4, BF16)
MAX_TOP_K = 4096            # fp8, nvfp4: a token's index row lives in SMEM beside the ~200 KB of tiles
WARPS_PER_WARPGROUP = 4
COPIES_PER_ROW = 3          # the NoPE bytes, the 128 bytes from the scales on, the RoPE
LANES = 128                 # threads of the memory warpgroup
LANE_GROUP = 8              # copy_issuers=128: threads that copy one 128-byte piece of a row together
LANE_GROUPS = LANES // LANE_GROUP
COPY_ISSUERS = (1, WARPS_PER_WARPGROUP, LANES)
COPY_GRANULE = 128          # bytes: every record copy moves a multiple of it
# bf16 records go straight into the K tile (128-byte swizzles): a K row lies in nine 128-byte
# chunks of 64 columns, one copy each
BF16_CHUNK_COLUMNS = 64
BF16_CHUNKS = (NOPE_DIM + ROPE_DIM) // BF16_CHUNK_COLUMNS
K_TILE_BYTES = 8 * COPY_GRANULE     # one [8, 64] tile of a K slot in SMEM: eight swizzled 128-byte rows
# copy_issuers=128: a thread's next row (16 rows on) is two [8, 64] tile rows of a K slot further
K_ROW_STEP = (LANE_GROUPS // 8) * BF16_CHUNKS * K_TILE_BYTES
# nvfp4: packed NoPE bytes converted at a time (the expanded group scales of that many columns
# are float32 registers beside the accumulators)
NVFP4_CONVERT_BYTES = 64
# The raw rows' padding in SMEM: unpadded, their 512 / 128 / 128-byte rows all start in bank 0,
# so the eight rows a warp reads at once in the WGMMA layout hit one bank; 16 bytes (four banks)
# more per row spread them over all 32
ROW_PAD_BYTES = 16
# setmaxnreg's smallest count
MIN_REGISTERS = 24


def register_budget(warpgroups: int) -> int:
    """What setmaxnreg shares among a thread of each of `warpgroups` warpgroups: the CTA launches
    with the 65,536 registers of the SM over its threads in steps of 8 a thread (three
    warpgroups: 168 each, 504 in all; four: 128 each, 512)."""
    return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


@dataclasses.dataclass(frozen=True, slots=True)
class MosaicAttentionTiles:
    block_k: int = 64           # top-k rows per step (the score tile's N)
    # Issuers of the record copies: 1, the memory warpgroup as one (every copy an arrival of all
    # 128 threads on one barrier, after a warpgroup barrier); 4, each warp of it issuing a
    # quarter of the rows onto a barrier of its own (32 threads arrive per copy, no warpgroup
    # barrier per copy; 1.3x to 1.55x faster than 1 at 64 heads); or 128, every thread of it
    # issuing its share of the tile's 16-byte chunks (`cp.async`, `mosaic_ptx`), one arrival per
    # thread and tile.  The first two are bulk copies of whole segments, one thread issuing each.
    copy_issuers: int = WARPS_PER_WARPGROUP
    # True: each compute warpgroup computes the scores of its half of the tile's entries, the row
    # maxima and the bf16 softmax weights exchanged through SMEM (half the score wgmmas and
    # exponentials, half the score registers; on the H200 at 64 heads, fp8 with one raw slot 147.6
    # against 123.8 TFLOP/s, with two K tiles 222.0 against 152.2); False: each computes every
    # score of the tile (and the whole softmax)
    split_scores: bool = True
    # K tiles in flight where the memory warpgroup fills them: bf16 records (copied straight in)
    # and, compiled with copy_issuers=128, fp8 and nvfp4 records (converted there,
    # `converts_in_memory_warpgroup`).  2: the next tile is filled during this one's products.
    # With split scores the SMEM of two 64-row tiles leaves no room for Q's RoPE columns beside
    # the exchange: each compute warpgroup then holds them in registers (`rope_in_registers`).
    # Otherwise (fp8 and nvfp4 with bulk copies or interpreted) the records go through one raw slot,
    # converted by the compute warpgroups into one K tile, whatever this says.
    k_slots: int = 1
    # setmaxnreg of each compute warpgroup; the memory warpgroups share what is left of the SM's
    # registers (`memory_registers`: 40 a thread with the default 232 and one memory warpgroup)
    compute_registers: int = 232
    # Memory warpgroups where they convert the records (`converts_in_memory_warpgroup`): 1, or 2,
    # each converting half of every tile's rows (twice the warps to wait out the loads' latency,
    # each thread with half the rows and fewer registers: the CTA then runs four warpgroups);
    # elsewhere one copies the records (`memory_warpgroups_of`)
    memory_warpgroups: int = 1

    def __post_init__(self):
        selection.check_power_of_two_fields(self, ("block_k",))
        if self.block_k != 64:
            raise ValueError(f"block_k: expected 64 (the WGMMA layout's rows; a wgmma's K groups), got {self.block_k}")
        if self.k_slots not in (1, 2):
            raise ValueError(f"k_slots: expected 1 or 2, got {self.k_slots}")
        if self.copy_issuers not in COPY_ISSUERS:
            raise ValueError(f"copy_issuers: expected one of {COPY_ISSUERS}, got {self.copy_issuers}")
        if not isinstance(self.split_scores, bool):
            raise TypeError(f"split_scores: expected a bool, got {self.split_scores!r}")
        if self.memory_warpgroups not in (1, 2):
            raise ValueError(f"memory_warpgroups: expected 1 or 2, got {self.memory_warpgroups!r}")
        # the kernel runs one memory warpgroup where it does not convert (`memory_warpgroups_of`):
        # the count must leave MIN_REGISTERS to each memory warpgroup either way
        most = min((register_budget(2 + m) - m * MIN_REGISTERS) // 2 for m in range(1, self.memory_warpgroups + 1))
        if not (isinstance(self.compute_registers, int) and self.compute_registers % 8 == 0
                and MIN_REGISTERS <= self.compute_registers <= most):
            raise ValueError(f"compute_registers: expected a multiple of 8 in [{MIN_REGISTERS}, {most}] (each memory "
                             f"warpgroup keeps at least {MIN_REGISTERS}), got {self.compute_registers!r}")

    def memory_registers(self, memory_warpgroups: int = 1) -> int:
        """setmaxnreg of each of `memory_warpgroups` memory warpgroups beside the two compute ones."""
        return (register_budget(2 + memory_warpgroups) - 2 * self.compute_registers) // memory_warpgroups


def copies_into_k(layout: RecordLayout) -> bool:
    """Whether the kernel copies records of `layout` straight into its K tiles (bf16: nothing to
    convert), their indices passing through a ring of tiles instead of the token's whole index row
    in SMEM."""
    return layout.kind == "bf16"


def top_k_fits(layout: RecordLayout, top_k: int) -> bool:
    """Whether a token's top-k of `top_k` entries fits the kernel's SMEM for records of `layout`."""
    return copies_into_k(layout) or top_k <= MAX_TOP_K


def default_tiles(layout: RecordLayout) -> MosaicAttentionTiles:
    """The measured best config for `layout` (BENCHMARKS.md, H200, 64 and 128 heads): split scores
    over two K tiles in flight, filled by the memory warpgroups' threads.  bf16: copied by one
    (317-332 TFLOP/s against 276.5 computing every score in both compute warpgroups).  fp8 and
    nvfp4: converted by two memory warpgroups with 208 registers a compute thread (fp8 231.2 at
    64 heads, 230.3 at 128, against 224.6 and 224.2 with one memory warpgroup; nvfp4 239.8 and
    246.9, against 214.9 with one and 149.2 converting in the compute warpgroups)."""
    if copies_into_k(layout):
        return MosaicAttentionTiles(copy_issuers=LANES, k_slots=2)
    return MosaicAttentionTiles(copy_issuers=LANES, k_slots=2, compute_registers=208, memory_warpgroups=2)


def _bf16_row_of(slot, j, chunk, block_k):
    """The row of k_rows (the K slots seen as 128-byte rows) that holds columns [64 chunk, 64 chunk
    + 64) of row j of K slot `slot`: the slots' [8, 64] tiles lie row-major over (slot, j // 8,
    chunk), eight rows each, and the 128-byte swizzle of a row depends on its address alone."""
    tile = (slot * (block_k // 8) + lax.div(j, 8)) * BF16_CHUNKS + chunk
    return tile * 8 + lax.rem(j, 8)


def _kernel(idx_ref, count_ref, scale_ref, q_ref, rec_u8, rec_scales, rec_bf16, zero_row, out_ref, lse_ref,
            q_smem, idx_smem, raw, k_views, exchange, lane_bars, q_loaded, idx_loaded, raw_bars, tile_syncs, slot_free,
            idx_bars, *, kind, copies, segments, num_records, record_bytes, top_k, block_k, slots, issuers, converted,
            split, rope_in_registers, compute_registers, memory_registers, memory_wgs, num_heads, interpret):
    # idx_ref: i32[T, top_k]; count_ref: i32[T]; scale_ref: f32[1]; q_ref: bf16[T, num_heads, 576]
    # (nvfp4: the NoPE's even elements, then its odd ones)
    # rec_u8 / rec_scales / rec_bf16: the records u8[N, R], viewed as u8, as f32 (fp8: its tile
    # scales) or u8 (nvfp4: its group scales), and as bf16 (bf16: [N, 576]); copies: ((start,
    # width) in each view) of the three copies of a row: NoPE, the COPY_GRANULE bytes from the
    # scales on, RoPE (fp8, nvfp4); zero_row: bf16[1, 576] of zeros (bf16: masked entries' rows)
    # out_ref: [T, num_heads, 512] (bf16 or f32; nvfp4: even elements, then odd); lse_ref: f32[T,
    # 64 * blocks] (a last partial block's other rows are the wrapper's to drop)
    # q_smem: bf16[64, 576] (swizzled; `rope_in_registers`: bf16[64, 512], the RoPE columns
    # arriving in p_smem and held in registers); idx_smem: i32[top_k], the token's index row (bf16: a ring
    # i32[slots, block_k] of the tiles' indices, copied in turn, so that two K tiles fit SMEM)
    # raw (fp8, nvfp4; bf16: empty): nope_raw u8[block_k, NoPE bytes + pad], scale_raw fp8
    # f32[block_k, 32 + pad] (scales in columns 0-3) or nvfp4 u8[block_k, 128 + pad] (scales in
    # columns 0-31), rope_raw bf16[block_k, 64 + pad] (each row padded by ROW_PAD_BYTES)
    # k_views, one SMEM allocation: k_smem bf16[block_k, 576] (swizzled; filled by the memory
    # warpgroups: bf16[slots, block_k, 576]); bf16, compiled: k_rows bf16[slots * block_k * 9,
    # 64], the same bytes seen as swizzled 128-byte rows, each the target of one row's 64 columns
    # (`_bf16_row_of`); last, out_staging [2, 64, 128] of out_ref's dtype, where each compute
    # warpgroup stages a part of a partial block's output once every tile is done;
    # exchange: scales_smem f32[4, block_k] (fp8 only); with split scores: p_smem bf16[64,
    # block_k + pad] (the softmax weights of both halves; `rope_in_registers`: bf16[64, block_k]
    # in [8, 32] tiles, 64-byte swizzle, each half one column of tiles, first Q's RoPE columns),
    # maxes_smem f32[2, 64] (each half's row maxima), stats_smem f32[6, 64] (each warpgroup's
    # sums, NaN and entry flags at the end)
    # lane_bars: i32[slots, 2], an mbarrier per slot for the copies of copy_issuers=128 (compiled)
    # q_loaded, idx_loaded: a barrier each (Q, in one or two copies; the index row);
    # raw_bars: barriers[slots * per_slot] of the tile's
    # record copies (row j of slot s on barrier s * per_slot + j % per_slot, per_slot 4 with four
    # issuing warps, else 1); slot_free:
    # barriers[slots] (bf16: both compute warpgroups are done with the slot); idx_bars:
    # barriers[slots] (bf16: the ring's indices of the slot arrived); tile_syncs: barriers[6] of the compute
    # warpgroups (both read the tile's records, wrote K, read K; with split scores: wrote their
    # row maxima, their softmax weights, their final sums)
    plgpu = compat.plgpu
    t, hb, wg = lax.axis_index("t"), lax.axis_index("hb"), lax.axis_index("wg")
    q_bar, idx_bar = compat.barrier_at(q_loaded, 0), compat.barrier_at(idx_loaded, 0)
    consumed_bar, k_ready, k_free, max_ready, p_ready, stats_ready = (tile_syncs.at[i] for i in range(6))
    num_keys = block_k // 2 if split else block_k      # the score columns of one compute warpgroup
    count = jnp.clip(count_ref[t], 0, top_k)
    num_tiles = (count + block_k - 1) // block_k
    # this CTA's heads: 64 from 64 hb on, but `tail` in a last block of fewer
    num_blocks = -(-num_heads // HEADS_PER_CTA)
    tail = num_heads - (num_blocks - 1) * HEADS_PER_CTA

    def by_block(body):
        """body(first, rows) for this CTA's heads, `rows` static: a full block, or the last of
        fewer (Q's other rows in SMEM are never loaded: each row of the products is its own
        head's, and those rows are neither stored nor reduced across)."""
        if tail == HEADS_PER_CTA:
            body(hb * HEADS_PER_CTA, HEADS_PER_CTA)
            return
        if num_blocks > 1:
            pl.when(hb < num_blocks - 1)(lambda: body(hb * HEADS_PER_CTA, HEADS_PER_CTA))
        pl.when(hb == num_blocks - 1)(lambda: body((num_blocks - 1) * HEADS_PER_CTA, tail))
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    direct = kind == "bf16"              # records copied straight into the K tile (`copies_into_k`)
    # K tiles filled by the memory warpgroups (bf16: copied; fp8 and nvfp4, `converted`: converted
    # there), in a ring of `slots`, their indices through a ring too; else one raw slot converted
    # by the compute warpgroups
    filled = direct or converted
    k_smem, out_staging = k_views[0], k_views[-1]
    scales_smem, p_smem, maxes_smem, stats_smem = exchange
    if not filled:
        nope_raw, scale_raw, rope_raw = raw
    # the interpreter has no warp-level scopes or inline PTX: one issuer of Pallas copies there
    lanes = issuers == LANES and not interpret
    per_slot = _copy_barriers_per_slot(issuers)
    if lanes:
        from pallas_kernels import mosaic_ptx
        mosaic_ptx.init_barriers(lane_bars, slots, LANES * memory_wgs)

    def k_tile(i):
        """The K tile of tile i: bf16[block_k, 576] (swizzled)."""
        return k_smem.at[lax.rem(i, slots)] if filled else k_smem

    def raw_bar(i, b):
        return compat.barrier_at(raw_bars, lax.rem(i, slots) * per_slot + b)

    def indices(i, first, size):
        """The ref of tile i's indices [first, first + size) (of its block_k)."""
        if filled:
            return idx_smem.at[lax.rem(i, slots), pl.ds(first, size)]
        return idx_smem.at[pl.ds(i * block_k + first, size)]

    def load(ref, layout):
        """ref[...] in `layout`, from an SMEM ref without transforms (interpret mode has no
        layouts: a plain load there)."""
        if interpret:
            return ref[...]
        return compat.mosaic_gpu_load(ref, layout=layout, optimized=False)

    def in_layout(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def iota(shape, dim, layout):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

    def accumulate(acc, a, b_ref):
        """acc + a @ b_ref: a wgmma into the accumulator (interpret mode, whose wgmma takes no
        accumulator initialised from a value: a float32 dot)."""
        if interpret:
            return acc + lax.dot(a, b_ref[...], preferred_element_type=jnp.float32)

        def into(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref)
        return pl.run_state(into)(plgpu.ACC.init(acc))

    def scores_of(*products):
        """The sum of a @ b_ref.T over products (a, b_ref) in float32, a a bf16[64, n] SMEM ref
        or register array (WGMMA layout), b_ref [keys, n] of a K tile: wgmmas into one accumulator
        with the transposed K tile (interpret mode, whose wgmma takes no transposed operand:
        float32 dots)."""
        if interpret:
            return sum(lax.dot_general(a if isinstance(a, jax.Array) else a[...], b_ref[...], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32) for a, b_ref in products)

        def body(acc_ref):
            for a, b_ref in products:
                plgpu.wgmma(acc_ref, a, b_ref.transpose((1, 0)))
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC((HEADS_PER_CTA, products[0][1].shape[0]), jnp.float32))

    def entry_ok(pos, row):
        return (pos < count) & (row >= 0) & (row < num_records)

    def sync(barrier):
        """Both compute warpgroups reach this point."""
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)

    @pl.when(wg >= 2)
    def _memory():
        plgpu.set_max_registers(memory_registers, action="decrease")
        mw = wg - 2             # this memory warpgroup (of `memory_wgs`, which only converting splits)
        if not filled:
            plgpu.copy_gmem_to_smem(idx_ref.at[t], idx_smem, idx_bar, oob_mode=in_bounds)
            plgpu.barrier_wait(idx_bar)

        def copy_rows(i, first, step):
            """The copies of rows first, first + step, ... of tile i, row j's onto raw_bar(i, j % per_slot)."""
            @pl.loop(first, block_k, step=step)
            def _row(j):
                pos = i * block_k + j
                row = idx_smem[lax.rem(i, slots), j] if direct else idx_smem[pos]
                ok = entry_ok(pos, row)
                bar = raw_bar(i, j % per_slot)
                if direct:
                    # masked entries copy a row of zeros: their K rows must be finite (a weight of
                    # 0 times a NaN of row 0 would be NaN)
                    pl.when(ok)(lambda: copy_bf16_row(rec_bf16, row, i, j, bar))
                    pl.when(jnp.logical_not(ok))(lambda: copy_bf16_row(zero_row, 0, i, j, bar))
                    return
                row = jnp.where(ok, row, 0)     # masked entries copy row 0, never used
                for src, dst, (first, width) in zip((rec_u8, rec_scales, rec_bf16), (nope_raw, scale_raw, rope_raw),
                                                    copies):
                    plgpu.copy_gmem_to_smem(src.at[row, pl.ds(first, width)], dst.at[j, pl.ds(0, width)], bar,
                                            oob_mode=in_bounds)

        def copy_bf16_row(src, row, i, j, bar):
            """Row `row` of src bf16[rows, 576] into row j of tile i's K slot: compiled, one copy per
            64 columns into its swizzled 128-byte row of k_rows (a copy of a whole row of k_smem
            would cut its 8-row tiles)."""
            if interpret:
                plgpu.copy_gmem_to_smem(src.at[row], k_smem.at[lax.rem(i, slots), j], bar)
                return
            for c in range(BF16_CHUNKS):
                plgpu.copy_gmem_to_smem(src.at[pl.ds(row, 1), pl.ds(c * BF16_CHUNK_COLUMNS, BF16_CHUNK_COLUMNS)],
                                        k_views[1].at[pl.ds(_bf16_row_of(lax.rem(i, slots), j, c, block_k), 1)],
                                        bar, oob_mode=in_bounds)

        def thread_rows(i_fa, count_fa, idx, records, first=None, num=block_k // LANE_GROUPS):
            """In an inline body of tile i (`lane_copies`, `convert_rows`): this thread's group g
            and place q in it (i32), the tile's slot, and for each of its rows j = g + 16 (first +
            r), r < num (first: an i32, None for 0), j (i32), the record's address (i64; a masked
            entry's: row 0's) and whether it is selected (i1)."""
            ptx = mosaic_ptx
            arith, c32 = ptx.arith, ptx.i32
            lt, ge = arith.CmpIPredicate.slt, arith.CmpIPredicate.sge
            tile_i, count_i = ptx.scalar(i_fa), ptx.scalar(count_fa)
            tid = ptx.thread_in_warpgroup()
            g, q = arith.divui(tid, c32(LANE_GROUP)), arith.remui(tid, c32(LANE_GROUP))
            slot = arith.remui(tile_i, c32(slots))
            base = ptx.address(records)
            first_row = g if first is None else arith.addi(g, arith.muli(first, c32(LANE_GROUPS)))
            rows, sources, valid = [], [], []
            for r in range(num):
                rows.append(arith.addi(first_row, c32(r * LANE_GROUPS)))
                pos = arith.addi(arith.muli(tile_i, c32(block_k)), rows[-1])
                row = ptx.memref.load(idx, [arith.index_cast(ptx.ir.IndexType.get(), pos)])
                ok = arith.andi(arith.andi(arith.cmpi(lt, pos, count_i), arith.cmpi(ge, row, c32(0))),
                                arith.cmpi(lt, row, c32(num_records)))
                row = ptx.to_i64(arith.select(ok, row, c32(0)))
                sources.append(arith.addi(base, arith.muli(row, ptx.i64(record_bytes))))
                valid.append(ok)
            return g, q, slot, rows, sources, valid

        def lane_copies(i):
            """Tile i's records in 16-byte chunks (`mosaic_ptx.copy_16`), every thread issuing its
            own, then one arrival of it on the slot's mbarrier, made once they landed.  The
            warpgroup is 16 groups of 8 threads: group g copies rows g, g + 16, g + 32 and g + 48
            of the tile, thread q of a group chunk q of every 128 bytes of a row (a group reads
            128 contiguous bytes at once), so a thread's rows, chunk and swizzle are fixed and its
            four row indices are read once a tile, from GMEM.  Masked entries' chunks are zeros
            (the copy reads no source byte).  fp8 / nvfp4: NoPE, scales and RoPE into their raw
            rows; bf16: the whole record into the K tile, a 16-byte chunk q of a row j moving to
            chunk q ^ (j % 8) of its 128-byte row (the 128-byte swizzle)."""
            ptx = mosaic_ptx
            arith = ptx.arith
            splat = plgpu.Layout.WG_SPLAT(shape=())
            dsts = (k_smem,) if direct else raw
            dst_types = (plgpu.RefType(_swizzled()),) if direct else (plgpu.RefType(),) * len(raw)
            # bytes from one row of each raw ref to the next
            dst_rows = (0,) if direct else tuple(r.shape[1] * jnp.dtype(r.dtype).itemsize for r in raw)

            @plgpu.inline_mgpu(arg_types=(splat, splat) + (plgpu.RefType(),) * 3 + dst_types)
            def issue(ctx, i_fa, count_fa, idx, records, bars, *dst_refs):
                lt, c32 = arith.CmpIPredicate.slt, ptx.i32
                g, q, slot, _, sources, valid = thread_rows(i_fa, count_fa, idx, records)
                chunk = ptx.to_i64(arith.muli(q, c32(ptx.CHUNK_BYTES)))
                if direct:
                    # row j = g + 16 r of slot s lies in [8, 64] tiles row-major over (s, j // 8,
                    # piece) (`_bf16_row_of`), at 128 bytes a row within one; the swizzle moves
                    # chunk q to q ^ (j % 8), and j % 8 = g % 8 for every r
                    g8 = arith.remui(g, c32(8))
                    first = arith.addi(arith.muli(arith.addi(arith.muli(slot, c32(block_k // 8)), arith.divui(g, c32(8))),
                                                  c32(BF16_CHUNKS * K_TILE_BYTES)),
                                       arith.addi(arith.muli(g8, c32(COPY_GRANULE)),
                                                  arith.muli(arith.xori(q, g8), c32(ptx.CHUNK_BYTES))))
                    thread_dsts = [arith.addi(ptx.address(dst_refs[0]), ptx.to_i64(first))]
                else:
                    thread_dsts = [arith.addi(arith.addi(ptx.address(d), ptx.to_i64(arith.muli(g, c32(rows)))), chunk)
                                   for d, rows in zip(dst_refs, dst_rows)]
                for k, (src_offset, nbytes) in enumerate(segments):
                    dst_base = thread_dsts[0 if direct else k]
                    for piece in range(-(-nbytes // COPY_GRANULE)):
                        chunks = min(nbytes - piece * COPY_GRANULE, COPY_GRANULE) // ptx.CHUNK_BYTES
                        in_piece = arith.cmpi(lt, q, c32(chunks))        # a short last piece: its first chunks
                        for r in range(block_k // LANE_GROUPS):
                            if direct:
                                dst_off = r * K_ROW_STEP + piece * K_TILE_BYTES
                            else:
                                dst_off = r * LANE_GROUPS * dst_rows[k] + piece * COPY_GRANULE
                            src = arith.addi(sources[r], arith.addi(chunk, ptx.i64(src_offset + piece * COPY_GRANULE)))
                            ptx.copy_16(arith.addi(dst_base, ptx.i64(dst_off)), src, in_piece, valid[r])
                ptx.arrive_when_done(ptx.barrier_address(bars, slot))

            issue(i, count, idx_ref.at[t], rec_u8, lane_bars, *dsts)

        def convert_rows(i):
            """fp8 or nvfp4 records of tile i converted by this warpgroup into K slot i % slots,
            the RoPE as it is, masked entries' rows zero.  fp8: the e4m3 values themselves (exact
            in bf16; the tile scales multiply the products, as in the compute warpgroups'
            conversion), the four tile scales of a row into its slot's table of scales_smem
            (masked entries' zero).  nvfp4: each e2m1 value times its group's e4m3 scale (exact
            in bf16, `mosaic_ptx.e2m1x8_to_bf16x8`), the low nibbles (even elements) into the
            first 256 columns and the high ones (odd) into the last 256, as the compute
            warpgroups convert them.  Thread q of group g (as in `lane_copies`) takes rows
            g + 16 r: NoPE bytes [16 u, 16 u + 16) for u = q + 8 m (fp8: K columns of the same
            span, two 16-byte chunks of piece u // 4; nvfp4: the scales of groups 2 u and 2 u + 1,
            and K columns [16 u, 16 u + 16) and 256 more), RoPE chunk q, and fp8's scale q (q <
            4).  It loads a row's bytes into registers (`load_16`),
            converts, stores them at their swizzled places, and arrives on the slot's mbarrier
            after fencing the async proxy (the wgmma reads them).  Every row's lines are sent to
            L2 first (`prefetch_l2`), so that the loads of the later rows find them there.

            With two memory warpgroups each converts half of those rows (warpgroup m rows
            g + 16 r for r in {2 m, 2 m + 1})."""
            ptx = mosaic_ptx
            arith = ptx.arith
            splat = plgpu.Layout.WG_SPLAT(shape=())
            nope, rope_at, scales_at = segments[0], segments[2][0], segments[1][0]
            rows_per_thread = block_k // LANE_GROUPS // memory_wgs
            share = (mw,) if memory_wgs > 1 else ()   # a scalar more: this warpgroup's block of rows

            @plgpu.inline_mgpu(arg_types=(splat,) * (2 + len(share)) + (plgpu.RefType(),) * 3
                               + (plgpu.RefType(_swizzled()), plgpu.RefType()))
            def body(ctx, i_fa, count_fa, *refs):
                idx, records, bars, k_ref, scales_ref = refs[len(share):]
                lt, eq = arith.CmpIPredicate.slt, arith.CmpIPredicate.eq
                c32, c64 = ptx.i32, ptx.i64
                first = arith.muli(ptx.scalar(refs[0]), c32(rows_per_thread)) if share else None
                g, q, slot, rows, sources, valid = thread_rows(i_fa, count_fa, idx, records, first, rows_per_thread)
                g8 = arith.remui(g, c32(8))
                # the rows' lines into L2: thread q the line at 128 q bytes, the last thread its last byte
                line = arith.select(arith.cmpi(eq, q, c32(LANE_GROUP - 1)), c32(record_bytes - 1),
                                    arith.muli(q, c32(COPY_GRANULE)))
                in_row = arith.cmpi(lt, line, c32(record_bytes))
                for src, ok in zip(sources, valid):
                    ptx.prefetch_l2(arith.addi(src, ptx.to_i64(line)), arith.andi(ok, in_row))
                # this thread's place in the slot: row g's [8, 64] tile row (slot, g // 8) of K,
                # its row g % 8 in it; chunk c of a piece lands at chunk c ^ (g % 8)
                k_base = arith.addi(ptx.address(k_ref), ptx.to_i64(arith.addi(
                    arith.muli(arith.addi(arith.muli(slot, c32(block_k // 8)), arith.divui(g, c32(8))),
                               c32(BF16_CHUNKS * K_TILE_BYTES)),
                    arith.muli(g8, c32(COPY_GRANULE)))))
                if share:                  # its first row is g + 16 first: `first` K row steps on
                    k_base = arith.addi(k_base, arith.muli(ptx.to_i64(first), c64(K_ROW_STEP)))

                def chunk_at(c):            # the swizzled offset of chunk c (i32) within a 128-byte row
                    return ptx.to_i64(arith.muli(arith.xori(c, g8), c32(ptx.CHUNK_BYTES)))

                chunks = arith.muli(arith.remui(q, c32(4)), c32(2))       # the two chunks of a 16-byte load
                first_chunk, second_chunk = chunk_at(chunks), chunk_at(arith.addi(chunks, c32(1)))
                piece_of_q = arith.divui(q, c32(4))
                scale_row = arith.addi(arith.muli(slot, c32(NUM_PARTS)), q)      # table row of part q
                scale_base = arith.addi(ptx.address(scales_ref),
                                        ptx.to_i64(arith.muli(arith.muli(scale_row, c32(block_k)), c32(4))))
                has_scale = arith.cmpi(lt, q, c32(NUM_PARTS))
                # nvfp4: the odd elements' columns, 256 on (four pieces)
                high_pieces = c64((NOPE_DIM // 2 // BF16_CHUNK_COLUMNS) * K_TILE_BYTES)
                for r, (src, ok) in enumerate(zip(sources, valid)):
                    row_base = arith.addi(k_base, c64(r * K_ROW_STEP))
                    for m in range(nope[1] // (LANE_GROUP * ptx.CHUNK_BYTES)):
                        u = arith.addi(q, c32(LANE_GROUP * m))
                        words = ptx.load_16(arith.addi(src, ptx.to_i64(arith.muli(u, c32(ptx.CHUNK_BYTES)))), ok)
                        piece = ptx.to_i64(arith.muli(arith.addi(piece_of_q, c32(2 * m)), c32(K_TILE_BYTES)))
                        at = arith.addi(row_base, piece)
                        if kind == "fp8_tiles":
                            values = [v for w in words for v in ptx.e4m3x4_to_bf16x4(w)]
                            ptx.store_16(arith.addi(at, first_chunk), values[:4])
                            ptx.store_16(arith.addi(at, second_chunk), values[4:])
                            continue
                        # groups 2 u (bytes 0-7 of the load) and 2 u + 1 (bytes 8-15)
                        pair_at = arith.addi(c64(scales_at), ptx.to_i64(arith.muli(u, c32(2))))
                        group_scales = ptx.e4m3x2_scales(ptx.load_2(arith.addi(src, pair_at), ok))
                        low, high = [], []
                        for k, w in enumerate(words):
                            lo, hi = ptx.e2m1x8_to_bf16x8(w, group_scales[k // 2])
                            low += lo
                            high += hi
                        for values, base in ((low, at), (high, arith.addi(at, high_pieces))):
                            ptx.store_16(arith.addi(base, first_chunk), values[:4])
                            ptx.store_16(arith.addi(base, second_chunk), values[4:])
                    rope = ptx.load_16(arith.addi(src, arith.addi(c64(rope_at), ptx.to_i64(
                        arith.muli(q, c32(ptx.CHUNK_BYTES))))), ok)
                    ptx.store_16(arith.addi(arith.addi(row_base, c64((NOPE_DIM // BF16_CHUNK_COLUMNS) * K_TILE_BYTES)),
                                            chunk_at(q)), rope)
                    if kind != "fp8_tiles":
                        continue
                    scale = ptx.load_4(arith.addi(src, arith.addi(c64(scales_at), ptx.to_i64(arith.muli(q, c32(4))))),
                                       arith.andi(ok, has_scale))
                    ptx.store_4(arith.addi(scale_base, ptx.to_i64(arith.muli(rows[r], c32(4)))), scale, has_scale)
                ptx.fence_proxy_async()
                ptx.arrive(ptx.barrier_address(bars, slot))

            body(i, count, *share, idx_ref.at[t], rec_u8, lane_bars, k_smem, scales_smem)

        @pl.loop(0, num_tiles)
        def _tile(i):
            if filled:
                @pl.when(i >= slots)
                def _():                  # both compute warpgroups are done with tile i - slots
                    plgpu.barrier_wait(compat.barrier_at(slot_free, lax.rem(i, slots)))

                ring_bar = compat.barrier_at(idx_bars, lax.rem(i, slots))

                @pl.when(mw == 0)
                def _():
                    plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds(i * block_k, block_k)],
                                            idx_smem.at[lax.rem(i, slots)], ring_bar, oob_mode=in_bounds)
                if not lanes:         # per-thread copies read their indices from GMEM; the masks wait
                    plgpu.barrier_wait(ring_bar)
            else:
                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(consumed_bar)         # both compute warpgroups read the slot

            if converted:
                convert_rows(i)
            elif lanes:
                lane_copies(i)
            elif per_slot == 1 or interpret:
                copy_rows(i, 0, 1)
            else:
                @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
                def _per_warp():
                    copy_rows(i, lax.axis_index("warp"), per_slot)

        # every phase of the slot barriers observed: the last tiles'
        if filled:
            @pl.loop(jnp.maximum(num_tiles - slots, 0), num_tiles)
            def _(i):
                plgpu.barrier_wait(compat.barrier_at(slot_free, lax.rem(i, slots)))
        else:
            @pl.when(num_tiles > 0)
            def _():
                plgpu.barrier_wait(consumed_bar)

    def compute(w):
        plgpu.set_max_registers(compute_registers, action="increase")
        if w == 0:
            def copy_q(first, rows):
                heads, filled_rows = pl.ds(first, rows), pl.ds(0, rows)
                if rope_in_registers:
                    plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(0, NOPE_DIM)], q_smem.at[filled_rows], q_bar)
                    plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(NOPE_DIM, ROPE_DIM)], p_smem.at[filled_rows],
                                            q_bar)
                else:
                    plgpu.copy_gmem_to_smem(q_ref.at[t, heads], q_smem.at[filled_rows], q_bar)
            by_block(copy_q)
        if not filled:
            plgpu.barrier_wait(idx_bar)
        plgpu.barrier_wait(q_bar)
        # bf16[64, 64]: read by both before either writes its first softmax weights into p_smem
        # (after the first tile's exchange of row maxima, which waits for both)
        q_rope = load(p_smem, plgpu.Layout.WGMMA) if rope_in_registers else None
        sm_scale = scale_ref[0]
        wgmma = plgpu.Layout.WGMMA
        rows_of = wgmma.reduce(1)          # a value per row: per head of the scores, per entry of K
        cols_of = wgmma.reduce(0)          # a value per column: per entry of the scores
        own = (2 * w, 2 * w + 1)

        def fp8_share(row_ok):
            """This warpgroup's share of the K tile from fp8 records: its two NoPE parts, exact e4m3
            values, masked entries' rows zeroed; its parts' scales per entry into scales_smem."""
            k_ok = lax.broadcast_in_dim(row_ok, (block_k, PART), (0,))
            raw_scales = load(scale_raw.at[:, pl.ds(0, 32)], wgmma)  # f32[block_k, 32]
            col = iota((block_k, 32), 1, wgmma)
            for p in own:
                e4m3 = load(nope_raw.at[:, pl.ds(p * PART, PART)], wgmma)
                # e4m3 -> f16 is the one hardware conversion from e4m3 (exact, like the rest of the chain)
                k = lax.bitcast_convert_type(e4m3, jnp.float8_e4m3fn).astype(jnp.float16)
                k = k.astype(jnp.float32).astype(jnp.bfloat16)
                k_smem[:, pl.ds(p * PART, PART)] = jnp.where(k_ok, k, jnp.zeros_like(k))
                # masked entries' scales are 0: their weights stay 0 (never NaN) without a mask later
                scales_smem[p] = jnp.where(row_ok, jnp.sum(jnp.where(col == p, raw_scales, 0.0), axis=1), 0.0)

        def nvfp4_group_scale(group, row_ok):
            """f32[block_k] (a value per K row): the records' e4m3 scale of `group` times 2**14 (the
            factor the e2m1 codes placed in an f16 lack), NaN for a NaN byte, 0 for masked entries
            (whose rows are then zeros: row 0's finite values times 0)."""
            b = load(scale_raw.at[:, group], rows_of).astype(jnp.uint16)
            # the e4m3 exponent and mantissa placed in an f16 (bias 15 against 7: the value times
            # 2**-8; an e4m3 subnormal lands on an f16 subnormal), exactly widened to float32
            mag = lax.bitcast_convert_type((b & 0x7F) << 7, jnp.float16).astype(jnp.float32) * 2.0 ** 22
            s = jnp.where((b & 0x80) != 0, -mag, mag)
            s = jnp.where((b & 0x7F) == 0x7F, jnp.nan, s)
            return jnp.where(row_ok, s, 0.0)

        def nvfp4_share(row_ok):
            """This warpgroup's share of the K tile from nvfp4 records: packed NoPE bytes [128 w,
            128 w + 128), whose low nibbles are the even elements 2b (K columns b, the first half)
            and high nibbles the odd ones (columns 256 + b), each the e2m1 value times its group's
            scale: exact in bf16 (`record_codec.decode_nvfp4_pairs`).  In the WGMMA layout a thread's
            values of a column tile (8 packed bytes) are one group's, so each tile's scale is one
            row vector; a select per tile puts it there (the tile index of a register is a
            constant)."""
            width = NVFP4_CONVERT_BYTES
            col_tile = iota((block_k, width), 1, wgmma) // 8
            for first in range(w * PART, (w + 1) * PART, width):
                scale = None
                for tile in range(width // 8):
                    s = lax.broadcast_in_dim(nvfp4_group_scale(first // 8 + tile, row_ok), (block_k, width), (0,))
                    scale = s if scale is None else jnp.where(col_tile == tile, s, scale)
                packed = load(nope_raw.at[:, pl.ds(first, width)], wgmma).astype(jnp.uint16)
                for x, column in ((packed & 0xF, first), (packed >> 4, NOPE_DIM // 2 + first)):
                    # the e2m1 code placed in an f16 (sign; exponent and mantissa in its lowest
                    # exponent bits and top mantissa bit): its value times 2**-14, subnormals included
                    half = lax.bitcast_convert_type(((x & 8) << 12) | ((x & 7) << 9), jnp.float16)
                    k_smem[:, pl.ds(column, width)] = (half.astype(jnp.float32) * scale).astype(jnp.bfloat16)

        def tile(i, carry):
            accs, m_prev, l_prev, nan_seen, seen = carry
            pos0 = i * block_k
            if lanes:                     # bf16: the wgmma reads what the copies wrote
                mosaic_ptx.wait(lane_bars, lax.rem(i, slots), lax.rem(lax.div(i, slots), 2), fence_async=filled)
                if filled:                # the ring's indices of the masks (the copies did not wait)
                    plgpu.barrier_wait(compat.barrier_at(idx_bars, lax.rem(i, slots)))
            else:
                for b in range(per_slot):
                    plgpu.barrier_wait(raw_bar(i, b))
            k_cur = k_tile(i)
            if not filled:
                k_rows = load(indices(i, 0, block_k), rows_of)
                k_pos = pos0 + iota((block_k,), 0, rows_of)
                row_ok = entry_ok(k_pos, k_rows)
                if kind == "fp8_tiles":
                    fp8_share(row_ok)
                else:
                    nvfp4_share(row_ok)
                if w == 0:
                    k_smem[:, pl.ds(NOPE_DIM, ROPE_DIM)] = load(rope_raw.at[:, pl.ds(0, ROPE_DIM)], wgmma)
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed_bar)
                sync(k_ready)

            # the scores of this warpgroup's entries (split: its half of the tile; else all): the
            # RoPE part, then each NoPE part times its tile scale.  Nothing of the tile's shape
            # lives across the wgmmas but the scores themselves (the accumulators already take
            # 128 registers a thread): the scales and the mask are per-column vectors, broadcast
            # where they are used
            first_key = w * num_keys if split else 0
            keys = pl.ds(first_key, num_keys)

            def from_smem(cols):
                return q_smem.at[:, cols], k_cur.at[keys, cols]

            rope_cols = pl.ds(NOPE_DIM, ROPE_DIM)
            rope = (q_rope, k_cur.at[keys, rope_cols]) if rope_in_registers else from_smem(rope_cols)

            def part_scale(p, columns):
                row = lax.rem(i, slots) * NUM_PARTS + p if converted else p     # converted: a table per slot
                return lax.broadcast_in_dim(load(scales_smem.at[row, columns], cols_of),
                                            (HEADS_PER_CTA, columns.size), (1,))

            if kind == "fp8_tiles":
                s = scores_of(rope)
                for p in range(NUM_PARTS):
                    s = s + scores_of(from_smem(pl.ds(p * PART, PART))) * part_scale(p, keys)
            elif rope_in_registers:        # scales in K (nvfp4) or none: one sum over all 576 columns
                s = scores_of(from_smem(pl.ds(0, NOPE_DIM)), rope)
            else:
                s = scores_of(from_smem(pl.ds(0, NOPE_DIM + ROPE_DIM)))
            s_rows = load(indices(i, first_key, num_keys), cols_of)
            s_pos = pos0 + first_key + iota((num_keys,), 0, cols_of)
            s_ok = lax.broadcast_in_dim(entry_ok(s_pos, s_rows), (HEADS_PER_CTA, num_keys), (1,))
            seen = jnp.maximum(seen, jnp.max(jnp.where(s_ok, 1.0, 0.0), axis=1))
            s = jnp.where(s_ok, s * sm_scale, -jnp.inf)                    # f32[64, num_keys]
            # masked entries are -inf now: a NaN is a selected entry's
            nan_seen = jnp.maximum(nan_seen, jnp.max(jnp.where(s != s, 1.0, 0.0), axis=1))
            tile_max = jnp.max(s, axis=1)
            if split:                      # the row maxima of both halves, through SMEM
                maxes_smem[w] = tile_max
                sync(max_ready)
                tile_max = jnp.maximum(load(maxes_smem.at[0], rows_of), load(maxes_smem.at[1], rows_of))
            m_new = jnp.maximum(m_prev, tile_max)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)              # no valid entry yet: exp(-inf) = 0
            correction = jnp.exp(m_prev - m_use)
            p_ = jnp.exp(s - lax.broadcast_in_dim(m_use, s.shape, (0,)))
            l_new = l_prev * correction + jnp.sum(p_, axis=1)     # split: over this warpgroup's half
            if split:                      # both halves of the softmax weights, through SMEM (bf16)
                p_smem[:, keys] = p_.astype(jnp.bfloat16)
                sync(p_ready)
                p_ = load(p_smem if rope_in_registers else p_smem.at[:, pl.ds(0, block_k)], wgmma).astype(jnp.float32)
            new_accs = []
            shared_weights = None if kind == "fp8_tiles" else p_.astype(jnp.bfloat16)
            for acc, p in zip(accs, own):
                weights = shared_weights
                if weights is None:
                    weights = (p_ * part_scale(p, pl.ds(0, block_k))).astype(jnp.bfloat16)
                acc = acc * lax.broadcast_in_dim(correction, acc.shape, (0,))
                new_accs.append(accumulate(acc, weights, k_cur.at[:, pl.ds(p * PART, PART)]))
            plgpu.wgmma_wait(0)
            if filled:
                # the slot is the memory warpgroup's again; the SMEM both exchange through needs
                # no barrier here (each reads the other's maxima and weights before it arrives at
                # the next exchange, which the other waits for before writing again)
                plgpu.barrier_arrive(compat.barrier_at(slot_free, lax.rem(i, slots)))
            else:
                sync(k_free)              # the next tile's conversion overwrites K
            return tuple(new_accs), m_new, l_new, nan_seen, seen

        zeros = lambda shape, layout: in_layout(jnp.zeros(shape, jnp.float32), layout)
        init = ((zeros((HEADS_PER_CTA, PART), wgmma), zeros((HEADS_PER_CTA, PART), wgmma)),
                in_layout(jnp.full((HEADS_PER_CTA,), -jnp.inf, jnp.float32), rows_of),
                zeros((HEADS_PER_CTA,), rows_of), zeros((HEADS_PER_CTA,), rows_of), zeros((HEADS_PER_CTA,), rows_of))
        accs, m, l, nan_seen, seen = lax.fori_loop(0, num_tiles, tile, init)
        if split:                          # the sums, NaN and entry flags of the other half
            for j, v in enumerate((l, nan_seen, seen)):
                stats_smem[3 * w + j] = v
            sync(stats_ready)
            other = 3 * (1 - w)
            l = l + load(stats_smem.at[other], rows_of)
            nan_seen = jnp.maximum(nan_seen, load(stats_smem.at[other + 1], rows_of))
            seen = jnp.maximum(seen, load(stats_smem.at[other + 2], rows_of))
        elif tail < HEADS_PER_CTA:
            sync(stats_ready)              # a partial block stages its output in the K tiles' SMEM
        nan_row = nan_seen > 0
        nonempty = seen > 0
        denom = jnp.where(l > 0, l, 1.0)
        outs = []
        for acc in accs:
            out = acc / lax.broadcast_in_dim(denom, acc.shape, (0,))
            out = jnp.where(lax.broadcast_in_dim(nonempty, acc.shape, (0,)), out, 0.0)
            outs.append(jnp.where(lax.broadcast_in_dim(nan_row, acc.shape, (0,)), jnp.nan, out).astype(out_ref.dtype))

        def store_out(first, rows):
            for out, p in zip(outs, own):
                dst = out_ref.at[t, pl.ds(first, rows), pl.ds(p * PART, PART)]
                if rows == HEADS_PER_CTA:
                    dst[...] = out
                    continue
                # a partial block: its rows through SMEM (a register array's rows are spread over
                # the warpgroup's warps), the copy out of SMEM done before the next part reuses it
                staged = out_staging.at[w]
                staged[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(staged.at[pl.ds(0, rows)], dst)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        by_block(store_out)
        if w == 0:
            lse = jnp.where(nonempty, jnp.log(denom) + m, -jnp.inf)
            lse_ref.at[t, pl.ds(hb * HEADS_PER_CTA, HEADS_PER_CTA)][...] = jnp.where(nan_row, jnp.nan, lse)

    for w in (0, 1):
        pl.when(wg == w)(functools.partial(compute, w))


def scale_view_dtype(layout: RecordLayout):
    """The dtype the kernel views fp8 or nvfp4 records as for their scales: f32 (fp8's tile
    scales), u8 (nvfp4's e4m3 group scales)."""
    return jnp.float32 if layout.kind == "fp8_tiles" else jnp.uint8


def records_as(records: jax.Array, dtype) -> jax.Array:
    """u8[N, R] records viewed as dtype[N, R / itemsize] (the same bytes)."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return records
    n, width = records.shape
    return lax.bitcast_convert_type(records.reshape(n, width // size, size), dtype)


def converts_in_memory_warpgroup(layout: RecordLayout, config: MosaicAttentionTiles, interpret=False) -> bool:
    """Whether the memory warpgroup converts fp8 or nvfp4 records into two K tiles itself
    (compiled, with per-thread copies and `k_slots=2`); interpreted, the same config converts in
    the compute warpgroups through one raw slot."""
    return (layout.kind in ("fp8_tiles", "nvfp4_groups") and config.copy_issuers == LANES and config.k_slots == 2
            and not interpret)


def memory_warpgroups_of(layout: RecordLayout, config: MosaicAttentionTiles, interpret=False) -> int:
    """The kernel's memory warpgroups: `config.memory_warpgroups` where they convert the records,
    else one."""
    return config.memory_warpgroups if converts_in_memory_warpgroup(layout, config, interpret) else 1


def fills_k_tiles(layout: RecordLayout, config: MosaicAttentionTiles, interpret=False) -> bool:
    """Whether the memory warpgroups fill the K tiles themselves (bf16 copied, fp8 and nvfp4
    converted), so that `config.k_slots` of them can be in flight; otherwise one raw slot feeds
    one K tile."""
    return copies_into_k(layout) or converts_in_memory_warpgroup(layout, config, interpret)


def lane_segments(layout: RecordLayout) -> tuple[tuple[int, int], ...]:
    """(byte offset, bytes) in a record of what `copy_issuers=128` copies of each row: bf16, the
    whole record (into the K tile); fp8 and nvfp4, the NoPE bytes, the scales and the RoPE (into
    their raw rows, in the order of `record_copies`), each a multiple of 16 bytes."""
    if copies_into_k(layout):
        return ((0, layout.record_bytes),)
    scales = layout.segment("tile_scales_f32" if layout.kind == "fp8_tiles" else "group_scales_e4m3")
    return tuple((seg.offset, seg.width) for seg in (layout.segments[0], scales, layout.segment("rope_bf16")))


def _copy_barriers_per_slot(issuers: int) -> int:
    """The `raw_bars` of one slot: one per issuing warp (four), else one (the per-thread copies
    use `lane_bars` compiled, and one issuer's Pallas copies interpreted)."""
    return issuers if issuers == WARPS_PER_WARPGROUP else 1


def _swizzled():
    """The transforms of Q and the K tiles in SMEM: [8, 64] tiles, 128-byte swizzle."""
    return (compat.plgpu.TilingTransform((8, 64)), compat.plgpu.SwizzleTransform(128))


def record_copies(layout: RecordLayout) -> tuple[tuple[int, int], ...]:
    """(start, width) of a row's three copies, each in its view of the records (u8;
    `scale_view_dtype`; bf16): the NoPE bytes, the COPY_GRANULE bytes from the scales on (the
    scales and what follows them), the RoPE."""
    nope = layout.segments[0]
    scales = layout.segment("tile_scales_f32" if layout.kind == "fp8_tiles" else "group_scales_e4m3")
    rope = layout.segment("rope_bf16")
    scale_word = jnp.dtype(scale_view_dtype(layout)).itemsize
    return ((nope.offset, nope.width), (scales.offset // scale_word, COPY_GRANULE // scale_word),
            (rope.offset // 2, rope.width // 2))


@functools.partial(jax.jit, static_argnames=("layout", "config", "out_dtype", "interpret"))
def sparse_mla_attention_mosaic(q, records, indices, counts, sm_scale, *, layout: RecordLayout = FP8,
                                config: MosaicAttentionTiles | None = None, out_dtype=jnp.bfloat16, interpret=False):
    """The contract of `reference.attention_reference` for fp8_ds_mla, nvfp4_ds_mla or bf16
    records (`LAYOUTS`), out in `out_dtype` (bf16, or float32 for partials that a merge combines).
    config: None takes `default_tiles(layout)`.

    interpret: False, or a Mosaic GPU interpret-params object (GPU interpret mode, for tests)."""
    plgpu = compat.plgpu
    if layout not in LAYOUTS:
        raise ValueError(f"layout: the pallas_mosaic_gpu kernel reads fp8_ds_mla, nvfp4_ds_mla and bf16 records, "
                         f"got {layout.kind} records of {layout.record_bytes} bytes")
    t, h, _ = q.shape
    n = records.shape[0]
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype: expected bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    if t == 0 or h == 0 or n == 0:
        out = jnp.zeros((t, h, NOPE_DIM), out_dtype)
        return out, jnp.full((t, h), -jnp.inf, jnp.float32)
    direct = copies_into_k(layout)
    config = config or default_tiles(layout)
    block_k = config.block_k
    converted = converts_in_memory_warpgroup(layout, config, interpret)
    slots = config.k_slots if fills_k_tiles(layout, config, interpret) else 1
    # two K tiles, Q and split scores' exchange took 236,656 bytes of SMEM against the H200's
    # 232,448: Q's RoPE columns (8 KB) move into registers
    rope_in_registers = slots > 1 and config.split_scores
    memory_wgs = memory_warpgroups_of(layout, config, interpret)
    # heads as they come, a multiple of 8 (the SMEM tiles' rows); a block of fewer than 64 is
    # copied in and out as such (no padding to the wgmma's M in GMEM)
    num_heads = -(-h // 8) * 8
    num_blocks = -(-num_heads // HEADS_PER_CTA)
    k = max(indices.shape[1], 1)
    kp = -(-k // block_k) * block_k
    if not top_k_fits(layout, kp):
        raise ValueError(f"indices: the pallas_mosaic_gpu kernel holds a token's index row in shared memory (fp8 "
                         f"and nvfp4 records), at most {MAX_TOP_K} entries; got int32[{t}, {indices.shape[1]}]")
    q16 = q.astype(jnp.bfloat16)
    if num_heads != h:
        q16 = jnp.pad(q16, ((0, 0), (0, num_heads - h), (0, 0)))
    if layout.kind == "nvfp4_groups":                   # the kernel's even / odd order of the NoPE
        q16 = jnp.concatenate([record_codec.split_even_odd(q16[..., :NOPE_DIM]), q16[..., NOPE_DIM:]], axis=-1)
    idx = jnp.pad(indices, ((0, 0), (0, kp - indices.shape[1])), constant_values=-1)
    scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
    rec_scales = records if direct else records_as(records, scale_view_dtype(layout))
    rec_bf16 = records_as(records, jnp.bfloat16)
    zero_row = jnp.zeros((1, NOPE_DIM + ROPE_DIM), jnp.bfloat16)
    swizzled = _swizzled()
    if direct:
        copies, raw, copies_per_row = (), (), 1 if interpret else BF16_CHUNKS
        k_shape = (slots, block_k, NOPE_DIM + ROPE_DIM)
        # the interpreter has no tiles or swizzles: its copies write whole rows of k_smem.  Compiled,
        # the two views share their first byte (a union of two single refs; the documented
        # contract promises no layout, so the compiled bf16 tests check every output value)
        k_views = [plgpu.SMEM(k_shape, jnp.bfloat16)] if interpret else [
            plgpu.SMEM(k_shape, jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((slots * block_k * BF16_CHUNKS, BF16_CHUNK_COLUMNS), jnp.bfloat16,
                       transforms=(plgpu.TilingTransform((1, BF16_CHUNK_COLUMNS)), plgpu.SwizzleTransform(128)))]
    elif converted:
        copies, raw, copies_per_row = record_copies(layout), (), 1
        k_views = [plgpu.SMEM((slots, block_k, NOPE_DIM + ROPE_DIM), jnp.bfloat16, transforms=swizzled)]
    else:
        copies, copies_per_row = record_copies(layout), COPIES_PER_ROW
        scale_dtype = scale_view_dtype(layout)
        pad = lambda dtype: ROW_PAD_BYTES // jnp.dtype(dtype).itemsize
        raw = (plgpu.SMEM((block_k, copies[0][1] + pad(jnp.uint8)), jnp.uint8),
               plgpu.SMEM((block_k, copies[1][1] + pad(scale_dtype)), scale_dtype),
               plgpu.SMEM((block_k, ROPE_DIM + pad(jnp.bfloat16)), jnp.bfloat16))
        k_views = [plgpu.SMEM((block_k, NOPE_DIM + ROPE_DIM), jnp.bfloat16, transforms=swizzled)]
    # a partial block's output, staged where the K tiles were (at most 64 KB: within one K tile;
    # jax 0.10's interpreter hangs on that union: there it is allocated apart)
    k_views.append(plgpu.SMEM((2, HEADS_PER_CTA, PART), out_dtype))
    k_views = tuple(k_views) if interpret else plgpu.RefUnion(*k_views)
    split = config.split_scores
    issuers = config.copy_issuers
    per_slot = _copy_barriers_per_slot(issuers)
    kernel = functools.partial(_kernel, kind=layout.kind, copies=copies, segments=lane_segments(layout),
                               num_records=n, record_bytes=layout.record_bytes, top_k=kp, block_k=block_k,
                               slots=slots, issuers=issuers, converted=converted, split=split,
                               rope_in_registers=rope_in_registers, compute_registers=config.compute_registers,
                               memory_registers=config.memory_registers(memory_wgs), memory_wgs=memory_wgs,
                               num_heads=num_heads, interpret=bool(interpret))
    # the tile scales (fp8) and the exchange of split scores, minimal where unused (and then one
    # allocation: each is aligned on its own)
    if rope_in_registers:   # Q's RoPE arrives there; each half of the weights is a column of tiles
        p_smem = plgpu.SMEM((HEADS_PER_CTA, block_k), jnp.bfloat16,
                            transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)))
    else:
        p_smem = plgpu.SMEM((HEADS_PER_CTA, block_k + ROW_PAD_BYTES // 2) if split else (8, 8), jnp.bfloat16)
    exchange = (plgpu.SMEM((slots * NUM_PARTS, block_k) if layout.kind == "fp8_tiles" else (1, 8), jnp.float32),
                p_smem,
                plgpu.SMEM((2, HEADS_PER_CTA) if split else (1, 8), jnp.float32),
                plgpu.SMEM((6, HEADS_PER_CTA) if split else (1, 8), jnp.float32))
    if direct and not split:
        exchange = plgpu.RefUnion(*exchange)     # unused: aliased
    smem = [
        plgpu.SMEM((HEADS_PER_CTA, NOPE_DIM if rope_in_registers else NOPE_DIM + ROPE_DIM), jnp.bfloat16,
                   transforms=swizzled),
        plgpu.SMEM((slots, block_k) if fills_k_tiles(layout, config, interpret) else (kp,), jnp.int32),
        raw,
        k_views,
        exchange,
        plgpu.SMEM((slots, 2), jnp.int32),       # lane_bars: an mbarrier (8 bytes) per slot
    ]
    extra = {"interpret": interpret} if interpret else {}
    out, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((t, num_heads, NOPE_DIM), out_dtype),
                  jax.ShapeDtypeStruct((t, num_blocks * HEADS_PER_CTA), jnp.float32)),
        grid=(t, num_blocks), grid_names=("t", "hb"), num_threads=2 + memory_wgs, thread_name="wg",
        scratch_types=smem + [
            plgpu.Barrier(num_arrivals=2 if rope_in_registers else 1, num_barriers=1),     # Q's copies
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
            plgpu.Barrier(num_arrivals=copies_per_row * block_k // per_slot, num_barriers=slots * per_slot),
            plgpu.Barrier(num_arrivals=2, num_barriers=6),
            plgpu.Barrier(num_arrivals=2, num_barriers=slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=slots),
        ],
        # Lane semantics (jax 0.11's default is Warpgroup, whose layout inference cannot place
        # the 1-D index and scale vectors): the layouts are the kernel's own
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name=f"ckv_sparse_mla_attention_mgpu_{layout.kind}", **extra,
    )(idx, counts, scale, q16, records, rec_scales, rec_bf16, zero_row)
    out = out[:, :h]
    if layout.kind == "nvfp4_groups":                   # even elements, then odd -> interleaved
        out = record_codec.join_even_odd(out)
    return out, lse[:, :h]
