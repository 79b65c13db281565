"""Parameter sharding rules, as data: which axis of each weight is split over the mesh.

Weights are FSDP-sharded: the largest axis divisible by the `fsdp` mesh size is split over it,
everything else is replicated. Small tensors (norm weights) stay replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FSDP_AXIS = "fsdp"
MIN_SHARDED_SIZE = 2**16  # below this, replication costs less than the collectives


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int) -> PartitionSpec:
    if fsdp_size <= 1 or len(shape) < 2 or _size(shape) < MIN_SHARDED_SIZE:
        return PartitionSpec()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % fsdp_size == 0:
            spec = [None] * len(shape)
            spec[axis] = FSDP_AXIS
            return PartitionSpec(*spec)
    return PartitionSpec()


def param_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    fsdp_size = mesh.shape.get(FSDP_AXIS, 1)
    return NamedSharding(mesh, fsdp_spec(tuple(shape), fsdp_size))


def state_shardings(mesh: Mesh, abstract_state):
    """A pytree of NamedShardings matching an (abstract) parameter/optimizer state."""
    return jax.tree.map(lambda x: param_sharding(mesh, x.shape), abstract_state)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
