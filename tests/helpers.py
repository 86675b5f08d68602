"""Random inputs, comparisons and worker processes shared by the tests."""
import dataclasses
import os
import re
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

import oracle
from ckv_jax.placement import DCP_AXIS

ON_GPU = jax.default_backend() == "gpu"
# XLA on CPU flushes subnormal float32 results (decode's products); GPU backends keep them.
FLUSHES_SUBNORMALS = not ON_GPU


def random_kv(rng, tokens, nope=512, rope=64, dtype=ml_dtypes.bfloat16):
    """Latents with per-token magnitudes spanning 1e-3..1e3 and a bf16 RoPE key."""
    mag = 10.0 ** rng.uniform(-3, 3, (tokens, 1))
    kv_c = (rng.standard_normal((tokens, nope)) * mag).astype(dtype)
    k_pe = (rng.standard_normal((tokens, rope)) * 4).astype(ml_dtypes.bfloat16)
    return kv_c, k_pe


def oracle_records(name, kv_c, k_pe, flush=False):
    return oracle.ENCODERS[name](np.asarray(kv_c).astype(np.float32), np.asarray(k_pe), flush_subnormals=flush)


def assert_bytes_equal(got, want, what="records"):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first at {bad[:4].tolist()}: " \
        f"got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"


def assert_bf16_bits_equal(got, want, what="values"):
    """bf16 arrays equal bit for bit, except that any NaN matches any NaN (NaN positions must
    agree): XLA on CPU quiets signaling NaNs and GPUs return a canonical NaN."""
    got, want = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    nan_got, nan_want = (((w & 0x7FFF) > 0x7F80) for w in (got, want))
    np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"{what}: NaN positions differ")
    assert_bytes_equal(np.where(nan_want, 0, got), np.where(nan_want, 0, want), what)


def nvfp4_every_code_and_scale():
    """u8[16, 432] nvfp4_ds_mla records in which every e2m1 code meets every e4m3 scale byte
    (NaN scales 0x7F and 0xFF included) at an even and at an odd element: record t's group g has
    scale byte (32t + g) % 256 and its 16 elements hold codes (j + t // 8) % 16, so the two
    groups sharing a scale byte hold each code at opposite parities.  RoPE bytes are random."""
    t = np.arange(16)[:, None, None]
    codes = ((np.arange(16)[None, None, :] + t // 8) % 16).astype(np.uint8)
    codes = np.broadcast_to(codes, (16, 32, 16)).reshape(16, 256, 2)
    records = np.zeros((16, 432), np.uint8)
    records[:, :256] = codes[:, :, 0] | (codes[:, :, 1] << 4)
    records[:, 256:288] = (32 * np.arange(16)[:, None] + np.arange(32)) % 256
    records[:, 304:] = np.random.default_rng(16).integers(0, 256, (16, 128), dtype=np.uint8)
    return records


def fp8_every_code():
    """u8[10, 656] fp8_ds_mla records: records 0 and 1 hold every finite e4m3 code (and zeros of
    both signs) in opposite orders, so each code sits at an even and at an odd byte; records 2-9
    one NaN code each (0x7F or 0xFF, at bytes 0, 1, 2, 3, 129, 258, 387 and 511: both bytes of a
    pair, both pairs of a word, every 128-byte tile) among random finite codes.  Tile scales are
    powers of two (the products stay exact in bf16); RoPE values random and finite."""
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]                                     # 254 codes
    rng = np.random.default_rng(8)
    records = np.zeros((10, 656), np.uint8)
    records[0, :512] = np.resize(finite, 512)
    records[1, :512] = records[0, 511::-1]
    records[2:, :512] = rng.choice(finite, (8, 512))
    for r, at in enumerate((0, 1, 2, 3, 129, 258, 387, 511)):
        records[2 + r, at] = (0x7F, 0xFF)[r % 2]
    scales = np.float32(2.0) ** rng.integers(-8, 9, (10, 4)).astype(np.float32)
    records[:, 512:528] = scales.view(np.uint8)
    records[:, 528:] = rng.standard_normal((10, 64)).astype(ml_dtypes.bfloat16).view(np.uint8)
    return records


def fp8_division_tiles(rng, tiles=4096):
    """(x: f32[tiles, 128], scale: f32[tiles]): fp8 tiles whose quotients x / scale are hard to
    round.  Scales are those of tile maxima with exponents -149..127 (FLT_MIN clamps and scales
    below 2**-92 included) and +Inf; each tile's x lie within 3 ulps of scale * v for e4m3 values
    and midpoints v (and the 448 boundary), with random signs, plus random x in the tile, zeros of
    both signs and, in Inf tiles, +-Inf and NaN."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    targets = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2, [448.0, 2.0 ** -10]]).astype(np.float32)
    amax = (rng.uniform(1, 2, tiles) * 2.0 ** rng.integers(-149, 128, tiles)).astype(np.float32)
    amax = np.where(np.isfinite(amax) & (amax > 0), amax, np.float32(1.0))
    with np.errstate(under="ignore"):
        scale = np.maximum((amax.astype(np.float64) / 448).astype(np.float32), np.finfo(np.float32).tiny)
    scale[:16] = np.inf
    v = rng.choice(targets, (tiles, 128))
    with np.errstate(invalid="ignore", over="ignore"):        # Inf tiles: replaced below
        x = (scale[:, None].astype(np.float64) * v).astype(np.float32)
    x = (x.view(np.int32) + rng.integers(-3, 4, x.shape, dtype=np.int32)).view(np.float32)
    x[:, 96:] = (amax[:, None] * rng.uniform(-1, 1, (tiles, 32))).astype(np.float32)
    x = np.where(np.abs(x) <= amax[:, None], x, amax[:, None])    # x stays within its tile's amax
    x *= rng.choice(np.float32([-1, 1]), x.shape)
    x[:, :2] = [0.0, -0.0]
    x[:16, 2:6] = [np.inf, -np.inf, np.nan, 1.0]
    return x, scale


HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, extra_args, *, num=2, timeout=240, wait_for=None, platform="cpu"):
    """Run `num` JAX processes of tests/`script` with arguments (pid, num, port, *extra_args(pid))
    on `platform` ("cpu", or "cuda": the worker picks its GPU); wait for those in `wait_for`
    (default all), then kill any still running.
    Returns (processes, {pid: combined stdout and stderr of the awaited ones})."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = platform
    if platform == "cuda":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"      # two processes' JAX and torch share each GPU
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), str(pid), str(num), str(port),
                               *extra_args(pid)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for pid in range(num)]
    logs = {}
    try:
        for pid in range(num) if wait_for is None else wait_for:
            logs[pid] = procs[pid].communicate(timeout=timeout)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return procs, logs


def copies_of_at_least(hlo_text, num_elements):
    """Instructions of an optimized HLO module that copy a uint8 buffer of >= num_elements:
    `copy` / `copy-start`, and a `dynamic-update-slice` standing outside a fusion (one that XLA
    did not fuse with the producer of its update writes that update twice).  The bodies of
    fusions are skipped: what a fusion computes is written once, in place."""
    fused = set(re.findall(r"\sfusion\(.*?calls=(%[\w.-]+)", hlo_text))
    found, skipping = [], False
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.-]+) .*\{$", line)
        if head:
            skipping = head.group(1) in fused
            continue
        m = re.search(r"=\s*u8\[([0-9,]+)\]\S*\s+(?:copy|copy-start|dynamic-update-slice)\(", line)
        if m and not skipping and int(np.prod([int(d) for d in m.group(1).split(",")])) >= num_elements:
            found.append(m.group(0))
    return found


def edge_case_kv():
    """Rows: zero tiles, +-448 boundaries, bf16 extremes, NaN/Inf, subnormals, tiny tiles."""
    bf = ml_dtypes.bfloat16
    finfo = ml_dtypes.finfo(bf)
    rng = np.random.default_rng(3)
    kv = (rng.standard_normal((12, 512))).astype(np.float32)
    kv[0] = 0.0                                           # all-zero record
    kv[1, :128] = 0.0                                     # one zero tile, others random
    kv[1, 128:144] = 0.0                                  # one zero nvfp4 group
    kv[2, :128] = np.linspace(-1, 1, 128) * 3.0           # +-amax hits exactly +-448 after scaling
    kv[2, 128:256] = 448.0 * (1 + np.arange(128) % 3 * 2.0 ** -7)  # values at and just above 448
    kv[3, :] = float(finfo.max) * np.sign(rng.standard_normal(512))   # bf16 max, both signs
    kv[4, :] = float(finfo.smallest_normal) * (1 + np.arange(512) % 4)  # smallest normals
    kv[5, 7] = np.nan                                     # NaN ignored by amax, encodes as NaN / +6
    kv[5, 300] = -np.nan
    kv[5, 384:] = np.nan                                  # an all-NaN fp8 tile (8 all-NaN nvfp4 groups)
    kv[5, 448:] = -np.nan
    kv[6, 200] = np.inf                                   # Inf tile: scale Inf / 448
    kv[6, 400] = -np.inf
    kv[7, ::2] = float(finfo.smallest_subnormal) * 5      # float32 subnormals in every tile
    kv[8, :] = float(finfo.smallest_subnormal) * (np.arange(512) % 7 - 3)  # an all-subnormal record
    kv[9, :64] = 1e-30                                    # tiny tile: scale clamps to FLT_MIN region
    kv[10, :] = -0.0                                      # negative zeros
    kv[11, :16] = 6.0 * 448                               # nvfp4 scale saturates near e4m3 max
    kv_bf16 = kv.astype(bf)
    k_pe = rng.standard_normal((12, 64)).astype(bf)
    k_pe[0, :4] = [finfo.max, -finfo.max, finfo.smallest_subnormal, np.nan]
    k_pe[1, :2] = [np.inf, -0.0]
    return kv_bf16, k_pe


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the kernel selection reads of a device: its kind (the measured table's key), platform
    and compute capability."""
    device_kind: str = "no measured table"
    platform: str = "gpu"
    compute_capability: str = "9.0"


def mesh_of(d):
    """A real d-device mesh: the default backend's devices, or the CPU devices the test session
    creates (JAX_NUM_CPU_DEVICES=4) on a machine with fewer accelerators."""
    devices = jax.devices() if len(jax.devices()) >= d else jax.devices("cpu")
    if len(devices) < d:
        pytest.fail(f"needs {d} devices; the test session sets JAX_NUM_CPU_DEVICES=4")
    return jax.make_mesh((d,), (DCP_AXIS,), devices=devices[:d])


def ancestors(ins, name, seen=None):
    """Every instruction `name` depends on, in `entry_instructions`' map."""
    seen = set() if seen is None else seen
    for op in ins.get(name, (0, [], ""))[1]:
        if op not in seen:
            seen.add(op)
            ancestors(ins, op, seen)
    return seen


def entry_instructions(hlo_text):
    """name -> (position, operand names) of the scheduled ENTRY computation of an optimized module."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    out = {}
    for i, line in enumerate(entry.splitlines()[1:]):
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = .*?[\w-]+\((.*?)\)", line)
        if m:
            out[m.group(1)] = (i, re.findall(r"%[\w.-]+", m.group(2)), line)
    return out
