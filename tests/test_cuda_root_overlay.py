"""tools/cuda_root_overlay.py (a maintainer tool, not installed): a CUDA root mirrored but for the
assembler, which comes from a wheel."""
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import cuda_root_overlay  # noqa: E402


def fake_root(tmp_path):
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    (root / "nvvm" / "libdevice").mkdir(parents=True)
    (root / "nvvm" / "libdevice" / "libdevice.10.bc").write_bytes(b"bitcode")
    for tool in ("ptxas", "nvlink", "nvdisasm"):
        (root / "bin" / tool).write_text(f"#!/bin/sh\necho old {tool}\n")
    return root


def fake_wheel(tmp_path, tools=("ptxas", "nvlink")):
    wheel = tmp_path / "nvidia_cuda_nvcc-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for tool in tools:
            archive.writestr(f"nvidia/cu13/bin/{tool}", f"#!/bin/sh\necho new {tool}\n")
        archive.writestr("nvidia/cu13/include/fatbinary_section.h", "")
    return wheel


def test_the_overlay_is_the_root_but_for_the_wheels_assembler(tmp_path):
    root = fake_root(tmp_path)
    out = cuda_root_overlay.build_overlay(root, fake_wheel(tmp_path), tmp_path / "overlay")
    for tool in ("ptxas", "nvlink"):
        assert not (out / "bin" / tool).is_symlink()
        assert (out / "bin" / tool).read_text() == f"#!/bin/sh\necho new {tool}\n"
    assert (out / "bin" / "nvdisasm").resolve() == (root / "bin" / "nvdisasm").resolve()
    assert (out / "nvvm" / "libdevice" / "libdevice.10.bc").read_bytes() == b"bitcode"
    assert (root / "bin" / "ptxas").read_text() == "#!/bin/sh\necho old ptxas\n"    # the root is untouched
    again = cuda_root_overlay.build_overlay(root, fake_wheel(tmp_path), out)     # rebuilding over it works
    assert (again / "bin" / "ptxas").read_text() == "#!/bin/sh\necho new ptxas\n"


def test_a_wheel_without_the_assembler_is_named(tmp_path):
    with pytest.raises(SystemExit, match="has no bin/nvlink"):
        cuda_root_overlay.build_overlay(fake_root(tmp_path), fake_wheel(tmp_path, ("ptxas",)), tmp_path / "o")
    with pytest.raises(SystemExit, match="--root: .* has no bin/ptxas"):
        cuda_root_overlay.build_overlay(tmp_path, fake_wheel(tmp_path), tmp_path / "o")
