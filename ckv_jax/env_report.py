"""`ckv-jax env`: versions, devices, Pallas GPU lowering and a DLPack self-check."""
from __future__ import annotations

import importlib.metadata
import platform


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_plugins() -> list[str]:
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("jax-cuda") or name.startswith("jax_cuda") or name.startswith("jax-rocm"):
            found.append(f"{dist.metadata['Name']} {dist.version}")
    return sorted(set(found))


def dlpack_self_check() -> str:
    """torch -> JAX -> torch through DLPack on the CPU; reports whether both directions were zero-copy."""
    try:
        import torch
    except ImportError:
        return "skipped (torch not installed)"
    import jax
    import jax.numpy as jnp
    src = torch.arange(4096, dtype=torch.int32)
    arr = jax.dlpack.from_dlpack(src)
    if int(jnp.sum(arr)) != int(src.sum()):
        return "FAILED: values differ after torch -> JAX"
    back = torch.from_dlpack(arr)
    same_in = arr.unsafe_buffer_pointer() == src.data_ptr()
    same_out = back.data_ptr() == arr.unsafe_buffer_pointer()
    if not torch.equal(back, src):
        return "FAILED: values differ after JAX -> torch"
    return (f"ok (torch {torch.__version__}; torch->JAX {'zero-copy' if same_in else 'COPIED'}, "
            f"JAX->torch {'zero-copy' if same_out else 'COPIED'})")


# a module missing from a plain install -> the extra that provides it
EXTRAS = {"absl": "mosaic-gpu", "torch": "torch", "flax": "flax", "matplotlib": "bench"}


def _extra_for(why: str) -> str:
    """'; pip install 'ckv-jax[extra]' provides it' when `why` names a module an extra provides."""
    for module, extra in EXTRAS.items():
        if f"No module named '{module}" in why:
            return f"; pip install 'ckv-jax[{extra}]' provides {module}"
    return ""


def report() -> list[tuple[str, str]]:
    import jax

    from pallas_kernels import compat
    rows = [("python", platform.python_version()),
            ("jax", _version("jax") or "?"),
            ("jaxlib", _version("jaxlib") or "?"),
            ("gpu plugin", ", ".join(_gpu_plugins()) or "none"),
            ("torch", _version("torch") or "not installed (pip install 'ckv-jax[torch]')"),
            ("triton", _version("triton") or "not installed"),
            ("flax", _version("flax") or "not installed (pip install 'ckv-jax[flax]')"),
            ("backend", jax.default_backend())]
    for d in jax.devices():
        rows.append((f"device {d.id}", f"{d.platform} {d.device_kind} (process {d.process_index})"))
    for backend in ("triton", "mosaic_gpu"):
        ok, why = compat.cuda_lowering_available(backend)
        rows.append((f"pallas {backend} lowering", ("yes" if ok else "no") + f" ({why}{_extra_for(why)})"))
    rows.append(("dlpack self-check", dlpack_self_check()))
    return rows


def main() -> int:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 1 if any(v.startswith("FAILED") for _, v in rows) else 0
