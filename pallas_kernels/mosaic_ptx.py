"""Inline PTX for Mosaic GPU kernels written in Pallas, for what Pallas does not expose: copies
that every thread of a warpgroup issues on its own (`cp.async`, 16 bytes each) and the mbarriers
that track them.  Each function emits MLIR where a `plgpu.inline_mgpu` body runs (lane semantics:
every thread of the calling warpgroup runs it); addresses are i64 values (`address`), predicates
i1, counts i32.

Why per-thread copies: a Pallas copy (`plgpu.copy_gmem_to_smem`) is one bulk copy issued by one
elected thread, with an mbarrier arrival per copy.  A kernel that gathers records row by row
issues hundreds of them per tile from a few threads, and that issue rate bounds it.  Here a
warpgroup's 128 threads each issue their share, and each thread's arrival (`arrive_when_done`)
fires once all of its copies landed.

`cp.async` writes shared memory through the generic proxy: a wgmma (async proxy) that reads what
it wrote needs `fence_proxy_async` after the barrier wait.  A `cp.async` writes bytes as they are
(no tensor map, so no swizzle): a kernel whose destination is swizzled computes the swizzled
address of every 16-byte chunk itself.
"""
from __future__ import annotations

from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import compat

# the builders (jax internals, through compat); the kernels' inline bodies use them from here
ir, arith, gpu, llvm, memref = compat.mlir_builders()

CHUNK_BYTES = 16            # one cp.async: the largest copy a thread issues, and its alignment
MBARRIER_BYTES = 8


def i32(value: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(32), value)


def i64(value: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(64), value)


def to_i64(value: ir.Value) -> ir.Value:
    """A signless i32 (or i64) value as i64, sign-extended."""
    if ir.IntegerType(value.type).width == 64:
        return value
    return arith.extsi(ir.IntegerType.get_signless(64), value)


def thread_in_warpgroup() -> ir.Value:
    """i32: this thread's index within its warpgroup of 128."""
    return arith.remui(mgpu_utils.thread_idx(), i32(128))


def address(memref: ir.Value) -> ir.Value:
    """i64: the address of a memref's first element (shared-window address for SMEM, global for
    GMEM), as the PTX below takes it."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), mgpu_utils.memref_ptr(memref))


def _asm(operands, text: str, constraints: str):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), operands, text, constraints, has_side_effects=True)


def copy_16(dst: ir.Value, src: ir.Value, predicate: ir.Value, read: ir.Value):
    """Where `predicate`: write 16 bytes at shared `dst`, asynchronously: where `read`, those at
    global `src` (both 16-byte aligned), else zeros (no byte of `src` is read).  Through L2 only
    (`.cg`: a gathered row is read once per CTA), which fetches the 256 bytes around each chunk
    (a record's chunks are read together, by the threads of a group and by the next copies)."""
    size = arith.select(read, i32(CHUNK_BYTES), i32(0))
    _asm([predicate, dst, src, size], "@$0 cp.async.cg.shared.global.L2::256B [$1], [$2], 16, $3;", "b,l,l,r")


def arrive_when_done(barrier: ir.Value):
    """One arrival on the mbarrier at `barrier`, made when every `copy_16` this thread issued so
    far has landed (`.noinc`: the barrier's expected count includes it)."""
    _asm([barrier], "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "l")


def init_barrier(barrier: ir.Value, count: int, predicate: ir.Value):
    """Where `predicate` (one thread): initialize the mbarrier at `barrier` for `count` arrivals
    a phase.  Make it visible with `fence_barrier_init` and a block-wide sync."""
    _asm([predicate, barrier, i32(count)], "@$0 mbarrier.init.shared::cta.b64 [$1], $2;", "b,l,r")


def fence_barrier_init():
    _asm([], "fence.mbarrier_init.release.cluster;", "")


def sync_block():
    """Every thread of the block reaches this point (`bar.sync 0`)."""
    gpu.barrier()


def wait_parity(barrier: ir.Value, parity: ir.Value):
    """Spin until the phase of the mbarrier at `barrier` with parity `parity` (i32, 0 or 1) has
    completed (acquire: what the arrivals' copies wrote is visible to this thread after it)."""
    _asm([barrier, parity],
         "{\n.reg .pred done;\nwait:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n"
         "@!done bra wait;\n}", "l,r")


def fence_proxy_async():
    """Order this thread's view of shared memory (written through the generic proxy: `copy_16`,
    stores) before its later async-proxy reads of it (wgmma operands)."""
    _asm([], "fence.proxy.async.shared::cta;", "")


# -- Pallas level: called from a kernel body (lane semantics) -----------------------------------

def scalar(array) -> ir.Value:
    """The ir.Value of a scalar passed to an `inline_mgpu` body as `WG_SPLAT(shape=())`."""
    return array.registers.item()


def init_barriers(barriers_ref, num: int, count: int):
    """Initialize `num` mbarriers in `barriers_ref` (SMEM, 8 bytes each: i32[num, 2]) for `count`
    arrivals a phase.  Every thread of the block calls it once, before any warpgroup uses them
    (it ends with a block-wide sync)."""
    plgpu = compat.plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, barriers):
        base = address(barriers)
        first = arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), i32(0))
        for b in range(num):
            init_barrier(arith.addi(base, i64(b * MBARRIER_BYTES)), count, first)
        fence_barrier_init()
        sync_block()

    init(barriers_ref)


def barrier_address(barriers: ir.Value, index: ir.Value) -> ir.Value:
    """i64: the address of mbarrier `index` (i32) of an i32[num, 2] SMEM memref."""
    return arith.addi(address(barriers), arith.muli(to_i64(index), i64(MBARRIER_BYTES)))


def wait(barriers_ref, index, parity, *, fence_async: bool):
    """The calling warpgroup waits for the phase of parity `parity` (0 or 1) of mbarrier `index`
    of `barriers_ref` (both int32 scalars); `fence_async`: then `fence_proxy_async` (the copies'
    bytes are read by a wgmma)."""
    plgpu = compat.plgpu
    splat = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat, splat))
    def body(ctx, barriers, index, parity):
        wait_parity(barrier_address(barriers, scalar(index)), scalar(parity))
        if fence_async:
            fence_proxy_async()

    body(barriers_ref, index, parity)


# -- loads, conversions and stores of one thread (converting in a producer warpgroup) -----------

def _i32_struct(n: int) -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n) + ")>")


def _fields(struct: ir.Value, n: int) -> list[ir.Value]:
    i32_type = ir.IntegerType.get_signless(32)
    return [llvm.extractvalue(i32_type, struct, [k]) for k in range(n)]


def load_16(src: ir.Value, read: ir.Value) -> list[ir.Value]:
    """Four i32: the 16 bytes at global `src` (16-byte aligned, read-only data) where `read`
    (i1), else zeros (nothing read)."""
    out = llvm.inline_asm(
        _i32_struct(4), [read, src],
        "{\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        "@$4 ld.global.nc.L2::256B.v4.u32 {$0, $1, $2, $3}, [$5];\n}",
        "=r,=r,=r,=r,b,l", has_side_effects=True)
    return _fields(out, 4)


def load_4(src: ir.Value, read: ir.Value) -> ir.Value:
    """i32: the 4 bytes at global `src` where `read`, else 0."""
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [read, src],
                           "{\nmov.b32 $0, 0;\n@$1 ld.global.nc.b32 $0, [$2];\n}", "=r,b,l", has_side_effects=True)


def e4m3x4_to_bf16x4(word: ir.Value) -> list[ir.Value]:
    """Two i32, each a bf16x2: the four e4m3 bytes of `word` (i32, byte 0 lowest) as bf16, byte k
    at element k (lower half first).  Exact, NaN kept: e4m3 -> f16 -> f32, whose upper half is the
    bf16 (every e4m3 value is exact in bf16, so the f32's lower 16 bits are zero, and a NaN stays
    a NaN): a byte permute (PRMT, an integer instruction) takes the two upper halves instead of
    the conversion unit's rounding pack (`cvt.rn.bf16x2.f32`, F2FP.BF16.F32.PACK_AB), which would
    be a second conversion-unit instruction a pair beside the e4m3 unpack; f16 -> f32 compiles to
    HADD2.F32 (ptxas 12.9, sm_90a)."""
    out = llvm.inline_asm(
        _i32_struct(2), [word],
        "{\n.reg .b16 pair0, pair1, half0, half1;\n.reg .b32 halves;\n.reg .f32 wide0, wide1;\n"
        "mov.b32 {pair0, pair1}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 halves, pair0;\nmov.b32 {half0, half1}, halves;\n"
        "cvt.f32.f16 wide0, half0;\ncvt.f32.f16 wide1, half1;\nprmt.b32 $0, wide0, wide1, 0x7632;\n"
        "cvt.rn.f16x2.e4m3x2 halves, pair1;\nmov.b32 {half0, half1}, halves;\n"
        "cvt.f32.f16 wide0, half0;\ncvt.f32.f16 wide1, half1;\nprmt.b32 $1, wide0, wide1, 0x7632;\n}",
        "=r,=r,r", has_side_effects=False)
    return _fields(out, 2)


def load_2(src: ir.Value, read: ir.Value) -> ir.Value:
    """i32: the 2 bytes at global `src` (2-byte aligned) zero-extended where `read`, else 0."""
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [read, src],
                           "{\nmov.b32 $0, 0;\n@$1 ld.global.nc.u16 $0, [$2];\n}", "=r,b,l", has_side_effects=True)


# e4m3 pair (the low 16 bits of an i32, byte 0 first) -> two f32, each times 2**14
E4M3X2_TO_F32X2_SCALED = (
    "{\n.reg .b16 pair, half0, half1;\n.reg .b32 halves;\n.reg .f32 wide0, wide1;\n"
    "cvt.u16.u32 pair, $2;\ncvt.rn.f16x2.e4m3x2 halves, pair;\nmov.b32 {half0, half1}, halves;\n"
    "cvt.f32.f16 wide0, half0;\ncvt.f32.f16 wide1, half1;\n"
    "mul.f32 $0, wide0, 0f46800000;\nmul.f32 $1, wide1, 0f46800000;\n}")


def e4m3x2_scales(pair: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Two f32: the e4m3 bytes 0 and 1 of `pair` (i32) as values times 2**14 (exact; NaN kept),
    the group scales `e2m1x8_to_bf16x8` takes."""
    f32 = ir.F32Type.get()
    out = llvm.inline_asm(ir.Type.parse("!llvm.struct<(f32, f32)>"), [pair], E4M3X2_TO_F32X2_SCALED, "=f,=f,r",
                          has_side_effects=False)
    return llvm.extractvalue(f32, out, [0]), llvm.extractvalue(f32, out, [1])


def _e2m1_pair_to_bf16x2(out: str, nibbles: str, selector: str) -> str:
    """PTX: the bf16x2 `out` of two nibbles (bytes `selector` picks from `nibbles`, one a byte)
    times the scale in `scale`: each nibble placed in an f16 as sign, exponent and mantissa bits
    (its e2m1 value times 2**-14, subnormals included), widened and multiplied in f32 (exact,
    and exact in bf16: the products' upper halves, as in `e4m3x4_to_bf16x4`)."""
    return (f"prmt.b32 spread, {nibbles}, 0, {selector};\n"
            "and.b32 sign, spread, 0x00080008;\nshl.b32 sign, sign, 12;\n"
            "and.b32 magnitude, spread, 0x00070007;\nshl.b32 magnitude, magnitude, 9;\n"
            "or.b32 spread, sign, magnitude;\nmov.b32 {half0, half1}, spread;\n"
            "cvt.f32.f16 wide0, half0;\ncvt.f32.f16 wide1, half1;\n"
            "mul.f32 wide0, wide0, scale;\nmul.f32 wide1, wide1, scale;\n"
            f"prmt.b32 {out}, wide0, wide1, 0x7632;\n")


E2M1X8_TO_BF16X8 = (
    "{\n.reg .b32 low, high, spread, sign, magnitude;\n.reg .b16 half0, half1;\n.reg .f32 wide0, wide1, scale;\n"
    "mov.b32 scale, $5;\nand.b32 low, $4, 0x0F0F0F0F;\nshr.b32 high, $4, 4;\nand.b32 high, high, 0x0F0F0F0F;\n"
    + _e2m1_pair_to_bf16x2("$0", "low", "0x4140") + _e2m1_pair_to_bf16x2("$1", "low", "0x4342")
    + _e2m1_pair_to_bf16x2("$2", "high", "0x4140") + _e2m1_pair_to_bf16x2("$3", "high", "0x4342") + "}")


def e2m1x8_to_bf16x8(word: ir.Value, scale: ir.Value) -> tuple[list[ir.Value], list[ir.Value]]:
    """The eight e2m1 codes of `word` (i32: four packed bytes, byte k holding elements 2k (low
    nibble) and 2k + 1 (high)) times `scale` (f32, the group's e4m3 scale times 2**14,
    `e4m3x2_scales`), as bf16 (exact; a NaN scale makes them NaN): two i32 of bf16x2 with the
    low nibbles of bytes 0-3 in order, and two with the high nibbles."""
    out = llvm.inline_asm(_i32_struct(4), [word, scale], E2M1X8_TO_BF16X8, "=r,=r,=r,=r,r,f", has_side_effects=False)
    words = _fields(out, 4)
    return words[:2], words[2:]


def store_16(dst: ir.Value, words: list[ir.Value]):
    """Four i32 to shared `dst` (16-byte aligned)."""
    _asm([dst, *words], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r")


def store_4(dst: ir.Value, word: ir.Value, predicate: ir.Value):
    _asm([predicate, dst, word], "@$0 st.shared.b32 [$1], $2;", "b,l,r")


def prefetch_l2(src: ir.Value, predicate: ir.Value):
    """Where `predicate`: fetch the line of global `src` into L2 (no register, no wait)."""
    _asm([predicate, src], "@$0 prefetch.global.L2 [$1];", "b,l")


def arrive(barrier: ir.Value):
    """One arrival on the mbarrier at `barrier` (release: this thread's writes before it are
    visible to a waiter)."""
    _asm([barrier], "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [$0];\n}", "l")
