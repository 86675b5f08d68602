"""Compile configs of the Mosaic GPU attention kernel for sm_90a on a machine without a GPU, and
read what ptxas made of each: registers, spills, and each warpgroup's SASS (`sass_regions`).

    python tools/compile_offline.py --plugin DIR/jax_plugins/xla_cuda13/xla_cuda_plugin.so \\
        --format fp8_ds_mla --heads 64 \\
        --mosaic-configs 'copy_issuers=128,k_slots=2,compute_registers=208;...' [--out DIR]

Without --mosaic-configs it compiles the format's default config.  Per config it writes
DIR/<n>/kernel.ptx, ptxas.txt (`ptxas -v`) and sass_regions.txt, and it prints one table: the
registers a thread launches with, the spill bytes, whether ptxas had to serialize the wgmmas, and
per warpgroup region the instructions and spill instructions of its loop over tiles.  A config
that ptxas rejects fails here, not on the GPU.

Needs, besides jax: the CUDA PJRT plugin of the same jax version, unpacked (`pip download
--no-deps jax-cuda13-pjrt==$(python -c 'import jax; print(jax.__version__)')`, then unzip; the
library is `jax_plugins/xla_cuda13/xla_cuda_plugin.so`); a CUDA toolkit's ptxas on PATH (the
plugin calls it too) and nvdisasm (NVIDIA's pip wheels have both); a C compiler (`cc`) and `nm`.

How: lowering for CUDA gives the kernel's Mosaic GPU module (the serialized MLIR the custom call
carries).  The plugin's `MosaicGpuCompile` (which jax's torch interop calls) runs Mosaic's pass
pipeline, LLVM's NVPTX backend and ptxas on it, writing the PTX where `MOSAIC_GPU_DUMP_TO` says.
It first asks the CUDA driver for the current device's compute capability: a stand-in
`libcuda.so.1`, built here from a few lines of C, answers 9.0 and fails the module load that
comes after the PTX is written.  It also needs LLVM's NVPTX target registered, which XLA's GPU
client does in a real process: the compile runs in a child process that first calls the
plugin's `mosaic::gpu::EnsureLLVMNVPTXTargetIsRegistered`, found in its symbol table.  The
counts are static, from the local ptxas: they rank configs before a GPU times them, nothing more.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import sass_regions  # noqa: E402
from tune import ATTENTION_SHAPE as SHAPE, parse_mosaic_configs  # noqa: E402

from ckv_jax import formats  # noqa: E402
from pallas_kernels.sparse_mla_attention import pallas_mosaic_gpu as mosaic  # noqa: E402

MOSAIC_CUSTOM_CALL = "mosaic_gpu_v2"
REGISTER_TARGET = "_ZN6mosaic3gpu33EnsureLLVMNVPTXTargetIsRegisteredEv"   # mosaic::gpu::EnsureLLVMNVPTXTargetIsRegistered()
COMPILE_ENTRY = "MosaicGpuCompile"
WGMMA_SERIALIZED = "C7512"            # ptxas: "wgmma.mma_async instructions are serialized due to ..."

# What the compile asks of the CUDA driver, answered for an H200 (compute capability 9.0); every
# other entry point the plugin looks up is absent, and the module load fails as with no device.
STAND_IN_DRIVER = r"""
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CUDA_ERROR_NO_DEVICE 100
int cuInit(unsigned flags) { return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
int cuCtxGetDevice(int *device) { *device = 0; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
  if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) { *value = 9; return 0; }
  if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) { *value = 0; return 0; }
  return CUDA_ERROR_NO_DEVICE;
}
int cuGetErrorString(int error, const char **text) { *text = "no device (compile_offline's stand-in driver)"; return 0; }
int cuModuleLoadData(void **module, const void *image) { return CUDA_ERROR_NO_DEVICE; }
"""


def build_stand_in_driver(directory: Path) -> Path:
    """Build the stand-in driver as directory/libcuda.so.1 (the name the plugin opens)."""
    source, library = directory / "stand_in_cuda.c", directory / "libcuda.so.1"
    source.write_text(STAND_IN_DRIVER)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("a C compiler (cc or gcc on PATH) builds the stand-in CUDA driver; none was found")
    done = subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"building the stand-in CUDA driver failed:\n{done.stderr.strip()}")
    return library


def mosaic_module(format_name: str, heads: int, config: mosaic.MosaicAttentionTiles, out_dtype=jnp.bfloat16) -> bytes:
    """The serialized Mosaic GPU module of the attention kernel for records of `format_name`,
    `heads` query heads, `config` and output in `out_dtype` (float32: the partials of stock
    DCP), as the custom call of its CUDA lowering carries it, at the tuning sweep's shape (the
    record count and the top-k are constants of the kernel)."""
    layout = formats.get(format_name).layout
    sds = jax.ShapeDtypeStruct
    lowered = jax.jit(lambda q, r, i, c: mosaic.sparse_mla_attention_mosaic(
        q, r, i, c, 0.04, layout=layout, config=config, out_dtype=out_dtype)).trace(
        sds((SHAPE["tokens"], heads, 576), jnp.bfloat16), sds((SHAPE["rows"], layout.record_bytes), jnp.uint8),
        sds((SHAPE["tokens"], SHAPE["top_k"]), jnp.int32), sds((SHAPE["tokens"],), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    modules = [op.attributes["mhlo.backend_config"]["module"].value_bytes
               for op in _operations(lowered.compiler_ir("stablehlo").operation)
               if op.name == "stablehlo.custom_call"
               and op.attributes["call_target_name"].value == MOSAIC_CUSTOM_CALL]
    if len(modules) != 1:
        raise RuntimeError(f"expected one {MOSAIC_CUSTOM_CALL} custom call in the lowering, found {len(modules)}")
    return modules[0]


def _operations(op):
    for region in op.regions:
        for block in region:
            for inner in block:
                yield inner
                yield from _operations(inner)


def compile_to_ptx(module: bytes, plugin: Path, driver_dir: Path, out_dir: Path) -> Path:
    """Compile `module` with the plugin in a child process (the stand-in driver must be found
    when the plugin opens libcuda.so.1); the PTX it dumped, moved to out_dir/kernel.ptx."""
    dump = out_dir / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    (out_dir / "module.mlirbc").write_bytes(module)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        raise SystemExit("ptxas: not on PATH (the plugin assembles the PTX with it; a CUDA toolkit's, or from "
                         "NVIDIA's pip wheel)")
    # the plugin builds no pass pipeline without a CUDA root named (any directory will do: it
    # finds libdevice and ptxas by its own search)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, (str(driver_dir),
                                                                       os.environ.get("LD_LIBRARY_PATH")))),
               MOSAIC_GPU_CUDA_ROOT=str(Path(ptxas).resolve().parents[1]),
               MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump))
    done = subprocess.run([sys.executable, __file__, "--child", str(plugin), str(out_dir / "module.mlirbc")],
                          env=env, capture_output=True, text=True)
    (out_dir / "compile.log").write_text(done.stdout + done.stderr)
    ptx = sorted(dump.glob("*.ptx"))
    if len(ptx) != 1:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"the plugin wrote {len(ptx)} PTX files (expected 1); {out_dir / 'compile.log'} ends:\n{tail}")
    kernel = out_dir / "kernel.ptx"
    ptx[0].replace(kernel)
    shutil.rmtree(dump)                 # the pass log beside it is tens of MB
    return kernel


def child_compile(plugin: str, module_path: str) -> None:
    """In the child: register LLVM's NVPTX target, then MosaicGpuCompile(module).  The compile
    itself ends in a failed module load (no device); the dumped PTX is what the parent reads."""
    library = ctypes.CDLL(plugin)
    symbols = _symbol_addresses(plugin, (COMPILE_ENTRY, REGISTER_TARGET))
    entry = library.MosaicGpuCompile
    base = ctypes.cast(entry, ctypes.c_void_p).value - symbols[COMPILE_ENTRY]
    ctypes.CFUNCTYPE(None)(base + symbols[REGISTER_TARGET])()
    entry.argtypes = [ctypes.c_char_p, ctypes.c_int]
    entry.restype = ctypes.c_void_p
    module = Path(module_path).read_bytes()
    entry(module, len(module))


def _symbol_addresses(library: str, names) -> dict[str, int]:
    try:
        listing = subprocess.run(["nm", library], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"nm {library} failed ({e}): the plugin's symbol table is needed")
    found = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in names:
            found[parts[2]] = int(parts[0], 16)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"--plugin: {library} has no symbol {', '.join(missing)} (not a CUDA PJRT plugin of a jax "
                         "with Mosaic GPU, or a version whose compile entry changed)")
    return found


def check_plugin(path: Path) -> None:
    """The plugin must exist and, where its wheel's metadata lies beside it, match jax's version
    (the module's serialization is versioned with jax)."""
    if not path.is_file():
        raise SystemExit(f"--plugin: no file {path}")
    for info in path.parents[2].glob("jax_cuda*_pjrt-*.dist-info") if len(path.parents) > 2 else ():
        version = info.name.removesuffix(".dist-info").split("-")[1]
        if version != jax.__version__:
            raise SystemExit(f"--plugin: {info.name} is for jax {version}, this is jax {jax.__version__}")


def summary_row(label: str, ptxas_report: str, sass: str) -> str:
    """One line of the table: the launch registers, spill bytes, whether ptxas serialized the
    wgmmas (its C7512: each waits for the one before, for want of registers to keep them in
    flight), and per region the loop's instructions / spill instructions."""
    registers = re.search(r"Used (\d+) registers", ptxas_report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_report)
    cells = [label, registers.group(1) if registers else "?",
             f"{spills.group(1)}/{spills.group(2)}" if spills else "?",
             "serialized" if WGMMA_SERIALIZED in ptxas_report else "async"]
    for name, ops, loop in sass_regions.regions(sass):
        if name == "entry":
            continue
        code = loop or ops
        cells.append(f"{name.split()[0].split('.')[1].lower()}{_registers_of(name)}: {len(code)}/"
                     f"{sass_regions.spill_count(code)}")
    return " | ".join(cells)


def _registers_of(region_name: str) -> str:
    m = re.search(r"\((\d+) registers\)", region_name)
    return f"@{m.group(1)}" if m else ""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_compile(*argv[1:])
    ap = argparse.ArgumentParser(prog="python tools/compile_offline.py", description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", type=Path, required=True, help="the CUDA PJRT plugin library (xla_cuda_plugin.so)")
    ap.add_argument("--format", default="fp8_ds_mla", choices=formats.names(), help="record format (default %(default)s)")
    ap.add_argument("--heads", type=int, default=64, help="query heads (default %(default)s)")
    ap.add_argument("--out-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the kernel's output (default %(default)s; float32: stock DCP's partials)")
    ap.add_argument("--mosaic-configs", help="'field=value,...;...' configs (default: the format's default)")
    ap.add_argument("--out", type=Path, help="where each config's files go (default: a temporary directory)")
    ap.add_argument("--nvdisasm", default="nvdisasm", help="nvdisasm executable (default: on PATH)")
    ap.add_argument("--top", type=int, default=24, help="opcodes listed per region in sass_regions.txt")
    args = ap.parse_args(argv)
    check_plugin(args.plugin)
    layout = formats.get(args.format).layout
    try:
        configs = (parse_mosaic_configs(args.mosaic_configs) if args.mosaic_configs
                   else [mosaic.default_tiles(layout)])
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    out = args.out or Path(tempfile.mkdtemp(prefix="compile_offline_"))
    with tempfile.TemporaryDirectory() as tmp:
        driver_dir = build_stand_in_driver(Path(tmp)).parent
        rows = []
        for n, config in enumerate(configs):
            where = out / str(n)
            where.mkdir(parents=True, exist_ok=True)
            (where / "config.txt").write_text(f"{args.format} heads={args.heads} out={args.out_dtype} {config}\n")
            ptx = compile_to_ptx(mosaic_module(args.format, args.heads, config, jnp.dtype(args.out_dtype)),
                                 args.plugin, driver_dir, where)
            ptxas_report, sass = sass_regions.assemble(ptx, "ptxas", args.nvdisasm, "sm_90a", None)
            (where / "ptxas.txt").write_text(ptxas_report)
            (where / "sass_regions.txt").write_text(sass_regions.report(sass, args.top) + "\n")
            rows.append(summary_row(str(n), ptxas_report, sass))
            print(f"{n}: {config}", flush=True)
    print(f"\n{args.format}, {args.heads} heads, {args.out_dtype} out; files in {out}")
    print("config | registers at launch | spill bytes stored/loaded | wgmma | per region: loop instructions/spills")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
