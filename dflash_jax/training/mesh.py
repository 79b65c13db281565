"""The device mesh and the shardings of a training batch.

Two axes: `data` (pure data parallelism) and `fsdp` (data parallelism whose members also split
the weights and the optimizer state, see `dflash_jax.models.sharding`). Batch rows are split
over both, so every device sees `rows / (data·fsdp)` rows.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dflash_jax.models.sharding import FSDP_AXIS

DATA_AXIS = "data"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
    """Resolve `data=-1` ("all devices fsdp leaves over"); raise if the shape does not fit."""
    if fsdp < 1 or data == 0 or data < -1:
        raise ValueError(f"mesh shape data={data}, fsdp={fsdp} is invalid (use data=-1 or >= 1, fsdp >= 1)")
    if data == -1:
        if num_devices % fsdp:
            raise ValueError(f"mesh fsdp={fsdp} does not divide the {num_devices} available devices")
        data = num_devices // fsdp
    if data * fsdp != num_devices:
        raise ValueError(
            f"mesh shape data={data} x fsdp={fsdp} = {data * fsdp} devices, but {num_devices} "
            "are available; set mesh.data=-1 to use them all"
        )
    return data, fsdp


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    """A data x fsdp mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    data, fsdp = mesh_shape(data, fsdp, len(devices))
    # Auto axes: the compiler propagates shardings through the models' plain einsums.
    return jax.make_mesh((data, fsdp), BATCH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [rows, seq_len] batch split over every device."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


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
