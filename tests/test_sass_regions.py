"""tools/sass_regions.py (a maintainer tool, not installed): a kernel's SASS split by warpgroup at
its register resizes, each region's largest loop, and the PTX version rewrite."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import sass_regions  # noqa: E402

# nvdisasm -c's shape: labels on their own lines, predicates before opcodes, a barrier wait's
# retry code after the end jumping back unconditionally
SASS = """
        .text.kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
.L_x_7:
        /*0030*/                   LDGSTS.E.BYPASS.LTC256B.128 [R31], desc[UR60][R2.64], P1 ;
        /*0040*/                   STL [R1+0x18], R0 ;
        /*0050*/                   LDS.128 R12, [R22] ;
        /*0060*/                   F2FP.F16.E4M3.UNPACK_B R3, R12.reuse ;
        /*0070*/               @P1 BRA `(.L_x_7) ;
        /*0080*/                   EXIT ;
        /*0090*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
        /*00a0*/                   FMUL R4, R4, R5 ;
.L_x_20:
        /*00b0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*00c0*/                   FMUL R4, R4, R5 ;
        /*00d0*/                   LDL.LU R27, [R1] ;
        /*00e0*/              @!P0 BRA `(.L_x_20) ;
        /*00f0*/                   FADD R6, R6, R7 ;
.L_x_21:
        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;
        /*0110*/                   BRA `(.L_x_21) ;
"""


def test_regions_split_at_each_register_resize_with_their_largest_loop():
    got = sass_regions.regions(SASS)
    assert [name for name, _, _ in got] == ["entry", "USETMAXREG.DEALLOC.CTAPOOL (40 registers)",
                                           "USETMAXREG.TRY_ALLOC.CTAPOOL (232 registers)"]
    entry, memory, compute = got
    assert entry[1] == ["MOV", "S2R"] and entry[2] == []
    assert memory[1][0] == "USETMAXREG.DEALLOC.CTAPOOL" and memory[1][-1] == "EXIT"
    assert memory[2] == ["LDGSTS.E.BYPASS.LTC256B.128", "STL", "LDS.128", "F2FP.F16.E4M3.UNPACK_B", "BRA"]
    # the retry code's unconditional jump back is not a loop; the predicated one is
    assert compute[2] == ["HGMMA.64x64x16.F32.BF16", "FMUL", "LDL.LU", "BRA"]


def test_the_report_counts_spills_per_region_and_per_loop():
    lines = sass_regions.report(SASS, top=2).splitlines()
    assert "== USETMAXREG.DEALLOC.CTAPOOL (40 registers): 7 instructions, 1 spill instructions (STL/LDL)" in lines
    assert "   its largest loop: 5 instructions, 1 spill instructions (STL/LDL)" in lines
    assert "== USETMAXREG.TRY_ALLOC.CTAPOOL (232 registers): 9 instructions, 1 spill instructions (STL/LDL)" in lines
    assert "   its largest loop: 4 instructions, 1 spill instructions (STL/LDL)" in lines
    loop = lines.index("   its largest loop: 4 instructions, 1 spill instructions (STL/LDL)")
    assert [line.split() for line in lines[loop + 1:loop + 3]] == [["1", "HGMMA.64x64x16.F32.BF16"], ["1", "FMUL"]]


def test_the_ptx_version_is_rewritten_or_the_input_is_refused():
    ptx = "//\n.version 9.0\n.target sm_90a\n.address_size 64\n"
    assert sass_regions.with_ptx_version(ptx, "8.8").splitlines()[1] == ".version 8.8"
    with pytest.raises(ValueError, match=r"--ptx-version: expected MAJOR.MINOR such as 8.8, got '8'"):
        sass_regions.with_ptx_version(ptx, "8")
    with pytest.raises(ValueError, match="KERNEL.ptx: expected a PTX module with a .version directive"):
        sass_regions.with_ptx_version(".target sm_90a\n", "8.8")


def test_missing_tools_are_named(tmp_path):
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(".version 8.8\n.target sm_90a\n")
    with pytest.raises(SystemExit, match=r"--ptxas: no executable '/nonexistent/ptxas'"):
        sass_regions.main([str(ptx), "--ptxas", "/nonexistent/ptxas"])
