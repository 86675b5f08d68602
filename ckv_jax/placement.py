"""The DCP mesh and what lives on it: the axis name, the mesh builder, replicated placement,
the axis-size check, and the sharded stack of per-rank caches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

DCP_AXIS = "dcp"


def replicated_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
    """An array of `ndim` dimensions whole on every device of `mesh` (a shard_map input with spec
    P()), spelled as a program's output of it is (a None per dimension): an array donated to a
    program and replaced by its output then keeps the sharding jit's cache is keyed on, instead of
    costing a second compile of the same program."""
    return NamedSharding(mesh, P(*(None,) * ndim))


def cache_sharding(mesh: jax.sharding.Mesh, axis_name: str = DCP_AXIS) -> NamedSharding:
    """The stacked per-rank caches u8[D * num_blocks, block_size, R], split over `axis_name` on
    axis 0, spelled as a program's output of them is (as `replicated_sharding`)."""
    return NamedSharding(mesh, P(axis_name, None, None))


def replicated(mesh: jax.sharding.Mesh, *arrays):
    """Each array placed whole on every device of `mesh` (`replicated_sharding`).  Where the
    mesh spans several processes (`jax.distributed`), every process passes the same values and
    each places its own copy on its own devices: `jax.device_put` of a process's array onto
    such a mesh is a transfer between processes, which a replicated input is not (on CPU it
    gave an array whose shards cannot be read)."""
    out = []
    for a in arrays:
        a = jnp.asarray(a)
        sharding = replicated_sharding(mesh, a.ndim)
        if a.is_fully_addressable and not sharding.is_fully_addressable:
            copies = [jax.device_put(a, device) for device in sharding.addressable_devices]
            out.append(assemble_replicated(mesh, copies))
        else:
            out.append(jax.device_put(a, sharding))
    return out


def assemble_replicated(mesh: jax.sharding.Mesh, copies: list) -> jax.Array:
    """This process's copies of one array, one on each of its devices of `mesh` (e.g. memory a
    torch engine handed over), as the array replicated on the whole mesh, without a copy: every
    process holds the same values in memory of its own."""
    return jax.make_array_from_single_device_arrays(copies[0].shape, replicated_sharding(mesh, copies[0].ndim),
                                                    copies)


def mesh_axis_size(mesh, axis_name: str = DCP_AXIS, world_size: int | None = None) -> int:
    """The size of `axis_name` in `mesh` (checked to equal `world_size`, the plan's or the
    engine's DCP size, if given), or an error naming the mesh's axes."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh: expected an axis named {axis_name!r}, got axes {tuple(mesh.shape)}")
    size = mesh.shape[axis_name]
    if world_size is not None and size != world_size:
        raise ValueError(f"mesh: axis {axis_name!r} has size {size}, expected the plan's world_size {world_size}")
    return size


def mesh_device(mesh: jax.sharding.Mesh) -> jax.Device:
    """The device kind a program on `mesh` runs on (its first device), for kernel selection."""
    return mesh.devices.flat[0]


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` with every axis of type Auto (the same devices and names).  Arrays sharded over an
    Explicit axis refuse plain indexing (`out[0, 0]`); the library's outputs live on this copy so
    that a user indexes them like any array, whichever mesh they built."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def dcp_mesh(world_size: int | None = None, devices=None, axis_name: str = DCP_AXIS) -> jax.sharding.Mesh:
    """A one-axis mesh over `world_size` devices (default: all of `devices`, or of the default
    backend) named `axis_name`, with an Auto axis type."""
    devices = list(jax.devices() if devices is None else devices)
    world_size = len(devices) if world_size is None else world_size
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size <= 0:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if world_size > len(devices):
        raise ValueError(f"world_size: {world_size} ranks need as many devices, got {len(devices)} "
                         f"({devices[0].platform if devices else 'none'}); on a CPU set "
                         "jax.config.update('jax_num_cpu_devices', N) before JAX starts")
    return jax.make_mesh((world_size,), (axis_name,), devices=devices[:world_size],
                         axis_types=(jax.sharding.AxisType.Auto,))


def place_caches(per_rank_caches, mesh: jax.sharding.Mesh, axis_name: str = DCP_AXIS):
    """Stack per-rank caches u8[num_blocks, block_size, R] (one per rank, host or device) into the
    sharded u8[D * num_blocks, block_size, R] that `all_gather_ckv` takes."""
    d = mesh_axis_size(mesh, axis_name)
    caches = [np.asarray(c) for c in per_rank_caches]
    if len(caches) != d:
        raise ValueError(f"per_rank_caches: expected one cache per rank of mesh axis {axis_name!r} "
                         f"({d}), got {len(caches)}")
    first = caches[0]
    if first.ndim != 3 or first.dtype != np.uint8:
        raise ValueError(f"per_rank_caches: expected uint8[num_blocks, block_size, R] per rank, got "
                         f"{first.dtype}{list(first.shape)} for rank 0")
    for rank, c in enumerate(caches):
        if c.shape != first.shape or c.dtype != first.dtype:
            raise ValueError(f"per_rank_caches: every rank's cache must be {first.dtype}{list(first.shape)} "
                             f"(rank 0's), got {c.dtype}{list(c.shape)} for rank {rank}")
    stacked = np.concatenate(caches, axis=0)
    # from a callback, so that each process of a multi-process run places only its own shards
    return jax.make_array_from_callback(stacked.shape, cache_sharding(mesh, axis_name), lambda index: stacked[index])
