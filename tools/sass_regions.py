"""What each warpgroup of a warp-specialized Mosaic GPU kernel executes, read from its SASS on
any machine, without a GPU.

    python tools/sass_regions.py KERNEL.ptx [--ptx-version 8.8] [--arch sm_90a] [--top 24] \
        [--ptxas PATH] [--nvdisasm PATH]

KERNEL.ptx is what `MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR` writes on the GPU beside
ptxas's report.  This assembles it with ptxas (`-v`: registers and spills) and disassembles it
with nvdisasm; both come with a CUDA toolkit or with NVIDIA's pip wheels
(`pip download --no-deps nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm`, unzipped: `bin/ptxas`,
`bin/nvdisasm`).  A PTX whose `.version` is newer than the local ptxas accepts can be assembled
with `--ptx-version` set to the one it names (ptxas then rejects any instruction the older ISA
lacks).

The SASS is split at its `USETMAXREG` instructions: a warp-specialized kernel's warpgroups each
resize their register files as they start (the memory warpgroup's `DEALLOC` to fewer, the compute
warpgroups' `TRY_ALLOC` to more), so the code from one to the next is one warpgroup's, in code
order (ptxas keeps each branch of the entry's warpgroup switch together; a jump out of a region
is not followed).  Per region, and per its largest loop (from a label to a predicated branch
back to it: the loop over tiles, whose instructions run once a tile): the instructions, the spill
instructions among them (`STL`, `LDL`) and the most frequent opcodes.  Counts are static.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# one instruction: its address, an optional predicate, the opcode with its modifiers
SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)")
SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
SASS_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")
SPILLS = ("STL", "LDL")


def spill_count(opcodes) -> int:
    """The spill instructions (local-memory stores and loads) among `opcodes`."""
    return sum(1 for op in opcodes if op.split(".")[0] in SPILLS)


def with_ptx_version(ptx: str, version: str) -> str:
    """ptx with its `.version` directive set to `version` (e.g. "8.8")."""
    if not re.fullmatch(r"\d+\.\d+", version):
        raise ValueError(f"--ptx-version: expected MAJOR.MINOR such as 8.8, got {version!r}")
    out, found = re.subn(r"^\.version\s+\S+", f".version {version}", ptx, count=1, flags=re.MULTILINE)
    if not found:
        raise ValueError("KERNEL.ptx: expected a PTX module with a .version directive")
    return out


def regions(sass: str) -> list[tuple[str, list[str], list[str]]]:
    """[(name, opcodes, loop)] of the SASS text, split before each USETMAXREG; the code before the
    first is "entry".  A region's name is its USETMAXREG instruction and the register count it asks
    for; `loop` is the opcodes of its largest loop (from a label to a predicated branch back to it,
    both in the region: a kernel's loop over tiles), empty if it has none.  Unconditional branches
    back are not loops: ptxas places a barrier wait's retry code after the kernel's end, and it
    jumps back to where the wait was."""
    out = []
    name, ops, labels, loops = "entry", [], {}, []

    def close():
        if ops:
            first, last = max(loops, key=lambda span: span[1] - span[0], default=(0, -1))
            out.append((name, ops, ops[first:last + 1]))

    for line in sass.splitlines():
        label = SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = SASS_INSTRUCTION.match(line)
        if not m:
            continue
        predicated, opcode = m.group(1) is not None, m.group(2)
        if opcode.startswith("USETMAXREG"):
            close()
            count = re.search(r"(0x[0-9a-f]+)\s*;", line)
            registers = f" ({int(count.group(1), 16)} registers)" if count else ""
            name, ops, labels, loops = f"{opcode}{registers}", [], {}, []
        target = SASS_BRANCH.search(line)
        if predicated and target and target.group(1) in labels:
            loops.append((labels[target.group(1)], len(ops)))
        ops.append(opcode)
    close()
    return out


def report(sass: str, top: int) -> str:
    lines = []
    for name, ops, loop in regions(sass):
        for what, code in ((f"== {name}", ops), ("   its largest loop", loop)):
            if not code:
                continue
            counts = collections.Counter(code)
            lines.append(f"{what}: {len(code)} instructions, {spill_count(code)} spill instructions (STL/LDL)")
            lines += [f"{n:7d} {op}" for op, n in counts.most_common(top)]
    return "\n".join(lines)


def assemble(ptx_path: Path, ptxas: str, nvdisasm: str, arch: str, ptx_version: str | None) -> tuple[str, str]:
    """(ptxas's -v report, nvdisasm's SASS) of the PTX at ptx_path."""
    ptx = ptx_path.read_text()
    if ptx_version:
        ptx = with_ptx_version(ptx, ptx_version)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        assembled = _run([ptxas, f"-arch={arch}", "-v", "-o", str(cubin), str(src)], "--ptxas")
        return assembled.stderr + assembled.stdout, _run([nvdisasm, "-c", str(cubin)], "--nvdisasm").stdout


def _run(cmd: list[str], flag: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"{flag}: no executable {cmd[0]!r} (a CUDA toolkit's, or from NVIDIA's pip wheel)")
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
    return done


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python tools/sass_regions.py", description=__doc__.splitlines()[0])
    ap.add_argument("ptx", type=Path, help="a kernel's PTX, as MOSAIC_GPU_DUMP_PTXAS=1 writes it")
    ap.add_argument("--ptxas", default="ptxas", help="ptxas executable (default: on PATH)")
    ap.add_argument("--nvdisasm", default="nvdisasm", help="nvdisasm executable (default: on PATH)")
    ap.add_argument("--arch", default="sm_90a", help="target (default %(default)s)")
    ap.add_argument("--ptx-version", help="assemble with this .version (MAJOR.MINOR) instead of the file's")
    ap.add_argument("--top", type=int, default=24, help="opcodes listed per region (default %(default)s)")
    args = ap.parse_args(argv)
    if not args.ptx.is_file():
        ap.error(f"KERNEL.ptx: no file {args.ptx}")
    if args.top < 1:
        ap.error(f"--top: expected a positive count, got {args.top}")
    try:
        ptxas_report, sass = assemble(args.ptx, args.ptxas, args.nvdisasm, args.arch, args.ptx_version)
    except ValueError as e:
        ap.error(str(e))
    print(ptxas_report.strip())
    print(report(sass, args.top))


if __name__ == "__main__":
    sys.exit(main())
