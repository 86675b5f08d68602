"""A CUDA root that is jax's own but for the PTX assembler: ptxas (and nvlink, which XLA checks
beside it) taken from an `nvidia-cuda-nvcc` wheel of another CUDA release.

    python tools/cuda_root_overlay.py --wheel nvidia_cuda_nvcc-13.5.37-...whl --out /tmp/cuda_overlay
    CUDA_ROOT=/tmp/cuda_overlay python ...        # Mosaic GPU kernels then assemble with that ptxas

Why: whether ptxas keeps a kernel's wgmmas in flight is the assembler's choice and it changes
between releases (the fp8 attention kernel at 208 registers a compute thread: ptxas 13.0.88
serializes them, C7512; 13.5.37 does not; `tools/compile_offline.py`).  With the overlay on every
route to an assembler (`CUDA_ROOT`, XLA's `--xla_gpu_cuda_data_dir`, Mosaic GPU's default data dir
./cuda_sdk_lib and PATH, as `STAGES=ptxas` of tools/device_run.sh sets them) a device times one
kernel under both assemblers without installing anything but the wheel it carries.

The overlay mirrors the current root (`current_cuda_root`, or --root) with symlinks, every entry
but bin/ptxas and bin/nvlink, which are extracted from the wheel.  It prints the overlay's path
and both assemblers' versions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPLACED = ("ptxas", "nvlink")


def current_cuda_root() -> Path:
    """The CUDA root whose ptxas this process would run: jax's (`CUDA_ROOT`, else the nvidia pip
    package holding bin/ptxas; jax 0.10-0.11 write the string "None" when there is none), else
    that of the ptxas on PATH, else /usr/local/cuda."""
    from jax._src import lib
    candidates = [Path(lib.cuda_path)] if lib.cuda_path else []
    on_path = shutil.which("ptxas")
    candidates += [Path(on_path).resolve().parents[1]] if on_path else []
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if (root / "bin" / "ptxas").is_file():
            return root
    raise SystemExit(f"no CUDA root with bin/ptxas among {', '.join(map(str, candidates))}: pass --root")


def build_overlay(root: Path, wheel: Path, out: Path) -> Path:
    """out: root mirrored by symlinks, with bin/ptxas and bin/nvlink from `wheel`."""
    if not (root / "bin" / "ptxas").is_file():
        raise SystemExit(f"--root: {root} has no bin/ptxas")
    with zipfile.ZipFile(wheel) as archive:
        members = {Path(name).name: name for name in archive.namelist()
                   if Path(name).parent.name == "bin" and Path(name).name in REPLACED}
        missing = [tool for tool in REPLACED if tool not in members]
        if missing:
            raise SystemExit(f"--wheel: {wheel.name} has no bin/{', bin/'.join(missing)} (not an nvidia-cuda-nvcc wheel)")
        (out / "bin").mkdir(parents=True, exist_ok=True)
        for entry in root.iterdir():
            if entry.name != "bin":
                _link(entry, out / entry.name)
        for entry in (root / "bin").iterdir():
            if entry.name not in REPLACED:
                _link(entry, out / "bin" / entry.name)
        for tool, name in members.items():
            target = out / "bin" / tool
            if target.is_symlink() or target.exists():
                target.unlink()
            target.write_bytes(archive.read(name))
            target.chmod(0o755)
    return out


def _link(source: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(source.resolve())


def ptxas_version(root: Path) -> str:
    done = subprocess.run([str(root / "bin" / "ptxas"), "--version"], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-2] if len(lines) >= 2 else done.stdout.strip() or done.stderr.strip()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python tools/cuda_root_overlay.py", description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, required=True, help="an nvidia-cuda-nvcc wheel (its bin/ptxas, bin/nvlink)")
    ap.add_argument("--out", type=Path, required=True, help="where the overlay goes")
    ap.add_argument("--root", type=Path, help="the CUDA root to mirror (default: the one whose ptxas runs here)")
    args = ap.parse_args(argv)
    if not args.wheel.is_file():
        raise SystemExit(f"--wheel: no file {args.wheel}")
    root = args.root or current_cuda_root()
    out = build_overlay(root, args.wheel, args.out)
    print(f"# {root}: {ptxas_version(root)}", file=sys.stderr)
    print(f"# {out}: {ptxas_version(out)}", file=sys.stderr)
    print(os.fspath(out))


if __name__ == "__main__":
    sys.exit(main())
