"""The device mesh and the shardings of a training batch.

Three axes (docs/design.md §8): `data` (pure data parallelism), `fsdp` (data parallelism whose
members also split the frozen target's weights) and `tensor` (model parallelism: the target's
heads, kv heads and MLP). Batch rows are split over (data, fsdp), so every device sees
`rows / (data·fsdp)` rows; the members of a tensor group see the same rows. Which weight lands
where is decided by name in `dflash_jax.models.sharding`.
"""

from __future__ import annotations

import os

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dflash_jax.models.sharding import BATCH_MESH_AXES, MESH_AXES


def mesh_shape(data: int, fsdp: int, num_devices: int, tensor: int = 1) -> tuple[int, int, int]:
    """(data, fsdp, tensor), resolving a -1 in `data` or `fsdp` ("all the devices the other two
    leave over"); raises ValueError if the shape does not fit the devices."""
    if tensor < 1 or 0 in (data, fsdp) or min(data, fsdp) < -1 or data == fsdp == -1:
        raise ValueError(
            f"mesh shape data={data}, fsdp={fsdp}, tensor={tensor} is invalid (data and fsdp >= 1, one of them "
            "may be -1; tensor >= 1)"
        )
    if -1 in (data, fsdp):
        given = ("fsdp", fsdp) if data == -1 else ("data", data)
        if num_devices % (given[1] * tensor):
            raise ValueError(
                f"mesh {given[0]}={given[1]} x tensor={tensor} does not divide the {num_devices} available devices"
            )
        rest = num_devices // (given[1] * tensor)
        data, fsdp = (rest, fsdp) if data == -1 else (data, rest)
    if data * fsdp * tensor != num_devices:
        raise ValueError(
            f"mesh shape data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} devices, but "
            f"{num_devices} are available; set mesh.data=-1 (or mesh.fsdp=-1) to use them all"
        )
    return data, fsdp, tensor


def make_mesh(data: int, fsdp: int, tensor: int = 1, *, devices=None) -> Mesh:
    """A data x fsdp x tensor mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(data, fsdp, len(devices), tensor)
    # Auto axes: the compiler propagates shardings through the models' plain einsums.
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        # TPU slices joined by the data-center network: the data axis spans them (one gradient
        # reduction a step crosses it), fsdp and tensor stay inside a slice.
        if shape[0] % slices:
            raise ValueError(f"mesh data={shape[0]} must be a multiple of the {slices} slices")
        grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, *shape[1:]), (slices, 1, 1), devices)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU torus whose axes no product of mesh axes matches (fsdp=8 on 16 chips in a 4x4): a mesh
        # axis then spans parts of two physical ones, which costs link bandwidth but runs.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [rows, seq_len] batch split over (data, fsdp), the same on every tensor member."""
    return NamedSharding(mesh, PartitionSpec(BATCH_MESH_AXES))


def mesh_axes_description(mesh: Mesh) -> str:
    """'data=2 x fsdp=4 x tensor=1'."""
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Joins a multi-process run if a coordinator is configured or JAX_COORDINATOR_ADDRESS is set.

    Call before anything touches a device. num_processes=0 / process_id=-1 take the values from
    JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from the cluster (SLURM, Open MPI, ...).
    """
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes or _env_int("JAX_NUM_PROCESSES"),
        process_id=process_id if process_id >= 0 else _env_int("JAX_PROCESS_ID"),
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None
